#!/usr/bin/env bash
# The anchorkv.transformers tests with an interpreter that has torch and transformers (CI runs
# the same tests through scripts/test-bindings.sh after scripts/install-deps.sh installed
# them; elsewhere they skip). With --passkey, also the pass-key table through transformers.
#
#   scripts/test-transformers.sh                  # pytest: small random Llama + SmolLM2 GGUF
#   scripts/test-transformers.sh --passkey        # + passkey_transformers.py, 2K/4K, 3 trials
#
# Environment: PYTHON (default python3), ANCHORKV_LIBRARY (default: build the library into
# build-bind, CPU only).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import torch, transformers' 2>/dev/null; then
  echo "$PYTHON cannot import torch and transformers: pip install torch transformers accelerate" >&2
  exit 1
fi
if [[ -z "${ANCHORKV_LIBRARY:-}" ]]; then
  cmake -S "$ROOT" -B "$ROOT/build-bind" -DANCHORKV_CUDA=OFF -DANCHORKV_BUILD_TESTS=OFF \
    -DANCHORKV_BUILD_CLI=OFF -DANCHORKV_BUILD_SWIG=OFF >/dev/null
  cmake --build "$ROOT/build-bind" --target anchorkv -j"${ANCHORKV_JOBS:-2}"
  ANCHORKV_LIBRARY=$(find "$ROOT/build-bind" -name 'libanchorkv.so.*' -type f -print -quit)
fi
export ANCHORKV_LIBRARY PYTHONPATH="$ROOT/python"${PYTHONPATH:+:$PYTHONPATH}
"$PYTHON" -m pytest -q -p no:cacheprovider -rs "$ROOT/python/tests/test_transformers.py" \
  "$ROOT/python/tests/test_lse.py" "$ROOT/tools/realmodel/test_transformers_realmodel.py"
if [[ "${1:-}" == --passkey ]]; then
  "$PYTHON" "$ROOT/tools/realmodel/passkey_transformers.py" --lengths 2048 4096 --trials 3 \
    --depths 0.05 0.15 0.25 --methods fullkv anchorkv --ratios 5 10 20
fi
