#!/usr/bin/env bash
# Fuzzes the GGUF and safetensors parsers (tests/fuzz/fuzz_parsers.cpp) with libFuzzer + ASan +
# UBSan for SECONDS (default 60). Builds into build-fuzz/ with clang; the corpus grows in
# build-fuzz/corpus, and a failing input is left as build-fuzz/crash-* (rerun one with
# `build-fuzz/fuzz_parsers FILE`). Exit status is non-zero when the fuzzer found something.
#   tools/fuzz.sh [SECONDS]        (needs clang and libclang-rt-*-dev; CXX_FUZZ overrides clang++)
set -euo pipefail
SECONDS_TO_RUN=${1:-60}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$ROOT/build-fuzz
CXX=${CXX_FUZZ:-clang++}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$OUT/corpus" "$OUT/seeds"

# The fuzz targets and the parser layers they test are built by CMake (MARKBASE_FUZZ), so the
# sources they need are the library's own, never a list kept here.
cmake -S "$ROOT" -B "$OUT" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER="$CXX" \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" -DMARKBASE_FUZZ=ON >/dev/null
ninja -C "$OUT" -j "$JOBS" fuzz_parsers

cat > "$OUT/gguf.dict" <<'DICT'
"GGUF"
"general.architecture"
"general.alignment"
"gemma3"
"gemma4"
"tokenizer.ggml.tokens"
".attention.sliding_window_pattern"
".feed_forward_length"
".attention.head_count_kv"
"blk.0.attn_v.weight"
"\x03\x00\x00\x00"
"\x09\x00\x00\x00"
"\x08\x00\x00\x00"
"dtype"
"data_offsets"
"shape"
DICT

rm -f "$OUT"/seeds/*
cp "$ROOT/tests/fixtures/gguf/all_types.gguf" "$OUT/seeds/"
FUZZ_WRITE_SEEDS="$OUT/seeds" "$OUT/fuzz_parsers" -runs=0 "$OUT/seeds" > /dev/null 2>&1
cd "$OUT"
exec ./fuzz_parsers -max_total_time="$SECONDS_TO_RUN" -max_len=16384 -timeout=10 -rss_limit_mb=4096 \
  -dict=gguf.dict -print_final_stats=1 corpus seeds
