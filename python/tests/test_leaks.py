"""No leaks over many create/destroy cycles.

tracemalloc cannot see C memory, so two other witnesses: a counting allocator passed to the
context (every byte the library takes through its allocator is given back), and the process
RSS from /proc/self/statm over 2000 cycles, with a generous bound.
"""
import ctypes
import ctypes.util
import gc
import os
import threading

import numpy as np
import pytest

import anchorkv
from conftest import make_layer

_libc = ctypes.CDLL(ctypes.util.find_library("c"))
_libc.aligned_alloc.restype = ctypes.c_void_p
_libc.aligned_alloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
_libc.free.argtypes = [ctypes.c_void_p]


class CountingAllocator:
    """256-byte aligned blocks from libc, counted; free checks the size it is given."""

    def __init__(self):
        self.live = {}
        self.allocations = 0
        self.peak_bytes = 0
        self.lock = threading.Lock()  # the library may allocate from worker threads

    def alloc(self, nbytes):
        rounded = max(256, (nbytes + 255) // 256 * 256)
        address = _libc.aligned_alloc(256, rounded)
        if address:
            with self.lock:
                self.live[address] = nbytes
                self.allocations += 1
                self.peak_bytes = max(self.peak_bytes, sum(self.live.values()))
        return address

    def free(self, address, nbytes):
        if not address:
            return
        with self.lock:
            assert self.live.pop(address) == nbytes, "free was given another size"
        _libc.free(address)

    @property
    def live_bytes(self):
        return sum(self.live.values())


def test_counting_allocator_sees_every_byte_returned(rng):
    keys, values, window = make_layer(rng)
    allocator = CountingAllocator()
    for _ in range(50):
        with anchorkv.Context(allocator=allocator, num_threads=2) as context:
            with context.compress(keys, values, window, retain_fraction=0.2) as cache:
                assert allocator.live_bytes >= cache.stats.allocated_bytes > 0
                cache.append(keys[:, :3], values[:, :3])
                cache.decode(rng.standard_normal((4, 2, 64), dtype=np.float32))
                restored = context.deserialize(bytes(cache))
                restored.close()
    assert allocator.allocations > 0
    assert allocator.live == {}, f"{len(allocator.live)} blocks never freed"


def test_out_of_memory_from_the_allocator(rng):
    keys, values, window = make_layer(rng)

    class Refusing(CountingAllocator):
        def alloc(self, nbytes):
            return 0  # NULL: the library must report it, not crash

    allocator = Refusing()
    try:
        context = anchorkv.Context(allocator=allocator)
    except anchorkv.OutOfMemoryError as error:  # the context itself needed memory
        assert error.status == anchorkv.Status.OUT_OF_MEMORY
        return
    with context:
        with pytest.raises(anchorkv.OutOfMemoryError) as info:
            context.compress(keys, values, window, retain_fraction=0.2)
        assert info.value.status == anchorkv.Status.OUT_OF_MEMORY


def _rss_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_rss_stays_flat_over_2000_cycles(rng):
    keys, values, window = make_layer(rng, seq_len=128)
    query = rng.standard_normal((4, 1, 64), dtype=np.float32)

    def cycle():
        with anchorkv.Context(num_threads=1) as context:
            cache = context.compress(keys, values, window, retain_fraction=0.3)
            cache.append(keys[:, :1], values[:, :1])
            cache.decode(query)
            anchorkv.Cache.from_bytes(bytes(cache), context).close()
            cache.close()

    for _ in range(200):  # warm up allocator pools and caches
        cycle()
    gc.collect()
    before = _rss_bytes()
    for _ in range(2000):
        cycle()
    gc.collect()
    grown = _rss_bytes() - before
    # One cycle holds ~100 KB; a leak of anything per cycle shows as >= 2000x that.
    assert grown < 16 * 1024 * 1024, f"RSS grew by {grown / 1e6:.1f} MB over 2000 cycles"


def test_garbage_collected_cycles_destroy_cache_before_context(rng):
    """A Context and Cache in one reference cycle: whichever __del__ runs first, no crash."""
    keys, values, window = make_layer(rng, seq_len=128)
    allocator = CountingAllocator()
    for _ in range(20):
        context = anchorkv.Context(allocator=allocator)
        cache = context.compress(keys, values, window, method="fullkv")
        context.cycle = cache  # context -> cache -> context
        del context, cache
        gc.collect()
    assert allocator.live == {}
