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
mkdir -p "$OUT/obj" "$OUT/corpus" "$OUT/seeds"

FLAGS=(-std=c++20 -g -O1 -fno-omit-frame-pointer -fsanitize=fuzzer-no-link,address,undefined
       -fno-sanitize-recover=undefined -I"$ROOT/include" -I"$ROOT/src")
SOURCES=(src/core/dtype.cpp src/core/mmap.cpp src/core/tensor.cpp src/formats/tensor_registry.cpp
         src/formats/safetensors.cpp src/formats/gguf.cpp src/formats/gguf_model.cpp tests/fuzz/fuzz_parsers.cpp)

objs=()
pids=()
for src in "${SOURCES[@]}"; do
  obj="$OUT/obj/$(echo "$src" | tr / _).o"
  objs+=("$obj")
  if [[ ! -f $obj || $ROOT/$src -nt $obj || -n $(find "$ROOT/src" -name '*.h' -newer "$obj" -print -quit) ]]; then
    "$CXX" "${FLAGS[@]}" -c "$ROOT/$src" -o "$obj" &
    pids+=($!)
    if (( ${#pids[@]} >= JOBS )); then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
  fi
done
for p in "${pids[@]}"; do wait "$p"; done
"$CXX" -fsanitize=fuzzer,address,undefined "${objs[@]}" -lfmt -o "$OUT/fuzz_parsers"

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
