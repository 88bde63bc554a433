#!/usr/bin/env bash
# Builds the peer engine, llama.cpp, for side-by-side benchmarks (docs/benchmarks.md).
#
#   tools/peer/build_llama_cpp.sh [DIR]      # default DIR=/tmp/markbase-peer
#
# Source: the llama.cpp tree vendored in PyPI's llama-cpp-python source distribution
# (vendor/llama.cpp); no llama.cpp code lives in this repository. Result:
#   DIR/src/llama_cpp_python-VERSION/vendor/llama.cpp   the source
#   DIR/build/bin/llama-{bench,completion,simple,perplexity,quantize,gguf} (and llama-server: PEER_SERVER=1)
# CPU only, Release, GGML_NATIVE=ON (this machine's ISA), OpenMP on.
# AMX is compiled out (-mno-amx-*; the AVX-512/VNNI kernels and the Q4_K 8x8 repack stay): with
# g++ 12 the AMX matmul of llama.cpp 0c1e57098 dies with SIGSEGV at its first ldtilecfg on an AMX
# Xeon (upstream issue ggml-org/llama.cpp#20824, fix proposed in PR #26954). PEER_AMX=1 keeps it.
# Env: LLAMA_CPP_PYTHON_VERSION=0.3.36 pins the sdist (default: newest); JOBS (default: nproc);
# PEER_MARCH=sapphirerapids builds for that CPU instead of this one (GGML_NATIVE=OFF, -march=...),
# e.g. on the AVX2 dev machine for the device host's AVX-512 Xeon (the binary is then carried there).
# PEER_SERVER=1 also builds llama-server (the OpenAI-compatible server, for tools/device/serve_bench.sh;
# its web UI assets come prebuilt with the source, nothing is fetched). llama-cli is not built: it
# needs the server too; llama-completion is the plain prompt -> text tool.
# PEER_CUDA=1 builds the CUDA peer for tools/device/gpu_suite.sh instead: GGML_CUDA for sm_90a (H100/H200),
# flash attention kernels as upstream ships them, shared libraries (one libggml-cuda.so beside the binaries),
# targets llama-bench and llama-batched-bench. nvcc compiles it on a machine without a GPU.
# PEER_MTMD=1 also builds llama-mtmd-cli (images and audio through an mmproj GGUF: bench/media_vs_transformers.py
# --llama-cpp DIR).
#
#   tools/peer/build_llama_cpp.sh --source-archive FILE.tar.xz [DIR]
# writes the sdist's llama.cpp tree as one archive (~5 MB: no docs, model vocabularies, tests or other GPU
# backends; its commit in PEER_COMMIT) for a machine without network to build from: PEER_SRC=FILE (an archive
# so made, or a llama.cpp folder) builds that tree instead of the sdist's. tools/device/gpu_suite.sh builds
# its CUDA peer so on the GPU machine, from build-peer-cuda/llama-src.tar.xz, in the call that runs the benchmarks.
set -euo pipefail

archive=""
if [ "${1:-}" = --source-archive ]; then
  archive=$(realpath -m "${2:?usage: $0 --source-archive FILE.tar.xz [DIR]}")
  shift 2
fi
dir=${1:-/tmp/markbase-peer}
jobs=${JOBS:-$(nproc)}
spec=llama-cpp-python${LLAMA_CPP_PYTHON_VERSION:+==$LLAMA_CPP_PYTHON_VERSION}
mkdir -p "$dir/src"

if [ -n "${PEER_SRC:-}" ]; then
  # 1. a llama.cpp tree given as it is, or as an archive that --source-archive made
  if [ -d "$PEER_SRC" ]; then
    src=$(realpath "$PEER_SRC")
  else
    rm -rf "$dir/src/llama.cpp"
    tar -xaf "$PEER_SRC" -C "$dir/src"
    src="$dir/src/llama.cpp"
  fi
  test -f "$src/CMakeLists.txt" || { echo "no llama.cpp tree in $PEER_SRC" >&2; exit 1; }
  commit=$(cat "$src/PEER_COMMIT" 2>/dev/null || true)
  echo "llama.cpp from $PEER_SRC, commit ${commit:-unknown}"
else
  # 1. the sdist (never a wheel), unpacked
  python3 -m pip download --no-binary :all: --no-deps "$spec" -d "$dir/src"
  sdist=$(ls -t "$dir"/src/llama_cpp_python-*.tar.gz | head -n 1)
  tar -xzf "$sdist" -C "$dir/src"
  pkg="$dir/src/$(basename "$sdist" .tar.gz)"
  src="$pkg/vendor/llama.cpp"
  test -f "$src/CMakeLists.txt" || { echo "no vendor/llama.cpp in $sdist" >&2; exit 1; }

  # The sdist's vendor/llama.cpp is a one-commit shallow clone (so the build number reads 1);
  # the CHANGELOG names the llama.cpp commit of each release, which also covers a missing git.
  version=${pkg##*-}
  commit=$(awk -v v="## [$version]" '$0 == v {f=1; next} f && /^## \[/ {exit}
    f && match($0, /llama\.cpp@[0-9a-f]+/) {print substr($0, RSTART + 10, RLENGTH - 10); exit}' \
    "$pkg/CHANGELOG.md" || true)
  echo "llama-cpp-python $version, llama.cpp commit ${commit:-unknown}"
fi

if [ -n "$archive" ]; then
  # What the CPU and CUDA builds read; the other backends' folders are only entered when enabled.
  excludes=()
  for part in docs models tests benches tools/ui 'tools/server/public*' '.git*'; do excludes+=("--exclude=llama.cpp/$part"); done
  for b in cann et hexagon hip metal musa opencl openvino sycl virtgpu vulkan webgpu zdnn zendnn; do
    excludes+=("--exclude=llama.cpp/ggml/src/ggml-$b")
  done
  echo "${commit:-unknown}" >"$src/PEER_COMMIT"
  mkdir -p "$(dirname "$archive")"
  tar -C "$(dirname "$src")" -cJf "$archive" "${excludes[@]}" --transform 's,^[^/]*,llama.cpp,' "$(basename "$src")"
  ls -l "$archive"
  exit 0
fi

# 2. configure + build (only the tools we use)
generator=()
noamx=()
[ "${PEER_AMX:-0}" = 1 ] || noamx=("-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
                                  "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
command -v ninja >/dev/null && generator=(-G Ninja)
server=OFF
[ "${PEER_SERVER:-0}" = 1 ] && server=ON
native=ON
if [ -n "${PEER_MARCH:-}" ]; then
  native=OFF
  march="-march=$PEER_MARCH -mtune=$PEER_MARCH"
  [ "${PEER_AMX:-0}" = 1 ] || march="$march -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  noamx=("-DCMAKE_C_FLAGS=$march" "-DCMAKE_CXX_FLAGS=$march")
fi
cuda=(-DGGML_CUDA=OFF -DBUILD_SHARED_LIBS=OFF)
if [ "${PEER_CUDA:-0}" = 1 ]; then
  # The GPU driver (libcuda.so.1) is not on a machine without a GPU: its symbols are left to the
  # machine that runs the binaries.
  cuda=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DBUILD_SHARED_LIBS=ON
        "-DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined")
fi
cmake -S "$src" -B "$dir/build" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=$native -DGGML_OPENMP=ON -DGGML_CPU=ON \
  "${cuda[@]}" -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=$server -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=ON \
  -DLLAMA_OPENSSL=OFF \
  "${noamx[@]}" \
  ${commit:+-DLLAMA_BUILD_COMMIT=$commit}
targets=(llama-bench llama-completion llama-simple llama-perplexity llama-quantize llama-gguf)
[ "$server" = ON ] && targets+=(llama-server)
[ "${PEER_MTMD:-0}" = 1 ] && targets+=(llama-mtmd-cli)
[ "${PEER_CUDA:-0}" = 1 ] && targets=(llama-bench llama-batched-bench)
cmake --build "$dir/build" -j "$jobs" --target "${targets[@]}"

ls -l "$dir"/build/bin/llama-*
