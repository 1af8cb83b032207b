PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export UCX_NET_DEVICES := lo
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: demo test lint format bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/flatcake-ray demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m flatcake_ray.cuda_ext.build --check
	$(BIN)/python -m pytest -q -rs

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/python benchmarks/ssd_layout.py --write-md BENCHMARKS.md

clean:
	rm -rf $(VENV) build *.egg-info
