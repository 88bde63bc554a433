#!/usr/bin/env bash
# Side-by-side pp/tg of MarkBase and llama.cpp on the same GGUF, alternating the two engines so
# both see the same machine weather, then the median of each. Both measure as llama-bench does:
# pp = one prompt of PP tokens, tg = TG tokens generated from an empty context (MarkBase runs its
# bench twice, --pp PP --tg 0 and --pp 0 --tg TG).
#   tools/bench_vs_llama.sh FILE.gguf [ROUNDS=3] [PP=512] [TG=128]
# LLAMA_BENCH (default /work/peer/build/bin/llama-bench, see tools/peer/build_llama_cpp.sh) and
# MARKBASE (default build/bin/markbase) pick the binaries; THREADS defaults to all cores.
set -euo pipefail
model=${1:?usage: $0 FILE.gguf [ROUNDS] [PP] [TG]}
rounds=${2:-3}
pp=${3:-512}
tg=${4:-128}
llama=${LLAMA_BENCH:-/work/peer/build/bin/llama-bench}
mb=${MARKBASE:-$(dirname "$0")/../build/bin/markbase}
threads=${THREADS:-$(nproc)}
[[ -x $llama ]] || { echo "no llama-bench at $llama (tools/peer/build_llama_cpp.sh builds it)" >&2; exit 1; }
[[ -x $mb ]] || { echo "no markbase at $mb (tools/build.sh release)" >&2; exit 1; }

median() { sort -g | awk '{a[NR]=$1} END {if (NR % 2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p')"
echo "model: $model, threads $threads, pp $pp, tg $tg, $rounds rounds"
for r in $(seq 1 "$rounds"); do
  echo "round $r, load $(cut -d' ' -f1-3 /proc/loadavg)"
  "$llama" -m "$model" -p "$pp" -n "$tg" -r 1 -t "$threads" -o json 2>/dev/null |
    python3 -c 'import json,sys
for t in json.load(sys.stdin):
    kind = "pp" if t["n_prompt"] > 0 else "tg"
    print(kind, t["avg_ts"])' >"$tmp/l$r"
  { "$mb" bench -m "$model" --pp "$pp" --tg 0 --reps 1 --threads "$threads" --json 2>/dev/null
    "$mb" bench -m "$model" --pp 0 --tg "$tg" --reps 1 --threads "$threads" --json 2>/dev/null; } |
    python3 -c 'import json,sys
for line in sys.stdin:
    j = json.loads(line)
    print("pp" if j["pp"] > 0 else "tg", j["pp_tokens_per_s"] if j["pp"] > 0 else j["tg_tokens_per_s"])' >"$tmp/m$r"
  echo "  llama.cpp: $(tr '\n' ' ' <"$tmp/l$r")"
  echo "  markbase:  $(tr '\n' ' ' <"$tmp/m$r")"
done
for k in pp tg; do
  l=$(cat "$tmp"/l* | awk -v k=$k '$1 == k {print $2}' | median)
  m=$(cat "$tmp"/m* | awk -v k=$k '$1 == k {print $2}' | median)
  awk -v k=$k -v l="$l" -v m="$m" 'BEGIN {printf "%s%s: llama.cpp %.2f t/s, markbase %.2f t/s, ratio %.2fx\n", k, (k == "pp" ? "'"$pp"'" : "'"$tg"'"), l, m, m / l}'
done
