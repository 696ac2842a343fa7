// CUDA kernels of mhc-proj. Launchers take raw pointers, sizes and a stream; nothing
// here synchronizes the host, so every launch is capturable in a CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "mhc_math.h"

namespace mhc_cuda {

constexpr int kThreads = 128;

struct FwdArgs {
  const void* src;
  void* dst;
  int* info;  // may be null
  int* work;  // [0] = count of matrices for the fallback, [1..B] their indices, then
              // B x N floats: fp32 potentials of each listed matrix (NaN: solve from scratch)
  int64_t batch;
  double tol;
  int max_iter;
  double fb_tol;
  int fb_max_iter;
  double pivot_min;
};

// 16-byte accesses of 4 consecutive floats (src, dst 16-byte aligned; the Python layer
// passes aligned tensors): the thread-per-matrix kernels move a matrix as E / 4 of them.
__device__ __forceinline__ void ldg_f4(const float* __restrict__ src, float* v) {
  const float4 q = __ldg(reinterpret_cast<const float4*>(src));
  v[0] = q.x;
  v[1] = q.y;
  v[2] = q.z;
  v[3] = q.w;
}
__device__ __forceinline__ void st_f4(float* dst, const float* v) {
  *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
}

// ---------------------------------------------------------------- thread per matrix
// The end of stage 1 for matrix b (status st as mhc::project_matrix): T, the work-list entry
// of a matrix for the float64 stage (st 0 or 2, with its fp32 potentials for st 2) and the
// info word.
template <int N>
__device__ __forceinline__ void fwd_emit(const FwdArgs& a, int64_t b, int st, int iters,
                                         const float* out, const float* beta) {
  constexpr int E = N * N;
  float* dst = static_cast<float*>(a.dst) + b * E;
  if constexpr (E % 4 == 0) {
#pragma unroll
    for (int q = 0; q < E / 4; ++q) st_f4(dst + 4 * q, out + 4 * q);
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e) dst[e] = out[e];
  }
  if (st == 0 || st == 2) {
    const int k = atomicAdd(a.work, 1);
    a.work[1 + k] = int(b);
    float* wb = reinterpret_cast<float*>(a.work + 1 + a.batch) + int64_t(k) * N;
#pragma unroll
    for (int j = 0; j < N; ++j) wb[j] = st == 2 ? beta[j] : NAN;
  }
  if (a.info) a.info[b] = iters | (st == 1 ? mhc::kInfoConverged : 0);
}

// Stage 1 (fp32): one thread solves one matrix (16-byte loads and stores for n = 4).
// Matrices that did not converge (or are ill-conditioned) are appended to a work list.
// CONT_RANGE: the fp32 continuation threshold (0: the default 16; layout "thread-c10": 10).
// LSP: the one-log1p line search (mhc::armijo_log_sum; layout "thread-c10ls").
// FLAT: one Newton loop for every continuation stage (mhc::newton_project_flat; layout
// "thread-flat"): a warp no longer runs the plain and the continued solves one after the
// other. Left alone ptxas gives it 88 registers (5 blocks = 20 warps per SM, against
// thread-c10ls's 72 and 7 blocks): capped at 7 blocks of 128 here (0: no cap, as before).
template <int N, int CONT_RANGE = 0, bool LSP = false, bool FLAT = false>
__global__ void __launch_bounds__(kThreads, FLAT ? 6 : 0) birkhoff_fwd_f32_thread(FwdArgs a) {
  const int64_t b = blockIdx.x * int64_t(kThreads) + threadIdx.x;
  if (b >= a.batch) return;
  constexpr int E = N * N;
  float in[E], out[E];
  const float* src = static_cast<const float*>(a.src) + b * E;
  if constexpr (E % 4 == 0) {
#pragma unroll
    for (int q = 0; q < E / 4; ++q) ldg_f4(src + 4 * q, in + 4 * q);
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e) in[e] = __ldg(src + e);
  }
  int iters = 0;
  float beta[N];
  const int st = mhc::project_matrix<N, float, CONT_RANGE, LSP, FLAT>(
      in, out, float(a.tol), a.max_iter, iters, float(a.pivot_min), beta);
  fwd_emit<N>(a, b, st, iters, out, beta);
}

// Stage 2 (fp64): the matrices on the work list, re-solved in double from the input.
// A fixed grid strides over the device-side count, so the host never reads it.
// UPDATE (layouts "thread-fb2*", n = 4 fp32): the warm-started polish updates its plans
// instead of recomputing 16 double exponentials per iteration (mhc::newton_step_update).
// That keeps T live across iterations: 246 registers for n = 4 (2 blocks = 8 warps per SM)
// against 164 (3 blocks); MIN_BLOCKS = 3 caps them at 168 with 232 B of L1 spills
// ("thread-fb2-occ3"). Which one is faster is for the GPU run to say (NOTES.md).
template <int N, bool UPDATE = false, int MIN_BLOCKS = 0, bool LSP = false>
__global__ void __launch_bounds__(kThreads, MIN_BLOCKS) birkhoff_fwd_fallback(FwdArgs a) {
  const int count = *static_cast<volatile int*>(a.work);
  constexpr int E = N * N;
  for (int k = blockIdx.x * kThreads + threadIdx.x; k < count; k += gridDim.x * kThreads) {
    const int64_t b = a.work[1 + k];
    const float* src = static_cast<const float*>(a.src) + b * E;
    float* dst = static_cast<float*>(a.dst) + b * E;
    int iters = 0;
    const float* wb = reinterpret_cast<const float*>(a.work + 1 + a.batch) + int64_t(k) * N;
    const int st = isnan(wb[0])
                       ? mhc::project_matrix<N, double>(src, dst, a.fb_tol, a.fb_max_iter, iters)
                       : mhc::polish_matrix<N, double, UPDATE, LSP>(src, dst, wb, a.fb_tol,
                                                                    a.fb_max_iter, iters);
    if (a.info) {
      int total = (a.info[b] & 0xffff) + iters;
      total = total > 0xffff ? 0xffff : total;
      a.info[b] = total | mhc::kInfoFallback | (st == 1 ? mhc::kInfoConverged : 0);
    }
  }
}

template <int N>
__global__ void __launch_bounds__(kThreads) birkhoff_fwd_f64_thread(FwdArgs a) {
  const int64_t b = blockIdx.x * int64_t(kThreads) + threadIdx.x;
  if (b >= a.batch) return;
  constexpr int E = N * N;
  int iters = 0;
  const int st = mhc::project_matrix<N, double>(static_cast<const double*>(a.src) + b * E,
                                                static_cast<double*>(a.dst) + b * E, a.tol,
                                                a.max_iter, iters);
  if (a.info) a.info[b] = iters | (st == 1 ? mhc::kInfoConverged : 0);
}

template <int N, typename S>
__global__ void __launch_bounds__(kThreads)
    birkhoff_bwd_thread(const S* t, const S* g, S* da, int64_t batch) {
  const int64_t b = blockIdx.x * int64_t(kThreads) + threadIdx.x;
  if (b >= batch) return;
  constexpr int E = N * N;
  if constexpr (E % 4 == 0 && sizeof(S) == 4) {
    float tt[E], gg[E], out[E];
#pragma unroll
    for (int q = 0; q < E / 4; ++q) {
      ldg_f4(t + b * E + 4 * q, tt + 4 * q);
      ldg_f4(g + b * E + 4 * q, gg + 4 * q);
    }
    mhc::vjp_matrix<N, float>(tt, gg, out);
#pragma unroll
    for (int q = 0; q < E / 4; ++q) st_f4(da + b * E + 4 * q, out + 4 * q);
  } else {
    mhc::vjp_matrix<N, S>(t + b * E, g + b * E, da + b * E);
  }
}

inline unsigned blocks_for(int64_t work, int per_block) {
  return unsigned((work + per_block - 1) / per_block);
}

// Stage 2 after an fp32 stage 1 of either layout (which started from a zeroed count).
template <int N>
void launch_fallback(const FwdArgs& a, cudaStream_t stream) {
  const unsigned grid = blocks_for(a.batch, kThreads);
  const unsigned fb_grid = grid < 528u ? grid : 528u;
  birkhoff_fwd_fallback<N><<<fb_grid, kThreads, 0, stream>>>(a);
}

// Stage 2 of the layouts "thread-wave" (UPDATE false: bitwise the default's results) and
// "thread-fb2*" (UPDATE true): a grid of exactly one wave of resident blocks. The fixed 528
// blocks above (4 per SM on 132 SMs) do not fit at once when a block needs more than a
// quarter of an SM's registers (the default n = 4 kernel: 164 registers x 128 threads -> 3
// blocks per SM), so the strided work of the last 132 blocks runs as a second wave after
// the first 396: ~2x the time of one wave for 1.33x the blocks. Each matrix is solved
// independently, so the grid changes no result. The occupancy is read once per process
// (first device used; every GPU of a host is the same model here).
template <int N, bool UPDATE, int MIN_BLOCKS, bool LSP = false>
void launch_fallback_wave(const FwdArgs& a, cudaStream_t stream) {
  static int resident = 0;  // blocks per SM x SMs
  if (resident == 0) {
    int dev = 0, sms = 0, per_sm = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, birkhoff_fwd_fallback<N, UPDATE, MIN_BLOCKS, LSP>, kThreads, 0);
    resident = (sms > 0 ? sms : 132) * (per_sm > 0 ? per_sm : 1);
  }
  const unsigned grid = blocks_for(a.batch, kThreads);
  const unsigned fb_grid = grid < unsigned(resident) ? grid : unsigned(resident);
  birkhoff_fwd_fallback<N, UPDATE, MIN_BLOCKS, LSP><<<fb_grid, kThreads, 0, stream>>>(a);
}

// Float64-stage variants of the fp32 forward (launch_fwd's FB; layouts in cuda_module.cu).
constexpr int kFbDefault = 0;     // "thread": launch_fallback
constexpr int kFbWave = 1;        // "thread-wave": default polish, one-wave grid
constexpr int kFbUpdate = 2;      // "thread-fb2": plan-updating polish, one-wave grid
constexpr int kFbUpdateOcc3 = 3;  // "thread-fb2-occ3": the same, 3 blocks per SM
constexpr int kFbUpdateLsp = 4;   // "thread-c10ls": kFbUpdate with the one-log1p search

// FB: the float64 stage's variant (kFb*), CONT_RANGE, LSP, FLAT: stage 1's
// (birkhoff_fwd_f32_thread); only n = 4 instantiates other values than the defaults.
template <int N, int FB = kFbDefault, int CONT_RANGE = 0, bool LSP = false, bool FLAT = false>
void launch_fwd(const FwdArgs& a, int dtype, cudaStream_t stream) {
  if (a.batch == 0) return;
  const unsigned grid = blocks_for(a.batch, kThreads);
  if (dtype == 1) {
    birkhoff_fwd_f64_thread<N><<<grid, kThreads, 0, stream>>>(a);
    return;
  }
  cudaMemsetAsync(a.work, 0, sizeof(int), stream);
  birkhoff_fwd_f32_thread<N, CONT_RANGE, LSP, FLAT><<<grid, kThreads, 0, stream>>>(a);
  if constexpr (FB == kFbWave)
    launch_fallback_wave<N, false, 0>(a, stream);
  else if constexpr (FB == kFbUpdate)
    launch_fallback_wave<N, true, 0>(a, stream);
  else if constexpr (FB == kFbUpdateOcc3)
    launch_fallback_wave<N, true, 3>(a, stream);
  else if constexpr (FB == kFbUpdateLsp)
    launch_fallback_wave<N, true, 0, true>(a, stream);
  else
    launch_fallback<N>(a, stream);
}

template <int N>
void launch_bwd(const void* t, const void* g, void* da, int64_t batch, int dtype,
                cudaStream_t stream) {
  if (batch == 0) return;
  const unsigned grid = blocks_for(batch, kThreads);
  if (dtype == 1)
    birkhoff_bwd_thread<N, double><<<grid, kThreads, 0, stream>>>(
        static_cast<const double*>(t), static_cast<const double*>(g), static_cast<double*>(da),
        batch);
  else
    birkhoff_bwd_thread<N, float><<<grid, kThreads, 0, stream>>>(
        static_cast<const float*>(t), static_cast<const float*>(g), static_cast<float*>(da),
        batch);
}

}  // namespace mhc_cuda
