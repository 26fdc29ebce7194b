# Two commands on a fresh machine: `make run` and `make test`.
# Both make .venv and install what they need (python3 with venv and pip is enough).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test lint typecheck unit proto bench smoke clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

## run: the node with an embedded edge and echo targets, on loopback
run: $(STAMP)
	$(VENV)/bin/iop-node demo

## test: lint (ruff, the import layers), type-check and the whole test suite
test: lint typecheck unit

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(PY) -m pytest -q

## proto: regenerate iop_trio/_gen from proto/
proto: $(STAMP)
	$(PY) tools/genproto.py

## bench: print the benchmark figures
bench: $(STAMP)
	$(PY) benchmarks/gate.py
	$(PY) benchmarks/store.py

## smoke: real-engine tests (llama.cpp server + Gemma 3 270M) in their own venv; opt-in
smoke:
	bash tools/smoke.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
