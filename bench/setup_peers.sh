#!/usr/bin/env bash
# Fetch and build the peers bench/batching.py compares corral with (idempotent; about 10 minutes on 2 cores):
# the llama-cpp-python sdist of the version corral pins (its batched example server, and llama.cpp's sources,
# from which llama-server is built), and the Python packages the two Python peers need (bench-only).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=$(.venv/bin/python -c 'import llama_cpp; print(llama_cpp.__version__)')
DIR=${CORRAL_BENCH_DIR:-$HOME/.cache/corral-bench}
SDIST="$DIR/llama_cpp_python-$VERSION"
mkdir -p "$DIR"
if [ ! -d "$SDIST" ]; then
  .venv/bin/python -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR"
  tar xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"
fi
if [ ! -x "$SDIST/vendor/llama.cpp/build/bin/llama-server" ]; then
  cmake -S "$SDIST/vendor/llama.cpp" -B "$SDIST/vendor/llama.cpp/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=ON >/dev/null
  cmake --build "$SDIST/vendor/llama.cpp/build" --target llama-server -j"$(nproc)" >/dev/null
fi
# llama-cpp-python's stock server extras, and the batched example server's imports
.venv/bin/python -m pip install -q sse-starlette starlette-context pydantic-settings safetensors websockets openai
echo "$SDIST"
