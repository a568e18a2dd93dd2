#!/usr/bin/env bash
# Build anchorkv and run every test it has. This is what CI runs (.ci/run).
#   (a) cpu       Release CPU build (scripts/build.sh) + ctest
#   (b) asan      the same suite under AddressSanitizer + UBSan (ANCHORKV_TEST_QUICK=1, label
#                 "long" excluded)
#       fuzz      scripts/fuzz.sh: the deserializer fuzz target for ANCHORKV_FUZZ_SECONDS (60)
#                 under ASan + UBSan (clang libFuzzer; else the asan build's mutation driver)
#       emu       the SIMT emulation tests under two more scheduling seeds (ANCHORKV_SIMT_SEED)
#   (c) cuda      compile-only CUDA build for sm_80 and sm_90 (skipped without nvcc): the device
#                 bundle of scripts/device-bundle.sh, every target the GPU machine runs
#   (d) install   install/consumer test (ctest label "install") + install into ANCHORKV_PREFIX
#   (e) bindings  scripts/test-bindings.sh, when present, with ANCHORKV_BUILD_DIR/ANCHORKV_PREFIX
# A failing step does not stop the independent ones; the summary lists every step and the
# script exits nonzero when any failed.
#
# Environment:
#   ANCHORKV_BUILD_DIR       CPU build directory (default: build)
#   ANCHORKV_ASAN_BUILD_DIR  sanitizer build directory (default: <build dir>-asan)
#   ANCHORKV_CUDA_BUILD_DIR  CUDA compile-only build directory (default: <build dir>-cuda)
#   ANCHORKV_FUZZ_BUILD_DIR  clang libFuzzer build directory (default: <build dir>-fuzz)
#   ANCHORKV_FUZZ_SECONDS    fuzzing time (default 60)
#   ANCHORKV_PREFIX          install prefix handed to the bindings (default: a fresh /tmp dir,
#                            removed at exit unless ANCHORKV_KEEP_PREFIX=1)
#   ANCHORKV_JOBS            parallel build and test jobs (default: number of cores)
#   ANCHORKV_SKIP            steps to skip, e.g. "asan fuzz cuda"
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

absolute() { case "$1" in /*) echo "$1" ;; *) echo "$root/$1" ;; esac; }
jobs="${ANCHORKV_JOBS:-$(nproc)}"
build_dir="$(absolute "${ANCHORKV_BUILD_DIR:-build}")"
asan_dir="$(absolute "${ANCHORKV_ASAN_BUILD_DIR:-${build_dir}-asan}")"
cuda_dir="$(absolute "${ANCHORKV_CUDA_BUILD_DIR:-${build_dir}-cuda}")"
fuzz_dir="$(absolute "${ANCHORKV_FUZZ_BUILD_DIR:-${build_dir}-fuzz}")"
fuzz_seconds="${ANCHORKV_FUZZ_SECONDS:-60}"
skip_list=" ${ANCHORKV_SKIP:-} "
if [ -n "${ANCHORKV_PREFIX:-}" ]; then
  prefix="$(absolute "$ANCHORKV_PREFIX")"; remove_prefix=0
else
  prefix="$(mktemp -d "${TMPDIR:-/tmp}/anchorkv-prefix.XXXXXX")"; remove_prefix=1
fi
cleanup() {
  if [ "$remove_prefix" = 1 ] && [ "${ANCHORKV_KEEP_PREFIX:-0}" != 1 ]; then rm -rf "$prefix"; fi
  rm -f "${failures_file:-}"
}
trap cleanup EXIT

# The Rust toolchain lives in ~/.cargo/bin, which a non-login shell may not have on PATH;
# nvcc in /usr/local/cuda/bin likewise.
[ -d "$HOME/.cargo/bin" ] && PATH="$PATH:$HOME/.cargo/bin"
[ -d /usr/local/cuda/bin ] && PATH="$PATH:/usr/local/cuda/bin"
export PATH

# ---- step bookkeeping -----------------------------------------------------------------------
names=() states=() times=() notes=()
declare -A state_of=()
record() { names+=("$1"); states+=("$2"); times+=("$3"); notes+=("$4"); state_of[$1]="$2"; }
# step NAME COMMAND...: runs COMMAND in a subshell with errexit on, records PASS/FAIL.
step() {
  local name="$1"; shift
  if [[ "$skip_list" == *" ${name%%:*} "* ]]; then skip "$name" "ANCHORKV_SKIP"; return 0; fi
  printf '\n==== %s ====\n' "$name"
  local start=$SECONDS rc
  set +e
  ( set -e; "$@" )
  rc=$?
  set -e
  if [ "$rc" -eq 0 ]; then record "$name" PASS $((SECONDS - start)) ""
  else record "$name" FAIL $((SECONDS - start)) "exit $rc"; fi
}
skip() { printf '\n==== %s: skipped (%s) ====\n' "$1" "$2"; record "$1" SKIP 0 "$2"; }
# after DEPENDENCY NAME COMMAND...: step NAME only when step DEPENDENCY passed.
after() {
  local dependency="$1"; shift
  case "${state_of[$dependency]:-}" in
    PASS) step "$@" ;;
    FAIL) skip "$1" "'$dependency' failed" ;;
    *) skip "$1" "'$dependency' skipped" ;;
  esac
}

# Failed tests, and what they printed, are repeated after the summary: the end of the log is
# what a CI report shows.
failures_file="$(mktemp "${TMPDIR:-/tmp}/anchorkv-failures.XXXXXX")"
ctest_run() { # ctest_run BUILD_DIR ARGS...: the whole suite must contain tests and pass
  local dir="$1"; shift
  if ctest --test-dir "$dir" --output-on-failure --no-tests=error -j "$jobs" "$@"; then return 0; fi
  {
    echo "failed in $dir:"
    sed 's/^/  /' "$dir/Testing/Temporary/LastTestsFailed.log" 2>/dev/null || true
    grep -E -A3 'Failure$|random seed|\(replay|Child aborted|\*\*\*Timeout|Which is|error:' \
      "$dir/Testing/Temporary/LastTest.log" 2>/dev/null | head -n 60 | sed 's/^/    /' || true
  } >> "$failures_file"
  return 1
}

echo "anchorkv test.sh: $(cmake --version | head -n 1), $(c++ --version | head -n 1), ${jobs} jobs"
echo "  build dirs: $build_dir, $asan_dir, $cuda_dir, $fuzz_dir; install prefix: $prefix"
total_start=$SECONDS

# ---- (a) CPU build + ctest --------------------------------------------------------------------
step "cpu: build" env ANCHORKV_BUILD_DIR="$build_dir" ANCHORKV_CUDA=OFF ANCHORKV_JOBS="$jobs" \
  "$root/scripts/build.sh" -DANCHORKV_BUILD_TESTS=ON -DANCHORKV_BUILD_CLI=ON
after "cpu: build" "cpu: ctest" ctest_run "$build_dir" -LE install
# The emulation draws the order of blocks, fibers and atomics from ANCHORKV_SIMT_SEED; ctest
# ran seed 1, two more seeds here (side by side).
emulation_seeds() {
  local pids=() seed pid failed=0
  for seed in 2 3; do
    # the million-position test checks lengths, not schedules: seed 1 (ctest) runs it
    ANCHORKV_SIMT_SEED=$seed "$build_dir/tests/anchorkv_emulation_tests" --gtest_brief=1 --gtest_filter='-*MillionPositions' &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  return "$failed"
}
after "cpu: build" "emu: seeds 2 3" emulation_seeds

# ---- (b) AddressSanitizer + UBSan ---------------------------------------------------------------
asan_build() {
  # -O1 -g1: line tables for the reports at a fraction of the compile time of -O2 -g (the
  # library's own objects keep their -O3).
  cmake -S "$root" -B "$asan_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DANCHORKV_CUDA=OFF \
        -DANCHORKV_SANITIZE=address,undefined -DANCHORKV_BUILD_TESTS=ON -DANCHORKV_BUILD_CLI=ON \
        -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1"
  cmake --build "$asan_dir" --parallel "$jobs"
}
asan_ctest() {
  # Quick mode: tests read ANCHORKV_TEST_QUICK to shrink their sizes; "long" ones are left out.
  ANCHORKV_TEST_QUICK=1 \
  ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:strict_string_checks=1:detect_stack_use_after_return=1" \
  UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
    ctest_run "$asan_dir" -LE 'long|install|emu'  # emu: fibers (ucontext) confuse ASan
}
step "asan: build" asan_build
after "asan: build" "asan: ctest" asan_ctest

# ---- (b2) fuzzing -------------------------------------------------------------------------------
# The seeds are checked in (tests/fuzz/corpus); new inputs stay in the fuzz build directory.
fuzz_run() {
  ANCHORKV_FUZZ_BUILD_DIR="$fuzz_dir" ANCHORKV_ASAN_BUILD_DIR="$asan_dir" ANCHORKV_JOBS="$jobs" \
    "$root/scripts/fuzz.sh" "$fuzz_seconds"
}
after "asan: build" "fuzz: deserialize ${fuzz_seconds}s" fuzz_run

# ---- (c) CUDA compile-only ----------------------------------------------------------------------
cuda_build() {
  # The device bundle (scripts/device-bundle.sh) for sm_80 and sm_90: every target that
  # scripts/device-check.sh runs on a GPU machine, built, linked and stripped here so that it
  # cannot rot. No GPU here: the GPU tests must skip, not fail.
  echo "CUDA sources: $(find "$root/src/cuda" -name '*.cu' | wc -l) .cu files in src/cuda"
  # SASS for both (every kernel compiled and assembled for each), without the PTX that "80;90"
  # also embeds: this bundle is never carried (a device run builds its own, sm_90 with PTX), and
  # the PTX was about a third of its size (61 MiB with the GPT-J decode kernels, past the limit
  # that a carried bundle must keep).
  ANCHORKV_BUNDLE_BUILD_DIR="$cuda_dir" ANCHORKV_CUDA_ARCHITECTURES="80-real;90-real" ANCHORKV_JOBS="$jobs" \
    "$root/scripts/device-bundle.sh" "$cuda_dir/bundle"
  grep -q '^ANCHORKV_CUDA:STRING=ON' "$cuda_dir/CMakeCache.txt"
  "$cuda_dir/bundle/bin/anchorkv_gpu_tests"  # RUNPATH $ORIGIN/../lib finds the library
  "$cuda_dir/bundle/bin/anchorkv_api_tests" --gtest_filter='GpuContext.*'
  # The kernels' SASS for sm_90: registers, spills, local memory, tensor-core use, and the
  # decode tile loop's instructions per token and head by phase (prints; skips without nvdisasm);
  # then the compression pass's predicted stages from those counts.
  python3 "$root/scripts/sass_count.py" --json "$cuda_dir/sass.json"
  if [ -f "$cuda_dir/sass.json" ]; then
    python3 "$root/scripts/predict_compress.py" --sass "$cuda_dir/sass.json"
  else
    python3 "$root/scripts/predict_compress.py"
  fi
}
if command -v nvcc >/dev/null 2>&1; then
  step "cuda: bundle sm_80+sm_90" cuda_build
else
  skip "cuda: bundle sm_80+sm_90" "nvcc not found"
fi

# ---- (d) install + consumers ---------------------------------------------------------------------
install_test() {
  ctest_run "$build_dir" -L install
  cmake --install "$build_dir" --prefix "$prefix" >/dev/null
  echo "installed into $prefix"
}
after "cpu: build" "install: consumer test" install_test

# ---- (e) bindings --------------------------------------------------------------------------------
if [ ! -f "$root/scripts/test-bindings.sh" ]; then
  skip "bindings" "scripts/test-bindings.sh not present"
else
  after "install: consumer test" "bindings" env ANCHORKV_BUILD_DIR="$build_dir" ANCHORKV_PREFIX="$prefix" \
    bash "$root/scripts/test-bindings.sh"
fi

# ---- summary ---------------------------------------------------------------------------------------
n_pass=0 n_fail=0 n_skip=0
printf '\n==== anchorkv test summary ====\n'
for i in "${!names[@]}"; do
  printf '  %-4s %-28s %5ss  %s\n' "${states[$i]}" "${names[$i]}" "${times[$i]}" "${notes[$i]}"
  case "${states[$i]}" in PASS) n_pass=$((n_pass + 1)) ;; FAIL) n_fail=$((n_fail + 1)) ;;
                          *) n_skip=$((n_skip + 1)) ;; esac
done
printf '  total wall time: %ss\n' $((SECONDS - total_start))
if [ -s "$failures_file" ]; then printf '\n==== failed tests ====\n'; cat "$failures_file"; fi
echo "steps: $n_pass passed, $n_fail failed, $n_skip skipped"
[ "$n_fail" -eq 0 ]
