#!/usr/bin/env bash
# Issue 5's CPU targets on this machine, in one run: synthetic E2B q4_0 and q8_0 files (made by
# `markbase bench --save` when absent, so both engines read the same file), MarkBase against
# llama.cpp side by side, the share of the memory floor, batch 8 against batch 1, and a decode
# profile. docs/benchmarks.md records its output.
#   tools/cpu_targets.sh [ROUNDS=3]
# Env: MARKBASE, LLAMA_BENCH (as tools/bench_vs_llama.sh), THREADS (default: every CPU this
# process may use, capped by a cgroup CPU quota), SYNTH_DIR (default /tmp/synth), FLOOR_ROUNDS
# (default 10: on a shared host sets of 5 rounds spread much wider than sets of 10 or more, whose
# medians agreed; measured: see docs/benchmarks.md).
set -euo pipefail
rounds=${1:-3}
here=$(cd "$(dirname "$0")" && pwd)
mb=${MARKBASE:-$here/../build/bin/markbase}
[[ -x $mb ]] || { echo "no markbase at $mb (tools/build.sh release)" >&2; exit 1; }
threads=${THREADS:-$(nproc)}
if [[ -z ${THREADS:-} && -r /sys/fs/cgroup/cpu.max ]]; then
  read -r quota period </sys/fs/cgroup/cpu.max
  [[ $quota != max ]] && (( quota / period < threads )) && threads=$(( quota / period ))
fi
export THREADS=$threads MARKBASE=$mb
dir=${SYNTH_DIR:-/tmp/synth}
mkdir -p "$dir"
# The model name alone can hide a different CPU (cloud VMs report "AMD EPYC" for several
# generations): the family/model numbers and the ISA flags tell them apart.
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'); $(lscpu | sed -n 's/^Model name: *//p') (family $(lscpu | sed -n 's/^CPU family: *//p'), model $(lscpu | sed -n 's/^Model: *//p')), $(nproc) CPUs, $threads threads"
grep -o -w -E 'avx2|avx512f|avx512_vnni|amx_int8' /proc/cpuinfo | sort | uniq -c || true
for t in q4_0 q8_0; do
  [[ -f $dir/e2b_$t.gguf ]] || "$mb" bench --synthetic e2b --dtype "$t" --pp 0 --tg 0 --threads "$threads" \
    --save "$dir/e2b_$t.gguf" 2>&1 | tail -n 1
done
tg_of() { python3 -c 'import json,sys
for l in sys.stdin: j = json.loads(l); print(j["batch"], round(j["tg_tokens_per_s"], 2))'; }
echo "=== side by side (pp512, tg128)"
for t in q4_0 q8_0; do bash "$here/bench_vs_llama.sh" "$dir/e2b_$t.gguf" "$rounds"; done
echo "=== share of the memory floor (pp16, tg64)"
for t in q4_0 q8_0; do bash "$here/floor.sh" "$dir/e2b_$t.gguf" "${FLOOR_ROUNDS:-10}" 64; done
echo "=== batch 8 against batch 1, aggregate tg t/s (q4_0, tg64)"
for r in $(seq 1 "$rounds"); do
  "$mb" bench -m "$dir/e2b_q4_0.gguf" --pp 0 --tg 64 --batch 1,8 --reps 1 --threads "$threads" --json 2>/dev/null | tg_of
done
echo "=== decode profile (q4_0, pp16, tg64)"
"$mb" bench -m "$dir/e2b_q4_0.gguf" --pp 16 --tg 64 --reps 1 --threads "$threads" --profile 2>&1 |
  sed -n '/decode profile/,$p' | head -n 20
