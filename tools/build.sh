#!/usr/bin/env bash
# Configures and builds one flavour: tools/build.sh [release|sanitize] -> build/ or build-sanitize/
set -euo pipefail
cd "$(dirname "$0")/.."
flavour=${1:-release}
case "$flavour" in
  release) dir=build; flags=(-DCMAKE_BUILD_TYPE=Release) ;;
  sanitize) dir=build-sanitize; flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DMARKBASE_SANITIZE=ON -DMARKBASE_BENCH=OFF) ;;
  *) echo "usage: tools/build.sh [release|sanitize]" >&2; exit 2 ;;
esac
cmake -S . -B "$dir" -G Ninja "${flags[@]}" >/dev/null
ninja -C "$dir"
