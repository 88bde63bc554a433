#!/usr/bin/env bash
# Share of the memory floor for decode: alternates `markbase bench --membw` with a decode run of
# FILE, ROUNDS times, and prints each round's streamed GB/s over the mean of the bandwidth read
# just before and just after it, then the median share. Decode speed and bandwidth swing with the
# neighbours on shared machines, so only a probe taken around each run is a fair floor.
# The floor's bandwidth is the median of the probe's passes (issue 5's target: share >= 0.85).
# A decode run averages over its seconds of streaming, so the probe's figure must average too:
# its best pass is a burst as long as one pass over the buffer, which a host's other tenants
# allow now and then: on shared hosts the best passes of successive probes swing far more than
# decode's rate does (measured: see docs/benchmarks.md). The share against the best pass is
# printed second, as the bound a quiet machine would set. The probe's buffer is bench's default,
# at least 20x the L2+L3 caches (MEMBW_MB sets another size in MiB).
#   tools/floor.sh FILE.gguf [ROUNDS=5] [TG=128]
# THREADS (default: every CPU this process may use) sets both the probe's and the decode's threads.
set -euo pipefail
model=${1:?usage: $0 FILE.gguf [ROUNDS] [TG]}
rounds=${2:-5}
tg=${3:-128}
mb=${MARKBASE:-$(dirname "$0")/../build/bin/markbase}
[[ -x $mb ]] || { echo "no markbase at $mb (tools/build.sh release)" >&2; exit 1; }
threads=(); [[ -n ${THREADS:-} ]] && threads=(--threads "$THREADS")
probe=(); [[ -n ${MEMBW_MB:-} ]] && probe=(--membw-mb "$MEMBW_MB")
membw() { "$mb" bench --membw "${probe[@]}" "${threads[@]}" --json 2>/dev/null | python3 -c 'import json,sys; j=json.loads(sys.stdin.readline()); print(j["membw_gb_per_s"], j["membw_median_gb_per_s"], j["membw_mb"])'; }
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, threads ${THREADS:-all}; model $model, --pp 16 --tg $tg, $rounds rounds"
shares=(); bshares=()
for r in $(seq 1 "$rounds"); do
  read -r before before_med buffer_mb < <(membw)
  streamed=$("$mb" bench -m "$model" --pp 16 --tg "$tg" --reps 1 "${threads[@]}" --json 2>/dev/null |
    python3 -c 'import json,sys; j=json.loads(sys.stdin.readline()); print(j["tg_tokens_per_s"] * j["weight_bytes_per_token"] / 1e9)')
  read -r after after_med buffer_mb < <(membw)
  share=$(python3 -c "print(f'{$streamed / (($before_med + $after_med) / 2):.3f}')")
  bshare=$(python3 -c "print(f'{$streamed / (($before + $after) / 2):.3f}')")
  shares+=("$share"); bshares+=("$bshare")
  printf 'round %d: streamed %.2f GB/s, membw (%d MiB) medians of the passes %.1f / %.1f GB/s (best passes %.1f / %.1f), share %s (of the best passes %s; load %s)\n' \
    "$r" "$streamed" "$buffer_mb" "$before_med" "$after_med" "$before" "$after" "$share" "$bshare" "$(cut -d' ' -f1 /proc/loadavg)"
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
echo "median share of the floor: $(median "${shares[@]}") (target >= 0.85; of the probes' best passes: $(median "${bshares[@]}"))"
