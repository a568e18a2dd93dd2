// Host emulation of the small SIMT subset the CUDA kernels use, so that their logic is
// tested on machines without a GPU (most CI machines): one-dimensional blocks run one at a
// time, each CUDA thread a fiber on the calling thread; __syncthreads and warp shuffles and votes
// are barriers over the block or the warp where fibers switch (so is mma.sync, computed from the
// warp's posted fragments); static shared variables
// (AKV_STATIC_SHARED) are function statics (one block lives at a time); atomics take a lock.
// Slow and only for small test shapes; it checks indexing, synchronisation and arithmetic,
// not performance. Included instead of the CUDA headers when AKV_SIMT_EMULATION is defined
// (see src/cuda/device_common.cuh).
//
// What hardware does not promise, the emulation does not give either: shared memory (dynamic
// and static) is poisoned at each block start (0xFF bytes: NaN as f32, f16 and bf16, -1 as an
// integer), so a read before any write shows; blocks, and the fibers between two barriers,
// run in an order drawn from ANCHORKV_SIMT_SEED (default 1), some threads are held back until
// no other can run, and a fiber yields at random after an atomic (which interleaves the
// atomics of different threads), so a missing barrier or a result that depends on the order
// of atomics shows, and changes with the seed. A barrier that not every thread reaches aborts.
#pragma once
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <ucontext.h>
#include <vector>

#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
#define __grid_constant__
#ifndef __align__
#define __align__(n) __attribute__((aligned(n)))
#endif
#define __global__ static  // one copy per test program: nvcc's host stubs have the same names
// Static shared memory is declared through AKV_STATIC_SHARED (below), which poisons it.
#define __shared__ static_assert(false, "declare static shared memory with AKV_STATIC_SHARED");

namespace simt {

struct uint3_ {
  unsigned x = 0, y = 0, z = 0;
};
struct uint4_ {
  unsigned x, y, z, w;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

// x86-64: a fiber switch saves the callee-saved registers on the old stack and swaps stack
// pointers (no signal-mask system call, unlike swapcontext, which made the emulation
// several times slower). Other architectures use ucontext.
#if defined(__x86_64__) && !defined(AKV_SIMT_UCONTEXT)
#define AKV_SIMT_ASM_SWITCH 1
extern "C" void akv_simt_switch(void **save_sp, void *next_sp);
asm(R"(
  .text
  .weak akv_simt_switch
  .type akv_simt_switch, @function
akv_simt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size akv_simt_switch, .-akv_simt_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");
#endif

// One emulated CUDA thread: its own stack and saved context. A block's threads run on the
// calling OS thread, switching at barriers (cheap, deterministic).
struct Fiber {
#ifdef AKV_SIMT_ASM_SWITCH
  void *sp = nullptr;
#else
  ucontext_t context;
#endif
  unsigned char *stack = nullptr;  // kStackBytes, from the thread's stack pool
  bool done = false;
  bool late = false;                            // runs only when no other fiber can
  const uint64_t *barrier = nullptr;            // the barrier generation it waits on
  uint64_t waited = 0;                          // ... until it differs from this
  bool runnable() const { return !done && (!barrier || *barrier != waited); }
};

// Fiber stacks are reused across blocks and launches (allocating and zeroing them per block
// cost more than the kernels).
constexpr size_t kStackBytes = 128 * 1024;
inline unsigned char *fiber_stack(int index) {
  thread_local std::vector<std::unique_ptr<unsigned char[]>> pool;
  while (static_cast<int>(pool.size()) <= index) pool.emplace_back(new unsigned char[kStackBytes]);
  return pool[index].get();
}

constexpr unsigned char kPoison = 0xFF;
inline std::atomic<uint64_t> g_blocks_started{0};

// Cache hints (prefetch_l2 in cuda/device_common.cuh) have no effect here; a test may install
// a hook that checks their addresses (tests/emu: inside the cache's arrays).
inline std::function<void(const void *)> &prefetch_hook() {
  static std::function<void(const void *)> hook;
  return hook;
}

// The scheduling order: one generator per OS thread, seeded from ANCHORKV_SIMT_SEED.
inline std::mt19937_64 &order_rng() {
  thread_local std::mt19937_64 rng([] {
    const char *s = std::getenv("ANCHORKV_SIMT_SEED");
    return s && *s ? std::strtoull(s, nullptr, 0) : 1ull;
  }());
  return rng;
}

struct Block {
  Block(int threads, size_t smem) : fibers(threads), dynamic(smem + 16, kPoison), exchange(threads), fragments(threads * 6), warp_arrived((threads + 31) / 32, 0),
        warp_generation((threads + 31) / 32, 0), serial(++g_blocks_started) {
    for (int t = 0; t < threads; ++t) fibers[t].stack = fiber_stack(t);
  }
  std::vector<Fiber> fibers;
#ifdef AKV_SIMT_ASM_SWITCH
  void *scheduler = nullptr;
#else
  ucontext_t scheduler;
#endif
  std::vector<unsigned char> dynamic;
  std::vector<uint64_t> exchange;  // one slot per thread for shuffles
  std::vector<uint32_t> fragments;  // six words per thread: a warp's mma operands (mma_m16n8k16_bf16)
  int block_arrived = 0;
  uint64_t block_generation = 0;
  int block_site = 0;  // the source line of the __syncthreads the current generation's first thread reached
  std::vector<int> warp_arrived;
  std::vector<uint64_t> warp_generation;
  int named_arrived[16] = {};  // bar.sync id, count (id 1-15; 0 is __syncthreads)
  uint64_t named_generation[16] = {};
  uint64_t serial;  // which block this is, for poisoning static shared memory once per block
  int current = 0;
};

inline thread_local uint3_ tl_thread, tl_block_index;
inline thread_local Block *tl_block = nullptr;
inline dim3 g_block_dim, g_grid_dim;
inline std::mutex g_atomic_lock;

inline void to_scheduler(Block *b) {
#ifdef AKV_SIMT_ASM_SWITCH
  akv_simt_switch(&b->fibers[b->current].sp, b->scheduler);
#else
  swapcontext(&b->fibers[b->current].context, &b->scheduler);
#endif
}
inline void to_fiber(Block *b, int t) {
  b->current = t;
#ifdef AKV_SIMT_ASM_SWITCH
  akv_simt_switch(&b->scheduler, b->fibers[t].sp);
#else
  swapcontext(&b->scheduler, &b->fibers[t].context);
#endif
}
inline void yield() { to_scheduler(tl_block); }

// Poisons a static shared variable when the first fiber of a block passes its declaration
// (before any fiber of the block can use it).
template <typename T>
void poison_static_shared(T &var, uint64_t &poisoned_block) {
  if (poisoned_block == tl_block->serial) return;
  std::memset(static_cast<void *>(&var), kPoison, sizeof var);
  poisoned_block = tl_block->serial;
}

// After an atomic, a fiber yields with probability 1/2: other threads' atomics come between.
inline void maybe_yield_after_atomic() {
  if (tl_block && (order_rng()() & 1)) yield();
}

// Waits until `count` threads have arrived at this barrier generation.
inline void arrive(int &arrived, uint64_t &generation, int count) {
  if (++arrived == count) {
    arrived = 0;
    ++generation;
    return;
  }
  Fiber &self = tl_block->fibers[tl_block->current];
  self.barrier = &generation;
  self.waited = generation;
  while (generation == self.waited) yield();  // resumed once the barrier is released
  self.barrier = nullptr;
}

// Every thread of a block must reach the same __syncthreads (CUDA leaves a barrier that the
// block's threads reach at different call sites undefined; the hardware lets them release one
// another, and what each side wrote before it is then unordered): a thread that reaches one at
// another source line than the generation's first thread aborts the run with both lines.
inline void syncthreads(int line = 0) {
  Block *b = tl_block;
  if (b->block_arrived == 0) {
    b->block_site = line;
  } else if (line != b->block_site) {
    std::fprintf(stderr, "simt: thread %u of block (%u, %u, %u) reached __syncthreads at line %d while the block's first "
                 "thread of this barrier waits at line %d\n", tl_thread.x, tl_block_index.x, tl_block_index.y,
                 tl_block_index.z, line, b->block_site);
    std::abort();
  }
  arrive(b->block_arrived, b->block_generation, static_cast<int>(b->fibers.size()));
}
// bar.sync id, count: the first `count` threads to arrive (whole warps) release each other.
inline void named_barrier(int id, int count) {
  Block *b = tl_block;
  arrive(b->named_arrived[id], b->named_generation[id], count);
}
inline void syncwarp() {
  Block *b = tl_block;
  const int w = static_cast<int>(tl_thread.x / 32);
  const int size = std::min(32, static_cast<int>(b->fibers.size()) - 32 * w);
  arrive(b->warp_arrived[w], b->warp_generation[w], size);
}

template <typename T>
T shfl(T v, int src_lane) {
  static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
  const unsigned tid = tl_thread.x, base = tid / 32 * 32;
  uint64_t slot = 0;
  std::memcpy(&slot, &v, sizeof(T));
  tl_block->exchange[tid] = slot;
  syncwarp();
  const uint64_t got = tl_block->exchange[base + (static_cast<unsigned>(src_lane) & 31u)];
  syncwarp();
  T r;
  std::memcpy(&r, &got, sizeof(T));
  return r;
}

// __match_any_sync over a whole warp: every lane posts its value, the warp meets, each lane
// gathers the lanes whose value equals its own, the warp meets again.
inline unsigned match_any(uint32_t v) {
  const unsigned tid = tl_thread.x, base = tid / 32 * 32;
  const unsigned size = std::min<unsigned>(32, static_cast<unsigned>(tl_block->fibers.size()) - base);
  tl_block->exchange[tid] = v;
  syncwarp();
  unsigned peers = 0;
  for (unsigned l = 0; l < size; ++l) peers |= (tl_block->exchange[base + l] == v ? 1u : 0u) << l;
  syncwarp();
  return peers;
}

// __ballot_sync over a whole warp: bit l set where lane l's predicate holds.
inline unsigned ballot(bool pred) {
  const unsigned tid = tl_thread.x, base = tid / 32 * 32;
  const unsigned size = std::min<unsigned>(32, static_cast<unsigned>(tl_block->fibers.size()) - base);
  tl_block->exchange[tid] = pred ? 1 : 0;
  syncwarp();
  unsigned bits = 0;
  for (unsigned l = 0; l < size; ++l) bits |= static_cast<unsigned>(tl_block->exchange[base + l] != 0) << l;
  syncwarp();
  return bits;
}

// __syncthreads_or: every thread posts its predicate, the block meets, each thread reads them
// all, the block meets again.
inline int syncthreads_or(bool pred, int line = 0) {
  Block *b = tl_block;
  const size_t n = b->fibers.size();
  b->exchange[tl_thread.x] = pred ? 1 : 0;
  syncthreads(line);
  int any = 0;
  for (size_t t = 0; t < n; ++t) any |= b->exchange[t] != 0;
  syncthreads(line);
  return any;
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 by one warp: d += A B with the PTX
// ISA's fragment layouts (group g = lane / 4, t = lane % 4; a register's low half holds the
// element of lower index):
//   A (16 x 16, row-major): a[0] row g, cols 2t, 2t+1; a[1] row g+8, same cols; a[2] row g,
//     cols 2t+8, 2t+9; a[3] row g+8, cols 2t+8, 2t+9;
//   B (16 x 8, K x N): b[0] rows 2t, 2t+1 of col g; b[1] rows 2t+8, 2t+9 of col g;
//   C, D (16 x 8, f32): d[0], d[1] row g, cols 2t, 2t+1; d[2], d[3] row g+8, same cols.
// Every lane posts its operands, the warp meets, each lane computes its four outputs (the
// products are exact in double, one rounding to float at the end), the warp meets again.
// mma_m16n8k16_f16: the same with f16 operands (.f32.f16.f16.f32), through mma_m16n8k16.
inline double half_bits_value(uint32_t h) {  // an IEEE binary16 as a double (exact)
  const int e = static_cast<int>(h >> 10 & 0x1f), m = static_cast<int>(h & 0x3ff);
  const double v = e == 0 ? std::ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : std::ldexp(m + 1024, e - 25);
  return h & 0x8000 ? -v : v;
}
inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], bool f16) {
  Block *blk = tl_block;
  const unsigned tid = tl_thread.x, base = tid / 32 * 32, lane = tid % 32;
  uint32_t *mine = &blk->fragments[tid * 6];
  for (int i = 0; i < 4; ++i) mine[i] = a[i];
  mine[4] = b[0];
  mine[5] = b[1];
  syncwarp();
  const uint32_t *f = &blk->fragments[base * 6];
  const auto elem = [f16](uint32_t word, int high) {
    if (f16) return half_bits_value(high ? word >> 16 : word & 0xffffu);
    const uint32_t bits = (high ? word >> 16 : word & 0xffffu) << 16;
    float v;
    std::memcpy(&v, &bits, sizeof v);
    return static_cast<double>(v);
  };
  const auto A = [&](int r, int c) { return elem(f[((r % 8) * 4 + (c % 8) / 2) * 6 + r / 8 + 2 * (c / 8)], c & 1); };
  const auto B = [&](int k, int n) { return elem(f[(n * 4 + (k % 8) / 2) * 6 + 4 + k / 8], k & 1); };
  const int g = static_cast<int>(lane / 4), t = static_cast<int>(lane % 4);
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int r = g + 8 * (i / 2), n = 2 * t + i % 2;
    double sum = 0.0;
    for (int k = 0; k < 16; ++k) sum += A(r, k) * B(k, n);
    out[i] = d[i] + static_cast<float>(sum);
  }
  syncwarp();  // every lane has read the operands before any posts the next ones
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}
inline void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) { mma_m16n8k16(d, a, b, false); }
inline void mma_m16n8k16_f16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) { mma_m16n8k16(d, a, b, true); }

struct Entry {
  std::function<void()> body;
  Block *block;
  int index;
};
inline thread_local Entry *tl_entries = nullptr;
inline void fiber_main() {
  Block *b = tl_block;
  Entry &e = tl_entries[b->current];
  e.body();
  b->fibers[e.index].done = true;
  to_scheduler(b);
}

// Runs kernel(args...) over the grid: blocks one after another in a drawn order.
template <typename... KArgs, typename... Args>
void launch(dim3 grid, dim3 block, size_t smem, void (*kernel)(KArgs...), Args &&...args) {
  g_grid_dim = grid;
  g_block_dim = block;
  const int threads = static_cast<int>(block.x);
  std::vector<uint64_t> blocks(static_cast<size_t>(grid.x) * grid.y * grid.z);
  std::iota(blocks.begin(), blocks.end(), uint64_t{0});
  std::shuffle(blocks.begin(), blocks.end(), order_rng());
  std::vector<int> order(threads);
  for (const uint64_t linear : blocks) {
    Block state(threads, smem);
    tl_block = &state;
    tl_block_index = {static_cast<unsigned>(linear % grid.x), static_cast<unsigned>(linear / grid.x % grid.y),
                      static_cast<unsigned>(linear / grid.x / grid.y)};
    std::vector<Entry> entries;
    entries.reserve(threads);
    for (int t = 0; t < threads; ++t) entries.push_back({[&] { kernel(args...); }, &state, t});
    tl_entries = entries.data();
    for (int t = 0; t < threads; ++t) {
      Fiber &f = state.fibers[t];
#ifdef AKV_SIMT_ASM_SWITCH
      // A stack the first switch "returns" from into fiber_main: six saved registers,
      // then fiber_main's address, then a fake return address (keeps the ABI alignment).
      uintptr_t top = reinterpret_cast<uintptr_t>(f.stack + kStackBytes) & ~uintptr_t{15};
      void **sp = reinterpret_cast<void **>(top);
      *--sp = nullptr;
      *--sp = reinterpret_cast<void *>(&fiber_main);
      for (int r = 0; r < 6; ++r) *--sp = nullptr;
      f.sp = sp;
#else
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = f.stack;
      f.context.uc_stack.ss_size = kStackBytes;
      f.context.uc_link = nullptr;
      makecontext(&f.context, fiber_main, 0);
#endif
    }
    // Rounds over the fibers in a fresh order: each runnable fiber runs until it yields (at
    // a barrier, or after an atomic) or ends. Some fibers are drawn late (whole warps, and
    // single threads): they run only once no other fiber can, then late fibers are drawn
    // anew. So warps fall behind warps, and threads behind threads, by whole stretches
    // between barriers.
    std::iota(order.begin(), order.end(), 0);
    bool draw = true, warp_late = false;
    for (int live = threads; live > 0;) {
      for (int t = 0; draw && t < threads; ++t) {  // a whole warp late in 4, a thread in 16
        if (t % 32 == 0) warp_late = order_rng()() % 4 == 0;
        state.fibers[t].late = warp_late || order_rng()() % 16 == 0;
      }
      draw = false;
      std::shuffle(order.begin(), order.end(), order_rng());
      bool ran = false;
      live = 0;
      for (const int t : order) {
        Fiber &f = state.fibers[t];
        if (f.done) continue;
        ++live;
        if (f.late || !f.runnable()) continue;
        tl_thread = {static_cast<unsigned>(t), 0, 0};
        to_fiber(&state, t);
        ran = true;
      }
      if (live > 0 && !ran) {
        bool any = false;
        for (const Fiber &f : state.fibers) any = any || f.runnable();
        if (!any) {
          std::fprintf(stderr, "simt: every live thread of block (%u, %u, %u) waits at a barrier that not all reach\n",
                       tl_block_index.x, tl_block_index.y, tl_block_index.z);
          std::abort();
        }
        // Only late fibers can run: one round of every runnable fiber, then a new draw.
        for (const int t : order)
          if (state.fibers[t].runnable()) {
            tl_thread = {static_cast<unsigned>(t), 0, 0};
            to_fiber(&state, t);
          }
        draw = true;
      }
    }
    tl_block = nullptr;
  }
}

}  // namespace simt

using uint4 = ::simt::uint4_;
#define threadIdx (::simt::tl_thread)
#define blockIdx (::simt::tl_block_index)
#define blockDim (::simt::g_block_dim)
#define gridDim (::simt::g_grid_dim)
#define __syncthreads() ::simt::syncthreads(__LINE__)
#define __syncwarp(...) ::simt::syncwarp()
#define __shfl_xor_sync(mask, v, m) ::simt::shfl((v), static_cast<int>(::simt::tl_thread.x % 32) ^ (m))
#define __shfl_sync(mask, v, src) ::simt::shfl((v), (src))
#define __syncthreads_or(pred) ::simt::syncthreads_or((pred), __LINE__)
#define __match_any_sync(mask, v) ::simt::match_any(static_cast<uint32_t>(v))
#define __ballot_sync(mask, pred) ::simt::ballot((pred))
#define __any_sync(mask, pred) (::simt::ballot((pred)) != 0u)
#define AKV_STATIC_SHARED(type, name, dims)                    \
  static type name dims;                                        \
  {                                                             \
    static uint64_t name##_poisoned_block = 0;                  \
    ::simt::poison_static_shared(name, name##_poisoned_block);  \
  }

namespace simt {
// *p = op(*p, v) under the lock; returns the old value. Yields at random afterwards.
template <typename T, typename Op>
T atomic_update(T *p, T v, Op op) {
  T old;
  {
    std::lock_guard<std::mutex> lock(g_atomic_lock);
    old = *p;
    *p = op(old, v);
  }
  maybe_yield_after_atomic();
  return old;
}
}  // namespace simt
inline float atomicAdd(float *p, float v) { return ::simt::atomic_update(p, v, std::plus<float>()); }
inline int atomicAdd(int *p, int v) { return ::simt::atomic_update(p, v, std::plus<int>()); }
inline unsigned atomicAdd(unsigned *p, unsigned v) { return ::simt::atomic_update(p, v, std::plus<unsigned>()); }
inline unsigned atomicMax(unsigned *p, unsigned v) {
  return ::simt::atomic_update(p, v, [](unsigned a, unsigned b) { return a > b ? a : b; });
}
inline unsigned long long atomicOr(unsigned long long *p, unsigned long long v) {
  return ::simt::atomic_update(p, v, std::bit_or<unsigned long long>());
}
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
