#!/usr/bin/env bash
# README command 1: install what is needed, build, and run the main job on the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install_deps.sh
tools/build.sh release
# Default model until the Gemma 3 270M GGUF lands: the E2B-shaped random-weight fixture that
# tools/reference/make_fixtures.py generates (PLE, KV sharing, double-wide MLP).
./build/bin/markbase info -m tests/fixtures/e2b_like
./build/bin/markbase generate -m tests/fixtures/e2b_like --tokens 2,14,254,446,102,355,88 -n 16 --print-ids
