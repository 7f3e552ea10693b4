#!/bin/sh
# Build llama.cpp's `llama-server` once per machine and print its path (issue #29's remote backend).
#
# The source is the llama.cpp bundled in llama-cpp-python's PyPI sdist (PyPI is the only registry the
# project's machines reach). Only the server target is built. The binary is cached outside the repo,
# so a second call prints the cached path at once; a lock lets `make test` (background build) and
# `make remote` run together without building twice.
#
#   sh deploy/llama_server.sh PYTHON     -> prints .../llama-server-<version>-b<build>/llama-server on stdout
#
# The binary is built on, cached on and run on the same machine, so it gets the instruction sets this
# CPU has (ggml's AVX2/AVX-512 quantized kernels; a baseline x86-64 build runs Q4_1 several times
# slower), named one by one from /proc/cpuinfo rather than -march=native: -march=native also turns on
# AMX, whose tile instructions need a permission (arch_prctl ARCH_REQ_XCOMP_PERM) that sandboxed
# kernels refuse, and llama-server then dies of SIGILL at its first matrix product (seen on this
# project's machines: "trap invalid opcode ... tilezero"). AMX stays off. A binary copied to another
# CPU may fail with "illegal instruction": delete the cache folder and build again there.
set -eu

PY=${1:-python3}
VERSION=0.3.36                       # llama-cpp-python release whose vendor/llama.cpp is built
BUILD=2                              # our build recipe's version: 2 = instruction sets by name, no AMX
CACHE=${DECODING_PLAYGROUND_CACHE:-$HOME/.cache/decoding-playground}
DEST=$CACHE/llama-server-$VERSION-b$BUILD
BIN=$DEST/llama-server
JOBS=${LLAMA_BUILD_JOBS:-2}

if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi

for tool in cmake c++ flock; do
  command -v "$tool" >/dev/null || { echo "llama-server: $tool is missing (apt-get install cmake g++ util-linux)" >&2; exit 1; }
done
mkdir -p "$CACHE"
exec 9>"$CACHE/llama-server-$VERSION-b$BUILD.lock"
flock 9                               # a concurrent build holds it; we then find its binary
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi

WORK=$CACHE/llama-server-$VERSION-b$BUILD.build
rm -rf "$WORK"
mkdir -p "$WORK"
echo "llama-server: downloading the llama-cpp-python $VERSION sdist" >&2
"$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK" >&2
tar -xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK" "llama_cpp_python-$VERSION/vendor/llama.cpp"
SRC=$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp

# The CPU's instruction sets, each ON only when /proc/cpuinfo lists it (x86-64; elsewhere ggml's defaults).
has() { grep -qw "$1" /proc/cpuinfo 2>/dev/null && echo ON || echo OFF; }
ISA=""
if [ "$(uname -m)" = x86_64 ]; then
  ISA="-DGGML_SSE42=$(has sse4_2) -DGGML_F16C=$(has f16c) -DGGML_FMA=$(has fma) -DGGML_BMI2=$(has bmi2)
       -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_AVX_VNNI=$(has avx_vnni) -DGGML_AVX512=$(has avx512f)
       -DGGML_AVX512_VBMI=$(has avx512vbmi) -DGGML_AVX512_VNNI=$(has avx512_vnni)
       -DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
fi

# Static, server only, nothing fetched at build time (no prebuilt web UI, no HTTPS client).
echo "llama-server: building with $JOBS jobs (about 15 min on 2 cores)" >&2
# shellcheck disable=SC2086  # ISA is a list of -D options
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=OFF $ISA -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >&2
cmake --build "$WORK/build" --target llama-server -j "$JOBS" >&2

mkdir -p "$DEST"
cp "$WORK/build/bin/llama-server" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"                  # atomic: a waiting reader never sees half a binary
rm -rf "$WORK"
echo "$BIN"
