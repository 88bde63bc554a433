#!/usr/bin/env bash
# Installs the Debian packages MarkBase builds with. Idempotent: does nothing when all are present.
set -euo pipefail
PKGS=(g++ cmake ninja-build nlohmann-json3-dev libcli11-dev libfmt-dev libgtest-dev libgmock-dev
      libbenchmark-dev python3 clang libclang-rt-14-dev nginx)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
# The load generator and the deploy tests (bench/serve_load.py, tests/deploy) are Python on PyPI packages.
python3 -c 'import httpx, pytest' 2>/dev/null || python3 -m pip install -q 'httpx>=0.27' 'pytest>=7'
