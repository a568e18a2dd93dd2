"""Bad input raises the AnchorKVError subclass of the library's status, with its message."""
import contextlib
import re

import numpy as np
import pytest

import anchorkv
from anchorkv import Status


@contextlib.contextmanager
def raises_status(error_class, status):
    """pytest.raises that also checks .status and a non-empty library message."""
    with pytest.raises(error_class) as info:
        yield info
    assert info.value.status == status
    assert isinstance(info.value, anchorkv.AnchorKVError)
    assert info.value.message


def test_budget_too_small_names_the_minimum(layer):
    keys, values, window = layer
    with raises_status(anchorkv.BudgetError, Status.BUDGET) as info:
        anchorkv.compress(keys, values, window, retain_fraction=0.001)
    assert "retain_fraction" in info.value.message
    with raises_status(anchorkv.BudgetError, Status.BUDGET):
        anchorkv.compressed_size(256, 2, 64, retain_fraction=0.001)


def test_budget_clamp_uses_the_named_minimum(layer):
    """on_budget="clamp" warns and compresses at the smallest workable retain_fraction, the
    one the BudgetError names; an unknown on_budget is refused."""
    keys, values, window = layer
    heads, seq_len, head_dim = keys.shape
    with pytest.raises(anchorkv.BudgetError) as info:
        anchorkv.compress(keys, values, window, retain_fraction=0.001)
    named = [float(x) for x in re.findall(r"retain_fraction[^0-9]*([0-9.]+)", info.value.message)]
    smallest = anchorkv.smallest_retain_fraction(seq_len, heads, head_dim, num_q_heads=window.shape[0])
    assert any(abs(x - smallest) <= 2e-6 for x in named), (info.value.message, smallest)
    with pytest.warns(UserWarning, match="cannot hold"):
        cache = anchorkv.compress(keys, values, window, retain_fraction=0.001, on_budget="clamp")
    assert cache.stats.compressed_bytes <= smallest * cache.stats.full_bytes
    with raises_status(anchorkv.InvalidArgumentError, Status.INVALID_ARGUMENT):
        anchorkv.compress(keys, values, window, retain_fraction=0.001, on_budget="guess")


def test_non_finite_input(layer):
    keys, values, window = layer
    keys = keys.copy()
    keys[1, 7, 3] = np.nan
    with raises_status(anchorkv.NonFiniteError, Status.NON_FINITE):
        anchorkv.compress(keys, values, window, retain_fraction=0.2)


def test_bad_option_values(layer):
    keys, values, window = layer
    with raises_status(anchorkv.InvalidArgumentError, Status.INVALID_ARGUMENT):
        anchorkv.compress(keys, values, window, retain_fraction=1.5)
    with raises_status(anchorkv.InvalidArgumentError, Status.INVALID_ARGUMENT):
        anchorkv.compress(keys, values, window, retain_fraction=0.2, pool_kernel=4)  # must be odd
    with pytest.raises(TypeError):
        anchorkv.compress(keys, values, window, retain_fractoin=0.1)  # typo: Python-side


def test_inv_freq_of_the_wrong_length_is_refused(layer):
    """The C struct has no length for inv_freq: the library reads rotary_dim/2 floats, so a
    shorter table would be read past its end (issue 12). The binding checks the length."""
    keys, values, window = layer  # head_dim 64: 32 frequencies
    for table in (np.full(10, 1e-3, np.float32), np.full(33, 1e-3, np.float32),
                  np.full((2, 16), 1e-3, np.float32)):
        with pytest.raises(anchorkv.InvalidArgumentError) as info:
            anchorkv.compress(keys, values, window, retain_fraction=0.5, inv_freq=table)
        assert "inv_freq" in info.value.message
        with pytest.raises(anchorkv.InvalidArgumentError):
            anchorkv.compressed_size(256, 2, 64, retain_fraction=0.5, inv_freq=table)
    with pytest.raises(anchorkv.InvalidArgumentError):  # partial rotation: rotary_dim/2 = 8
        anchorkv.compress(keys, values, window, method="fullkv", rotary_dim=16,
                          inv_freq=np.full(32, 1e-3, np.float32))
    anchorkv.compress(keys, values, window, method="fullkv", rotary_dim=16,
                      inv_freq=np.full(8, 1e-3, np.float32))
    anchorkv.compress(keys, values, window, method="fullkv", inv_freq=np.full(32, 1e-3, np.float32))
    # Without a rotation the table is not read.
    anchorkv.compress(keys, values, window, method="fullkv", rope_style="none",
                      inv_freq=np.full(3, 1e-3, np.float32))


def test_head_dim_the_codec_cannot_take(rng):  # 72: not a multiple of 16
    keys = rng.standard_normal((2, 256, 72), dtype=np.float32)
    queries = rng.standard_normal((2, 32, 72), dtype=np.float32)
    with pytest.raises(anchorkv.AnchorKVError) as info:
        anchorkv.compress(keys, keys, queries)
    assert info.value.status in (Status.INVALID_ARGUMENT, Status.UNSUPPORTED)
    assert "72" in info.value.message


def test_shape_errors_caught_before_the_library(layer, rng):
    keys, values, window = layer
    with raises_status(anchorkv.InvalidArgumentError, Status.INVALID_ARGUMENT):
        anchorkv.compress(keys, values[:, :-1], window)
    with raises_status(anchorkv.InvalidArgumentError, Status.INVALID_ARGUMENT):
        anchorkv.compress(keys, values, window, window=16)  # queries hold 32 positions
    with raises_status(anchorkv.InvalidArgumentError, Status.INVALID_ARGUMENT):
        anchorkv.compress(keys.astype(np.float64), values, window)
    cache = anchorkv.compress(keys, values, window, method="fullkv")
    with raises_status(anchorkv.InvalidArgumentError, Status.INVALID_ARGUMENT):
        cache.decode(rng.standard_normal((3, 1, 64), dtype=np.float32))  # Hq is 4
    with raises_status(anchorkv.InvalidArgumentError, Status.INVALID_ARGUMENT):
        cache.decode(rng.standard_normal((4, 1, 64), dtype=np.float32),
                     out=np.empty((4, 1, 64), np.float16))
    with raises_status(anchorkv.InvalidArgumentError, Status.INVALID_ARGUMENT):
        read_only = np.empty((4, 1, 64), np.float32)
        read_only.flags.writeable = False
        cache.decode(rng.standard_normal((4, 1, 64), dtype=np.float32), out=read_only)


def test_q_len_beyond_appended_tokens(layer, rng):
    keys, values, window = layer
    cache = anchorkv.compress(keys, values, window, method="fullkv")
    with raises_status(anchorkv.InvalidArgumentError, Status.INVALID_ARGUMENT):
        cache.decode(rng.standard_normal((4, 2, 64), dtype=np.float32))  # nothing appended


def test_corrupt_and_truncated_serialized_data(layer):
    keys, values, window = layer
    data = bytearray(bytes(anchorkv.compress(keys, values, window, retain_fraction=0.2)))
    with raises_status(anchorkv.CorruptDataError, Status.CORRUPT_DATA):
        anchorkv.Cache.from_bytes(bytes(data[: len(data) // 2]))
    data[len(data) // 2] ^= 0x5A
    with raises_status(anchorkv.CorruptDataError, Status.CORRUPT_DATA):
        anchorkv.Cache.from_bytes(bytes(data))
    with raises_status(anchorkv.CorruptDataError, Status.CORRUPT_DATA):
        anchorkv.Cache.from_bytes(b"not an anchorkv cache at all")


def test_serialize_into_too_small_buffer(layer):
    keys, values, window = layer
    cache = anchorkv.compress(keys, values, window, retain_fraction=0.2)
    with raises_status(anchorkv.CapacityError, Status.CAPACITY):
        cache.serialize_into(bytearray(16))


def test_batch_of_caches_from_two_contexts(layer, rng):
    keys, values, window = layer
    with anchorkv.Context() as first, anchorkv.Context() as second:
        a = first.compress(keys, values, window, method="fullkv")
        b = second.compress(keys, values, window, method="fullkv")
        with raises_status(anchorkv.MismatchError, Status.MISMATCH):
            first.decode_batch([a, b], rng.standard_normal((2, 4, 1, 64), dtype=np.float32))


def test_cuda_backend_unavailable_or_usable():
    try:
        context = anchorkv.Context("cuda")
    except anchorkv.AnchorKVError as error:
        assert error.status in (Status.BACKEND_UNAVAILABLE, Status.BACKEND)
        assert isinstance(error, (anchorkv.BackendUnavailableError, anchorkv.BackendError))
    else:  # a CUDA build on a machine with a GPU
        context.close()


def test_cuda_array_given_to_cpu_context_is_a_mismatch(layer):
    keys, values, window = layer

    class FakeDeviceArray:  # what CuPy or torch would present
        __cuda_array_interface__ = {"shape": keys.shape, "typestr": "<f4",
                                    "data": (0x10000, False), "version": 3, "strides": None}
    with raises_status(anchorkv.MismatchError, Status.MISMATCH):
        anchorkv.compress(FakeDeviceArray(), values, window)


def test_unknown_status_code_is_kept():
    error = anchorkv._errors.error_for(99, "from a newer library")
    assert type(error) is anchorkv.AnchorKVError and error.status == 99
    assert "newer" in str(error)


def test_error_classes_cover_every_status():
    for status in Status:
        if status == Status.OK:
            continue
        error = anchorkv._errors.error_for(status, "detail")
        assert error.status == status and type(error) is not anchorkv.AnchorKVError
        assert str(error) == f"{status.name}: detail"


def test_wrong_types_raise_type_errors_that_name_the_argument(layer):
    keys, values, window = layer
    with pytest.raises(TypeError, match="keys must be an array"):
        anchorkv.compress(object(), values, window)
    with pytest.raises(TypeError, match="compression option retain_fraction must be a number"):
        anchorkv.compress(keys, values, window, retain_fraction=object())
    with pytest.raises(TypeError, match="option method"):
        anchorkv.compress(keys, values, window, method=object())
    cache = anchorkv.compress(keys, values, window, method="fullkv")
    with pytest.raises(TypeError, match="queries must be an array"):
        cache.decode(object())


def test_enums_are_named_in_library_messages(layer):
    keys, values, window = layer
    with raises_status(anchorkv.InvalidArgumentError, Status.INVALID_ARGUMENT) as info:
        anchorkv.compress(keys, values, window, storage_dtype="f32")
    assert "storage_dtype f32 " in info.value.message


def test_a_window_that_disagrees_with_the_method_is_refused(layer):
    keys, values, window = layer  # 32 query positions; SnapKV's window is 64
    with pytest.raises(anchorkv.InvalidArgumentError, match="SNAPKV's window is 64.*window=32"):
        anchorkv.compress(keys, values, window, method="snapkv", retain_fraction=0.5)
    cache = anchorkv.compress(keys, values, window, method="snapkv", retain_fraction=0.5, window=32)
    assert cache.stats.window == 32
    # FullKV reads no window: any number of queries goes.
    anchorkv.compress(keys, values, window[:, :5], method="fullkv")


def test_calls_without_a_context_share_one(layer):
    keys, values, window = layer
    data = bytes(anchorkv.compress(keys, values, window, method="fullkv"))
    caches = [anchorkv.Cache.from_bytes(data) for _ in range(8)]
    assert len({id(cache.context) for cache in caches}) == 1
    caches[0].context.close()  # closing the shared context: the next call makes another
    assert anchorkv.Cache.from_bytes(data).context is not caches[0].context
