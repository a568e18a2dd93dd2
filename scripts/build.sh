#!/usr/bin/env bash
# Configure and build anchorkv (Release, CPU backend) with CMake.
#   scripts/build.sh [extra cmake -D options...]
# Environment:
#   ANCHORKV_BUILD_DIR  build directory (default: build, relative to the repository root)
#   ANCHORKV_CUDA       AUTO | ON | OFF (default OFF: nvcc adds minutes to a full build;
#                       scripts/test.sh checks that the CUDA backend compiles separately)
#   ANCHORKV_JOBS       parallel build jobs (default: number of cores)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${ANCHORKV_BUILD_DIR:-build}"
case "$build_dir" in /*) ;; *) build_dir="$root/$build_dir" ;; esac
jobs="${ANCHORKV_JOBS:-$(nproc)}"

cmake -S "$root" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release \
      -DANCHORKV_CUDA="${ANCHORKV_CUDA:-OFF}" -DANCHORKV_BUILD_CLI=ON "$@"
cmake --build "$build_dir" --parallel "$jobs"
echo "build.sh: built in $build_dir (CLI: $build_dir/tools/cli/anchorkv)"
