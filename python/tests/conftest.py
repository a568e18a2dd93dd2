import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # reference.py


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def make_layer(rng, heads=2, q_heads=4, seq_len=256, head_dim=64, window=32, bf16_exact=True):
    """Random K, V, window queries; bf16-representable so a bf16 cache stores them exactly."""
    from reference import round_to_bf16
    keys = rng.standard_normal((heads, seq_len, head_dim), dtype=np.float32)
    values = rng.standard_normal((heads, seq_len, head_dim), dtype=np.float32)
    queries = rng.standard_normal((q_heads, window, head_dim), dtype=np.float32)
    if bf16_exact:
        keys, values, queries = round_to_bf16(keys), round_to_bf16(values), round_to_bf16(queries)
    return keys, values, queries


@pytest.fixture
def layer(rng):
    return make_layer(rng)
