#!/usr/bin/env bash
# Configures and builds one flavour: tools/build.sh [release|sanitize] -> build/ or build-sanitize/
set -euo pipefail
cd "$(dirname "$0")/.."
flavour=${1:-release}
case "$flavour" in
  release) dir=build; flags=(-DCMAKE_BUILD_TYPE=Release) ;;
  # The CUDA backend is left out of the sanitizer build: ASan and the CUDA runtime do not mix (its
  # driver maps memory ASan's shadow claims), and no GPU runs it in CI.
  # -O1 with line tables only: about half the compile time of -O2 -g on the 2-core CI, and ASan's
  # reports still name file and line.
  sanitize) dir=build-sanitize; flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1"
                                       -DMARKBASE_SANITIZE=ON -DMARKBASE_BENCH=OFF -DMARKBASE_CUDA=OFF) ;;
  *) echo "usage: tools/build.sh [release|sanitize]" >&2; exit 2 ;;
esac
cmake -S . -B "$dir" -G Ninja "${flags[@]}" >/dev/null
ninja -C "$dir"
