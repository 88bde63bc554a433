#!/usr/bin/env bash
# `markbase serve` side by side with llama.cpp's `llama-server` on the same machine, model and prompts, both with
# 16 parallel slots (issue 21's proof). One command, from the repository root, on the GPU machine's host:
#   OUT=DIR tools/device/serve_bench.sh
# It builds markbase (Release, the CLI only, in build-serve/), takes llama-server (see LLAMA_SERVER), makes the
# model when none is given, and then runs each server in turn under bench/serve_load.py with the same seed, so
# both see the same requests: a prefix probe (a repeated system prompt's latency cold vs warm, i.e. without and
# with prefix caching) and SLOTS concurrent streaming clients for DURATION seconds. It ends with one table:
# aggregate generated tokens/s, TTFT and inter-token p50/p99, the probe, and each server's checks; $OUT holds each
# run's JSON report and server log. Exit status: 0 when both ran (markbase's checks passed), 1 when a check or a
# run failed, 2 when it could not build or find what it needs. With the defaults a run takes about 2 minutes a server
# plus the build and the model (one device call of 10 minutes holds ROUNDS=1).
#
# Env:
#   OUT (default /tmp/serve-bench); SLOTS (16: markbase --max-seqs, llama-server -np, and the clients);
#   DURATION (60 s of load per server); ROUNDS (1: servers alternate, ROUNDS runs each); THREADS (nproc);
#   CTX (4096 tokens per sequence); PROBE_ROUNDS (5); SEED (1); JOBS (build jobs, nproc).
#   MODEL: a GGUF both servers read. Default: the synthetic E2B q4_0 (random weights in Gemma 4 E2B's shapes) that
#     `markbase bench --synthetic e2b --dtype q4_0 --save` writes to /tmp/synth/e2b_q4_0.gguf; it needs the
#     Gemma 4 tokenizer from ../shared (MARKBASE_SHARED_DIR, or a shared/ folder carried in the tree). It has no
#     chat template, so the load uses /v1/completions only (set ENDPOINTS=mixed for chat too, with a model that
#     has one).
#   LLAMA_SERVER: a llama-server binary. Default: build-peer/llama-server when present (built elsewhere with
#     `PEER_SERVER=1 PEER_MARCH=sapphirerapids tools/peer/build_llama_cpp.sh` and carried: the source does not
#     fit a device call), else built here by tools/peer/build_llama_cpp.sh (needs PyPI).
#   MARKBASE: a markbase binary to use instead of building one.
#   MARKBASE_NO_PREFIX_CACHE_FLAG (default --no-prefix-cache): markbase also runs the probe with this flag, its
#     prefix cache off, as a further line under the table; empty: skipped.
# The build needs nlohmann-json, CLI11, fmt, cpp-httplib and pkg-config (Debian: nlohmann-json3-dev libcli11-dev
# libfmt-dev libcpp-httplib-dev pkgconf); a markbase binary built elsewhere (MARKBASE) needs cpp-httplib's and
# fmt's shared libraries. Without them and without a network: `tools/device/serve_bench.sh --fetch-deps` on a
# machine with apt puts their .deb files in build-devdeps/; carry that folder along.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
deps_debs=${DEPS_DEBS:-$root/build-devdeps}
# shellcheck source=tools/device/lib.sh
source "$root/tools/device/lib.sh"
cmake_pkgs=(nlohmann_json CLI11 fmt)
debs=(nlohmann-json3-dev libcli11-dev libfmt-dev libfmt9 libcpp-httplib-dev libcpp-httplib0.11 libbrotli-dev
      libbrotli1 libssl-dev libssl3 zlib1g-dev zlib1g pkgconf pkgconf-bin libpkgconf3)
if [[ ${1:-} == --fetch-deps ]]; then
  devdeps_fetch "$deps_debs" "${debs[@]}"
  exit 0
fi
[[ $# -eq 0 ]] || { echo "usage: OUT=DIR $0 | $0 --fetch-deps" >&2; exit 2; }

out=${OUT:-/tmp/serve-bench}
mkdir -p "$out"
summary=$out/summary.txt
: >"$summary"
say() { printf '%s\n' "$*" | tee -a "$summary"; }
slots=${SLOTS:-16}
duration=${DURATION:-60}
rounds=${ROUNDS:-1}
threads=${THREADS:-$(nproc)}
ctx=${CTX:-4096}
seed=${SEED:-1}
t_start=$SECONDS

commit=$(device_commit "$root")
say "date: $(date -u '+%Y-%m-%d %H:%M UTC'); commit: $commit"
say "cpu: $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1); $(nproc) CPUs; threads $threads"

# ---------------------------------------------------------------- markbase
shared=${MARKBASE_SHARED_DIR:-}
if [[ -z $shared && -d $root/shared ]]; then shared=$root/shared; fi
if [[ ! -e $root/../shared && -n $shared ]]; then
  ln -s "$(cd "$shared" && pwd)" "$root/../shared" && say "shared data: ../shared -> $shared"
fi
# The carried .deb files serve a build that misses a package, or a given binary that misses a shared library.
need_debs=0
if [[ -n ${MARKBASE:-} ]]; then
  [[ $(ldd "$MARKBASE") == *"not found"* ]] && need_debs=1  # not `| grep -q`: SIGPIPE fails the pipe
else
  mapfile -t missing < <(devdeps_missing "${cmake_pkgs[@]}")
  { ((${#missing[@]})) || ! pkg-config --exists cpp-httplib 2>/dev/null; } && need_debs=1
fi
if ((need_debs)) && compgen -G "$deps_debs/*.deb" >/dev/null; then
  devdeps_unpack "$deps_debs" /tmp/markbase-deps
  say "packages: some are missing here; using the .deb files of $deps_debs (unpacked in /tmp/markbase-deps)"
fi
markbase=${MARKBASE:-}
if [[ -z $markbase ]]; then
  build=$root/build-serve
  device_build "$root" "$build" markbase "$out/build.log" -DMARKBASE_TESTS=OFF ||
    { tail -n 40 "$out/build.log"; say "cannot build markbase: its log's end is above ($out/build.log)"; exit 2; }
  markbase=$build/bin/markbase
  say "markbase built in $((SECONDS - t_start)) s"
fi

# ---------------------------------------------------------------- llama-server
llama=${LLAMA_SERVER:-}
if [[ -z $llama && -x $root/build-peer/llama-server ]]; then llama=$root/build-peer/llama-server; fi
if [[ -z $llama ]]; then
  say "building llama-server (tools/peer/build_llama_cpp.sh, PEER_SERVER=1)"
  if PEER_SERVER=1 LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36} \
       tools/peer/build_llama_cpp.sh /tmp/markbase-peer >"$out/peer-build.log" 2>&1; then
    llama=/tmp/markbase-peer/build/bin/llama-server
  else
    tail -n 20 "$out/peer-build.log"
    say "cannot build llama-server (no network here? carry one as build-peer/llama-server or set LLAMA_SERVER)"
    exit 2
  fi
fi
[[ -x $llama ]] || { say "no llama-server at $llama"; exit 2; }
say "llama-server: $llama ($("$llama" --version 2>&1 | grep -m 1 -i version || echo 'version unknown'))"

# ---------------------------------------------------------------- the model
model=${MODEL:-}
if [[ -z $model ]]; then
  model=/tmp/synth/e2b_q4_0.gguf
  if [[ ! -f $model ]]; then
    mkdir -p /tmp/synth
    if ! "$markbase" bench --synthetic e2b --dtype q4_0 --pp 0 --tg 0 --save "$model" >"$out/synth.log" 2>&1; then
      tail -n 5 "$out/synth.log"
      say "cannot make the synthetic model (the Gemma 4 tokenizer from ../shared is needed; see above)"
      exit 2
    fi
  fi
fi
[[ -f $model ]] || { say "no model at $model"; exit 2; }
say "model: $model ($(du -h "$model" | cut -f 1)); $slots slots, ${duration} s of load, ctx $ctx a sequence"

# ---------------------------------------------------------------- the runs
endpoints=(--completions-fraction 1)
[[ ${ENDPOINTS:-completions} == mixed ]] && endpoints=()
load_args=(--clients "$slots" --duration "$duration" --seed "$seed" --prefix-probe "${PROBE_ROUNDS:-5}"
           --probe-system-words 1000 --system-words 100,600 --user-words 5,300 --max-tokens 32,256
           --disconnect-fraction 0.05 --replay 8 --request-timeout 300 --ready-timeout 300 "${endpoints[@]}")
# Each run listens on a port of its own: a port just closed by the last server can still refuse a new bind.
port=${PORT:-18080}
mb_cmd="$markbase serve -m $model --host 127.0.0.1 --port @PORT@ --max-seqs $slots --ctx $ctx --threads $threads"
# -c is the context of all slots together; prompt caching (cache_prompt) is on by default, but for a model with
# sliding-window layers (Gemma's) llama.cpp reuses a cached prefix only with --swa-full (else it keeps just the
# window and prefills every prompt whole); --metrics for /metrics.
ll_cmd="$llama -m $model --host 127.0.0.1 --port @PORT@ -np $slots -c $((slots * ctx)) -t $threads -tb $threads \
--cont-batching --swa-full --metrics --no-webui"
run() {  # name, command, extra serve_load arguments
  local name=$1 cmd=${2//@PORT@/$port}
  shift 2
  say "--- $name: $cmd"
  set +e
  PYTHONUNBUFFERED=1 python3 bench/serve_load.py --launch "$cmd" --base-url "http://127.0.0.1:$port" \
    --server-log "$out/$name.log" \
    --json "$out/$name.json" "${load_args[@]}" "$@" 2>&1 | tee -a "$summary"
  local rc=${PIPESTATUS[0]}
  set -e
  say "($name: exit $rc)"
  port=$((port + 1))
  return 0
}
for r in $(seq 1 "$rounds"); do
  run "markbase-$r" "$mb_cmd"
  # llama.cpp's numerics depend on the batch: its replays could only be reported, so they are skipped.
  run "llama-server-$r" "$ll_cmd" --no-batch-invariance --replay 0 --no-clean-exit
done
nocache_flag=${MARKBASE_NO_PREFIX_CACHE_FLAG---no-prefix-cache}
if [[ -n $nocache_flag ]]; then
  run "markbase-nocache" "$mb_cmd $nocache_flag" --duration 0
fi

# ---------------------------------------------------------------- the table
set +e
python3 - "$out" "$rounds" <<'PY' | tee -a "$summary"
import json, os, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def load(name):
    try:
        with open(os.path.join(out, name + ".json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
def med(reports, get):
    vals = [get(r) for r in reports if r]
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None
runs = {s: [load(f"{s}-{i}") for i in range(1, rounds + 1)] for s in ("markbase", "llama-server")}
def stat(key, q):
    return lambda r: (1e3 * ((r.get("load") or {}).get(key) or {}).get(q, float("nan")))
def probe(key):
    return lambda r: (r.get("prefix_probe") or {}).get(key)
ms = lambda get: (lambda r: None if get(r) is None else 1e3 * get(r))  # noqa: E731
rows = [
    ("generated tokens/s (all streams)", lambda r: (r.get("load") or {}).get("throughput_tok_s"), "{:.1f}", ">= 1.5x"),
    ("TTFT p50, ms", stat("ttft_s", "p50"), "{:.1f}", ""),
    ("TTFT p99, ms", stat("ttft_s", "p99"), "{:.1f}", "<= 1x"),
    ("time per output token p50, ms", stat("tpot_s", "p50"), "{:.2f}", ""),
    ("time per output token p99, ms", stat("tpot_s", "p99"), "{:.2f}", ""),
    ("inter-chunk gap p99, ms", stat("itl_s", "p99"), "{:.2f}", ""),
    ("probe cold (no cache possible), ms", ms(probe("cold_median_s")), "{:.1f}", ""),
    ("probe warm (repeated system prompt), ms", ms(probe("warm_median_s")), "{:.1f}", ""),
    ("probe warm / cold", probe("warm_over_cold"), "{:.3f}", "<= 0.2"),
]
print()
print(f"{'row':42s} {'markbase':>12s} {'llama-server':>12s} {'ratio':>8s}  target")
for label, get, f, target in rows:
    m, l = med(runs["markbase"], get), med(runs["llama-server"], get)
    show = lambda v: "-" if v is None or v != v else f.format(v)
    ratio = "-" if m is None or l is None or not l or m != m or l != l else f"{m / l:.2f}x"
    if label.startswith("probe warm /"):
        ratio = ""
    print(f"{label:42s} {show(m):>12s} {show(l):>12s} {ratio:>8s}  {target}")
nc = load("markbase-nocache")
if nc and nc.get("prefix_probe"):
    pp = nc["prefix_probe"]
    line = (f"markbase with its prefix cache off: probe cold {1e3 * pp['cold_median_s']:.1f} ms, repeated "
            f"{1e3 * pp['warm_median_s']:.1f} ms")
    cached = med(runs["markbase"], probe("warm_median_s"))
    if cached is not None and pp["warm_median_s"] > 0:
        line += f"; repeated with the cache / without: {cached / pp['warm_median_s']:.3f} (target <= 0.2)"
    print(line)
status = 0
for s, reps in runs.items():
    for i, r in enumerate(reps, 1):
        if not r:
            print(f"{s} round {i}: no report (see its log)")
            status = 1
            continue
        checks = r.get("checks", {})
        bad = [k for k, v in checks.items() if not v["ok"]] + (["could not run"] if "fatal" in r else [])
        print(f"{s} round {i}: checks {'all passed' if not bad else 'FAILED: ' + ', '.join(bad)}"
              + ("" if "fatal" not in r else f"; {r['fatal']}"))
        if s == "markbase" and (bad or "fatal" in r):
            status = 1
sys.exit(status)
PY
status=$?
say "total $((SECONDS - t_start)) s; reports, server logs and this summary in $out"
exit $status
