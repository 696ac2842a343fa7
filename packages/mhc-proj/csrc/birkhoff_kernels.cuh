// CUDA kernels of the Birkhoff projection, one thread per matrix, and their launchers:
// cuda_module.cu instantiates them for n = 4 (the flat solve), cuda_generic_n.cu for the
// other n (the generic solve). Launchers take raw pointers, sizes and a stream; nothing here
// synchronizes the host, so every launch is capturable in a CUDA graph.
//
// Forward of a float32 batch: stage 1 solves every matrix in float32 and appends the ones
// that did not converge or are ill-conditioned to a device-side work list (atomicAdd); stage
// 2 is a fixed grid that strides over the device-side count and re-solves those in float64
// from the input (warm-started from their float32 potentials). float64 batches: one float64
// solve per thread. Backward: the implicit VJP (vjp.h), memory-bound.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "newton.h"
#include "vjp.h"

namespace mhc_cuda {

constexpr int kThreads = 128;

struct FwdArgs {
  const void* src;
  void* dst;
  int* info;  // may be null
  int* work;  // [0] = count of matrices for the fallback, [1..B] their indices, then
              // B x N floats: fp32 potentials of each listed matrix (NaN: solve from scratch)
  int64_t batch;
  double tol;  // the float32 stage's tolerance and the certificate of the stored T
  int max_iter;
  double fb_tol;  // the float64 stage's tolerance (the caller passes min(FALLBACK_TOL, tol))
  int fb_max_iter;
  double pivot_min;
  double range_tol;  // float64 inputs: tolerance floor per unit of logit range (0: none)
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

// The info word's flags for a final status (converged / infeasible).
__device__ __forceinline__ int status_flags(int st) {
  return st == mhc::kStatusConverged ? mhc::kInfoConverged
         : st == mhc::kStatusInfeasible ? mhc::kInfoInfeasible
                                        : 0;
}

// The solve each n runs (newton.h): the flat solve for the tuned n = 4 kernels.
template <int N>
constexpr mhc::Solve kSolve = N == 4 ? mhc::Solve::kFlat : mhc::Solve::kGeneric;

// ---------------------------------------------------------------- kernels
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
  if (st == mhc::kStatusNotConverged || st == mhc::kStatusPolish) {
    const int k = atomicAdd(a.work, 1);
    a.work[1 + k] = int(b);
    float* wb = reinterpret_cast<float*>(a.work + 1 + a.batch) + int64_t(k) * N;
#pragma unroll
    for (int j = 0; j < N; ++j) wb[j] = st == mhc::kStatusPolish ? beta[j] : NAN;
  }
  if (a.info) a.info[b] = iters | status_flags(st);
}

// Stage 1 (float32): one thread solves one matrix (16-byte loads and stores for n = 4).
// Matrices that did not converge (or are ill-conditioned) are appended to a work list.
// The flat solve is capped at 6 resident blocks of 128 per SM: 80 registers and 16 B of
// stack (left alone ptxas gives it 88 registers and 5 blocks; 7 blocks: 72 registers and
// 56 B of stack).
template <int N, mhc::Solve SOLVE = kSolve<N>>
__global__ void __launch_bounds__(kThreads, SOLVE == mhc::Solve::kFlat ? 6 : 0)
    birkhoff_fwd_f32_thread(FwdArgs a) {
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
  const int st = mhc::project_matrix<N, float, SOLVE>(in, out, float(a.tol), a.max_iter, iters,
                                                     a.tol, float(a.pivot_min), beta);
  fwd_emit<N>(a, b, st, iters, out, beta);
}

// Stage 2 (float64): the matrices on the work list, re-solved in double from the input.
// A fixed grid strides over the device-side count, so the host never reads it. The flat
// solve's polish updates its plans instead of recomputing 16 double exponentials per
// iteration (mhc::newton_step_update).
template <int N, mhc::Solve SOLVE = kSolve<N>>
__global__ void __launch_bounds__(kThreads) birkhoff_fwd_fallback(FwdArgs a) {
  const int count = *static_cast<volatile int*>(a.work);
  constexpr int E = N * N;
  for (int k = blockIdx.x * kThreads + threadIdx.x; k < count; k += gridDim.x * kThreads) {
    const int64_t b = a.work[1 + k];
    const float* src = static_cast<const float*>(a.src) + b * E;
    float* dst = static_cast<float*>(a.dst) + b * E;
    int iters = 0;
    const float* wb = reinterpret_cast<const float*>(a.work + 1 + a.batch) + int64_t(k) * N;
    // warm-started from the fp32 potentials, or from scratch (wb[0] NaN)
    const int st =
        mhc::polish_matrix<N, double, SOLVE>(src, dst, wb, a.fb_tol, a.fb_max_iter, iters, a.tol);
    if (a.info) {
      int total = (a.info[b] & 0xffff) + iters;
      total = total > 0xffff ? 0xffff : total;
      a.info[b] = total | mhc::kInfoFallback | status_flags(st);
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
                                                a.max_iter, iters, a.tol, 0.0, nullptr,
                                                a.range_tol);
  if (a.info) a.info[b] = iters | status_flags(st);
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

// Stage 2's grid. The generic solve: min(blocks, 528). The flat solve: exactly one wave of
// resident blocks (occupancy x SMs, read once per process on the first device used; every
// GPU of a host is the same model here), because its kernel (248 registers for n = 4) fits
// 2 blocks of 128 per SM, and a strided grid larger than one wave runs its last blocks as a
// second wave (~2x one block's time for the work of a few more blocks). Each matrix is solved independently, so the
// grid changes no result.
template <int N, mhc::Solve SOLVE>
void launch_fallback(const FwdArgs& a, cudaStream_t stream) {
  const unsigned grid = blocks_for(a.batch, kThreads);
  unsigned cap = 528u;
  if constexpr (SOLVE == mhc::Solve::kFlat) {
    static int resident = 0;  // blocks per SM x SMs
    if (resident == 0) {
      int dev = 0, sms = 0, per_sm = 0;
      cudaGetDevice(&dev);
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, birkhoff_fwd_fallback<N, SOLVE>,
                                                    kThreads, 0);
      resident = (sms > 0 ? sms : 132) * (per_sm > 0 ? per_sm : 1);
    }
    cap = unsigned(resident);
  }
  const unsigned fb_grid = grid < cap ? grid : cap;
  birkhoff_fwd_fallback<N, SOLVE><<<fb_grid, kThreads, 0, stream>>>(a);
}

// The forward of a batch: float64 (dtype 1) in one kernel; float32 in the two stages.
template <int N>
void launch_fwd(const FwdArgs& a, int dtype, cudaStream_t stream) {
  if (a.batch == 0) return;
  const unsigned grid = blocks_for(a.batch, kThreads);
  if (dtype == 1) {
    birkhoff_fwd_f64_thread<N><<<grid, kThreads, 0, stream>>>(a);
    return;
  }
  cudaMemsetAsync(a.work, 0, sizeof(int), stream);
  birkhoff_fwd_f32_thread<N><<<grid, kThreads, 0, stream>>>(a);
  launch_fallback<N, kSolve<N>>(a, stream);
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
