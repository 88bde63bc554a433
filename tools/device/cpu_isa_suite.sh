#!/usr/bin/env bash
# The whole test binary once per CPU kernel path this machine runs. CI's machines are AVX2-only, so
# the AVX-512, VNNI and AMX kernels and their bit-for-bit twin tests run only where a CPU has them:
# on the GPU machine's host. One command, from the repository root:
#   OUT=DIR tools/device/cpu_isa_suite.sh
# It prints the CPU, builds the Release test binary in build-isa/ (Ninja when present, else
# Makefiles; the benchmarks and CUDA left out), runs it with the default dispatch, MARKBASE_AMX=0
# (where the CPU has AMX), MARKBASE_CPU_ISA=avx2 (where AVX-512 is the default) and
# MARKBASE_CPU_ISA=scalar, writes gtest's XML of each run and a summary into $OUT, and ends with
# one table: setting, active kernels, tests passed / failed / skipped, and the commit. Exit status:
# 0 when every run passed, 1 when a test failed or a run crashed, 2 when it could not build.
# docs/benchmarks.md records the results.
#
# Env: OUT (default /tmp/cpu-isa-suite); JOBS (build jobs, default nproc); RUN_TIMEOUT (seconds per
# run, default 240); MARKBASE_SHARED_DIR (the shared reference data: linked as ../shared when that
# is absent, as tests read it there; ./shared is used when present); CMAKE_PREFIX_PATH (where the
# build's packages are when not installed system-wide); DEPS_DEBS (default build-devdeps/).
#
# The build needs nlohmann-json, CLI11, fmt and GoogleTest (Debian: nlohmann-json3-dev
# libcli11-dev libfmt-dev libgtest-dev libgmock-dev). A machine without them and without a network
# can take them as .deb files, unpacked into a private prefix, never into /: on a machine with apt,
#   tools/device/cpu_isa_suite.sh --fetch-deps      # apt-get download into build-devdeps/
# then carry build-devdeps/ along (it is ignored by git like every build*/ folder). Nothing is
# vendored; with the packages installed the folder is not read.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
deps_debs=${DEPS_DEBS:-$root/build-devdeps}
# Debian packages of each CMake package the test binary needs (fmt's .so lives in libfmt9).
declare -A debs=([nlohmann_json]="nlohmann-json3-dev" [CLI11]="libcli11-dev" [fmt]="libfmt-dev libfmt9"
                 [GTest]="libgtest-dev libgmock-dev")

# shellcheck source=tools/device/lib.sh
source "$root/tools/device/lib.sh"

if [[ ${1:-} == --fetch-deps ]]; then
  # shellcheck disable=SC2046
  devdeps_fetch "$deps_debs" $(printf '%s ' "${debs[@]}")
  exit 0
fi
[[ $# -eq 0 ]] || { echo "usage: OUT=DIR $0 | $0 --fetch-deps" >&2; exit 2; }

out=${OUT:-/tmp/cpu-isa-suite}
mkdir -p "$out"
summary=$out/summary.txt
: >"$summary"
say() { printf '%s\n' "$*" | tee -a "$summary"; }
t_start=$SECONDS

# ---------------------------------------------------------------- the machine and the commit
commit=$(device_commit "$root")
lscpu_field() { lscpu 2>/dev/null | sed -n "s/^$1: *//p" | head -n 1; }
flags=$(grep -m 1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has_flag() { [[ " $flags " == *" $1 "* ]]; }
say "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
say "commit: $commit"
say "cpu: $(lscpu_field 'Model name') (family $(lscpu_field 'CPU family'), model $(lscpu_field 'Model')," \
    "stepping $(lscpu_field 'Stepping')); $(nproc) CPUs; kernel $(uname -r)"
line="flags:"
for f in avx2 avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16 cldemote; do
  if has_flag "$f"; then line+=" $f"; else line+=" (no $f)"; fi
done
say "$line"
say "(whether Linux grants this process the AMX tile state, arch_prctl, is the 'AMX-INT8 ready' of each run below)"

# ---------------------------------------------------------------- shared data, packages, build
shared=${MARKBASE_SHARED_DIR:-}
if [[ -z $shared && -d $root/shared ]]; then shared=$root/shared; fi
if [[ ! -e $root/../shared ]]; then
  if [[ -n $shared ]]; then
    ln -s "$(cd "$shared" && pwd)" "$root/../shared" && say "shared data: ../shared -> $shared"
  else
    say "shared data: none (no ../shared): the tests that read it skip"
  fi
fi

command -v cmake >/dev/null || { say "cannot build: cmake is missing"; exit 2; }
command -v c++ >/dev/null || command -v g++ >/dev/null || { say "cannot build: no C++ compiler"; exit 2; }
mapfile -t missing < <(devdeps_missing "${!debs[@]}")
if ((${#missing[@]})) && compgen -G "$deps_debs/*.deb" >/dev/null; then
  prefix=/tmp/markbase-deps
  devdeps_unpack "$deps_debs" "$prefix"
  say "packages: ${missing[*]} not installed; using the .deb files of $deps_debs (unpacked in $prefix)"
  mapfile -t missing < <(devdeps_missing "${!debs[@]}")
fi
if ((${#missing[@]})); then
  need=()
  for p in "${missing[@]}"; do need+=("${debs[$p]}"); done
  say "cannot build the test binary: CMake finds no ${missing[*]}."
  say "Install the Debian packages ${need[*]}, or point CMAKE_PREFIX_PATH at them, or run"
  say "'tools/device/cpu_isa_suite.sh --fetch-deps' on a machine with apt and carry build-devdeps/ here."
  exit 2
fi

build=$root/build-isa
say "build: $(command -v ninja >/dev/null && echo Ninja || echo Unix), Release, $(${CXX:-c++} --version 2>/dev/null |
    head -n 1), cmake $(cmake --version | head -n 1 | awk '{print $3}')"
if ! device_build "$root" "$build" markbase_tests "$out/build.log" -DMARKBASE_TESTS=ON; then
  tail -n 40 "$out/build.log"
  say "cannot build the test binary: the end of the build log is above ($out/build.log)"
  exit 2
fi
bin=$build/tests/markbase_tests
say "built in $((SECONDS - t_start)) s"

# ---------------------------------------------------------------- the runs
# Which paths the library itself finds on this CPU (its one check, the one every kernel uses).
best=$("$bin" --gtest_filter='CpuIsa.ActivePathsAreTheEnvironmentsChoice' 2>/dev/null |
       sed -n 's/.*(best here: \([a-z0-9]*\)).*/\1/p' | head -n 1)
settings=("default")
if has_flag amx_int8 || has_flag amx_bf16; then settings+=("MARKBASE_AMX=0"); fi
[[ $best == avx512 ]] && settings+=("MARKBASE_CPU_ISA=avx2")
settings+=("MARKBASE_CPU_ISA=scalar")
say "kernel paths the library finds: best $best; runs: ${settings[*]}"
runs_log=$out/runs.log
: >"$runs_log"
timeout_cmd=(); command -v timeout >/dev/null && timeout_cmd=(timeout "${RUN_TIMEOUT:-240}")
declare -A rc active passed failed skipped total skipped_names failed_names secs
active_re='^\[ figure \] active kernels: \([a-z0-9]*\) .*integer matmul: \([^;]*\);'
active_re+=' AMX-INT8 ready: \([a-z]*\); AMX-BF16 ready: \([a-z]*\).*'
for s in "${settings[@]}"; do
  name=${s//[^A-Za-z0-9]/_}
  env_args=(); [[ $s == default ]] || env_args=("$s")
  tmp=$(mktemp -d)
  t0=$SECONDS
  set +e
  env "${env_args[@]}" TMPDIR="$tmp" "${timeout_cmd[@]}" "$bin" --gtest_output="xml:$out/tests-$name.xml" \
    >"$tmp/log" 2>&1
  rc[$s]=$?
  set -e
  secs[$s]=$((SECONDS - t0))
  { echo "=== $s (exit ${rc[$s]}, ${secs[$s]} s)"; cat "$tmp/log"; } >>"$runs_log"
  log=$tmp/log
  # CpuIsa.ActivePathsAreTheEnvironmentsChoice's line: the table, the integer matmul, AMX's state.
  active[$s]=$(sed -n "s/$active_re/\1, int8 \2, amx-int8 \3, amx-bf16 \4/p" "$log" | head -n 1)
  total[$s]=$(sed -n 's/^\[==========\] \([0-9]*\) tests\{0,1\} from .* ran\..*/\1/p' "$log" | tail -n 1)
  passed[$s]=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) tests\{0,1\}\..*/\1/p' "$log" | tail -n 1)
  skipped[$s]=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests\{0,1\}, listed below:.*/\1/p' "$log" | tail -n 1)
  failed[$s]=$(sed -n 's/^\[  FAILED  \] \([0-9]*\) tests\{0,1\}, listed below:.*/\1/p' "$log" | tail -n 1)
  # The lists at the end of the log: "[  SKIPPED ] Suite.Name" lines after the count line.
  skipped_names[$s]=$(awk '/^\[  SKIPPED \] [0-9]+ tests?, listed below:/ {on = 1; next}
                          on && /^\[  SKIPPED \] / {sub(/,$/, "", $4); print $4; next} on {on = 0}' "$log" |
                     paste -sd ' ' -)
  failed_names[$s]=$(awk '/^\[  FAILED  \] [0-9]+ tests?, listed below:/ {on = 1; next}
                         on && /^\[  FAILED  \] / {sub(/,$/, "", $4); print $4; next} on {on = 0}' "$log" |
                    paste -sd ' ' -)
  rm -rf "$tmp"
done

# ---------------------------------------------------------------- the table
status=0
say ""
say "commit $commit"
say "$(printf '%-24s %-64s %6s %6s %6s %7s %5s %5s' setting 'active kernels' tests passed failed skipped exit secs)"
for s in "${settings[@]}"; do
  t=${total[$s]:-}
  if [[ -z $t ]]; then
    say "$(printf '%-24s %-64s %s' "$s" "${active[$s]:-?}" \
           "no test summary: the run crashed or timed out (exit ${rc[$s]}; see runs.log)")"
    status=1
    continue
  fi
  f=${failed[$s]:-0} k=${skipped[$s]:-0} r=${rc[$s]}
  if ((f != 0 || r != 0)); then status=1; fi
  say "$(printf '%-24s %-64s %6s %6s %6s %7s %5s %5s' "$s" "${active[$s]:-?}" "$t" "${passed[$s]:-0}" "$f" "$k" \
           "$r" "${secs[$s]}")"
done
for s in "${settings[@]}"; do
  if [[ -n ${failed_names[$s]:-} ]]; then say "failed ($s): ${failed_names[$s]}"; fi
  if [[ -n ${skipped_names[$s]:-} ]]; then say "skipped ($s): ${skipped_names[$s]}"; fi
done
say "total $((SECONDS - t_start)) s; gtest XML, runs.log, build.log and this summary in $out"
exit $status
