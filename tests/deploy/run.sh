#!/usr/bin/env bash
# The deploy and load tests of `markbase serve`, for tools/test.sh:
#   tests/deploy/run.sh [BUILD_DIR]     # default build; build-sanitize runs the load test under ASan+UBSan
# 1. tests/deploy/test_replicas.py: two replicas behind nginx (deploy/), routing, affinity, a replica killed.
# 2. bench/serve_load.py for LOAD_SECONDS (default 60): 64 streaming clients against one replica on the small
#    Gemma 4 fixture, with shared system prompts and clients hanging up mid-reply; fails on a 5xx, a crash, a
#    stream with another's tokens (replayed alone afterwards), requests left running, RSS growth after warm-up,
#    or an exit status other than 0 after SIGTERM (with ASan: a leak report). The KV pool is small (--kv-mem):
#    it holds far less than 64 clients' prompts, so cached prefixes are evicted to make room all along.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
export MARKBASE_BIN=${MARKBASE_BIN:-$PWD/$build/bin/markbase}
[[ -x $MARKBASE_BIN ]] || { echo "no markbase at $MARKBASE_BIN: build it first (tools/build.sh)" >&2; exit 1; }
status=0
asan=0
# The output is matched whole, not piped into `grep -q`: under pipefail, grep leaving at the first match can kill
# ldd with SIGPIPE and fail the pipe, which read as "no ASan" and ran the RSS check on an ASan build.
[[ $(ldd "$MARKBASE_BIN") == *libasan* ]] && asan=1
# The replicas test checks routing, which a sanitizer adds nothing to: release builds only, to keep CI short.
if ((asan == 0)); then python3 -m pytest tests/deploy -q -p no:cacheprovider || status=1; fi

model=${MARKBASE_DEPLOY_MODEL:-tests/fixtures/e2b_like}
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
log=$(mktemp)
sanitizer=()  # ASan's quarantine keeps freed memory resident: there the leak check at exit stands for the RSS one
((asan)) && sanitizer=(--no-rss-check)
if ! python3 bench/serve_load.py --launch "$MARKBASE_BIN serve -m $model --host 127.0.0.1 --port $port \
       --max-seqs 16 --threads 1 --ctx 8192 --kv-mem 32M" --base-url "http://127.0.0.1:$port" --server-log "$log" \
       --clients 64 --duration "${LOAD_SECONDS:-60}" --system-words 20,200 --user-words 3,100 --max-tokens 8,64 \
       --replay 32 "${sanitizer[@]}" --json "$build/serve_load.json"; then
  status=1
fi
rm -f "$log"
exit $status
