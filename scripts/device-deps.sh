#!/usr/bin/env bash
# Run on the development machine (Debian 12) before a device run. The GPU machine's image has
# CMake, nvcc and g++ but not Debian's -dev packages that the tests and the CLI need, and it
# cannot download anything. This fetches them with `apt-get download` and unpacks them into
# build-device-deps/root (ignored by git, about 4 MB); name `build-device-deps` in the device
# tool's `carry` and scripts/device-check.sh puts it on CMAKE_PREFIX_PATH.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/build-device-deps"
packages=(libgtest-dev libcxxopts-dev nlohmann-json3-dev)

rm -rf "$dest"
mkdir -p "$dest/debs" "$dest/root"
cd "$dest/debs"
# The download runs as the calling user, so an unprivileged _apt sandbox warning is harmless.
if ! apt-get download "${packages[@]}"; then
  apt-get update -q && apt-get download "${packages[@]}"
fi
for deb in ./*.deb; do dpkg-deb -x "$deb" "$dest/root"; done
echo "device-deps: $(ls "$dest/debs" | tr '\n' ' ')"
echo "device-deps: unpacked into $dest/root ($(du -sh "$dest" | cut -f1)); carry: [\"build-device-deps\"]"
