PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export UCX_NET_DEVICES := lo
export RAY_USAGE_STATS_ENABLED := 0

ENGINES := .venv-engines
ENGINES_STAMP := $(ENGINES)/.installed

PEERS := .venv-peers
PEERS_STAMP := $(PEERS)/.installed

.PHONY: demo test test-unit test-integrations lint format bench bench-peers clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/flatcake-ray demo

test: test-unit test-integrations

test-unit: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m flatcake_ray.cuda_ext.build --check
	$(BIN)/python -m pytest -q -rs

# vLLM and SGLang live in their own venv (see requirements-engines.txt for why).
$(ENGINES_STAMP): pyproject.toml constraints.txt requirements-engines.txt
	test -x $(ENGINES)/bin/python || $(PY) -m venv $(ENGINES)
	$(ENGINES)/bin/pip install -q --upgrade pip
	$(ENGINES)/bin/pip install -q -c constraints.txt -e '.[test]'
	$(ENGINES)/bin/pip install -q -c constraints.txt -r requirements-engines.txt
	$(ENGINES)/bin/pip install -q -c constraints.txt --no-deps vllm==0.33.0 xgrammar==0.2.8 sglang==0.5.23
	touch $(ENGINES_STAMP)

test-integrations: $(ENGINES_STAMP)
	VLLM_TARGET_DEVICE=cpu PYTHONHASHSEED=0 $(ENGINES)/bin/python -m pytest -q -rs tests/integrations

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/python benchmarks/ssd_layout.py --write-md BENCHMARKS.md

# FlatCake-Ray beside Mooncake Store and LMCache (benchmarks/peers), in their own venv (see
# requirements-peers.txt for why LMCache goes in with --no-deps). Not part of `make test`.
$(PEERS_STAMP): pyproject.toml constraints.txt requirements-peers.txt
	ldconfig -p | grep -q 'libibverbs.so.1 ' || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1)
	test -x $(PEERS)/bin/python || $(PY) -m venv $(PEERS)
	$(PEERS)/bin/pip install -q --upgrade pip
	$(PEERS)/bin/pip install -q -c constraints.txt -e '.[test]'
	$(PEERS)/bin/pip install -q -c constraints.txt -r requirements-peers.txt
	$(PEERS)/bin/pip install -q -c constraints.txt --no-deps lmcache==0.5.6
	touch $(PEERS_STAMP)

bench-peers: $(PEERS_STAMP)
	$(PEERS)/bin/python -m benchmarks.peers --write-md BENCHMARKS.md

clean:
	rm -rf $(VENV) $(ENGINES) $(PEERS) build *.egg-info
