#!/usr/bin/env bash
# Builds, on a machine without a GPU, everything scripts/device-check.sh runs on the GPU
# machine, into one self-contained folder that the device call names in `carry`:
#   lib/libanchorkv.so*   the library with the CUDA backend (Release, stripped; for one
#                         architecture the device code has -lineinfo, which changes no
#                         instruction and puts source lines in compute-sanitizer's and Nsight
#                         Compute's reports): what the
#                         Python package loads for bench_decode.py, bench_compress.py and
#                         python/tests/test_gpu.py (ANCHORKV_LIBRARY)
#   bin/                  anchorkv_gpu_tests, anchorkv_api_tests (its GpuContext tests),
#                         anchorkv_emulation_tests and the CLI `anchorkv`, stripped
#   BUNDLE.txt            what was built: source commit, CUDA architectures, nvcc, sizes
# GoogleTest is linked statically (Debian ships only its archives), cxxopts and nlohmann-json
# are header-only, BLAS is left out (the GPU machine has no OpenBLAS); the CUDA runtime and
# cuBLAS (soname 13) come from the GPU machine's toolkit. The bundle must stay under
# ANCHORKV_BUNDLE_MAX_MIB (default 60; the device call carries at most 64 MiB).
#
# Usage: scripts/device-bundle.sh [BUNDLE_DIR]   (default: build-device-bundle, ignored by git)
# Environment: ANCHORKV_BUNDLE_BUILD_DIR (default build-bundle), ANCHORKV_CUDA_ARCHITECTURES
#   (default 90: the H200), ANCHORKV_JOBS (default: cores), ANCHORKV_BUNDLE_CMAKE_ARGS (extra
#   cmake arguments, split at spaces), ANCHORKV_BUNDLE_MAX_MIB.
# CI (scripts/test.sh, CUDA step) builds it for "80-real;90-real" (SASS, no PTX) so that it
# cannot rot; on the GPU machine scripts/device-check.sh falls back to this script when no
# bundle was carried.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
absolute() { case "$1" in /*) echo "$1" ;; *) echo "$root/$1" ;; esac; }
bundle="$(absolute "${1:-build-device-bundle}")"
build_dir="$(absolute "${ANCHORKV_BUNDLE_BUILD_DIR:-build-bundle}")"
archs="${ANCHORKV_CUDA_ARCHITECTURES:-90}"
jobs="${ANCHORKV_JOBS:-$(nproc)}"
max_mib="${ANCHORKV_BUNDLE_MAX_MIB:-60}"
read -r -a extra_cmake <<<"${ANCHORKV_BUNDLE_CMAKE_ARGS:-}"
[ -d /usr/local/cuda/bin ] && PATH="$PATH:/usr/local/cuda/bin"
# Every target the device runs; CI builds the same list.
targets=(anchorkv anchorkv_gpu_tests anchorkv_api_tests anchorkv_emulation_tests anchorkv_cli)

# Line info in the device code for the device run's one architecture (CI's two-architecture
# build would pass the size limit with it: 63 MiB).
lineinfo=()
[[ "$archs" != *";"* ]] && lineinfo=(-DCMAKE_CUDA_FLAGS=-lineinfo)

start=$SECONDS
# Relative RPATHs: $ORIGIN/../src in the build tree, $ORIGIN/../lib in the bundle.
cmake -S "$root" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DANCHORKV_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES="$archs" -DANCHORKV_BUILD_TESTS=ON -DANCHORKV_BUILD_CLI=ON \
      -DANCHORKV_USE_BLAS=OFF -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON '-DCMAKE_BUILD_RPATH=$ORIGIN/../lib' \
      "${lineinfo[@]}" "${extra_cmake[@]}"
cmake --build "$build_dir" --parallel "$jobs" --target "${targets[@]}"
echo "device-bundle: built in $((SECONDS - start)) s"

rm -rf "$bundle"
mkdir -p "$bundle/lib" "$bundle/bin"
# The library the build just linked and its two links (not an older version left in the
# build directory).
library="$(readlink -f "$build_dir/src/libanchorkv.so")"
cp "$library" "$bundle/lib/"
cp -P "$build_dir/src/libanchorkv.so" "$build_dir/src/$(readlink "$build_dir/src/libanchorkv.so")" "$bundle/lib/"
cp "$build_dir"/tests/anchorkv_gpu_tests "$build_dir"/tests/anchorkv_api_tests \
   "$build_dir"/tests/anchorkv_emulation_tests "$build_dir"/tools/cli/anchorkv "$bundle/bin/"
find "$bundle" -type f -exec strip --strip-unneeded {} +

commit="$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)"
dirty="$(git -C "$root" status --porcelain --untracked-files=no 2>/dev/null | grep -q . && echo ' (with uncommitted changes)' || true)"
{
  echo "anchorkv device bundle"
  echo "commit: $commit$dirty"
  echo "built: $(date -u +%FT%TZ) on $(hostname)"
  echo "CUDA architectures: $archs"
  echo "nvcc: $(nvcc --version 2>/dev/null | tail -n 1 || echo unknown)"
  echo "files:"
  (cd "$bundle" && find . -type f -printf '  %p %s bytes\n' | sort)
} >"$bundle/BUNDLE.txt"
size_kib="$(du -sk "$bundle" | cut -f1)"
echo "device-bundle: $bundle, $((size_kib / 1024)) MiB ($size_kib KiB); carry: [\"${bundle#"$root"/}\"]"
cat "$bundle/BUNDLE.txt"
if [ "$size_kib" -gt $((max_mib * 1024)) ]; then
  echo "device-bundle: larger than $max_mib MiB" >&2
  exit 1
fi
