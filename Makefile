# Two commands on a fresh machine: `make run` and `make test`.
# Both make .venv and install what they need (python3 with venv and pip is enough).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
FLOOR  ?= .venv-floor

.PHONY: run test faults test-floor lint typecheck unit proto bench smoke clean

$(STAMP): pyproject.toml
	@echo "installing iop-trio and its dependencies into $(VENV) (the first time takes a minute)..."
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

## run: an edge (proto-socket + OpenAI-compatible API) and a node with echo targets, on
## loopback; runs are kept in ./var/demo.db and the node's metrics are served
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
	$(PY) -m pytest -q -m "not faults"

## faults: the fault suite: bursts, floods, kill -9, full disks, deaf peers, bad engines
faults: $(STAMP)
	$(PY) -m pytest -v -m faults -p no:cacheprovider --durations=5

## test-floor: the test suite against the lowest versions pyproject.toml allows
## (uv's lowest-direct resolution), so a declared floor is tested, not guessed
$(FLOOR)/.installed: pyproject.toml
	rm -rf $(FLOOR)
	$(PYTHON) -m venv $(FLOOR)
	$(FLOOR)/bin/python -m pip install --quiet uv
	$(FLOOR)/bin/uv pip compile pyproject.toml --extra test --resolution lowest-direct \
		--python $(FLOOR)/bin/python --quiet --output-file $(FLOOR)/floor.txt
	$(FLOOR)/bin/uv pip install --quiet --python $(FLOOR)/bin/python -r $(FLOOR)/floor.txt
	$(FLOOR)/bin/uv pip install --quiet --python $(FLOOR)/bin/python --no-deps -e .
	touch $@

test-floor: $(FLOOR)/.installed
	@echo "floors under test:" $$(grep -E '^(trio|trio-websocket|wsproto|attrs|protobuf|httpx|h11|cattrs|pyyaml|prometheus-client|hypercorn|opentelemetry-api|opentelemetry-sdk|opentelemetry-exporter-otlp-proto-http|pytest|pytest-trio|hypothesis|h11|trustme|openai)==' $(FLOOR)/floor.txt)
	$(FLOOR)/bin/python -m pytest -q -p no:cacheprovider -m "not faults"

## proto: regenerate iop_trio/_gen from proto/
proto: $(STAMP)
	$(PY) tools/genproto.py

## bench: print the benchmark figures
bench: $(STAMP)
	$(PY) benchmarks/gate.py
	$(PY) benchmarks/store.py
	$(PY) benchmarks/drain.py
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/fairness.py

## smoke: real-engine tests (llama.cpp server + Gemma 3 270M) in their own venv; opt-in
smoke:
	bash tools/smoke.sh

clean:
	rm -rf $(VENV) $(FLOOR) .pytest_cache .mypy_cache .ruff_cache .hypothesis
