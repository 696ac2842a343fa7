// CUDA kernels of Sinkhorn-k for n = 4 float32 (sinkhorn.h's math), one thread per matrix,
// and their launchers. Raw pointers, sizes and a stream; no host synchronization.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "birkhoff_kernels.cuh"  // ldg_f4, st_f4, blocks_for
#include "sinkhorn.h"

namespace mhc_cuda {

// Iteration counts the CUDA kernels take (iters = 20 has its own unrolled kernels); the
// Python layer runs larger counts in torch ops.
constexpr int kMaxSinkhornIters = 64;
constexpr int kSkThreads = 128;

// One 4 x 4 matrix as four 16-byte loads / stores.
__device__ __forceinline__ void ldg_4x4(const float* __restrict__ src, float (&m)[4][4]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) ldg_f4(src + 4 * q, m[q]);
}
__device__ __forceinline__ void st_4x4(float* dst, const float (&m)[4][4]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) st_f4(dst + 4 * q, m[q]);
}

// ---------------------------------------------------------------- forward
// P0 (16 floats) and the scaling vectors r, c (4 each) in registers; a step is one 4 x 4
// mat-vec and 4 MUFU.RCP. ITERS > 0: compile-time count, straight-line code; ITERS == 0:
// run-time count. H200: 0.963 ms at B = 16M (docs/design/mhc-proj.md).
template <int ITERS>
__global__ void __launch_bounds__(kSkThreads)
    sinkhorn4_fwd(const float* __restrict__ src, float* __restrict__ dst, int64_t batch,
                  int iters, float eps) {
  const int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (b >= batch) return;
  float a[4][4], p[4][4];
  ldg_4x4(src + b * 16, a);
  mhc::sinkhorn_forward<4, float, ITERS>(a, p, iters, eps);
  st_4x4(dst + b * 16, p);
}

// ---------------------------------------------------------------- backward
// mhc::sinkhorn_vjp in two phases: the replay (step vectors written), G loaded, the reverse
// sweep (step vectors read back in reverse). ITERS = 20: the first kSkStash of the 39 step
// vectors (written first by the replay, read last by the reverse sweep) in dynamic shared
// memory, one 16-byte slot per thread and step ([slot][thread]: a warp's STS.128 / LDS.128
// touch 512 consecutive bytes, no bank conflicts), the other 39 - kSkStash in registers.
// kSkStash = 27 is 54 KB per block, so 4 blocks of 128 fit the 228 KB per SM, and
// __launch_bounds__(128, 4) caps the registers at 128 with no spills: 16 warps per SM
// (all 39 in registers: 12 warps and local-memory spills, 22% slower on the H200). No
// __syncthreads: each thread reads only its own slots. ITERS == 0: run-time count
// (<= kMaxSinkhornIters), the vectors in local memory.
constexpr int kSkStash = 27;

template <int KS, int K>
struct SkVecStash {
  float4* smem;  // this thread's slot 0; slot k at smem[k * kSkThreads]
  float reg[K - KS][4];
  __device__ __forceinline__ void put(int k, const float (&x)[4]) {
    if (k < KS) {
      smem[k * kSkThreads] = make_float4(x[0], x[1], x[2], x[3]);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) reg[k - KS][j] = x[j];
    }
  }
  __device__ __forceinline__ void get(int k, float (&x)[4]) const {
    if (k < KS) {
      const float4 v = smem[k * kSkThreads];
      x[0] = v.x;
      x[1] = v.y;
      x[2] = v.z;
      x[3] = v.w;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) x[j] = reg[k - KS][j];
    }
  }
};

// L2 prefetch of `bytes` (a multiple of 16, 16-byte aligned) from p: one bulk request
// (sm_90's cp.async.bulk.prefetch); nothing on older architectures.
__device__ __forceinline__ void prefetch_l2_bulk(const void* p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

template <int ITERS>
__global__ void __launch_bounds__(kSkThreads, ITERS > 0 ? 4 : 0)
    sinkhorn4_bwd(const float* __restrict__ src, const float* __restrict__ grad,
                  float* __restrict__ dst, int64_t batch, int iters, float eps) {
  constexpr int KS = ITERS > 0 ? kSkStash : 0;
  const int64_t b0 = blockIdx.x * int64_t(kSkThreads);
  const int64_t b = b0 + threadIdx.x;
  // G is loaded after the replay (~1k instructions later): bring the block's 8 KB of G to
  // L2 now, so that load does not wait for HBM
  if (threadIdx.x == 0)
    prefetch_l2_bulk(grad + b0 * 16, unsigned(min(int64_t(kSkThreads), batch - b0)) * 64u);
  if (b >= batch) return;
  float a[4][4], g[4][4], sm[4][4], p0[4][4], r[4], c[4];
  ldg_4x4(src + b * 16, a);
  auto run = [&](auto& vec) {
    mhc::sinkhorn_replay<4, float, ITERS>(a, iters, eps, sm, p0, r, c, vec);
    ldg_4x4(grad + b * 16, g);  // after the replay: G is not live across it
    mhc::sinkhorn_reverse<4, float, ITERS>(sm, p0, r, c, g, iters, vec);
  };
  if constexpr (ITERS > 0 && KS > 0) {
    extern __shared__ float4 sk_stash[];
    SkVecStash<KS, 2 * ITERS - 1> vec{sk_stash + threadIdx.x};
    run(vec);
  } else {
    constexpr int kSlots = ITERS > 0 ? 2 * ITERS - 1 : 2 * kMaxSinkhornIters - 1;
    float v[kSlots][4];
    mhc::SkVecArray<4, float> vec{v};
    run(vec);
  }
  st_4x4(dst + b * 16, g);
}

// ---------------------------------------------------------------- launchers
inline void launch_sinkhorn_fwd(const float* x, float* out, int64_t batch, int iters,
                                float eps, cudaStream_t s) {
  if (batch == 0) return;
  const unsigned grid = blocks_for(batch, kSkThreads);
  if (iters == 20)
    sinkhorn4_fwd<20><<<grid, kSkThreads, 0, s>>>(x, out, batch, iters, eps);
  else
    sinkhorn4_fwd<0><<<grid, kSkThreads, 0, s>>>(x, out, batch, iters, eps);
}

inline void launch_sinkhorn_bwd(const float* x, const float* g, float* out, int64_t batch,
                                int iters, float eps, cudaStream_t s) {
  if (batch == 0) return;
  const unsigned grid = blocks_for(batch, kSkThreads);
  if (iters != 20) {
    sinkhorn4_bwd<0><<<grid, kSkThreads, 0, s>>>(x, g, out, batch, iters, eps);
    return;
  }
  // > 48 KB of dynamic shared memory (and the largest carveout) is an opt-in per device:
  // once per device (bit d of `configured`; the binding holds the GIL)
  constexpr int kBytes = kSkStash * kSkThreads * int(sizeof(float4));
  auto* kernel = sinkhorn4_bwd<20>;
  static unsigned configured = 0;
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev >= 32 || !(configured & (1u << dev))) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
    cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                         cudaSharedmemCarveoutMaxShared);
    if (dev < 32) configured |= 1u << dev;
  }
  kernel<<<grid, kSkThreads, kBytes, s>>>(x, g, out, batch, iters, eps);
}

}  // namespace mhc_cuda
