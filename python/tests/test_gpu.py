"""CUDA backend through torch (and CuPy) tensors: DLPack/__cuda_array_interface__, streams.

Skipped unless torch sees a GPU and the library was built with a CUDA backend that runs.
"""
import numpy as np
import pytest

import anchorkv
from conftest import make_layer

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to torch", allow_module_level=True)


@pytest.fixture(scope="module")
def cuda_context():
    try:
        context = anchorkv.Context("cuda", device=0)
    except (anchorkv.BackendUnavailableError, anchorkv.BackendError) as error:
        pytest.skip(f"library without a usable CUDA backend: {error}")
    yield context
    context.close()


def _compress_or_skip(context, *args, **kwargs):
    try:
        return context.compress(*args, **kwargs)
    except anchorkv.UnsupportedError as error:
        pytest.skip(f"CUDA compression not in this library version: {error}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_gpu_matches_cpu(cuda_context, rng, dtype):
    keys, values, window = make_layer(rng)
    torch_dtype = getattr(torch, dtype)
    on_gpu = [torch.from_numpy(a).to("cuda", torch_dtype) for a in (keys, values, window)]
    gpu_cache = _compress_or_skip(cuda_context, *on_gpu, retain_fraction=0.2)
    cpu_cache = anchorkv.compress(*[t.cpu() for t in on_gpu] if dtype != "bfloat16" else
                                  [t.view(torch.int16).cpu().numpy().view(np.uint16) for t in on_gpu],
                                  retain_fraction=0.2, dtype="bf16" if dtype == "bfloat16" else None)
    query = torch.randn(4, 1, 64, device="cuda").to(torch_dtype)
    out = gpu_cache.decode(query)
    assert out.device.type == "cuda" and out.dtype == torch_dtype
    torch.cuda.synchronize()
    host_query = query.cpu()
    if dtype == "bfloat16":
        bits = cpu_cache.decode(host_query.view(torch.int16).numpy().view(np.uint16), dtype="bf16")
        expected = (bits.astype(np.uint32) << 16).view(np.float32)
    else:
        expected = cpu_cache.decode(host_query.numpy())
    # The GPU compression pass may flip a floating-point near-tie (an assignment, a residual
    # choice) against the CPU's, so the float32 bound is looser than the arithmetic's. bf16
    # queries run the key side in bf16 on the GPU (the tests/gpu bound, 4e-2).
    atol = {"float32": 2e-3, "float16": 2e-2, "bfloat16": 4e-2}[dtype]
    np.testing.assert_allclose(out.float().cpu().numpy(), np.asarray(expected, np.float32), atol=atol)
    # One layout on both backends: same footprint, and GPU bytes decode on the CPU.
    assert gpu_cache.stats.compressed_bytes == cpu_cache.stats.compressed_bytes
    from_gpu = anchorkv.Cache.from_bytes(bytes(gpu_cache))
    assert from_gpu.stats.compressed_bytes == cpu_cache.stats.compressed_bytes


def test_current_torch_stream_is_used(cuda_context, rng):
    keys, values, window = make_layer(rng)
    on_gpu = [torch.from_numpy(a).cuda() for a in (keys, values, window)]
    cache = _compress_or_skip(cuda_context, *on_gpu, method="fullkv")
    side = torch.cuda.Stream()
    query = torch.randn(4, 1, 64, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out_on_side = cache.decode(query)  # enqueued on `side`, no host sync
    side.synchronize()
    out_explicit = cache.decode(query, stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    torch.testing.assert_close(out_on_side, out_explicit)


def test_gpu_cache_deserializes_on_cpu(cuda_context, rng):
    keys, values, window = make_layer(rng)
    on_gpu = [torch.from_numpy(a).cuda() for a in (keys, values, window)]
    cache = _compress_or_skip(cuda_context, *on_gpu, retain_fraction=0.2)
    restored = anchorkv.Cache.from_bytes(bytes(cache))
    query = torch.randn(4, 1, 64, device="cuda")
    torch.testing.assert_close(torch.from_numpy(restored.decode(query.cpu().numpy())),
                               cache.decode(query).cpu(), atol=1e-4, rtol=1e-4)


def test_cupy_arrays(cuda_context, rng):
    cupy = pytest.importorskip("cupy")
    keys, values, window = make_layer(rng)
    cache = _compress_or_skip(cuda_context, *(cupy.asarray(a) for a in (keys, values, window)),
                              method="fullkv")
    query = cupy.asarray(rng.standard_normal((4, 1, 64), dtype=np.float32))
    out = cache.decode(query)
    assert isinstance(out, cupy.ndarray)
    cpu = anchorkv.compress(keys, values, window, method="fullkv")
    np.testing.assert_allclose(cupy.asnumpy(out), cpu.decode(cupy.asnumpy(query)), atol=1e-4)


def test_numpy_array_given_to_cuda_context(cuda_context, rng):
    keys, values, window = make_layer(rng)
    with pytest.raises(anchorkv.MismatchError):
        cuda_context.compress(keys, values, window)
