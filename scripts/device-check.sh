#!/usr/bin/env bash
# The check for a machine with an NVIDIA GPU (an H200, sm_90), sized for one device call:
# nothing is compiled there when a bundle is carried, and the most telling steps run first.
#   0. the bundle: ANCHORKV_DEVICE_BUNDLE (default build-device-bundle), made here by
#      scripts/device-bundle.sh and named in the device call's `carry`. Without one it is built
#      there by the same script (minutes; carry build-device-deps from scripts/device-deps.sh);
#   1. smoke: one decode and one compression against the CPU (Cuda.Smoke*), after the GPU,
#      the bundle and its shared libraries are listed;
#   2. scripts/bench_decode.py: compact decode vs our dense decode vs PyTorch SDPA, cold L2
#      (ANCHORKV_DECODE_BENCH_ARGS; default the rows of issue 14: "--rows 32768x1 131072x1 131072x8 32768x32");
#      the batch-1 rows again with ANCHORKV_DECODE_PDL=0 (no programmatic dependent launch);
#   3. scripts/bench_compress.py: the GPU compression pass vs SDPA causal prefill attention
#      and our SnapKV (ANCHORKV_COMPRESS_BENCH_ARGS); then, where the image has Nsight Compute
#      (ncu), the split kernel's profile at 32K x 1 and 128K x 8 (into bench-decode.log) and a
#      coverage round's candidate search at 32K (into bench-compress.log);
#   4. the GPU test suite: anchorkv_gpu_tests (64K and 128K decodes included), the GpuContext
#      tests of anchorkv_api_tests, python/tests/test_gpu.py (when pytest and torch are there);
#   5. compute-sanitizer memcheck, racecheck, initcheck and synccheck over the GPU tests at
#      the quick sizes plus one 128K decode (ANCHORKV_TEST_QUICK=1); racecheck again over the
#      decodes of each storage format alone;
#   6. with the time left, the emulation tests under two more scheduling seeds.
# Every step's log is written straight into $OUT while it runs (else $ANCHORKV_DEVICE_LOGS,
# default build-device/logs), at most 7 files: summary.txt (rewritten after every step: the
# step table, then the benchmark tables), build.log (only without a bundle), smoke.log,
# bench-decode.log, bench-compress.log, gpu-tests.log, sanitizer.log.
# Deadline: ANCHORKV_DEVICE_DEADLINE seconds from the start (default 420). Each step runs
# under `timeout` for the time left; once less than 20 s is left the remaining steps are
# skipped, and the summary and tables are still written. A failing step does not stop the
# later ones (without a library nothing after the build runs). ANCHORKV_SKIP: any of
# "smoke decode-bench compress-bench ncu gpu-tests sanitizer emulation". Exit status: 0 when no
# step failed.
# Without a GPU (a dry run on a development machine) the test programs run and skip, and the
# benchmarks and compute-sanitizer are skipped; with one, a GPU test that skips fails
# (ANCHORKV_REQUIRE_GPU).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 1
absolute() { case "$1" in /*) echo "$1" ;; *) echo "$root/$1" ;; esac; }
bundle="$(absolute "${ANCHORKV_DEVICE_BUNDLE:-build-device-bundle}")"
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then logs="$OUT"; else logs="$(absolute "${ANCHORKV_DEVICE_LOGS:-build-device/logs}")"; fi
deadline="${ANCHORKV_DEVICE_DEADLINE:-420}"
skip_list=" ${ANCHORKV_SKIP:-} "
[ -d /usr/local/cuda/bin ] && PATH="$PATH:/usr/local/cuda/bin"
mkdir -p "$logs"
summary_file="$logs/summary.txt"

summary=()
note() { summary+=("$(printf '%-5s %-44s %5ss' "$1" "$2" "$3")"); write_summary; }
skipped() { [[ "$skip_list" == *" $1 "* ]]; }
left() { echo $((deadline - SECONDS)); }
# The summary file: the step table, then the tables of the benchmark logs. Rewritten after
# every step, so that a run cut short still brings one back.
write_summary() {
  {
    echo "device-check: started $started on $(hostname); deadline ${deadline}s; ${SECONDS}s elapsed"
    printf '  %s\n' "${summary[@]}"
    if [ -s "$logs/bench-decode.log" ]; then
      printf '\n==== bench_decode.py: H=8 Hq=32 D=128 bf16 theta=0.05, cold L2, medians ====\n'
      grep -E '^#|^ *S |^ +[0-9]+ |^FAIL|^anchorkv decode profile' "$logs/bench-decode.log"
    fi
    if [ -s "$logs/bench-compress.log" ]; then
      printf '\n==== bench_compress.py: one layer, H=8 Hq=32 D=128 bf16 theta=0.05, medians ====\n'
      grep -E '^#|^ *S |^ +[0-9]+ |^FAIL' "$logs/bench-compress.log"
    fi
  } >"$summary_file"
}
# step NAME LOG COMMAND...: COMMAND under `timeout` for the time left, its output to the
# terminal and appended to LOG; PASS, FAIL or SKIP (deadline) in the summary.
step() {
  local name="$1" log="$2" start=$SECONDS rc budget; shift 2
  budget=$(left)
  if [ "$budget" -lt 20 ]; then note SKIP "$name (deadline)" 0; return 1; fi
  printf '\n==== %s (%ss left) ====\n' "$name" "$budget" | tee -a "$log"
  timeout --kill-after=5 "$budget" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ]; then note PASS "$name" $((SECONDS - start))
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then note FAIL "$name (deadline hit)" $((SECONDS - start))
  else note FAIL "$name (exit $rc)" $((SECONDS - start)); fi
  return "$rc"
}

started="$(date -u +%FT%TZ)"
write_summary
echo "device-check: $started on $(hostname), deadline ${deadline}s, logs in $logs"

# ---- 0. the bundle ------------------------------------------------------------------------------
have_bundle=0
if [ -f "$bundle/BUNDLE.txt" ]; then
  have_bundle=1
  note PASS "bundle carried ($(du -sh "$bundle" | cut -f1))" 0
else
  # The GPU machine's image lacks Debian's GoogleTest, cxxopts and nlohmann-json and cannot
  # download them: scripts/device-deps.sh unpacks them into build-device-deps, carried along.
  build_args="${ANCHORKV_BUNDLE_CMAKE_ARGS:-}"
  [ -d "$root/build-device-deps/root/usr" ] && build_args+=" -DCMAKE_PREFIX_PATH=$root/build-device-deps/root/usr"
  step "build the bundle there (no bundle carried)" "$logs/build.log" \
    env ANCHORKV_BUNDLE_BUILD_DIR=build-device ANCHORKV_BUNDLE_CMAKE_ARGS="$build_args" \
    "$root/scripts/device-bundle.sh" "$bundle" && have_bundle=1
fi
bin="$bundle/bin"
export LD_LIBRARY_PATH="$bundle/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" ANCHORKV_LIBRARY="$bundle/lib"
export PYTHONUNBUFFERED=1
has_torch=0
python3 -c 'import torch' 2>/dev/null && has_torch=1
# Without a GPU (a dry run on a development machine) the test programs still run and skip;
# the benchmarks and compute-sanitizer are skipped.
has_gpu=0
nvidia-smi -L 2>/dev/null | grep -q '^GPU' && has_gpu=1
# With a GPU, a GPU test that finds no usable device fails instead of skipping.
[ "$has_gpu" = 1 ] && export ANCHORKV_REQUIRE_GPU=1

# ---- 1. smoke -----------------------------------------------------------------------------------
describe_machine() {
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/GPU: /'
  else echo "GPU: none (no nvidia-smi)"; fi
  echo "nvcc: $(nvcc --version 2>/dev/null | tail -n 1 || echo 'not found')"
  cat "$bundle/BUNDLE.txt"
  echo "shared libraries of the bundle's library:"
  ldd "$bundle"/lib/libanchorkv.so | sed 's/^/ /'
}
if [ "$have_bundle" = 0 ]; then note FAIL "no bundle: nothing else could run" 0
else
  if skipped smoke; then note SKIP "smoke" 0
  else
    describe_machine >>"$logs/smoke.log" 2>&1
    step "smoke: one decode, one compression vs CPU" "$logs/smoke.log" \
      "$bin/anchorkv_gpu_tests" --gtest_filter='Cuda.Smoke*'
  fi

  # ---- 2, 3. benchmarks -------------------------------------------------------------------------
  if skipped decode-bench; then note SKIP "bench_decode.py" 0
  elif [ "$has_gpu" = 0 ]; then note SKIP "bench_decode.py: no GPU" 0
  elif [ "$has_torch" = 0 ]; then note SKIP "bench_decode.py: no torch" 0
  else
    # shellcheck disable=SC2086  # a list of words
    step "bench_decode.py (vs SDPA)" "$logs/bench-decode.log" \
      python3 "$root/scripts/bench_decode.py" ${ANCHORKV_DECODE_BENCH_ARGS:---rows 32768x1 131072x1 131072x8 32768x32 --profile}
    # The same small-batch rows with the anchor values' and merge kernels launched plainly:
    # what programmatic dependent launch saves (backend.cu, launch_after).
    step "bench_decode.py, ANCHORKV_DECODE_PDL=0" "$logs/bench-decode.log" \
      env ANCHORKV_DECODE_PDL=0 python3 "$root/scripts/bench_decode.py" --rows 32768x1 131072x1
    # GPT-J pairs: the register-gather path's own kernel (decode_split_kernel<..., true, true>).
    step "bench_decode.py, GPT-J RoPE" "$logs/bench-decode.log" \
      python3 "$root/scripts/bench_decode.py" --rows 32768x1 131072x8 --rope-style gptj
    # No RoPE (keys handed rotated): the anchors' scores looked up (decode_scores_kernel,
    # lookup_scores), not their rows gathered: the SASS model says no faster (its tile waits on
    # the key residuals' chain either way) with 16% fewer instructions and a sixteenth of the
    # rows' L2 traffic; this says whether the gathers were what the first run waited on.
    step "bench_decode.py, no RoPE (scores)" "$logs/bench-decode.log" \
      python3 "$root/scripts/bench_decode.py" --rows 32768x1 --rope-style none
  fi
  if skipped compress-bench; then note SKIP "bench_compress.py" 0
  elif [ "$has_gpu" = 0 ]; then note SKIP "bench_compress.py: no GPU" 0
  elif [ "$has_torch" = 0 ]; then note SKIP "bench_compress.py: no torch" 0
  else
    # shellcheck disable=SC2086
    step "bench_compress.py (vs SDPA prefill)" "$logs/bench-compress.log" \
      python3 "$root/scripts/bench_compress.py" ${ANCHORKV_COMPRESS_BENCH_ARGS:-}
  fi

  # ---- 3b. Nsight Compute, where the image has it: the compact decode's split kernel at 32K x 1
  # and 128K x 8 (cold L2: ncu flushes the caches before each pass), its stall reasons,
  # occupancy and memory traffic, appended to bench-decode.log. The SASS model (scripts/
  # sass_count.py) was ~3x off on the first device run; these say where.
  ncu_bin="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
  if skipped ncu || skipped decode-bench; then note SKIP "ncu: the split kernel" 0
  elif [ "$has_gpu" = 0 ] || [ "$has_torch" = 0 ]; then note SKIP "ncu: no GPU or torch" 0
  elif [ ! -x "$ncu_bin" ]; then note SKIP "ncu (not found)" 0
  else
    for row in 32768x1 131072x8; do
      step "ncu: split kernel $row" "$logs/bench-decode.log" \
        "$ncu_bin" --kernel-name-base demangled --kernel-name 'regex:decode_split_kernel<128, 4, true, false>' \
        --launch-skip 3 --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis \
        --section SourceCounters python3 "$root/scripts/bench_decode.py" --rows "$row" --iters 5
    done
    # The compression's largest stage (anchor selection, 3-4x its prediction on the first run):
    # a coverage round's local_nearest_kernel (launch 4 of the first pass: after the first
    # absorb and two rounds) at 32K.
    if skipped compress-bench; then note SKIP "ncu: the candidate search" 0
    else
      step "ncu: candidate search 32768" "$logs/bench-compress.log" \
        "$ncu_bin" --kernel-name-base demangled --kernel-name 'regex:local_nearest_kernel<128' \
        --launch-skip 3 --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis \
        --section SourceCounters python3 "$root/scripts/bench_compress.py" --seq-lens 32768 --iters 1 --no-profile
    fi
  fi

  # ---- 4. the GPU test suite ------------------------------------------------------------------------
  if skipped gpu-tests; then note SKIP "GPU test suite" 0
  else
    step "anchorkv_gpu_tests" "$logs/gpu-tests.log" "$bin/anchorkv_gpu_tests"
    # On a GPU machine the GPU tests must run, not skip.
    grep -E '^\[  SKIPPED \] [0-9]+ test' "$logs/gpu-tests.log" | sed 's/^/GPU tests that skipped: /'
    step "anchorkv_api_tests GpuContext.*" "$logs/gpu-tests.log" \
      "$bin/anchorkv_api_tests" --gtest_filter='GpuContext.*'
    if [ "$has_gpu" = 0 ]; then note SKIP "pytest test_gpu.py: no GPU" 0
    elif python3 -c 'import pytest, torch' 2>/dev/null; then
      step "pytest python/tests/test_gpu.py" "$logs/gpu-tests.log" \
        python3 -m pytest -q -p no:cacheprovider "$root/python/tests/test_gpu.py"
    else note SKIP "pytest test_gpu.py: no pytest/torch" 0; fi
  fi

  # ---- 5. compute-sanitizer ---------------------------------------------------------------------------
  sanitizer="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
  filter='Cuda.Smoke*:Cuda.DecodeMatches*:Cuda.DecodeLong*:Cuda.GraphCaptured*:Cuda.CompressionPass*'
  for tool in memcheck racecheck initcheck synccheck; do
    if skipped sanitizer; then note SKIP "compute-sanitizer $tool" 0; continue; fi
    if [ "$has_gpu" = 0 ]; then note SKIP "compute-sanitizer $tool: no GPU" 0; continue; fi
    if [ ! -x "$sanitizer" ]; then note SKIP "compute-sanitizer $tool (not found)" 0; continue; fi
    step "compute-sanitizer $tool" "$logs/sanitizer.log" env ANCHORKV_TEST_QUICK=1 \
      "$sanitizer" --tool "$tool" --error-exitcode 3 "$bin/anchorkv_gpu_tests" --gtest_filter="$filter"
  done
  # racecheck over decodes of one storage format at a time: the first run's hazards (split
  # kernel, accesses a __syncthreads separates) in format 3 only would point at the one named
  # barrier (format3_meta: warps 0-1), in both at something else; the individual hazards'
  # threads (--racecheck-report all) say whether warps 0-1 are on one side of each.
  for format in Two Three; do
    if skipped sanitizer || [ "$has_gpu" = 0 ] || [ ! -x "$sanitizer" ]; then break; fi
    step "racecheck, format $format decodes only" "$logs/sanitizer.log" \
      "$sanitizer" --tool racecheck --racecheck-report all --print-limit 8 --error-exitcode 3 \
      "$bin/anchorkv_gpu_tests" --gtest_filter="Cuda.Format${format}DecodeMatchesCpu"
  done

  # ---- 6. with the time left: the emulation under two more seeds (CI runs them too) ------------
  if skipped emulation; then note SKIP "emulation tests" 0
  else
    step "emulation tests, seeds 2 and 3" "$logs/gpu-tests.log" bash -c \
      'f=-*MillionPositions; ANCHORKV_SIMT_SEED=2 "$1" --gtest_brief=1 --gtest_filter="$f" & ANCHORKV_SIMT_SEED=3 "$1" --gtest_brief=1 --gtest_filter="$f" || exit 1; wait $!' \
      _ "$bin/anchorkv_emulation_tests"
  fi
fi

# ---- the summary, last -------------------------------------------------------------------------------
write_summary
failed=$(printf '%s\n' "${summary[@]}" | grep -c '^FAIL')
echo "device-check: $failed failed step(s) in ${SECONDS}s" >>"$summary_file"
printf '\n'
cat "$summary_file"
[ "$failed" -eq 0 ]
