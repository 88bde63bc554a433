#!/usr/bin/env bash
# Installs the Debian packages MarkBase builds with. Idempotent: does nothing when all are present.
set -euo pipefail
# libcpp-httplib-dev: `markbase serve`; stb, libjpeg-turbo, libwebp, libsndfile, libsoxr, FFTW: images and audio in; libav*: video files in; chromium + chromium-driver: the chat page's test (tests/server);
# nginx: the replicas test (tests/deploy).
PKGS=(g++ cmake ninja-build pkg-config nlohmann-json3-dev libcli11-dev libfmt-dev libgtest-dev libgmock-dev
      libbenchmark-dev libcpp-httplib-dev libstb-dev libjpeg62-turbo-dev libwebp-dev libsndfile1-dev libsoxr-dev
      libfftw3-dev libavformat-dev libavcodec-dev libswscale-dev libavutil-dev python3 python3-pip clang libclang-rt-14-dev chromium chromium-driver nginx)
missing=()
for p in "${PKGS[@]}"; do
  [[ $(dpkg-query -W -f='${Status}' "$p" 2>/dev/null) == *"install ok installed"* ]] || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
# The server tests (tests/server: the official OpenAI client, selenium for Chromium), the load generator
# and the deploy tests (bench/serve_load.py, tests/deploy): Python packages from PyPI.
PY_PKGS=(openai selenium pytest requests 'httpx>=0.27')
if ! python3 -c 'import openai, selenium, pytest, requests, httpx' 2>/dev/null; then
  python3 -m pip install -q "${PY_PKGS[@]}" 2>/dev/null || python3 -m pip install -q --break-system-packages "${PY_PKGS[@]}"
fi
