#!/usr/bin/env bash
# The CUDA backend on the GPU machine, in one device call: what the GPU is, the CUDA tests (op-level parity with
# the CPU backend, tests/test_cuda_backend.cpp; whole models, tests/test_cuda_model.cpp) with the rest of the test
# binary on the host's CPU beside them, compute-sanitizer's memcheck and racecheck on a small subset, the device's
# copy bandwidth, and markbase against llama.cpp's CUDA build on the same GGUF files in the same call: llama-bench's
# pp512/tg128 and llama-batched-bench's decode of 8, 64 and 128 sequences. It ends with one markdown table (model,
# dtype, test, markbase t/s, llama.cpp t/s, ratio, each engine's share of the bandwidth floor).
#
#   tools/device/gpu_suite.sh --build        # here, on a machine without a GPU (nvcc is enough): build-cuda/carry/
#   OUT=DIR tools/device/gpu_suite.sh        # there: everything below
#   tools/device/gpu_suite.sh --fetch-deps   # on a machine with apt: the .deb files into build-devdeps/
#
# Binaries (PREBUILT=auto, the default; 1 insists on carried ones, 0 always builds): build-cuda/bin/markbase and
# build-cuda/tests/markbase_tests when present, else those of a packed carry folder (CARRY_DIR; by default
# build-cuda/carry/, else .devcarry/): markbase.xz and markbase_tests.xz (or plain), the build's CMakeCache.txt,
# COMMIT, and lib/ with the shared libraries a bare machine lacks (put first on their LD_LIBRARY_PATH). `--build`
# makes that folder here: Release, -DMARKBASE_CUDA=ON (no video files: -DMARKBASE_VIDEO=OFF), stripped (STRIP=0 keeps symbols), xz-compressed (11 and 8
# MB become ~3 and ~2), and prints what the call would send. Without binaries the script builds build-cuda/ there
# (the 16-core host takes a few minutes of the call) from the .deb files of build-devdeps/ where packages are
# missing (nlohmann-json, CLI11, fmt, GoogleTest, cpp-httplib; unpacked into a private prefix, never into /), which
# also serve carried binaries that miss a library. A binary built elsewhere names its source tree by absolute path
# (the fixtures, the CLI the tests run): when the carried CMakeCache.txt names a path that does not exist there,
# that path is made a link to this tree. cuBLAS comes from the CUDA toolkit there (/usr/local/cuda, python3's
# nvidia-* wheels). The Gemma 4 tokenizer that `--save` writes into the models: TOKENIZER, else shared/ (or
# ../shared), else tok.xz in the carry folder.
# llama.cpp: llama-bench and llama-batched-bench with their .so files from LLAMA_CUDA_DIR (default build-peer-cuda/,
# made by `PEER_CUDA=1 tools/peer/build_llama_cpp.sh` and carried; the folder may instead hold one .tar.xz/.tar.gz/
# .tar.zst/.tar of them, unpacked to /tmp), or else its source, LLAMA_CUDA_DIR/llama-src.tar.xz (made by
# `tools/peer/build_llama_cpp.sh --source-archive build-peer-cuda/llama-src.tar.xz`: the same llama.cpp as the CPU
# peer's), which this script builds there on every core while the CUDA tests run (~4 minutes on 16 cores; a warm
# machine's next call reuses /tmp/markbase-peer-cuda). Without either the table has markbase's figures alone.
# A call carries, with the working tree (64 MiB in all, shared/ included: ~47 MiB before any carry here):
#   carry: build-cuda/carry build-peer-cuda        (plus build-devdeps to build there instead)
#
# Time: everything is time-boxed (`timeout`) within BUDGET seconds of wall time (default 510: the call's 10 minutes
# less the start and the transfers); a step that would start with too little left is skipped and says so. The
# steps, in order: nvidia-smi; the CUDA tests (--gtest_filter='*Cuda*'), the host tests (-'*Cuda*') running beside
# them on the CPU; compute-sanitizer; the bandwidth probe; the benchmarks (the host tests are waited for first, so
# that nothing else runs on the machine while they do). The synthetic models are made by `markbase bench
# --synthetic NAME --dtype D --save FILE.gguf` (the Gemma 4 tokenizer from shared/), benchmarked by markbase in the
# same run, then by llama.cpp from the file, and deleted.
#
# Env:
#   OUT (default /tmp/gpu-suite); BUDGET (510 s); JOBS (build jobs, nproc); PREBUILT (auto|1|0); BUILD_DIR
#   (build-cuda); CARRY_DIR; TOKENIZER; LLAMA_CUDA_DIR.
#   SKIP_TESTS=1, SKIP_HOST_TESTS=1, SKIP_SANITIZER=1, SKIP_BENCH=1: leave those steps out (a full run with BIG=1
#     takes two calls: SKIP_BENCH=1, then SKIP_TESTS=1 SKIP_SANITIZER=1 BIG=1).
#   CUDA_TEST_TIMEOUT (300), HOST_TEST_TIMEOUT (360), SANITIZER_TIMEOUT (90 per tool), BENCH_TIMEOUT (180 per command).
#   CUDA_TEST_FILTER ('*Cuda*'); HOST_TEST_FILTER ('-*Cuda*'); MEMCHECK_FILTER, RACECHECK_FILTER (one small model
#   fixture test each).
#   SYNTH_MODEL (e4b); DTYPES ("q4_0 q8_0 bf16": the model in each); BATCHED_DTYPES ("q4_0": those with the batched
#   comparison too); BATCHES (8,64,128);
#   BIG=1: 31b and 26b-a4b at q4_0 too (pp/tg; their files are ~17 and ~15 GB, minutes to make); REPS (3).
#   MEDIA=1: the media encoders against transformers on this GPU, with MarkBase's op tables (MEDIA_TIMEOUT, 300 s;
#     MEDIA_ARGS: more arguments for bench/media_vs_transformers.py, e.g. --profile-env VAR=VALUE).
#   MEDIA_CPU=1: the same on this host's CPU (MEDIA_THREADS: a list of thread counts, default every core; MEDIA_REPS,
#     5), after the peer's build.
#   PEER_BUILD_TIMEOUT (420 s); SKIP_PEER_BUILD=1 leaves the peer's source unbuilt.
#   MODEL_DIR (/tmp/gpu-suite-models); KEEP_MODELS=1 keeps the .gguf files.
#   SWEEP="A=1 A=2,B=3": markbase's pp/tg on the first dtype's file under each setting, rounds interleaved
#     (SWEEP_ROUNDS, 3; SWEEP_ARGS, "--pp 512 --tg 128 --reps 3": bench's arguments, --profile's tables in the
#     logs), with a table of medians.
#   STEP_PROFILE="8 128": ncu's time of each kernel of decode steps at those batches, on the first dtype's file
#     (STEP_PROFILE_TG decode steps, 3, after one-token prompts whose launches it skips); STEP_PROFILE_ENV="A=1 B=2":
#     settings for those runs alone.
# Output ($OUT, at most 8 files): gpu_suite.md (the summary and the table), results.json (every figure),
# cuda-tests.log and cuda-tests.xml, host-tests.xml, logs.tar.gz (every other log). Exit status: 0 when every test
# passed and the sanitizers found nothing (or could not run here); 1 when a test failed, a sanitizer reported an
# error or a step crashed; 2 when there is no GPU or nothing to run.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
root=$PWD
# shellcheck source=tools/device/lib.sh
source "$root/tools/device/lib.sh"
deps_debs=${DEPS_DEBS:-$root/build-devdeps}
build=${BUILD_DIR:-$root/build-cuda}
debs=(nlohmann-json3-dev libcli11-dev libfmt-dev libfmt9 libgtest-dev libgmock-dev libcpp-httplib-dev
      libcpp-httplib0.11 libbrotli-dev libbrotli1 libssl-dev libssl3 zlib1g-dev zlib1g pkgconf pkgconf-bin libpkgconf3)

configure_and_build() {  # LOG: Release, CUDA on, benchmarks off; markbase and the test binary
  local log=$1
  if [[ -f $build/CMakeCache.txt ]] && ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$root" "$build/CMakeCache.txt"; then
    rm -rf "$build"
  fi
  local gen=(-G "Unix Makefiles")
  command -v ninja >/dev/null && gen=(-G Ninja)
  { cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DMARKBASE_CUDA=ON -DMARKBASE_VIDEO=OFF -DMARKBASE_BENCH=OFF \
      -DMARKBASE_TESTS=ON &&
      cmake --build "$build" --target markbase markbase_tests -j "${JOBS:-$(nproc)}"; } >"$log" 2>&1
}

case ${1:-} in
  --fetch-deps)
    devdeps_fetch "$deps_debs" "${debs[@]}"
    exit 0 ;;
  --build)
    log=${TMPDIR:-/tmp}/markbase-gpu-suite-build.log
    echo "building $build (Release, CUDA on; log: $log) ..."
    t=$SECONDS
    if ! configure_and_build "$log"; then
      tail -n 30 "$log"
      echo "the build failed (above; $log)" >&2
      exit 2
    fi
    [[ ${STRIP:-1} == 1 ]] && strip --strip-unneeded "$build/bin/markbase" "$build/tests/markbase_tests"
    echo "built in $((SECONDS - t)) s"
    ls -l "$build/bin/markbase" "$build/tests/markbase_tests"
    # The packed carry folder: the binaries xz-compressed (a third of their size), the CMakeCache.txt that names
    # the source path, the commit, and the shared libraries they load that a bare Ubuntu lacks (fmt, cpp-httplib,
    # brotli; glibc, libstdc++, OpenSSL and zlib are there, cuBLAS comes with the CUDA toolkit).
    pack=${CARRY_DIR:-$build/carry}
    rm -rf "$pack" && mkdir -p "$pack/lib"
    xz -T0 -6 -c "$build/bin/markbase" >"$pack/markbase.xz"
    xz -T0 -6 -c "$build/tests/markbase_tests" >"$pack/markbase_tests.xz"
    cp "$build/CMakeCache.txt" "$pack/"
    # shared/ does not travel from a checkout beside it: the tokenizer that `bench --save` writes into the models.
    for t in "$root/shared/data/tokenizer/gemma4-tokenizer.json" "$root/../shared/data/tokenizer/gemma4-tokenizer.json"; do
      [[ -f $t ]] && { xz -T0 -6 -c "$t" >"$pack/tok.xz"; break; }
    done
    dirty=""
    [[ -n $(git status --porcelain --untracked-files=no 2>/dev/null) ]] && dirty=" (with uncommitted changes)"
    echo "$(git rev-parse HEAD 2>/dev/null || echo unknown)$dirty" >"$pack/COMMIT"
    ldd "$build/bin/markbase" "$build/tests/markbase_tests" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
      while read -r name path; do
        case $name in
          libc.so*|libm.so*|libstdc++*|libgcc_s*|libpthread*|libdl.so*|librt.so*|ld-linux*|libssl.so*|libcrypto.so*|\
          libz.so*|libcublas*|libcudart*) ;;
          *) cp -L "$path" "$pack/lib/$name" ;;
        esac
      done
    # What a device call sends: tracked and untracked-not-ignored files, shared/, and the carried paths.
    rel=${pack#"$root"/}
    carry=("$rel" build-peer-cuda)
    tree=$( (git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -n 1 |
             cut -f 1; [[ -d shared ]] && du -sb shared | cut -f 1; for c in "${carry[@]}"; do
             [[ -e $c ]] && du -sb "$c" | cut -f 1; done) | awk '{s += $1} END {print s}')
    echo "carry: ${carry[*]}"
    for c in "${carry[@]}"; do [[ -e $c ]] && du -sh "$c" || echo "  ($c: absent)"; done
    ls -l "$pack" "$pack/lib"
    awk -v b="$tree" 'BEGIN {printf "the call would send %.1f MiB of the 64 MiB allowed\n", b / 1048576;
                             if (b > 64 * 1048576) print "TOO LARGE: carry less"}'
    exit 0 ;;
  ""|run) ;;
  *) echo "usage: OUT=DIR $0 | $0 --build | $0 --fetch-deps" >&2; exit 2 ;;
esac

# ====================================================================== on the GPU machine
out=${OUT:-/tmp/gpu-suite}
mkdir -p "$out"
work=$(mktemp -d /tmp/gpu-suite-work.XXXXXX)
mkdir -p "$work/results"
md=$out/gpu_suite.md
: >"$md"
say() { printf '%s\n' "$*" | tee -a "$md"; }
budget=${BUDGET:-510}
t0=$SECONDS
status=0
fail() { status=1; say "FAILED: $*"; }
# shellcheck disable=SC2317  # run by the EXIT trap
finish() {
  # Every log into one tarball (only 8 files come back); the steps' times at the end of the summary.
  {
    echo
    echo "## steps"
    echo
    echo "| step | seconds | exit |"
    echo "|---|---|---|"
    awk -F '\t' '{printf "| %s | %s | %s |\n", $1, $2, $3}' "$work/steps.tsv" 2>/dev/null
    echo
    echo "total $((SECONDS - t0)) s of a budget of $budget s; exit status $status"
  } >>"$md"
  tar -czf "$out/logs.tar.gz" -C "$work" . 2>/dev/null
  rm -rf "$work"
  # The model files this run made (a run cut short leaves them otherwise).
  if [[ ${KEEP_MODELS:-0} != 1 ]]; then
    for f in "${made_models[@]}"; do rm -f "$f" "$f.part"; done
  fi
}
made_models=()
trap finish EXIT

# run_step NAME LIMIT CMD...: CMD under `timeout`, its output in $work/NAME.log, its time and exit in steps.tsv.
# LIMIT shrinks to what is left of the budget (less 20 s for the table and the tarball); with under 15 s left the
# step is skipped (exit 125).
run_step() {
  local name=$1 limit=$2
  shift 2
  local rem=$((budget - (SECONDS - t0) - 20))
  if ((rem < 15)); then
    printf '%s\t-\tskipped (time budget)\n' "$name" >>"$work/steps.tsv"
    say "skipped $name: the time budget is spent"
    return 125
  fi
  ((limit > rem)) && limit=$rem
  local s=$SECONDS rc
  timeout -k 10 "$limit" "$@" >"$work/$name.log" 2>&1
  rc=$?
  local note=$rc
  ((rc == 124 || rc == 137)) && note="$rc (timed out after $limit s)"
  printf '%s\t%s\t%s\n' "$name" $((SECONDS - s)) "$note" >>"$work/steps.tsv"
  return $rc
}

say "# markbase CUDA suite"
say ""
commit=$(device_commit "$root")
for c in "${CARRY_DIR:-$build/carry}/COMMIT" "$root/.devcarry/COMMIT"; do
  if [[ ! -f $root/COMMIT && -f $c ]]; then commit="$(head -n 1 "$c") (from $c)"; break; fi
done
say "date: $(date -u '+%Y-%m-%d %H:%M UTC'); commit: $commit"
say "host: $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1); $(nproc) CPUs; kernel $(uname -r)"

# ---------------------------------------------------------------- the GPU
if ! run_step nvidia-smi 30 nvidia-smi; then
  say "nvidia-smi failed: no GPU here?"
  sed -n '1,20p' "$work/nvidia-smi.log" | tee -a "$md"
  exit 2
fi
gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader 2>/dev/null |
      head -n 1)
say "gpu: $gpu; nvcc: $(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p' || echo none)"

# ---------------------------------------------------------------- shared data, libraries, binaries
if [[ ! -e $root/../shared && -d $root/shared ]]; then ln -s "$root/shared" "$root/../shared" 2>/dev/null; fi
tokenizer=${TOKENIZER:-$root/shared/data/tokenizer/gemma4-tokenizer.json}
[[ -f $tokenizer ]] || tokenizer=$root/../shared/data/tokenizer/gemma4-tokenizer.json

# cuBLAS and the CUDA runtime: the toolkit's folders and python3's nvidia-* wheels.
cuda_dirs=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib \
         $(python3 -c 'import glob, site, os
for s in site.getsitepackages():
    for d in sorted(glob.glob(os.path.join(s, "nvidia", "*", "lib"))): print(d)' 2>/dev/null); do
  [[ -d $d ]] && compgen -G "$d/libcublas*.so*" >/dev/null && cuda_dirs+="${cuda_dirs:+:}$d"
done
base_ld=${LD_LIBRARY_PATH:-}
mb_ld=$cuda_dirs${base_ld:+:$base_ld}
deps_unpacked=0
unpack_deps() {  # the carried .deb files into a private prefix; their libraries for markbase's binaries only
  ((deps_unpacked)) && return 0
  compgen -G "$deps_debs/*.deb" >/dev/null || return 1
  devdeps_unpack "$deps_debs" /tmp/markbase-deps
  mb_ld=/tmp/markbase-deps/usr/lib/x86_64-linux-gnu:$mb_ld
  export LD_LIBRARY_PATH=$base_ld
  deps_unpacked=1
  say "packages: the .deb files of $deps_debs unpacked in /tmp/markbase-deps"
}
mbrun() { env LD_LIBRARY_PATH="$mb_ld" "$@"; }

# A packed carry folder (`--build` writes build-cuda/carry; .devcarry/ holds the same by hand): the binaries
# xz-compressed, the build's CMakeCache.txt, COMMIT, lib/ with the shared libraries a bare machine lacks.
carry_dir=${CARRY_DIR:-}
if [[ -z $carry_dir ]]; then
  for d in "$build/carry" "$root/.devcarry"; do [[ -d $d ]] && { carry_dir=$d; break; }; done
fi
unxz_to() {  # SRC DST: xz, or python's lzma where xz is missing
  if command -v xz >/dev/null; then xz -dc "$1" >"$2"
  else python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$1" "$2"; fi
}
find_binary() {  # NAME BUILD_PATH -> a runnable path, or nothing
  local name=$1 plain=$2
  if [[ -x $plain ]]; then echo "$plain"; return; fi
  [[ -n $carry_dir ]] || return 0
  if [[ -x $carry_dir/$name ]]; then echo "$carry_dir/$name"; return; fi
  if [[ -f $carry_dir/$name.xz ]]; then
    mkdir -p /tmp/gpu-suite-bin && unxz_to "$carry_dir/$name.xz" "/tmp/gpu-suite-bin/$name" &&
      chmod +x "/tmp/gpu-suite-bin/$name" && echo "/tmp/gpu-suite-bin/$name"
  fi
}
prebuilt=${PREBUILT:-auto}
markbase="" tests=""
if [[ $prebuilt != 0 ]]; then
  markbase=$(find_binary markbase "$build/bin/markbase")
  tests=$(find_binary markbase_tests "$build/tests/markbase_tests")
  if [[ -n $markbase && -n $tests ]]; then prebuilt=1
  elif [[ $prebuilt == 1 ]]; then say "PREBUILT=1 but no markbase and markbase_tests in $build or ${carry_dir:-a carry folder}"; exit 2
  else prebuilt=0; fi
fi
if [[ ! -f $tokenizer && -n $carry_dir ]]; then  # shared/ left behind: a compressed copy in the carry folder
  for t in "$carry_dir/tok.xz" "$carry_dir/gemma4-tokenizer.json.xz"; do
    [[ -f $t ]] && unxz_to "$t" /tmp/gemma4-tokenizer.json && tokenizer=/tmp/gemma4-tokenizer.json && break
  done
fi
if [[ $prebuilt == 1 ]]; then
  say "binaries: carried, $markbase ($(du -h "$markbase" | cut -f 1)) and $tests ($(du -h "$tests" | cut -f 1))"
  if [[ -n $carry_dir && -d $carry_dir/lib ]]; then
    mb_ld=$carry_dir/lib:$mb_ld
    say "libraries: $carry_dir/lib ($(find "$carry_dir/lib" -name '*.so*' | wc -l) files)"
  fi
  # The source tree the binaries were built in (fixture paths and the CLI's path are compiled in).
  cache=$build/CMakeCache.txt
  [[ -f $cache || -z $carry_dir ]] || cache=$carry_dir/CMakeCache.txt
  src_dir=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$cache" 2>/dev/null)
  if [[ -n $src_dir && $src_dir != "$root" && ! -e $src_dir ]]; then
    mkdir -p "$(dirname "$src_dir")" && ln -s "$root" "$src_dir" && say "source path: $src_dir -> $root (a link)"
  elif [[ -z $src_dir ]]; then
    say "note: no CMakeCache.txt carried; tests that read fixtures need the tree at the path it was built in"
  fi
  if [[ $(mbrun ldd "$markbase" "$tests") == *"not found"* ]]; then
    unpack_deps || true
    if [[ $(mbrun ldd "$markbase" "$tests") == *"not found"* ]]; then
      say "shared libraries missing for the carried binaries:"
      mbrun ldd "$markbase" "$tests" | grep "not found" | sort -u | tee -a "$md"
      exit 2
    fi
  fi
else
  cmake_pkgs=(nlohmann_json CLI11 fmt GTest)
  mapfile -t missing < <(devdeps_missing "${cmake_pkgs[@]}")
  if ((${#missing[@]})) || ! pkg-config --exists cpp-httplib 2>/dev/null; then
    unpack_deps || say "packages: ${missing[*]:-cpp-httplib} missing and no .deb files in $deps_debs"
  fi
  say "binaries: building $build here ($(nproc) jobs) ..."
  if ! run_step build 420 env LD_LIBRARY_PATH="$mb_ld" bash -c "$(declare -f configure_and_build); root='$root' \
      build='$build' JOBS=${JOBS:-$(nproc)} configure_and_build /dev/stdout"; then
    tail -n 30 "$work/build.log" | tee -a "$md"
    say "cannot build (log above; logs.tar.gz has all of it)"
    exit 2
  fi
  say "built in $(awk -F '\t' '$1 == "build" {print $2}' "$work/steps.tsv") s"
  markbase=$build/bin/markbase
  tests=$build/tests/markbase_tests
fi
mbrun "$markbase" --version 2>&1 | head -n 1 | sed 's/^/markbase: /' | tee -a "$md"

# ---------------------------------------------------------------- llama.cpp's CUDA build, from source
# Without carried binaries of the peer, its source archive (`tools/peer/build_llama_cpp.sh --source-archive
# build-peer-cuda/llama-src.tar.xz`, ~5 MB) is built here on every core while the CUDA tests use the GPU, into
# /tmp (a warm machine's next call finds it there); waited for before anything is timed.
llama_dir=${LLAMA_CUDA_DIR:-$root/build-peer-cuda}
peer_build=/tmp/markbase-peer-cuda
has_llama_bench() { [[ -n $(find "$1" -maxdepth 2 -name llama-bench -type f 2>/dev/null) ]]; }
peer_pid=""
if [[ ${SKIP_PEER_BUILD:-0} != 1 ]] && ! has_llama_bench "$llama_dir" &&
    [[ ! -x $peer_build/build/bin/llama-bench && -f $llama_dir/llama-src.tar.xz ]]; then
  say "llama.cpp: building its CUDA peer from $llama_dir/llama-src.tar.xz ($(nproc) jobs, beside the tests)"
  (
    s=$SECONDS
    timeout -k 10 "${PEER_BUILD_TIMEOUT:-420}" env PEER_CUDA=1 PEER_SRC="$llama_dir/llama-src.tar.xz" \
      JOBS="$(nproc)" bash "$root/tools/peer/build_llama_cpp.sh" "$peer_build" >"$work/peer-build.log" 2>&1
    printf 'peer-build\t%s\t%s\n' $((SECONDS - s)) $? >"$work/peer-build.step"
  ) &
  peer_pid=$!
fi
wait_peer_build() {
  [[ -n $peer_pid ]] || return 0
  wait "$peer_pid"
  peer_pid=""
  cat "$work/peer-build.step" >>"$work/steps.tsv" 2>/dev/null
  if [[ -x $peer_build/build/bin/llama-bench ]]; then
    say "llama.cpp: built in $(cut -f 2 "$work/peer-build.step") s ($(grep -m 1 'llama.cpp' "$work/peer-build.log"))"
  else
    say "llama.cpp: the build failed ($(cut -f 3 "$work/peer-build.step")): $(tail -n 3 "$work/peer-build.log" | tr '\n' ' ')"
  fi
}

# ---------------------------------------------------------------- tests
gtest_counts() {  # LOG -> "N tests: P passed, F failed, S skipped"
  local log=$1 t p f s
  t=$(sed -n 's/^\[==========\] \([0-9]*\) tests\{0,1\} from .* ran\..*/\1/p' "$log" | tail -n 1)
  p=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) tests\{0,1\}\..*/\1/p' "$log" | tail -n 1)
  f=$(sed -n 's/^\[  FAILED  \] \([0-9]*\) tests\{0,1\}, listed below:.*/\1/p' "$log" | tail -n 1)
  s=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests\{0,1\}, listed below:.*/\1/p' "$log" | tail -n 1)
  if [[ -z $t ]]; then echo "no summary (crashed or timed out)"; return 1; fi
  echo "$t tests: ${p:-0} passed, ${f:-0} failed, ${s:-0} skipped"
  [[ ${f:-0} == 0 ]]
}
failed_names() {
  awk '/^\[  FAILED  \] [0-9]+ tests?, listed below:/ {on = 1; next}
       on && /^\[  FAILED  \] / {sub(/,$/, "", $4); print $4; next} on {on = 0}' "$1"
}

host_pid=""
if [[ ${SKIP_HOST_TESTS:-0} != 1 && ${SKIP_TESTS:-0} != 1 ]]; then
  # Beside the CUDA tests, on the CPU; waited for before the benchmarks.
  (
    s=$SECONDS
    TMPDIR=$(mktemp -d) timeout -k 10 "${HOST_TEST_TIMEOUT:-360}" env LD_LIBRARY_PATH="$mb_ld" "$tests" \
      --gtest_filter="${HOST_TEST_FILTER:--*Cuda*}" --gtest_output="xml:$out/host-tests.xml" >"$work/host-tests.log" 2>&1
    printf 'host-tests\t%s\t%s\n' $((SECONDS - s)) $? >"$work/host-tests.step"
  ) &
  host_pid=$!
fi

if [[ ${SKIP_TESTS:-0} != 1 ]]; then
  say ""
  say "## CUDA tests"
  run_step cuda-tests "${CUDA_TEST_TIMEOUT:-300}" env LD_LIBRARY_PATH="$mb_ld" "$tests" \
    --gtest_filter="${CUDA_TEST_FILTER:-*Cuda*}" --gtest_output="xml:$out/cuda-tests.xml"
  rc=$?
  cp "$work/cuda-tests.log" "$out/cuda-tests.log" 2>/dev/null
  if counts=$(gtest_counts "$work/cuda-tests.log") && ((rc == 0)); then
    say "$counts"
  else
    fail "CUDA tests (exit $rc): $counts"
    failed_names "$work/cuda-tests.log" | sed 's/^/- /' | tee -a "$md"
  fi
  if grep -q '^\[  SKIPPED \] [0-9]* tests\{0,1\}, listed below' "$work/cuda-tests.log" &&
     grep -q 'no CUDA device visible' "$work/cuda-tests.log"; then
    fail "the CUDA tests skipped: the test binary sees no GPU (built without CUDA?)"
  fi
  say ""
  say "Near-ties (greedy tokens that differ from the CPU's by less than the logit difference there):"
  grep -h '^\[ NEAR-TIE \]' "$work/cuda-tests.log" | sed 's/^/    /' | tee -a "$md" || say "    none"
  say ""
  say "Model figures:"
  grep -h '^\[ cuda-model \]' "$work/cuda-tests.log" | grep -v 'chunk 7' | sed 's/^\[ cuda-model \] /    /' | tee -a "$md"
  say ""
  say "The 12 largest op errors (relative to the output's max |value|; all in cuda-tests.log):"
  grep -h '^\[ cuda-op  \]' "$work/cuda-tests.log" | awk '{
      w = 0
      for (i = 1; i <= NF; i++) if ($i == "worst" || $i == "rel") {v = $(i + 1); if (v + 0 == v) w = v}
      print w "\t" $0}' | sort -g -r | head -n 12 | cut -f 2- | sed 's/^\[ cuda-op  \] /    /' | tee -a "$md"
fi

# ---------------------------------------------------------------- compute-sanitizer
if [[ ${SKIP_SANITIZER:-0} != 1 && ${SKIP_TESTS:-0} != 1 ]]; then
  say ""
  say "## compute-sanitizer"
  san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
  if [[ -z $san ]]; then
    say "not found: skipped"
  else
    # Whether it takes this device at all (on gVisor it answers "Device not supported").
    run_step sanitizer-probe 60 env LD_LIBRARY_PATH="$mb_ld" "$san" --tool memcheck --error-exitcode 86 "$tests" \
      --gtest_filter='CudaOps.SliceGatherCopy'
    probe=$?
    if grep -qiE 'device not supported|not supported on this|unable to|error 999|unknown error' \
         "$work/sanitizer-probe.log" && ((probe != 0)); then
      say "compute-sanitizer refuses this device: skipped ($(grep -m 1 -iE 'not supported|unable|999|unknown error' \
          "$work/sanitizer-probe.log"))"
    else
      for tool in memcheck racecheck; do
        if [[ $tool == memcheck ]]; then filter=${MEMCHECK_FILTER:-Fixtures/CudaModel.PromptLogitsMatchCpu/2:CudaOps.RecordedStepReplaysWithNewStagedInputs}
        else filter=${RACECHECK_FILTER:-Fixtures/CudaModel.DecodeThroughPagedCacheEqualsPrefill/5}; fi
        extra=()
        [[ $tool == memcheck ]] && extra=(--leak-check no)
        run_step "sanitizer-$tool" "${SANITIZER_TIMEOUT:-90}" env LD_LIBRARY_PATH="$mb_ld" "$san" --tool "$tool" \
          "${extra[@]}" --error-exitcode 86 --print-limit 20 "$tests" --gtest_filter="$filter"
        rc=$?
        summary=$(grep -hE '(ERROR|RACECHECK) SUMMARY' "$work/sanitizer-$tool.log" | tail -n 1 | sed 's/^=* *//')
        if ((rc == 86)); then
          fail "$tool ($filter): ${summary:-errors reported}"
          grep -m 10 -E '^========= (Invalid|Race|Error|.*hazard)' "$work/sanitizer-$tool.log" | tee -a "$md"
        elif ((rc == 124 || rc == 137)); then
          say "$tool ($filter): timed out (not an error; ${summary:-no summary})"
        elif ((rc != 0)); then
          fail "$tool ($filter): exit $rc (${summary:-see the log}); $(gtest_counts "$work/sanitizer-$tool.log")"
        else
          say "$tool ($filter): ${summary:-clean}; $(gtest_counts "$work/sanitizer-$tool.log")"
        fi
      done
    fi
  fi
fi

# ---------------------------------------------------------------- the host tests' result
if [[ -n $host_pid ]]; then
  say ""
  say "## host tests (the rest of the binary, on the CPU)"
  wait "$host_pid"
  cat "$work/host-tests.step" >>"$work/steps.tsv" 2>/dev/null
  if counts=$(gtest_counts "$work/host-tests.log"); then
    say "$counts"
  else
    fail "host tests: $counts"
    failed_names "$work/host-tests.log" | sed 's/^/- /' | tee -a "$md"
  fi
fi

wait_peer_build  # nothing below shares the machine with a compiler

# ---------------------------------------------------------------- media encoders
# MEDIA_CPU=1: bench/media_vs_transformers.py on this host's CPU, every core (MEDIA_THREADS), MarkBase's CPU
# backend against transformers on torch's CPU kernels, then MarkBase's op table for one run of each input.
if [[ ${MEDIA_CPU:-0} == 1 ]]; then
  say ""
  say "## media encoders on the CPU (bench/media_vs_transformers.py --threads N --profile)"
  if python3 -c "import torch, torchvision, transformers" 2>/dev/null; then
    for n in ${MEDIA_THREADS:-$(nproc)}; do
      run_step "media-cpu-$n" "${MEDIA_TIMEOUT:-300}" env LD_LIBRARY_PATH="$mb_ld" python3 \
        "$root/bench/media_vs_transformers.py" --threads "$n" --reps "${MEDIA_REPS:-5}" --markbase "$markbase" --profile
      grep -E '^(\||bf16|f32)' "$work/media-cpu-$n.log" | tee -a "$md"
      sed -n '/^MarkBase ops/,$p' "$work/media-cpu-$n.log" | head -n 60 | tee -a "$md"
    done
  else
    say "torch, torchvision or transformers missing: skipped"
  fi
fi

# MEDIA=1: bench/media_vs_transformers.py on this GPU (E4B-size ViT and conformer against transformers, with
# MarkBase's op table for one run of each input), when torch and transformers are installed here.
if [[ ${MEDIA:-0} == 1 ]]; then
  say ""
  say "## media encoders (bench/media_vs_transformers.py --device cuda --profile)"
  if python3 -c "import torch, torchvision, transformers" 2>/dev/null; then
    run_step media "${MEDIA_TIMEOUT:-300}" env LD_LIBRARY_PATH="$mb_ld" python3 "$root/bench/media_vs_transformers.py" \
      --device cuda --markbase "$markbase" --profile ${MEDIA_ARGS:-}
    grep -E '^\|' "$work/media.log" | tee -a "$md"
    sed -n '/^MarkBase ops/,$p' "$work/media.log" | head -n 200 | tee -a "$md"
  else
    say "torch, torchvision or transformers missing: skipped"
  fi
fi

# ---------------------------------------------------------------- benchmarks
if [[ ${SKIP_BENCH:-0} != 1 ]]; then
  say ""
  say "## benchmarks"
  model_dir=${MODEL_DIR:-/tmp/gpu-suite-models}
  mkdir -p "$model_dir"
  # llama.cpp's CUDA build: the binaries and their .so files, or an archive of them, or what was built above.
  [[ -x $peer_build/build/bin/llama-bench ]] && ! has_llama_bench "$llama_dir" && llama_dir=$peer_build/build
  if [[ -d $llama_dir ]] && ! has_llama_bench "$llama_dir"; then
    arc=$(find "$llama_dir" -maxdepth 1 -type f \( -name '*.tar' -o -name '*.tar.*' -o -name '*.tgz' \) \
          ! -name llama-src.tar.xz | head -n 1)
    if [[ -n $arc ]]; then
      mkdir -p /tmp/llama-cuda && tar -xaf "$arc" -C /tmp/llama-cuda && llama_dir=/tmp/llama-cuda
    fi
  fi
  llama_bench=$(find "$llama_dir" -name llama-bench -type f 2>/dev/null | head -n 1)
  llama_batched=$(find "$llama_dir" -name llama-batched-bench -type f 2>/dev/null | head -n 1)
  ll_ld=$cuda_dirs
  for so in $(find "$llama_dir" -name 'lib*.so*' -exec dirname {} \; 2>/dev/null | sort -u); do ll_ld=$so:$ll_ld; done
  [[ -n $llama_bench ]] && ll_ld=$(dirname "$llama_bench"):$ll_ld
  ll_env="LD_LIBRARY_PATH=$ll_ld${base_ld:+:$base_ld}"
  if [[ -z $llama_bench ]]; then
    say "llama.cpp: no llama-bench under $llama_dir (PEER_CUDA=1 tools/peer/build_llama_cpp.sh, carried): markbase only"
  else
    chmod +x "$llama_bench" "$llama_batched" 2>/dev/null
    missing_so=$(env "$ll_env" ldd "$llama_bench" 2>&1 | grep "not found" | sort -u)
    [[ -n $missing_so ]] && say "llama.cpp: libraries not found: $missing_so"
    say "llama.cpp: $llama_bench$( [[ -n $llama_batched ]] && echo " and llama-batched-bench")"
  fi

  # The device's copy bandwidth (a read and a write of each byte count twice: what a stream of weights gets).
  if run_step membw 60 env LD_LIBRARY_PATH="$mb_ld" "$markbase" bench --device cuda --membw --json; then
    grep -h '^{' "$work/membw.log" | tail -n 1 >"$work/results/membw.json"
    say "bandwidth: $(python3 -c 'import json, sys
j = json.load(open(sys.argv[1]))
print("%.0f GB/s (a copy kernel over %s MiB, read and write counted)" % (j["membw_gb_per_s"], j.get("membw_mb")))' \
          "$work/results/membw.json" 2>/dev/null || echo '?')"
  else
    say "bandwidth probe failed (exit $?): the floor column stays empty"
  fi

  reps=${REPS:-3}
  batches=${BATCHES:-8,64,128}
  bench_one() {  # MODEL DTYPE BATCHED(0/1) TIMEOUT
    local m=$1 d=$2 batched=$3 limit=$4 tag="$1-$2" file="$model_dir/$1_$2.gguf"
    made_models+=("$file")
    # 1. markbase makes the synthetic model, saves it, and benchmarks it: pp512 and tg128 at batch 1.
    run_step "markbase-$tag" "$limit" env LD_LIBRARY_PATH="$mb_ld" "$markbase" bench --device cuda \
      --synthetic "$m" --dtype "$d" --pp 512 --tg 128 --reps "$reps" --json --save "$file" --tokenizer "$tokenizer"
    local rc=$?
    grep -hs '^{' "$work/markbase-$tag.log" >"$work/results/markbase-$tag.json"
    if ((rc != 0)); then
      say "markbase $m $d: exit $rc ($(grep -m 1 -iE 'error|fail' "$work/markbase-$tag.log" || tail -n 1 "$work/markbase-$tag.log"))"
      ((rc == 124 || rc == 137 || rc == 125)) || status=1
    fi
    [[ -f $file ]] || { say "no $file: llama.cpp skipped for $m $d"; return; }
    # 2. llama.cpp on the same file.
    if [[ -n $llama_bench ]]; then
      run_step "llama-bench-$tag" "$limit" env "$ll_env" "$llama_bench" -m "$file" -p 512 -n 128 -fa 1 \
        -ngl 99 -r "$reps" -o json
      rc=$?
      # The JSON array is the output's only bracketed block (the log has llama.cpp's own lines too).
      python3 - "$work/llama-bench-$tag.log" >"$work/results/llama-bench-$tag.json" <<'PY' || say "llama-bench $m $d: exit $rc, no JSON"
import json, sys
text = open(sys.argv[1], errors="replace").read()
start, end = text.find("["), text.rfind("]")
json.dump(json.loads(text[start:end + 1]), sys.stdout)
PY
    fi
    if ((batched)); then
      if [[ -n $llama_batched ]]; then
        run_step "llama-batched-$tag" "$limit" env "$ll_env" "$llama_batched" -m "$file" -c 40000 -b 2048 \
          -ub 512 -npp 128 -ntg 128 -npl "$batches" -fa on -ngl 99 --output-format jsonl
        grep -hs '^{' "$work/llama-batched-$tag.log" | grep '"pl"' >"$work/results/llama-batched-$tag.json"
        if [[ ! -s $work/results/llama-batched-$tag.json ]]; then
          # Builds without --output-format: the markdown table's rows.
          awk -F '|' '/^\| *[0-9]+ \|/ {gsub(/ /, ""); printf "{\"pp\": %s, \"tg\": %s, \"pl\": %s, \"speed_pp\": %s, \"speed_tg\": %s}\n", $2, $3, $4, $7, $9}' \
            "$work/llama-batched-$tag.log" >"$work/results/llama-batched-$tag.json"
        fi
      fi
      # markbase's batched decode from the same file (prefill: each sequence's 128 tokens on its own).
      run_step "markbase-batched-$tag" "$limit" env LD_LIBRARY_PATH="$mb_ld" "$markbase" bench \
        --device cuda -m "$file" --batch "$batches" --pp 128 --tg 128 --reps "$(( reps > 2 ? 2 : reps ))" --json
      grep -hs '^{' "$work/markbase-batched-$tag.log" >"$work/results/markbase-batched-$tag.json"
    fi
    [[ ${KEEP_MODELS:-0} == 1 ]] || rm -f "$file"
  }
  batched_set=" ${BATCHED_DTYPES:-q4_0} "
  # SWEEP and STEP_PROFILE run on the first dtype's file, kept until they are done.
  keep_asked=${KEEP_MODELS:-0}
  [[ -n ${SWEEP:-}${STEP_PROFILE:-} ]] && KEEP_MODELS=1
  for d in ${DTYPES:-q4_0 q8_0 bf16}; do
    b=0
    [[ $batched_set == *" $d "* ]] && b=1
    bench_one "${SYNTH_MODEL:-e4b}" "$d" "$b" "${BENCH_TIMEOUT:-180}"
  done
  read -r d0 _ <<<"${DTYPES:-q4_0 q8_0 bf16}"
  file="$model_dir/${SYNTH_MODEL:-e4b}_$d0.gguf"
  # SWEEP: settings (space-separated VAR=VALUE, commas for several in one) measured on the first dtype's
  # file, interleaved round by round (SWEEP_ROUNDS, 3) so that the machine's drift falls on all alike.
  if [[ -n ${SWEEP:-} ]]; then
    for ((r = 1; r <= ${SWEEP_ROUNDS:-3}; ++r)); do
      i=0
      for setting in $SWEEP; do
        i=$((i + 1))
        # shellcheck disable=SC2046,SC2086  # one word per assignment and per argument
        run_step "sweep-$i-$r" "${BENCH_TIMEOUT:-180}" env LD_LIBRARY_PATH="$mb_ld" $(tr ',' ' ' <<<"$setting") \
          "$markbase" bench --device cuda -m "$file" ${SWEEP_ARGS:---pp 512 --tg 128 --reps 3} --json
        grep -hs '^{' "$work/sweep-$i-$r.log" | sed "s|^{|{\"setting\": \"$setting\", |" >>"$work/sweep.jsonl"
      done
    done
    python3 - "$work/sweep.jsonl" <<'PY' | tee -a "$md"
import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    j = json.loads(line)
    runs.setdefault((j["setting"], j.get("batch", 1)), []).append(j)
print("\n| setting | batch | tg tok/s (runs) | median | pp tok/s median |\n|---|---|---|---|---|")
for (k, b), v in runs.items():
    tg = [r.get("tg_tokens_per_s") or 0 for r in v]
    pp = [r.get("pp_tokens_per_s") or 0 for r in v]
    print(f"| {k} | {b} | {' '.join(f'{t:.0f}' for t in tg)} | {statistics.median(tg):.0f} | {statistics.median(pp):.0f} |")
PY
  fi
  # STEP_PROFILE: each decode kernel's time (ncu, each kernel alone) at the batches of STEP_PROFILE ("8 128"), on
  # the first dtype's file.
  if [[ -n ${STEP_PROFILE:-} ]]; then
    ncu_bin=$(command -v ncu || find /usr/local/cuda*/bin /opt/nvidia -name ncu -type f 2>/dev/null | head -n 1)
    if [[ -z $ncu_bin ]]; then
      say "STEP_PROFILE: no ncu on this machine"
    else
      for b in $STEP_PROFILE; do
        # Sequences prefill one at a time (1-token prompts: one forward each, ~570 launches for E4B's 42 layers,
        # fewer for models of fewer layers, after ~1,500 of loading and warming up); ncu skips most of those
        # launches and times every kernel after them alone (graph nodes one by one). The skip must stay below the
        # real count (at 600 a sequence it passed E4B's decode steps from 64 streams up), so it takes 300 a
        # sequence and the window reaches past the rest of the prefill. The table takes the last
        # STEP_PROFILE_TG runs of kernels that end in a pick (argmax): the decode steps.
        steps=${STEP_PROFILE_TG:-3}
        # shellcheck disable=SC2086  # one word per assignment
        run_step "ncu-$b" "${BENCH_TIMEOUT:-180}" env LD_LIBRARY_PATH="$mb_ld" ${STEP_PROFILE_ENV:-} "$ncu_bin" --graph-profiling node \
          --metrics gpu__time_duration.sum --csv --page raw --launch-skip $((b * 300 + 1000)) \
          --launch-count $((b * 500 + steps * 1200 + 3000)) "$markbase" bench --device cuda -m "$file" --batch "$b" --pp 1 \
          --tg "$steps" --reps 1
        python3 - "$work/ncu-$b.log" "$b" "$steps" <<'PY' | tee -a "$md"
import csv, collections, io, sys
text = open(sys.argv[1], errors="replace").read().splitlines()
start = next((i for i, l in enumerate(text) if l.startswith('"ID"')), None)
if start is None:
    print(f"ncu {sys.argv[2]}: no kernel rows"); sys.exit()
rows = [r for r in csv.DictReader(io.StringIO("\n".join(text[start:]))) if r.get("ID", "").isdigit()]
ends = [i for i, r in enumerate(rows) if "argmax" in r["Kernel Name"] or "sample_rows" in r["Kernel Name"]]
steps = min(int(sys.argv[3]), len(ends) - 1)
if steps < 1:
    print(f"ncu {sys.argv[2]}: fewer than two picks among {len(rows)} launches"); sys.exit()
rows = rows[ends[-steps - 1] + 1:ends[-1] + 1]
by = collections.defaultdict(lambda: [0.0, 0])
for r in rows:
    try: t = float(r["gpu__time_duration.sum"].replace(",", ""))
    except ValueError: continue
    e = by[r["Kernel Name"].split("(")[0][:80]]
    e[0] += t
    e[1] += 1
unit = next((r.get("gpu__time_duration.sum") for r in csv.DictReader(io.StringIO("\n".join(text[start:start + 2])))), "")
tot = sum(v[0] for v in by.values())
print(f"\nkernels timed alone, {sys.argv[2]} streams: {len(rows)} launches in {steps} decode steps (unit: {unit}); {tot / steps:.1f} a step")
print("| a step | share | launches a step | kernel |\n|---|---|---|---|")
for k, (t, c) in sorted(by.items(), key=lambda kv: -kv[1][0])[:22]:
    print(f"| {t / steps:.1f} | {100 * t / tot:.1f}% | {c / steps:.1f} | {k} |")
PY
      done
    fi
  fi
  [[ $keep_asked == 1 ]] || rm -f "${made_models[@]}"
  KEEP_MODELS=$keep_asked  # BIG's files (~32 GB) go as before
  if [[ ${BIG:-0} == 1 ]]; then
    bench_one 31b q4_0 0 "${BIG_BENCH_TIMEOUT:-420}"
    bench_one 26b-a4b q4_0 0 "${BIG_BENCH_TIMEOUT:-420}"
  fi

  # ---------------------------------------------------------------- the table
  python3 - "$work/results" "$out/results.json" <<'PY' | tee -a "$md"
import glob, json, os, sys
res, dest = sys.argv[1], sys.argv[2]
def lines(path):
    rows = []
    try:
        for line in open(path):
            line = line.strip()
            if line.startswith("{"):
                try: rows.append(json.loads(line))
                except ValueError: pass
    except OSError: pass
    return rows
def load(path):
    try: return json.load(open(path))
    except (OSError, ValueError): return None
every = {os.path.basename(p)[:-5]: (load(p) if "llama-bench" in p or "membw" in p else lines(p))
         for p in sorted(glob.glob(os.path.join(res, "*.json")))}
json.dump(every, open(dest, "w"), indent=1)
membw = (every.get("membw") or {}).get("membw_gb_per_s")
def tag_of(k):
    for prefix in ("markbase-batched-", "llama-batched-", "llama-bench-", "markbase-"):
        if k.startswith(prefix):
            return k[len(prefix):]
    return None
tags = sorted({t for t in map(tag_of, every) if t})
rows = []
def floor(wbytes, batch):  # tokens/s the bandwidth allows if each step reads the weights once
    return batch * membw * 1e9 / wbytes if membw and wbytes else None
def frac(v, f):
    return f"{100 * v / f:.0f}%" if v and f else "-"
for tag in tags:
    model, dtype = tag.rsplit("-", 1)
    mb = (every.get("markbase-" + tag) or [None])[0] or {}
    wb = mb.get("weight_bytes_per_token")
    ll = {}
    for t in every.get("llama-bench-" + tag) or []:
        ll["pp" if t.get("n_prompt") else "tg"] = t.get("avg_ts")
    if mb or ll:
        rows.append((model, dtype, f"pp{mb.get('pp', 512)}", mb.get("pp_tokens_per_s"), ll.get("pp"), None))
        rows.append((model, dtype, f"tg{mb.get('tg', 128)}", mb.get("tg_tokens_per_s"), ll.get("tg"), floor(wb, 1)))
    mbb = {r["batch"]: r for r in every.get("markbase-batched-" + tag) or []}
    llb = {r["pl"]: r for r in every.get("llama-batched-" + tag) or []}
    for b in sorted(set(mbb) | set(llb)):
        m, l = mbb.get(b, {}), llb.get(b, {})
        wbb = m.get("weight_bytes_per_token") or wb
        rows.append((model, dtype, f"pp128 x{b}", m.get("pp_tokens_per_s"), l.get("speed_pp"), None))
        rows.append((model, dtype, f"tg128 x{b}", m.get("tg_tokens_per_s"), l.get("speed_tg"), floor(wbb, b)))
fmt = lambda v: f"{v:.1f}" if isinstance(v, (int, float)) and v == v else "-"
print()
print("| model | dtype | test | markbase t/s | llama.cpp t/s | ratio | markbase % of floor | llama.cpp % of floor |")
print("|---|---|---|---|---|---|---|---|")
for model, dtype, test, m, l, f in rows:
    ratio = f"{m / l:.2f}x" if m and l else "-"
    print(f"| {model} | {dtype} | {test} | {fmt(m)} | {fmt(l)} | {ratio} | {frac(m, f)} | {frac(l, f)} |")
print()
print("Floor: tokens/s if a decode step only streamed the weights once at the measured bandwidth "
      "(batch x bandwidth / markbase's weight_bytes_per_token; for MoE the routed experts of one token, so "
      "batched MoE rows overstate it). pp rows have none (compute-bound). markbase's tg128 follows its pp512 "
      "prompt (llama-bench's starts empty); its batched pp prefills each sequence on its own, llama-batched-bench "
      "all at once.")
PY
fi

say ""
say "status: $status"
exit $status
