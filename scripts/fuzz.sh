#!/usr/bin/env bash
# Fuzz akv_cache_deserialize and every call on what it accepts (tests/fuzz/README.md) under
# AddressSanitizer + UBSan, from the checked-in seed corpus and past findings.
#   scripts/fuzz.sh [SECONDS]      (default 60; scripts/test.sh runs it in CI)
#
# With clang and its libFuzzer runtime (Debian: clang, libclang-rt-dev; scripts/install-deps.sh
# installs them): builds the target with -fsanitize=address,undefined,fuzzer into its own
# build directory and runs libFuzzer, coverage-guided. Without them: the seeded mutation
# driver of the gcc sanitizer build (ANCHORKV_ASAN_BUILD_DIR, built by scripts/test.sh) runs
# for the same time. Exits nonzero on a finding; the input is written to the build directory
# (libFuzzer: crash-*, leak-*, timeout-*, oom-*; the driver: fuzz-finding.bin).
#
# Environment:
#   ANCHORKV_FUZZ_BUILD_DIR  clang build directory (default: build-fuzz)
#   ANCHORKV_ASAN_BUILD_DIR  gcc sanitizer build for the fallback (default: build-asan)
#   ANCHORKV_FUZZ_RUNS       stop after this many inputs instead of SECONDS (libFuzzer -runs)
#   ANCHORKV_FUZZ_ENGINE     libfuzzer | standalone | auto (default auto)
#   ANCHORKV_JOBS            build jobs (default: number of cores)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
absolute() { case "$1" in /*) echo "$1" ;; *) echo "$root/$1" ;; esac; }
seconds="${1:-60}"
jobs="${ANCHORKV_JOBS:-$(nproc)}"
fuzz_dir="$(absolute "${ANCHORKV_FUZZ_BUILD_DIR:-build-fuzz}")"
asan_dir="$(absolute "${ANCHORKV_ASAN_BUILD_DIR:-build-asan}")"
engine="${ANCHORKV_FUZZ_ENGINE:-auto}"
corpus="$root/tests/fuzz/corpus"
regressions="$root/tests/fuzz/regressions"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:strict_string_checks=1:detect_stack_use_after_return=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

have_libfuzzer() {  # clang++ links a fuzz target with ASan and UBSan
  command -v clang++ >/dev/null 2>&1 || return 1
  local probe
  probe="$(mktemp -d)"
  printf '#include <cstdint>\n#include <cstddef>\nextern "C" int LLVMFuzzerTestOneInput(const uint8_t *, size_t) { return 0; }\n' \
    >"$probe/probe.cpp"
  local ok=0
  clang++ -fsanitize=fuzzer,address,undefined "$probe/probe.cpp" -o "$probe/probe" >/dev/null 2>&1 || ok=1
  rm -rf "$probe"
  return $ok
}

if [ "$engine" = auto ]; then
  if have_libfuzzer; then engine=libfuzzer; else engine=standalone; fi
fi

if [ "$engine" = libfuzzer ]; then
  # -O1 -g1 like the sanitizer CI build (the library's own objects keep their -O3).
  CC=clang CXX=clang++ cmake -S "$root" -B "$fuzz_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DANCHORKV_CUDA=OFF \
    -DANCHORKV_SANITIZE=address,undefined,fuzzer-no-link -DANCHORKV_LIBFUZZER=ON \
    -DANCHORKV_BUILD_TESTS=ON -DANCHORKV_BUILD_CLI=OFF \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1" >/dev/null
  cmake --build "$fuzz_dir" --parallel "$jobs" --target anchorkv_fuzz_deserialize
  # New inputs go to a scratch corpus: the checked-in seeds are only read.
  work="$fuzz_dir/fuzz-corpus"
  mkdir -p "$work"
  limit=(-max_total_time="$seconds")
  [ -n "${ANCHORKV_FUZZ_RUNS:-}" ] && limit=(-runs="$ANCHORKV_FUZZ_RUNS")
  echo "fuzz.sh: libFuzzer (clang, ASan+UBSan), ${limit[*]}, seeds $corpus and $regressions"
  cd "$fuzz_dir"
  # -rss_limit_mb / -malloc_limit_mb: an allocation sized from unchecked data is a finding.
  "$fuzz_dir/tests/fuzz/anchorkv_fuzz_deserialize" "${limit[@]}" -timeout=20 -rss_limit_mb=2048 \
    -malloc_limit_mb=1024 -print_final_stats=1 -artifact_prefix="$fuzz_dir/" "$work" "$corpus" "$regressions"
else
  driver="$asan_dir/tests/fuzz/anchorkv_fuzz_deserialize"
  if [ ! -x "$driver" ]; then
    echo "fuzz.sh: no clang libFuzzer and no $driver (build the sanitizer build first: scripts/test.sh)" >&2
    exit 1
  fi
  runs=()
  [ -n "${ANCHORKV_FUZZ_RUNS:-}" ] && runs=(--runs "$ANCHORKV_FUZZ_RUNS")
  echo "fuzz.sh: seeded mutation driver of the sanitizer build ($driver), ${seconds} s"
  cd "$asan_dir"
  "$driver" --accepted "$corpus" "$regressions" --seconds "$seconds" "${runs[@]}" --seed "${ANCHORKV_FUZZ_SEED:-$RANDOM}"
fi
