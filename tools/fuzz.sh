#!/usr/bin/env bash
# Fuzzes what users and models feed the engine with libFuzzer + ASan + UBSan, for about SECONDS of
# wall-clock time in all (default 120), split evenly over the targets of tests/fuzz/fuzz_targets.h:
#   files    GGUF and safetensors files
#   jinja    chat template source text
#   request  a JSON chat request rendered through the real Gemma 4 template, then tokenized; the same
#            bytes through the OpenAI adapter (chat, completions, tokenize, detokenize)
#   output   generated Gemma 4 text: thinking, tool calls, values
# Targets run side by side, one per core, each for SECONDS x min(cores, targets) / targets.
# Builds into build-fuzz/ with clang; each target's corpus grows in build-fuzz/corpus/TARGET, its
# log is build-fuzz/TARGET.log, and a failing input is left as build-fuzz/TARGET-crash-* (rerun
# one with `MARKBASE_FUZZ_TARGET=TARGET build-fuzz/fuzz_markbase FILE`). Exit status is non-zero
# when a fuzzer found something.
#   tools/fuzz.sh [SECONDS [TARGET...]]   (needs clang and libclang-rt-*-dev; CXX_FUZZ overrides clang++)
set -euo pipefail
SECONDS_TO_RUN=${1:-120}
shift || true
TARGETS=("$@")
(( ${#TARGETS[@]} )) || TARGETS=(files jinja request output)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$ROOT/build-fuzz
CXX=${CXX_FUZZ:-clang++}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$OUT/corpus" "$OUT/seeds"

# The fuzz binary and the parser layers it tests are built by CMake (MARKBASE_FUZZ), so the
# sources it needs are the library's own, never a list kept here.
cmake -S "$ROOT" -B "$OUT" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER="$CXX" \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" -DMARKBASE_FUZZ=ON >/dev/null
ninja -C "$OUT" -j "$JOBS" fuzz_markbase

# Dictionaries: the words each format is made of.
cat > "$OUT/files.dict" <<'DICT'
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
cat > "$OUT/jinja.dict" <<'DICT'
"{{"
"}}"
"{%"
"%}"
"{%-"
"-%}"
"{#"
"#}"
"{% for x in messages %}"
"{% endfor %}"
"{% if "
"{% elif "
"{% else %}"
"{% endif %}"
"{% set "
"{% macro m(a, b=1) %}"
"{% endmacro %}"
"{% raw %}"
"{% endraw %}"
"namespace("
"loop.index"
" | tojson"
" | map(attribute='"
" | selectattr("
" | dictsort"
" | join("
" | indent("
" | replace("
" is defined"
" is mapping"
" is string"
"range("
"raise_exception("
"messages[0]['content']"
"tools"
"[1:-1]"
"**"
"//"
"~"
"'\x5cu00e9'"
DICT
cat > "$OUT/request.dict" <<'DICT'
"{\"messages\": ["
"{\"role\": \"user\", \"content\": \"hi\"}"
"\"role\""
"\"content\""
"\"system\""
"\"assistant\""
"\"tool\""
"\"model\""
"\"developer\""
"\"tool_calls\""
"\"tool_call_id\""
"\"reasoning_content\""
"\"function\""
"\"arguments\""
"\"name\""
"\"type\""
"\"text\""
"\"image\""
"\"audio\""
"\"video\""
"\"tools\""
"\"parameters\""
"\"properties\""
"\"required\""
"\"description\""
"\"enum\""
"\"items\""
"\"enable_thinking\""
"\"model\": \"fixture\""
"\"prompt\""
"\"tokens\""
"\"max_tokens\""
"\"max_completion_tokens\""
"\"temperature\""
"\"top_p\""
"\"top_k\""
"\"min_p\""
"\"n\""
"\"stop\""
"\"seed\""
"\"logprobs\""
"\"top_logprobs\""
"\"logit_bias\""
"\"presence_penalty\""
"\"frequency_penalty\""
"\"repetition_penalty\""
"\"stream\""
"\"stream_options\""
"\"include_usage\""
"\"echo\""
"\"ignore_eos\""
"\"timeout\""
"\"chat_template_kwargs\""
"\"tool_choice\""
"\"response_format\""
"\"add_generation_prompt\""
"\"chat_template_kwargs\""
"null"
"true"
"false"
"1e400"
"\"\x5cud83d\x5cude42\""
DICT
cat > "$OUT/output.dict" <<'DICT'
"<|channel>"
"<channel|>"
"thought\x0a"
"<|tool_call>"
"<tool_call|>"
"call:"
"<|\x22|>"
"<turn|>"
"<eos>"
"<|tool_response>"
"{a:"
"[1,"
"None"
"True"
"-2.5e-3"
DICT

run_target() {
  local t=$1 secs=$2
  rm -rf "$OUT/seeds/$t"
  mkdir -p "$OUT/seeds/$t" "$OUT/corpus/$t"
  [[ $t == files ]] && cp "$ROOT/tests/fixtures/gguf/all_types.gguf" "$OUT/seeds/files/"
  MARKBASE_FUZZ_TARGET=$t FUZZ_WRITE_SEEDS="$OUT/seeds/$t" "$OUT/fuzz_markbase" -runs=0 "$OUT/seeds/$t" > /dev/null 2>&1
  # -malloc_limit_mb: no input of 16 KB may ask for 1 GB at once (a template multiplying a string,
  # a file claiming a huge array); -timeout: none may take 10 s.
  (cd "$OUT" && MARKBASE_FUZZ_TARGET=$t ./fuzz_markbase -max_total_time="$secs" -max_len=16384 -timeout=10 \
     -rss_limit_mb=2048 -malloc_limit_mb=1024 -dict="$t.dict" -artifact_prefix="$t-" -print_final_stats=1 \
     "corpus/$t" "seeds/$t") > "$OUT/$t.log" 2>&1
}

n=${#TARGETS[@]}
parallel=$(( JOBS < n ? JOBS : n ))
secs=$(( SECONDS_TO_RUN * parallel / n ))
(( secs >= 1 )) || secs=1
echo "fuzzing ${TARGETS[*]}: ${secs} s each, ${parallel} at a time"
declare -A pid_of rc_of
finish() { if wait "${pid_of[$1]}"; then rc_of[$1]=0; else rc_of[$1]=1; fi; }
running=()
for t in "${TARGETS[@]}"; do
  run_target "$t" "$secs" &
  pid_of[$t]=$!
  running+=("$t")
  if (( ${#running[@]} >= parallel )); then
    finish "${running[0]}"
    running=("${running[@]:1}")
  fi
done
for t in "${running[@]}"; do finish "$t"; done
status=0
for t in "${TARGETS[@]}"; do
  if (( rc_of[$t] == 0 )); then
    echo "$t: ok, $(grep -m1 'stat::number_of_executed_units' "$OUT/$t.log" | awk '{print $2}') runs"
  else
    status=1
    echo "$t: FOUND SOMETHING (build-fuzz/$t.log):"
    grep -E 'ERROR|SUMMARY|Test unit written|deadly signal|terminate' "$OUT/$t.log" | head -20 || true
  fi
done
exit $status
