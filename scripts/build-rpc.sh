#!/usr/bin/env bash
# Build llama.cpp's RPC backend from the sources of the pinned llama-cpp-python (idempotent).
#
# Produces, in a cache outside the repo (${CORRAL_RPC_CACHE:-~/.cache/corral-rpc}/<version>/):
#   bin/rpc-server   llama.cpp's rpc-server (run one on each host that lends its CPU/GPU to a model)
#   lib/             libllama.so, libggml*.so (with libggml-rpc.so) and libmtmd.so, built with -DGGML_RPC=ON
#                    from the same llama.cpp as the venv's llama-cpp-python, so its Python bindings load them:
#                    corral's runners use them when CORRAL_RPC_SERVERS is set and the venv's own build has no
#                    RPC backend (or point CORRAL_LLAMA_LIB_PATH at this lib/ directory).
# A second run with the outputs in place does nothing but print their paths. Takes some minutes on 2 cores.
#
# Environment: CORRAL_RPC_CACHE (cache root), CORRAL_RPC_VERSION (llama-cpp-python version; default: the pin in
# pyproject.toml), PYTHON (a Python with pip, for `pip download`), CMAKE_ARGS (extra cmake arguments, e.g.
# "-DGGML_CUDA=ON" on a GPU host), JOBS (parallel build jobs; default: the number of CPUs).
#
# To build llama-cpp-python itself with the RPC backend instead (then no separate lib/ is needed):
#   CMAKE_ARGS="-DGGML_RPC=on" pip install --force-reinstall --no-cache-dir --no-binary llama-cpp-python \
#     llama-cpp-python==0.3.36
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=${CORRAL_RPC_VERSION:-$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml | head -n1)}
if [ -z "$VERSION" ]; then
  echo "build-rpc: cannot find the llama-cpp-python pin in pyproject.toml; set CORRAL_RPC_VERSION" >&2
  exit 1
fi
ROOT=${CORRAL_RPC_CACHE:-${HOME}/.cache/corral-rpc}/${VERSION}
BIN=$ROOT/bin
LIB=$ROOT/lib
STAMP=$ROOT/.built

print_paths() {
  echo "rpc-server: $BIN/rpc-server"
  echo "lib: $LIB"
}

if [ -f "$STAMP" ] && [ -x "$BIN/rpc-server" ] && [ -e "$LIB/libllama.so" ] && [ -e "$LIB/libggml-rpc.so" ]; then
  print_paths
  exit 0
fi

for tool in cmake c++ tar; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "build-rpc: '$tool' is needed to build llama.cpp's rpc-server (apt-get install cmake g++)" >&2
    exit 1
  fi
done
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

mkdir -p "$ROOT"
SRC=$ROOT/src/llama_cpp_python-$VERSION
if [ ! -f "$SRC/vendor/llama.cpp/tools/rpc/rpc-server.cpp" ]; then
  DL=$ROOT/download
  mkdir -p "$DL"
  if ! ls "$DL"/llama_cpp_python-"$VERSION".tar.gz >/dev/null 2>&1; then
    echo "build-rpc: downloading the llama-cpp-python==$VERSION sdist from PyPI" >&2
    "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$DL" "llama-cpp-python==$VERSION"
  fi
  rm -rf "$ROOT/src"
  mkdir -p "$ROOT/src"
  tar -xzf "$DL/llama_cpp_python-$VERSION.tar.gz" -C "$ROOT/src"
fi

BUILD=$ROOT/build
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}
echo "build-rpc: configuring llama.cpp (GGML_RPC=ON) in $BUILD" >&2
# shellcheck disable=SC2086  # CMAKE_ARGS is a list of arguments
cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=ON -DGGML_RPC=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF '-DCMAKE_INSTALL_RPATH=$ORIGIN/../lib:$ORIGIN' \
  -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON ${CMAKE_ARGS:-} >"$ROOT/configure.log" 2>&1 || {
  tail -n 40 "$ROOT/configure.log" >&2
  echo "build-rpc: cmake configure failed (full log: $ROOT/configure.log)" >&2
  exit 1
}
echo "build-rpc: building rpc-server, llama, ggml (with ggml-rpc) and mtmd with $JOBS jobs" >&2
cmake --build "$BUILD" -j "$JOBS" --target ggml-rpc-server llama mtmd >"$ROOT/build.log" 2>&1 || {
  tail -n 40 "$ROOT/build.log" >&2
  echo "build-rpc: build failed (full log: $ROOT/build.log)" >&2
  exit 1
}

rm -rf "$BIN" "$LIB"
mkdir -p "$BIN" "$LIB"
# (built with RPATH $ORIGIN/../lib: rpc-server finds lib/ beside bin/, the libraries find each other)
cp "$BUILD/bin/ggml-rpc-server" "$BIN/rpc-server"
# the shared libraries with their version symlinks (libllama.so -> libllama.so.0 -> libllama.so.0.x.y)
find "$BUILD/bin" "$BUILD/src" "$BUILD/ggml" "$BUILD/tools" -maxdepth 3 \
  \( -name 'libllama.so*' -o -name 'libggml*.so*' -o -name 'libmtmd.so*' \) \
  \( -type f -o -type l \) -exec cp -P {} "$LIB/" \;
for need in libllama.so libggml.so libggml-base.so libggml-cpu.so libggml-rpc.so libmtmd.so; do
  if [ ! -e "$LIB/$need" ]; then
    echo "build-rpc: $need was not built (see $ROOT/build.log)" >&2
    exit 1
  fi
done
echo "$VERSION" >"$STAMP"
print_paths
