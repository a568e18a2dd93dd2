#!/usr/bin/env bash
# Install/consumer test: install a built tree into a fresh prefix and use it the way an outside
# project would.
#   check_install.sh --build-dir DIR --source-dir DIR [--prefix DIR]
# Checks, in order:
#   1. `cmake --install` lays out header, library, CMake package and pkg-config file;
#   2. the shared library's SONAME is libanchorkv.so.<AKV_VERSION_MAJOR>;
#   3. it exports exactly the akv_* functions the header declares, nothing else;
#   4. the installed header compiles alone as pedantic C99 and as C++11 (-Werror);
#   5. anchorkv.pc: version equals the header's, libdir points into the install prefix;
#   6. the CMake version file is SameMajorVersion;
#   7. tests/install/consumer.c builds and runs through pkg-config and through
#      find_package(anchorkv) + anchorkv::anchorkv; both print the same line;
#   8. the C example in README.md (between the readme-example markers) builds and runs.
# Environment: CC (default cc), CXX (default c++), CMAKE (default cmake),
# ANCHORKV_KEEP_INSTALL=1 keeps the prefix and work files for inspection.
set -euo pipefail

build_dir="" source_dir="" prefix=""
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) build_dir="$2"; shift 2 ;;
    --source-dir) source_dir="$2"; shift 2 ;;
    --prefix) prefix="$2"; shift 2 ;;
    *) echo "check_install.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -n "$build_dir" ] && [ -n "$source_dir" ] || {
  echo "usage: check_install.sh --build-dir DIR --source-dir DIR [--prefix DIR]" >&2; exit 2; }
CC="${CC:-cc}" CXX="${CXX:-c++}" CMAKE="${CMAKE:-cmake}"

work="$(mktemp -d "${TMPDIR:-/tmp}/anchorkv-install-test.XXXXXX")"
[ -n "$prefix" ] || prefix="$work/prefix"
cleanup() {
  if [ "${ANCHORKV_KEEP_INSTALL:-0}" = 1 ]; then echo "kept $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT

checks=0
ok() { checks=$((checks + 1)); printf 'ok %d - %s\n' "$checks" "$*"; }
die() { printf 'FAIL - %s\n' "$*" >&2; exit 1; }

header_src="$source_dir/include/anchorkv/anchorkv.h"
version_major="$(sed -n 's/^#define AKV_VERSION_MAJOR \([0-9]*\).*/\1/p' "$header_src")"
version_string="$(sed -n 's/^#define AKV_VERSION_STRING "\(.*\)".*/\1/p' "$header_src")"
[ -n "$version_major" ] && [ -n "$version_string" ] || die "cannot read the version from $header_src"

# ---- 1. install ------------------------------------------------------------------------
"$CMAKE" --install "$build_dir" --prefix "$prefix" >"$work/install.log" \
  || { cat "$work/install.log"; die "cmake --install failed"; }
pc_file="$(find "$prefix" -path '*/pkgconfig/anchorkv.pc' | head -n 1)"
[ -n "$pc_file" ] || die "no pkgconfig/anchorkv.pc under $prefix"
libdir="$(dirname "$(dirname "$pc_file")")"
for f in "$prefix/include/anchorkv/anchorkv.h" "$libdir/libanchorkv.so" \
         "$libdir/libanchorkv.so.$version_major" \
         "$libdir/cmake/anchorkv/anchorkvConfig.cmake" \
         "$libdir/cmake/anchorkv/anchorkvConfigVersion.cmake" \
         "$libdir/cmake/anchorkv/anchorkvTargets.cmake"; do
  [ -e "$f" ] || die "missing after install: ${f#"$prefix"/}"
done
cmp -s "$header_src" "$prefix/include/anchorkv/anchorkv.h" || die "installed header differs"
ok "cmake --install laid out header, library, CMake package and pkg-config file (${libdir#"$prefix"/})"

# ---- 2. SONAME ---------------------------------------------------------------------------
library="$(readlink -f "$libdir/libanchorkv.so")"
soname="$(readelf -d "$library" | sed -n 's/.*(SONAME).*\[\(.*\)\].*/\1/p')"
[ "$soname" = "libanchorkv.so.$version_major" ] \
  || die "SONAME is '$soname', expected libanchorkv.so.$version_major"
ok "SONAME $soname"

# ---- 3. exported symbols -------------------------------------------------------------------
nm -D --defined-only "$library" | awk '{ print $NF }' | sed 's/@.*//' | sort -u >"$work/exported"
grep -E '^AKV_API' "$header_src" | grep -oE '\bakv_[a-z0-9_]+ *\(' | tr -d ' (' | sort -u \
  >"$work/declared"
if grep -v '^akv_' "$work/exported" >"$work/foreign"; then
  die "the library exports non-akv_ symbols: $(head -n 20 "$work/foreign" | tr '\n' ' ')"
fi
if ! diff -u "$work/declared" "$work/exported" >"$work/symbols.diff"; then
  cat "$work/symbols.diff" >&2
  die "exported symbols differ from the header's declarations (- declared only, + exported only)"
fi
ok "exports exactly the $(wc -l <"$work/declared") akv_* functions the header declares"

# ---- 4. header hygiene ---------------------------------------------------------------------
printf '#include <anchorkv/anchorkv.h>\nint main(void) { return akv_version_number() == 0; }\n' \
  >"$work/header_only.c"
"$CC" -std=c99 -Wall -Wextra -pedantic -Werror -fsyntax-only -I"$prefix/include" \
  "$work/header_only.c" || die "the installed header does not compile as C99"
"$CXX" -std=c++11 -Wall -Wextra -pedantic -Werror -fsyntax-only -x c++ -I"$prefix/include" \
  "$work/header_only.c" || die "the installed header does not compile as C++11"
ok "installed header compiles alone as pedantic C99 and C++11 with -Werror"

# ---- 5. pkg-config -------------------------------------------------------------------------
export PKG_CONFIG_PATH="$libdir/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
pc_version="$(pkg-config --modversion anchorkv)"
[ "$pc_version" = "$version_string" ] \
  || die "anchorkv.pc says version $pc_version, the header $version_string"
pc_libdir="$(pkg-config --variable=libdir anchorkv)"
[ "$(readlink -f "$pc_libdir")" = "$(readlink -f "$libdir")" ] \
  || die "anchorkv.pc libdir is $pc_libdir, the library is in $libdir"
ok "anchorkv.pc: version $pc_version, libdir in the install prefix"
# A static link needs the library's own dependencies: each shared library it depends on that is
# not part of the C/C++ runtime must be in Libs.private (OpenBLAS, CUDA when built with them).
pc_static="$(pkg-config --libs --static anchorkv)"
for needed in $(readelf -d "$library" | sed -n 's/.*(NEEDED).*\[lib\([^.]*\)\..*\].*/\1/p'); do
  case "$needed" in c|m|stdc++|gcc_s|pthread|dl|rt|asan|ubsan) continue ;; esac
  case " $pc_static " in *" -l$needed "*) ;; *)
    die "libanchorkv needs lib$needed but 'pkg-config --libs --static anchorkv' gives: $pc_static" ;;
  esac
done
ok "anchorkv.pc Libs.private lists the library's dependencies ($pc_static)"

# ---- 6. CMake version compatibility (SameMajorVersion) -----------------------------------
cat >"$work/version_check.cmake" <<EOF
function(accepts requested expected)
  string(REPLACE "." ";" parts "\${requested}")
  list(GET parts 0 PACKAGE_FIND_VERSION_MAJOR)
  list(GET parts 1 PACKAGE_FIND_VERSION_MINOR)
  set(PACKAGE_FIND_VERSION "\${requested}")
  set(PACKAGE_FIND_VERSION_COUNT 2)
  set(CMAKE_SIZEOF_VOID_P 8)
  include("$libdir/cmake/anchorkv/anchorkvConfigVersion.cmake")
  if(NOT "\${PACKAGE_VERSION}" STREQUAL "$version_string")
    message(FATAL_ERROR "package version \${PACKAGE_VERSION}, header $version_string")
  endif()
  if(NOT "\${PACKAGE_VERSION_COMPATIBLE}" STREQUAL "\${expected}")
    message(FATAL_ERROR "find_package(anchorkv \${requested}): compatible=\${PACKAGE_VERSION_COMPATIBLE}, expected \${expected}")
  endif()
endfunction()
accepts("$version_major.0" TRUE)
accepts("$((version_major + 1)).0" FALSE)
EOF
"$CMAKE" -P "$work/version_check.cmake" || die "anchorkvConfigVersion.cmake is not SameMajorVersion"
ok "anchorkvConfigVersion.cmake $version_string accepts $version_major.0, rejects $((version_major + 1)).0"

# ---- 7. consumers ------------------------------------------------------------------------
# shellcheck disable=SC2046  # pkg-config output is meant to split into flags
"$CC" -std=c99 -Wall -Wextra -pedantic -Werror "$source_dir/tests/install/consumer.c" \
  $(pkg-config --cflags --libs anchorkv) -o "$work/consumer_pkgconfig" \
  || die "consumer.c does not build with pkg-config flags"
LD_LIBRARY_PATH="$pc_libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$work/consumer_pkgconfig" \
  >"$work/out_pkgconfig" || die "the pkg-config consumer failed"
cat "$work/out_pkgconfig"
ok "consumer built with pkg-config runs"

# The README example, when README.md has one between the markers.
readme="$source_dir/README.md"
example_arg=()
if [ -f "$readme" ] && grep -q '<!-- readme-example: begin -->' "$readme"; then
  sed -n '/<!-- readme-example: begin -->/,/<!-- readme-example: end -->/p' "$readme" \
    | sed '/^<!--/d; /^```/d' >"$work/readme_example.c"
  example_arg=(-DANCHORKV_README_EXAMPLE="$work/readme_example.c")
fi

"$CMAKE" -S "$source_dir/tests/install" -B "$work/cmake-consumer" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_C_COMPILER="$CC" -DCMAKE_PREFIX_PATH="$prefix" \
  -DANCHORKV_EXPECTED_VERSION="$version_string" "${example_arg[@]}" >"$work/consumer-cmake.log" \
  || { cat "$work/consumer-cmake.log"; die "find_package(anchorkv $version_string) failed"; }
"$CMAKE" --build "$work/cmake-consumer" >>"$work/consumer-cmake.log" 2>&1 \
  || { cat "$work/consumer-cmake.log"; die "the CMake consumer does not build"; }
# No LD_LIBRARY_PATH here: the imported target's location gives the build-tree rpath.
env -u LD_LIBRARY_PATH "$work/cmake-consumer/consumer" >"$work/out_cmake" \
  || die "the find_package consumer failed"
cmp -s "$work/out_pkgconfig" "$work/out_cmake" || die "the two consumers printed different lines"
ok "consumer built with find_package(anchorkv $version_string) + anchorkv::anchorkv runs, same output"

# ---- 8. README example ----------------------------------------------------------------------
if [ "${#example_arg[@]}" -gt 0 ]; then
  env -u LD_LIBRARY_PATH "$work/cmake-consumer/readme_example" \
    || die "the README example failed (source: $readme)"
  ok "README.md example builds and runs"
else
  echo "skip - README.md has no readme-example block"
fi
echo "install test: $checks checks passed"
