"""Zero-copy adapters: DLPack producers on the CPU, torch CPU tensors when torch exists."""
import numpy as np
import pytest

import anchorkv
from anchorkv import _tensors
from conftest import make_layer


class DLPackOnly:
    """Exposes an array through DLPack alone, as a foreign framework would."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, stream=None):
        return self._array.__dlpack__()

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def test_dlpack_view_shares_memory(rng):
    array = rng.standard_normal((2, 5, 8), dtype=np.float32)[:, ::2]  # strided
    view = _tensors.view(DLPackOnly(array), name="x")
    assert view.pointer == array.ctypes.data
    assert view.shape == array.shape
    assert view.strides == tuple(s // 4 for s in array.strides)
    assert view.dtype == anchorkv.DType.F32 and view.device == "cpu"


def test_dlpack_producer_compresses_like_numpy(rng):
    keys, values, window = make_layer(rng)
    query = rng.standard_normal((4, 1, 64), dtype=np.float32)
    direct = anchorkv.compress(keys, values, window, retain_fraction=0.2)
    through_dlpack = anchorkv.compress(DLPackOnly(keys), DLPackOnly(values), DLPackOnly(window),
                                       retain_fraction=0.2)
    assert bytes(direct) == bytes(through_dlpack)
    out = np.empty((4, 1, 64), np.float32)
    assert through_dlpack.decode(DLPackOnly(query), out=out) is out
    np.testing.assert_array_equal(out, direct.decode(query))


def test_lists_are_accepted_by_copy(rng):
    keys, values, window = make_layer(rng, seq_len=64)
    cache = anchorkv.compress(keys.tolist(), values.tolist(), window.tolist(), method="fullkv")
    query = rng.standard_normal((4, 64), dtype=np.float32)
    np.testing.assert_array_equal(cache.decode(query.tolist()),
                                  anchorkv.compress(keys, values, window, method="fullkv").decode(query))


def test_torch_cpu_tensors_without_copy(rng):
    torch = pytest.importorskip("torch")
    keys, values, window = make_layer(rng)
    tk, tv, tw = (torch.from_numpy(a) for a in (keys, values, window))
    view = _tensors.view(tk, name="keys")
    assert view.pointer == tk.data_ptr()
    cache = anchorkv.compress(tk, tv, tw, retain_fraction=0.2)
    query = torch.randn(4, 1, 64)
    out = cache.decode(query)
    assert isinstance(out, torch.Tensor)
    np.testing.assert_array_equal(out.numpy(), cache.decode(query.numpy()))
    bf16 = anchorkv.compress(tk.bfloat16(), tv.bfloat16(), tw.bfloat16(), method="fullkv")
    assert bf16.decode(query.bfloat16()).dtype == torch.bfloat16
