#!/usr/bin/env bash
# README command 2: every test, on a Release build and on an ASan+UBSan build.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install_deps.sh
tools/install_model.sh >/dev/null  # the real-model perplexity test runs on it
status=0
for flavour in release sanitize; do
  dir=build; [ "$flavour" = sanitize ] && dir=build-sanitize
  echo "=== $flavour build (${SECONDS} s in)"
  tools/build.sh "$flavour"
  echo "=== $flavour tests (${SECONDS} s in)"
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
  # The sanitizer run fills every activation block with NaN bytes before use (core/scratch_pool.h):
  # an op that reads output memory it has not written shows up as a failed parity or NaN test.
  if [ "$flavour" = sanitize ]; then export MARKBASE_POISON_SCRATCH=1; else unset MARKBASE_POISON_SCRATCH; fi
  ctest --test-dir "$dir" --output-on-failure -j2 || status=1
  # About 1.5 minutes: two replicas behind nginx (release only), then 64 streaming clients for 60 s.
  echo "=== $flavour deploy and load tests (${SECONDS} s in)"
  tests/deploy/run.sh "$dir" || status=1
done
# Under a minute: `markbase serve` and `markbase chat` (release build) with the openai client, raw HTTP
# and headless Chromium.
echo "=== server tests (${SECONDS} s in)"
MARKBASE_BIN=build/bin/markbase MARKBASE_POISON_SCRATCH= python3 -m pytest -q -p no:cacheprovider tests/server || status=1
# About 2 minutes on 2 cores: ~1 minute to build, then 4 targets x 30 s, two at a time.
echo "=== fuzzing the file, template, chat request and model output parsers (${SECONDS} s in)"
tools/fuzz.sh 60 || status=1
echo "=== done after ${SECONDS} s"
exit $status
