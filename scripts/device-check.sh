#!/usr/bin/env bash
# The one script to run on a machine with an NVIDIA GPU (an H200, sm_90):
#   1. configure build-device with the CUDA backend for sm_90, build everything;
#   2. ctest, GPU tests included (tests/gpu skip themselves without a GPU; the emulation tests
#      run the same kernels on the CPU); the install test (needs pkg-config) is left out;
#   3. compute-sanitizer memcheck and racecheck over the GPU decode tests (quick sizes);
#   4. the Python GPU tests (torch tensors on a CUDA context), when pytest is present;
#   5. scripts/bench_decode.py: compact decode vs our dense decode vs PyTorch SDPA,
#      S = 8K..128K, batch 1, 8, 32, cold L2 (the issue-5 table); then
#      scripts/bench_compress.py: the GPU compression pass vs SDPA causal prefill attention
#      and our SnapKV, S = 32K..128K (the issue-4 table);
#   6. optionally (ANCHORKV_RUN="cli-bench") `anchorkv bench` per method at
#      ANCHORKV_BENCH_SEQ_LENS (default 32768);
#   7. a summary and the tables, printed last.
# A failing step does not stop the later ones (a failed build skips what needs it). Logs go
# to $ANCHORKV_DEVICE_LOGS (default: build-device/logs; also copied to $OUT when set, for the
# device tool to bring back).
# Before the device call, run scripts/device-deps.sh here and carry build-device-deps.
# Environment: ANCHORKV_DEVICE_CMAKE_ARGS (extra cmake arguments, split at spaces),
#   ANCHORKV_DEVICE_BUILD_DIR (default build-device), ANCHORKV_JOBS (default: cores),
#   ANCHORKV_DECODE_BENCH_ARGS (extra arguments for bench_decode.py),
#   ANCHORKV_BENCH_SEQ_LENS, ANCHORKV_BENCH_ARGS, ANCHORKV_BENCH_BACKEND (default cuda) and
#   ANCHORKV_BENCH_TIMEOUT (seconds per run, default 120) for the CLI bench,
#   ANCHORKV_SKIP ("build ctest sanitizer pytest decode-bench compress-bench", any of them),
#   ANCHORKV_RUN ("cli-bench" to add the CLI bench). The whole script must fit in one
#   10-minute device call.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 1
build_dir="${ANCHORKV_DEVICE_BUILD_DIR:-build-device}"
case "$build_dir" in /*) ;; *) build_dir="$root/$build_dir" ;; esac
logs="${ANCHORKV_DEVICE_LOGS:-$build_dir/logs}"
jobs="${ANCHORKV_JOBS:-$(nproc)}"
seq_lens="${ANCHORKV_BENCH_SEQ_LENS:-32768}"
skip_list=" ${ANCHORKV_SKIP:-} "
run_list=" ${ANCHORKV_RUN:-} "
[ -d /usr/local/cuda/bin ] && PATH="$PATH:/usr/local/cuda/bin"
mkdir -p "$logs"

summary=()
note() { summary+=("$(printf '%-5s %-34s %6ss' "$1" "$2" "$3")"); }
# run_logged NAME LOGFILE COMMAND...: output to the terminal and to the log; PASS or FAIL.
run_logged() {
  local name="$1" log="$2" start=$SECONDS rc; shift 2
  printf '\n==== %s ====\n' "$name"
  "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ]; then note PASS "$name" $((SECONDS - start)); else
    note FAIL "$name (exit $rc)" $((SECONDS - start)); fi
  return "$rc"
}
skipped() { [[ "$skip_list" == *" $1 "* ]]; }

echo "device-check: $(date -u +%FT%TZ) on $(hostname)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 \
  | sed 's/^/  GPU: /'
echo "  nvcc: $(nvcc --version 2>/dev/null | tail -n 1 || echo 'not found')"

# ---- 1. build -------------------------------------------------------------------------------
build_ok=0
# The GPU machine's image lacks Debian's GoogleTest, cxxopts and nlohmann-json and cannot
# download them: scripts/device-deps.sh unpacks them into build-device-deps here, carried along.
carried_deps="$root/build-device-deps/root/usr"
read -r -a extra_cmake <<<"${ANCHORKV_DEVICE_CMAKE_ARGS:-}"
if [ -d "$carried_deps" ]; then
  extra_cmake+=(-DCMAKE_PREFIX_PATH="$carried_deps")
  echo "  using carried packages in $carried_deps"
fi
configure_and_build() {
  cmake -S "$root" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DANCHORKV_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=90 -DANCHORKV_BUILD_TESTS=ON -DANCHORKV_BUILD_CLI=ON \
        "${extra_cmake[@]}" &&
  cmake --build "$build_dir" --parallel "$jobs"
}
if skipped build; then note SKIP "build" 0; build_ok=1
elif run_logged "build (CUDA sm_90)" "$logs/build.log" configure_and_build; then build_ok=1; fi

# ---- 2. ctest ------------------------------------------------------------------------------
if skipped ctest; then note SKIP "ctest" 0
elif [ "$build_ok" = 1 ]; then
  run_logged "ctest (GPU tests included)" "$logs/ctest.log" \
    ctest --test-dir "$build_dir" --output-on-failure --no-tests=error -j "$jobs" --timeout 900 \
      -LE install
  grep -E 'tests passed|tests failed' "$logs/ctest.log" | tail -n 1 | sed 's/^/  /'
  # On a GPU machine the GPU tests must run, not skip: say how many skipped.
  echo "  skipped tests: $(grep -cE '^ *[0-9]+/[0-9]+ Test +#[0-9]+: .*Skipped' "$logs/ctest.log")"
else note SKIP "ctest (build failed)" 0; fi

# ---- 3. compute-sanitizer --------------------------------------------------------------------
gpu_tests="$build_dir/tests/anchorkv_gpu_tests"
sanitizer="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
for tool in memcheck racecheck; do
  if skipped sanitizer; then note SKIP "compute-sanitizer $tool" 0; continue; fi
  if [ ! -x "$gpu_tests" ] || [ ! -x "$sanitizer" ]; then note SKIP "compute-sanitizer $tool (missing)" 0; continue; fi
  run_logged "compute-sanitizer $tool" "$logs/sanitizer-$tool.log" env ANCHORKV_TEST_QUICK=1 \
    timeout 240 "$sanitizer" --tool "$tool" --error-exitcode 3 "$gpu_tests" \
      --gtest_filter='Cuda.DecodeMatches*:Cuda.GraphCaptured*:Cuda.CompressionPass*'
  grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$logs/sanitizer-$tool.log" | tail -n 1 | sed 's/^/  /'
done

# ---- 4. Python GPU tests ---------------------------------------------------------------------
py_env=(env PYTHONPATH="$root/python" ANCHORKV_LIBRARY="$build_dir/src")
if skipped pytest; then note SKIP "pytest (GPU)" 0
elif ! python3 -c 'import pytest, torch' 2>/dev/null; then note SKIP "pytest (GPU): no pytest/torch" 0
else
  run_logged "pytest python/tests/test_gpu.py" "$logs/pytest-gpu.log" "${py_env[@]}" \
    timeout 240 python3 -m pytest -q "$root/python/tests/test_gpu.py"
fi

# ---- 5. decode benchmark against SDPA ------------------------------------------------------------
if skipped decode-bench; then note SKIP "bench_decode.py" 0
elif ! python3 -c 'import torch' 2>/dev/null; then note SKIP "bench_decode.py: no torch" 0
else
  # shellcheck disable=SC2086  # a list of words
  run_logged "bench_decode.py (vs SDPA)" "$logs/bench-decode.txt" "${py_env[@]}" \
    timeout 300 python3 "$root/scripts/bench_decode.py" --csv "$logs/bench-decode.csv" ${ANCHORKV_DECODE_BENCH_ARGS:-}
fi

# ---- 5b. compression benchmark against SDPA prefill -----------------------------------------
if skipped compress-bench; then note SKIP "bench_compress.py" 0
elif ! python3 -c 'import torch' 2>/dev/null; then note SKIP "bench_compress.py: no torch" 0
else
  run_logged "bench_compress.py (vs SDPA prefill)" "$logs/bench-compress.txt" "${py_env[@]}" \
    timeout 240 python3 "$root/scripts/bench_compress.py"
fi

# ---- 6. CLI bench (optional) -------------------------------------------------------------------
cli="$build_dir/tools/cli/anchorkv"
bench_timeout="${ANCHORKV_BENCH_TIMEOUT:-120}"
bench_backend="${ANCHORKV_BENCH_BACKEND:-cuda}"
bench_rows=()
if [[ "$run_list" == *" cli-bench "* ]]; then
  for s in $seq_lens; do
    if [ ! -x "$cli" ]; then note SKIP "bench S=$s (no $cli)" 0; continue; fi
    # shellcheck disable=SC2086  # ANCHORKV_BENCH_ARGS is a list of words
    run_logged "bench S=$s" "$logs/bench-$s.csv" timeout "$bench_timeout" \
      "$cli" bench --backend "$bench_backend" --seq-len "$s" --csv --quiet ${ANCHORKV_BENCH_ARGS:-}
    bench_rows+=("$s")
  done
fi

if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then cp "$logs"/* "$OUT"/ 2>/dev/null; fi

# ---- 7. summary and tables --------------------------------------------------------------------
printf '\n==== device-check summary ====\n'
printf '  %s\n' "${summary[@]}"
if [ -s "$logs/bench-compress.txt" ]; then
  printf '\n==== bench_compress.py: one layer, H=8 Hq=32 D=128 bf16 theta=0.05, medians ====\n'
  grep -E '^#|^ *S |^ +[0-9]+ ' "$logs/bench-compress.txt"
fi
if [ -s "$logs/bench-decode.txt" ]; then
  printf '\n==== bench_decode.py: H=8 Hq=32 D=128 bf16 theta=0.05, cold L2, medians ====\n'
  grep -E '^#|^ *S |^ +[0-9]+ ' "$logs/bench-decode.txt"
fi
if [ "${#bench_rows[@]}" -gt 0 ]; then
  printf '\n==== anchorkv bench, %s backend (medians; CSV in %s) ====\n' "$bench_backend" "$logs"
  printf '%8s %-12s %7s %8s %12s %12s %10s\n' S method target ratio compress decode "vs FullKV"
  for s in "${bench_rows[@]}"; do
    awk -F, -v S="$s" '
      $1 == "backend" { header = 1; next }
      header && NF >= 9 {
        rows++
        if ($4 == "") { printf "%8s %-12s %6sx  FAILED %s\n", S, $2, $3, $10; next }
        printf "%8s %-12s %6sx %7.2fx %10.2fms %10.1fus %9.2fx\n", S, $2, $3, $4, $6 * 1e3, $7 * 1e6, $8
      }
      END { if (!rows) printf "%8s (no results: see %s)\n", S, FILENAME }' "$logs/bench-$s.csv"
  done
fi
failed=$(printf '%s\n' "${summary[@]}" | grep -c '^FAIL')
echo "device-check: $failed failed step(s)"
[ "$failed" -eq 0 ]
