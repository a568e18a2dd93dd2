// AKV_HD marks the inline functions that host code and the CUDA kernels share (hashes,
// codebooks, launch arithmetic): __host__ __device__ under nvcc, nothing for a plain C++
// compiler (the library's .cpp files, and the SIMT emulation, which compiles the kernels
// with g++ and defines __host__ and __device__ away itself).
#pragma once

#if defined(__CUDACC__)
#define AKV_HD __host__ __device__
#else
#define AKV_HD
#endif
