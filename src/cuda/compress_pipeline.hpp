// The AnchorKV compression pass on the GPU, step by step (docs/design.md §2.2; the CPU reference is
// cpu/compress_anchorkv.cpp), written once over a small device policy so that the same
// orchestration runs on a CUDA device (cuda/compress.cu: launches on a stream, cuBLAS GEMMs,
// CUB radix sorts) and on the CPU through the SIMT emulation (tests/emu: the kernels run as
// fibers, sorts are std::stable_sort, GEMMs host loops).
//
// The policy provides:
//   launch(kernel, gx, gy, block, args...)          a kernel over a (gx, gy) grid
//   gemm_nt(M, N, K, alpha, A, lda, B, ldb, C, ldc)  C = alpha A B^T  (row-major)
//   gemm_nn(M, N, K, alpha, A, lda, B, ldb, C, ldc)  C = alpha A B
//   gemm_nt_batched(M, N, K, alpha, A, lda, sa, B, ldb, sb, C, ldc, sc, batch)
//                                                    gemm_nt for `batch` problems, operand i at
//                                                    A + i sa, B + i sb, C + i sc (strided batch)
//   gemm_nt_batched_bf16(...)                        gemm_nt_batched on bf16 operands (fp32 C)
//   sort_u32(keys, values, n), sort_u64(keys, values, n)  stable ascending, in place
//   sort_segments_u32(keys, values, segments, n)     each of `segments` runs of n, stable, in place
//   copy(dst, src, bytes), fill(dst, byte, bytes)    ordered with the kernels
//   read(host_dst, src, bytes)                        waits for the work so far, then copies
//   int read_int(const int32_t *)                    the same for one int
//   stage(CompressStage)                             the work from here on belongs to this stage
//                                                    (timed on a device when profiling; else a no-op)
//
// The passes: cuda/compress_anchorkv_pass.hpp (AnchorKV) and cuda/compress_dense_passes.hpp
// (FullKV and the eviction baselines); what they share is in cuda/compress_common.hpp.
#pragma once
#include "cuda/compress_anchorkv_pass.hpp"
#include "cuda/compress_dense_passes.hpp"
