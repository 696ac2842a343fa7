// mhc_proj._cuda: CUDA kernels and their pybind11 bindings. Bindings take raw device
// pointers, sizes and a cudaStream_t as an integer (torch.cuda.current_stream().cuda_stream);
// no libtorch, static cudart, no host synchronization.
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "cuda_kernels.cuh"
#include "mhc_lane16.h"

namespace py = pybind11;

namespace mhc_cuda {
void generic_fwd(int n, const FwdArgs& a, int dtype, cudaStream_t s);
void generic_bwd(int n, const void* t, const void* g, void* da, int64_t batch, int dtype,
                 cudaStream_t s);

// ---------------------------------------------------------------- Sinkhorn-k, n = 4
// The published layout: 16 lanes per matrix (two matrices per warp), lane = 4 i + j holds
// one entry; row sums by __shfl_xor_sync over lanes 1, 2, column sums over 4, 8. No shared
// or global memory for intermediates. ITERS > 0: compile-time iteration count, the saved
// states of the backward stay in registers; ITERS == 0: run-time count (<= 64), states in
// local memory.
constexpr int kMaxSinkhornIters = 64;

__device__ __forceinline__ float row_sum16(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float col_sum16(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 4);
  return v + __shfl_xor_sync(0xffffffffu, v, 8);
}
__device__ __forceinline__ float row_max16(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float softmax16(float x) {
  const float m = row_max16(x);
  const float e = __expf(x - m);
  return e * __frcp_rn(row_sum16(e));
}

template <int ITERS>
__global__ void __launch_bounds__(256) sinkhorn4_fwd_lane(const float* __restrict__ src,
                                                          float* __restrict__ dst, int64_t batch,
                                                          int iters, float eps) {
  const int64_t gid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const bool valid = (gid >> 4) < batch;
  const float x = valid ? __ldg(src + gid) : 0.0f;
  float p = softmax16(x) + eps;
  const int steps = 2 * (ITERS > 0 ? ITERS : iters) - 1;
#pragma unroll
  for (int k = 0; k < steps; ++k) {
    const float s = (k & 1) ? row_sum16(p) : col_sum16(p);
    p = p * __frcp_rn(s + eps);
  }
  if (valid) dst[gid] = p;
}

template <int ITERS>
__global__ void __launch_bounds__(256) sinkhorn4_bwd_lane(const float* __restrict__ src,
                                                          const float* __restrict__ grad,
                                                          float* __restrict__ dst, int64_t batch,
                                                          int iters, float eps) {
  const int64_t gid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const bool valid = (gid >> 4) < batch;
  const float x = valid ? __ldg(src + gid) : 0.0f;
  float d = valid ? __ldg(grad + gid) : 0.0f;
  const float sm = softmax16(x);
  constexpr int kSlots = ITERS > 0 ? 2 * ITERS - 1 : 2 * kMaxSinkhornIters - 1;
  float states[kSlots];
  const int steps = 2 * (ITERS > 0 ? ITERS : iters) - 1;
  float p = sm + eps;
#pragma unroll
  for (int k = 0; k < steps; ++k) {
    states[k] = p;
    const float s = (k & 1) ? row_sum16(p) : col_sum16(p);
    p = p * __frcp_rn(s + eps);
  }
#pragma unroll
  for (int k = steps - 1; k >= 0; --k) {
    const float pk = states[k];
    const float s = (k & 1) ? row_sum16(pk) : col_sum16(pk);
    const float inv = __frcp_rn(s + eps);
    const float prod = d * (pk * inv);
    const float dot = (k & 1) ? row_sum16(prod) : col_sum16(prod);
    d = (d - dot) * inv;
  }
  const float dot = row_sum16(d * sm);
  if (valid) dst[gid] = sm * (d - dot);
}

// One 4 x 4 matrix as four 16-byte loads / stores (thread-per-matrix kernels).
__device__ __forceinline__ void ldg_4x4(const float* __restrict__ src, float (&m)[4][4]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) ldg_f4(src + 4 * q, m[q]);
}
__device__ __forceinline__ void st_4x4(float* dst, const float (&m)[4][4]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) st_f4(dst + 4 * q, m[q]);
}

// One thread per matrix, 16-byte loads and stores, the shared header's scalar code.
// SCALING = false: the iteration on the full 16-float state (mhc::sinkhorn_fwd_state,
// correctly rounded reciprocals, run-time loop; ITERS unused): variant 1 of sinkhorn_fwd,
// the default. SCALING = true: the scaling form (mhc::sinkhorn_fwd_scaling; the CPU module
// runs the same code with variant 2): P0 (16 floats) and the scaling vectors r, c (4 each)
// in registers; a step is one 4 x 4 mat-vec and 4 MUFU.RCP (no full-state rescale, no
// correctly rounded reciprocals), the same steps as sinkhorn4_bwd_thread's replay. ITERS > 0:
// compile-time count, straight-line code; ITERS == 0: run-time count. Variant 2 (opt-in
// until measured, see NOTES.md).
template <bool SCALING, int ITERS>
__global__ void __launch_bounds__(128) sinkhorn4_fwd_thread(const float* __restrict__ src,
                                                            float* __restrict__ dst,
                                                            int64_t batch, int iters, float eps) {
  const int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (b >= batch) return;
  float a[4][4], p[4][4];
  ldg_4x4(src + b * 16, a);
  if constexpr (SCALING)
    mhc::sinkhorn_fwd_scaling<4, float, ITERS>(a, p, iters, eps);
  else
    mhc::sinkhorn_fwd_state<4, float>(a, p, iters, eps);
  st_4x4(dst + b * 16, p);
}

// Thread-per-matrix backward (exact, of the truncated iteration): the shared header's
// recompute formulation, mhc::sinkhorn_vjp_scaling. It keeps the vector each step updates
// (4 floats per step instead of the 16-float state): for ITERS = 20 that is 39 x 4 = 156
// floats, in registers (every index is a compile-time constant after unrolling). One forward
// replay plus the reverse sweep; no shuffles. ITERS == 0: run-time count (<= 64), the vectors
// in local memory. Selected with variant = 1 of sinkhorn_bwd (see NOTES.md).
// MIN_BLOCKS: __launch_bounds__'s resident-blocks hint, 0 for none (variant 1: ptxas keeps
// all 156 floats in registers, 255 per thread, no spills; 2 blocks = 8 warps per SM, little
// latency hiding). 3 (variant 2, opt-in): at most 168 registers, 360 B of spill stores per
// thread to L1-resident local memory, 12 warps per SM; measured slower at B = 16M (4.31 vs
// 3.85 ms on the H200, run 4); at 1M faster in run 3 only (0.354 vs 0.422 ms; run 4: 0.342
// vs 0.330).
// RESCALED (variant 3, "thread-e", opt-in until measured): the same replay with the
// division-free reverse sweep of mhc::sinkhorn_vjp_rescaled (~36 instead of ~72 FP
// instructions per step; the CPU module runs the same code with its variant 3). ITERS = 20:
// 2888 SASS instructions (thread: 4224), 217 registers, no spills: still 2 blocks per SM.
// Variant 4 ("thread-e-occ3"): the same with MIN_BLOCKS = 3.
template <int ITERS, int MIN_BLOCKS = 0, bool RESCALED = false>
__global__ void __launch_bounds__(128, MIN_BLOCKS)
    sinkhorn4_bwd_thread(const float* __restrict__ src, const float* __restrict__ grad,
                         float* __restrict__ dst, int64_t batch, int iters, float eps) {
  const int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (b >= batch) return;
  float a[4][4], g[4][4];
  ldg_4x4(src + b * 16, a);
  ldg_4x4(grad + b * 16, g);
  constexpr int kSlots = ITERS > 0 ? 2 * ITERS - 1 : 2 * kMaxSinkhornIters - 1;
  float vec[kSlots][4];
  if constexpr (RESCALED)
    mhc::sinkhorn_vjp_rescaled<4, float, ITERS>(a, g, iters, eps, vec);
  else
    mhc::sinkhorn_vjp_scaling<4, float, ITERS>(a, g, iters, eps, vec);
  st_4x4(dst + b * 16, g);
}

// Reciprocal-form replay + rescaled reverse sweep (mhc::sinkhorn_vjp_recip; the CPU module
// runs the same code with its variant 4). KS = 0 (variant 5, "thread-r-occ3"): the 39 step
// vectors in registers, MIN_BLOCKS = 3 as thread-e-occ3. KS > 0 (variant 6, "thread-rs"):
// the first KS step vectors (written first by the replay, read last by the reverse sweep)
// in dynamic shared memory, one 16-byte slot per thread and step ([slot][thread]: a warp's
// STS.128 / LDS.128 touch 512 consecutive bytes, no bank conflicts), the other 39 - KS in
// registers; KS = 27 is 54 KB per block, so 4 blocks of 128 fit the 228 KB per SM, and
// MIN_BLOCKS = 4 caps the registers at 128: 16 warps per SM instead of 12. No
// __syncthreads: each thread reads only its own slots. ITERS == 0: run-time count (<= 64),
// the vectors in local memory.
constexpr int kSkThreads = 128;
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

// L2 prefetch of the line holding p (no register, no wait).
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

template <int ITERS, int MIN_BLOCKS, int KS>
__global__ void __launch_bounds__(kSkThreads, MIN_BLOCKS)
    sinkhorn4_bwd_recip(const float* __restrict__ src, const float* __restrict__ grad,
                        float* __restrict__ dst, int64_t batch, int iters, float eps) {
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
    mhc::sk_recip_replay<4, float, ITERS>(a, iters, eps, sm, p0, r, c, vec);
    ldg_4x4(grad + b * 16, g);  // after the replay: G is not live across it
    mhc::sk_recip_reverse<4, float, ITERS>(sm, p0, r, c, g, iters, vec);
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

// Variant 7, "thread-rp": mhc::sinkhorn_vjp_recip_pipe, two matrices in flight per thread
// (the reverse sweep of one interleaved with the replay of the next; the CPU module runs
// the same code with its variant 5). Persistent: 3 blocks of 128 per SM, thread t takes
// matrices t, t + T, t + 2T, ... (T = grid x 128). Slots 0..36 in shared memory (74 KB
// per block; 3 blocks fit 228 KB), 37..38 in registers; the mirrored slot mapping
// alternates per matrix (compile-time, two phases per loop trip). A and G of a phase are
// L2-prefetched one phase ahead. iters = 20 only (other counts: variant 6's kernels).
constexpr int kSkPipeStash = 37;
constexpr int kSkPipeBlocksPerSm = 3;

struct SkIoStrided {
  const float* src;
  const float* grad;
  float* dst;
  int64_t first, stride, n;
  __device__ __forceinline__ int64_t count() const { return n; }
  __device__ __forceinline__ int64_t at(int64_t i) const { return (first + i * stride) * 16; }
  __device__ __forceinline__ void load_a(int64_t i, float (&a)[4][4]) const {
    ldg_4x4(src + at(i), a);
    // load_a(i) runs in the phase before matrix i's reverse: prefetch matrix i + 1's A
    // (loaded one phase later) and G (two phases later), both 32-byte halves
    if (i + 1 < n) {
      const int64_t o = at(i + 1);
      prefetch_l2(src + o);
      prefetch_l2(src + o + 8);
      prefetch_l2(grad + o);
      prefetch_l2(grad + o + 8);
    }
  }
  __device__ __forceinline__ void load_g(int64_t i, float (&g)[4][4]) const {
    ldg_4x4(grad + at(i), g);
  }
  __device__ __forceinline__ void store(int64_t i, const float (&d)[4][4]) const {
    st_4x4(dst + at(i), d);
  }
};

template <int KS>
__global__ void __launch_bounds__(kSkThreads, kSkPipeBlocksPerSm)
    sinkhorn4_bwd_pipe(const float* __restrict__ src, const float* __restrict__ grad,
                       float* __restrict__ dst, int64_t batch, float eps) {
  const int64_t t = blockIdx.x * int64_t(kSkThreads) + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * kSkThreads;
  if (t >= batch) return;
  SkIoStrided io{src, grad, dst, t, stride, (batch - t + stride - 1) / stride};
  extern __shared__ float4 sk_stash[];
  SkVecStash<KS, 39> vec{sk_stash + threadIdx.x};
  mhc::sinkhorn_vjp_recip_pipe<4, float, 20>(io, 20, eps, vec);
}

// Opt-in to > 48 KB of dynamic shared memory (and the largest carveout), once per device.
template <typename K>
void sk_smem_opt_in(K* kernel, int bytes, unsigned& configured) {
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 32 && (configured & (1u << dev))) return;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                       cudaSharedmemCarveoutMaxShared);
  if (dev < 32) configured |= 1u << dev;
}

// Launches variant 5, 6 or 7 (iters != 20: the run-time-count kernel for all three).
void launch_sinkhorn_bwd_recip(int variant, const float* xs, const float* gs, float* out,
                               int64_t B, int iters, float eps, cudaStream_t s) {
  const unsigned tgrid = unsigned((B + kSkThreads - 1) / kSkThreads);
  if (variant == 7 && iters == 20) {
    constexpr int kBytes = kSkPipeStash * kSkThreads * int(sizeof(float4));
    auto* kernel = sinkhorn4_bwd_pipe<kSkPipeStash>;
    static unsigned configured = 0;  // bit d: device d done (the binding holds the GIL)
    sk_smem_opt_in(kernel, kBytes, configured);
    static int sms[32] = {0};
    int dev = 0;
    cudaGetDevice(&dev);
    int nsm = dev < 32 ? sms[dev] : 0;
    if (nsm == 0) {
      cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, dev);
      if (dev < 32) sms[dev] = nsm;
    }
    const int64_t resident = int64_t(nsm) * kSkPipeBlocksPerSm;
    const unsigned grid = unsigned(tgrid < resident ? tgrid : resident);
    kernel<<<grid, kSkThreads, kBytes, s>>>(xs, gs, out, B, eps);
    return;
  }
  if (variant == 7) variant = 6;  // other iteration counts: variant 6's kernels
  if (iters != 20) {
    sinkhorn4_bwd_recip<0, 0, 0><<<tgrid, kSkThreads, 0, s>>>(xs, gs, out, B, iters, eps);
  } else if (variant == 5) {
    sinkhorn4_bwd_recip<20, 3, 0><<<tgrid, kSkThreads, 0, s>>>(xs, gs, out, B, iters, eps);
  } else {
    constexpr int kBytes = kSkStash * kSkThreads * int(sizeof(float4));
    auto* kernel = sinkhorn4_bwd_recip<20, 4, kSkStash>;
    static unsigned configured = 0;  // bit d: device d done (the binding holds the GIL)
    sk_smem_opt_in(kernel, kBytes, configured);
    kernel<<<tgrid, kSkThreads, kBytes, s>>>(xs, gs, out, B, iters, eps);
  }
}

// ---------------------------------------------------------------- Birkhoff, n = 4, 16 lanes
// The published layout for the Newton forward and the implicit backward (layout code 0,
// opt-in: 5.9x slower forward, 2.6x slower backward than thread per matrix at B = 16M on
// the H200; see NOTES.md): mhc_lane16.h's algorithm with this policy. Lane
// l = 4 i + j of each half-warp holds entry (i, j) of one matrix (coalesced 4-byte loads
// and stores, 64 B per matrix); every shuffle, vote and reduction uses the half-warp's own
// mask and stays inside it, and all lanes of a matrix take the same branches (the values
// they branch on are bitwise equal), so the two matrices of a warp may diverge from each
// other but never a matrix from itself. Intermediates live in registers only.
constexpr int kLaneThreads = 256;

struct WarpHalf {
  using V = float;
  int lane;       // lane in the warp
  unsigned mask;  // the 16 lanes of this lane's matrix
  __device__ __forceinline__ WarpHalf()
      : lane(int(threadIdx.x & 31)), mask(0xffffu << (threadIdx.x & 16)) {}

  // v + partner's v, rounded as written (never contracted into an FMA: every lane must
  // compute the bitwise same sum)
  __device__ __forceinline__ float bfly_sum(float v, int m) const {
    return __fadd_rn(v, __shfl_xor_sync(mask, v, m));
  }
  __device__ __forceinline__ float bfly_max(float v, int m) const {
    return fmaxf(v, __shfl_xor_sync(mask, v, m));
  }
  __device__ __forceinline__ float row_sum(float v) const { return bfly_sum(bfly_sum(v, 1), 2); }
  __device__ __forceinline__ float col_sum(float v) const { return bfly_sum(bfly_sum(v, 4), 8); }
  __device__ __forceinline__ float row_max(float v) const { return bfly_max(bfly_max(v, 1), 2); }
  __device__ __forceinline__ float col_max(float v) const { return bfly_max(bfly_max(v, 4), 8); }
  __device__ __forceinline__ float all_max(float v) const { return col_max(row_max(v)); }
  __device__ __forceinline__ float row_xor(float v, int k) const {
    return __shfl_xor_sync(mask, v, k);
  }
  __device__ __forceinline__ float from_col(float v, int k) const {
    return __shfl_sync(mask, v, (lane & ~3) | k);
  }
  __device__ __forceinline__ float by_col(const float (&x)[4]) const {
    const int j = lane & 3;  // selects, not a register-array index (no local memory)
    float r = x[0];
    r = j == 1 ? x[1] : r;
    r = j == 2 ? x[2] : r;
    return j == 3 ? x[3] : r;
  }
  __device__ __forceinline__ float sel_col(float a, float b, int cols) const {
    return (cols >> (lane & 3)) & 1 ? a : b;
  }
  __device__ __forceinline__ float uni(float v) const { return v; }
  __device__ __forceinline__ bool all_finite(float v) const {
    return __all_sync(mask, mhc::m_finite(v)) != 0;
  }
};

// Stage 1 (fp32) in the 16-lane layout; the same outputs, info words and work-list entries
// as birkhoff_fwd_f32_thread<4>, so stage 2 (birkhoff_fwd_fallback<4>) is shared.
__global__ void __launch_bounds__(kLaneThreads) birkhoff4_fwd_f32_lane(FwdArgs a) {
  const int64_t gid = blockIdx.x * int64_t(kLaneThreads) + threadIdx.x;
  const int64_t b = gid >> 4;
  if (b >= a.batch) return;  // whole half-warps (16 divides the block): no shuffle partner leaves
  const WarpHalf l;
  const float x = __ldg(static_cast<const float*>(a.src) + gid);
  float t, beta;
  int iters = 0;
  const int st = mhc::lane16::project_matrix(l, x, t, beta, float(a.tol), a.max_iter, iters,
                                             float(a.pivot_min));
  static_cast<float*>(a.dst)[gid] = t;
  const int e = int(threadIdx.x & 15);  // 4 i + j
  if (st == 0 || st == 2) {             // uniform over the matrix's lanes
    int k = 0;
    if (e == 0) k = atomicAdd(a.work, 1);
    k = __shfl_sync(l.mask, k, l.lane & 16);
    if (e == 0) a.work[1 + k] = int(b);
    // lanes (0, j) hold beta_j: the potentials for the warm-started float64 polish
    float* wb = reinterpret_cast<float*>(a.work + 1 + a.batch) + int64_t(k) * 4;
    if (e < 4) wb[e] = st == 2 ? beta : NAN;
  }
  if (a.info && e == 0) a.info[b] = iters | (st == 1 ? mhc::kInfoConverged : 0);
}

__global__ void __launch_bounds__(kLaneThreads)
    birkhoff4_bwd_lane(const float* __restrict__ t, const float* __restrict__ g,
                       float* __restrict__ da, int64_t batch) {
  const int64_t gid = blockIdx.x * int64_t(kLaneThreads) + threadIdx.x;
  if ((gid >> 4) >= batch) return;
  const WarpHalf l;
  da[gid] = mhc::lane16::implicit_vjp(l, __ldg(t + gid), __ldg(g + gid));
}

// Layout codes of the bindings (Python: birkhoff.layout_code). 2..6: thread per matrix
// with another float64 stage (kFb* in cuda_kernels.cuh; n = 4 fp32 forward only, otherwise
// and for the backward the thread layout): 2 "thread-wave", 3 "thread-fb2", 4
// "thread-fb2-occ3", 5 "thread-c10" (thread-fb2 with the fp32 continuation from logit range
// 10 instead of 16), 6 "thread-c10ls" (thread-c10 whose line searches, fp32 and float64,
// evaluate the objective change with one log1p: mhc::armijo_log_sum), 7 "thread-flat"
// (thread-c10ls with one Newton loop for all continuation stages: mhc::newton_project_flat).
constexpr int kLayoutLane = 0;
constexpr int kLayoutThread = 1;
constexpr int kLayoutThreadWave = 2;
constexpr int kLayoutThreadFb2 = 3;
constexpr int kLayoutThreadFb2Occ3 = 4;
constexpr int kLayoutThreadC10 = 5;
constexpr int kLayoutThreadC10Ls = 6;
constexpr int kLayoutThreadFlat = 7;

void check_layout(int layout) {
  if (layout < kLayoutLane || layout > kLayoutThreadFlat)
    throw std::invalid_argument("birkhoff: layout must be 0 (16 lanes per matrix), 1 (thread "
                                "per matrix), 2..7 (thread per matrix, float64 stage and "
                                "continuation variants), got " +
                                std::to_string(layout));
}

void launch_fwd4_lane(const FwdArgs& a, cudaStream_t stream) {
  if (a.batch == 0) return;
  cudaMemsetAsync(a.work, 0, sizeof(int), stream);
  birkhoff4_fwd_f32_lane<<<blocks_for(a.batch * 16, kLaneThreads), kLaneThreads, 0, stream>>>(a);
  launch_fallback<4>(a, stream);
}

// ---------------------------------------------------------------- smoke
__global__ void copy_kernel(const float* src, float* dst, int64_t count) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < count) dst[i] = src[i];
}

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

}  // namespace mhc_cuda

using namespace mhc_cuda;

namespace {
cudaStream_t as_stream(std::uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }
template <typename T>
T* ptr(std::uintptr_t p) {
  return reinterpret_cast<T*>(p);
}
}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "mhc-proj CUDA kernels (raw pointers + stream, no libtorch)";
  m.def("device_count", []() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return n;
  });
  m.def(
      "smoke_copy",
      [](std::uintptr_t src, std::uintptr_t dst, int64_t count, std::uintptr_t stream) {
        if (count > 0)
          copy_kernel<<<unsigned((count + 255) / 256), 256, 0, as_stream(stream)>>>(
              ptr<const float>(src), ptr<float>(dst), count);
        check_launch("smoke_copy");
      },
      py::arg("src"), py::arg("dst"), py::arg("count"), py::arg("stream"));
  m.def(
      "birkhoff_fwd",
      [](std::uintptr_t src, std::uintptr_t dst, std::uintptr_t info, std::uintptr_t work,
         int64_t B, int n, int dtype, double tol, int max_iter, double fb_tol, int fb_max_iter,
         double pivot_min, std::uintptr_t stream, int layout) {
        check_layout(layout);
        FwdArgs a{ptr<const void>(src), ptr<void>(dst), ptr<int>(info), ptr<int>(work), B,
                  tol, max_iter, fb_tol, fb_max_iter, pivot_min};
        // the 16-lane layout exists for n = 4 fp32; other cases run the thread kernels.
        if (n == 4 && dtype == 0 && layout == kLayoutLane)
          launch_fwd4_lane(a, as_stream(stream));
        else if (n == 4 && layout == kLayoutThreadWave)
          launch_fwd<4, kFbWave>(a, dtype, as_stream(stream));
        else if (n == 4 && layout == kLayoutThreadFb2)
          launch_fwd<4, kFbUpdate>(a, dtype, as_stream(stream));
        else if (n == 4 && layout == kLayoutThreadFb2Occ3)
          launch_fwd<4, kFbUpdateOcc3>(a, dtype, as_stream(stream));
        else if (n == 4 && layout == kLayoutThreadC10)
          launch_fwd<4, kFbUpdate, 10>(a, dtype, as_stream(stream));
        else if (n == 4 && layout == kLayoutThreadC10Ls)
          launch_fwd<4, kFbUpdateLsp, 10, true>(a, dtype, as_stream(stream));
        else if (n == 4 && layout == kLayoutThreadFlat)
          launch_fwd<4, kFbUpdateLsp, 10, true, true>(a, dtype, as_stream(stream));
        else if (n == 4)
          launch_fwd<4>(a, dtype, as_stream(stream));
        else
          generic_fwd(n, a, dtype, as_stream(stream));
        check_launch("birkhoff_fwd");
      },
      py::arg("src"), py::arg("dst"), py::arg("info"), py::arg("work"), py::arg("batch"),
      py::arg("n"), py::arg("dtype"), py::arg("tol"), py::arg("max_iter"),
      py::arg("fallback_tol"), py::arg("fallback_max_iter"), py::arg("pivot_min"),
      py::arg("stream"), py::arg("layout") = kLayoutThread);
  m.def(
      "birkhoff_bwd",
      [](std::uintptr_t t, std::uintptr_t g, std::uintptr_t da, int64_t B, int n, int dtype,
         std::uintptr_t stream, int layout) {
        check_layout(layout);
        if (n == 4 && dtype == 0 && layout == kLayoutLane) {
          if (B > 0)
            birkhoff4_bwd_lane<<<blocks_for(B * 16, kLaneThreads), kLaneThreads, 0,
                                 as_stream(stream)>>>(ptr<const float>(t), ptr<const float>(g),
                                                      ptr<float>(da), B);
        } else if (n == 4)
          launch_bwd<4>(ptr<const void>(t), ptr<const void>(g), ptr<void>(da), B, dtype,
                        as_stream(stream));
        else
          generic_bwd(n, ptr<const void>(t), ptr<const void>(g), ptr<void>(da), B, dtype,
                      as_stream(stream));
        check_launch("birkhoff_bwd");
      },
      py::arg("t"), py::arg("grad"), py::arg("out"), py::arg("batch"), py::arg("n"),
      py::arg("dtype"), py::arg("stream"), py::arg("layout") = kLayoutThread);
  m.def(
      "sinkhorn_fwd",
      [](std::uintptr_t src, std::uintptr_t dst, int64_t B, int iters, double eps, int variant,
         std::uintptr_t stream) {
        if (iters < 1 || iters > kMaxSinkhornIters)
          throw std::invalid_argument("iters must be in 1..64 on CUDA, got " +
                                      std::to_string(iters));
        if (variant < 0 || variant > 2)
          throw std::invalid_argument("sinkhorn_fwd: variant must be 0 (16 lanes per matrix), "
                                      "1 (thread per matrix) or 2 (thread per matrix, scaling "
                                      "form), got " +
                                      std::to_string(variant));
        if (B == 0) return;
        const cudaStream_t s = as_stream(stream);
        const unsigned tgrid = unsigned((B + 127) / 128);
        if (variant == 2) {
          if (iters == 20)
            sinkhorn4_fwd_thread<true, 20><<<tgrid, 128, 0, s>>>(
                ptr<const float>(src), ptr<float>(dst), B, iters, float(eps));
          else
            sinkhorn4_fwd_thread<true, 0><<<tgrid, 128, 0, s>>>(
                ptr<const float>(src), ptr<float>(dst), B, iters, float(eps));
        } else if (variant == 1) {
          sinkhorn4_fwd_thread<false, 0><<<tgrid, 128, 0, s>>>(ptr<const float>(src),
                                                               ptr<float>(dst), B, iters,
                                                               float(eps));
        } else {
          const unsigned grid = unsigned((B * 16 + 255) / 256);
          if (iters == 20)
            sinkhorn4_fwd_lane<20><<<grid, 256, 0, s>>>(ptr<const float>(src), ptr<float>(dst),
                                                       B, iters, float(eps));
          else
            sinkhorn4_fwd_lane<0><<<grid, 256, 0, s>>>(ptr<const float>(src), ptr<float>(dst), B,
                                                      iters, float(eps));
        }
        check_launch("sinkhorn_fwd");
      },
      py::arg("src"), py::arg("dst"), py::arg("batch"), py::arg("iters"), py::arg("eps"),
      py::arg("variant"), py::arg("stream"));
  m.def(
      "sinkhorn_bwd",
      [](std::uintptr_t src, std::uintptr_t g, std::uintptr_t dst, int64_t B, int iters,
         double eps, int variant, std::uintptr_t stream) {
        if (iters < 1 || iters > kMaxSinkhornIters)
          throw std::invalid_argument("iters must be in 1..64 on CUDA, got " +
                                      std::to_string(iters));
        if (B == 0) return;
        const cudaStream_t s = as_stream(stream);
        if (variant >= 5 && variant <= 7) {
          launch_sinkhorn_bwd_recip(variant, ptr<const float>(src), ptr<const float>(g),
                                    ptr<float>(dst), B, iters, float(eps), s);
          check_launch("sinkhorn_bwd");
          return;
        }
        if (variant >= 1 && variant <= 4) {
          const unsigned tgrid = unsigned((B + 127) / 128);
          const float* xs = ptr<const float>(src);
          const float* gs = ptr<const float>(g);
          float* out = ptr<float>(dst);
          if (variant >= 3 && iters != 20)
            sinkhorn4_bwd_thread<0, 0, true><<<tgrid, 128, 0, s>>>(xs, gs, out, B, iters,
                                                                   float(eps));
          else if (variant == 3)
            sinkhorn4_bwd_thread<20, 0, true><<<tgrid, 128, 0, s>>>(xs, gs, out, B, iters,
                                                                    float(eps));
          else if (variant == 4)
            sinkhorn4_bwd_thread<20, 3, true><<<tgrid, 128, 0, s>>>(xs, gs, out, B, iters,
                                                                    float(eps));
          else if (iters != 20)
            sinkhorn4_bwd_thread<0><<<tgrid, 128, 0, s>>>(xs, gs, out, B, iters, float(eps));
          else if (variant == 1)
            sinkhorn4_bwd_thread<20, 0><<<tgrid, 128, 0, s>>>(xs, gs, out, B, iters, float(eps));
          else
            sinkhorn4_bwd_thread<20, 3><<<tgrid, 128, 0, s>>>(xs, gs, out, B, iters, float(eps));
          check_launch("sinkhorn_bwd");
          return;
        }
        if (variant != 0)
          throw std::invalid_argument("sinkhorn_bwd: variant must be 0 (16 lanes per matrix), "
                                      "1 (thread per matrix), 2 (thread, 3 blocks/SM), 3 "
                                      "(thread, rescaled adjoint), 4 (3, 3 blocks/SM), 5 (reciprocal replay, 3 "
                                      "blocks/SM), 6 (5 with a shared-memory stash, 4 "
                                      "blocks/SM) or 7 (6 as a two-matrix pipeline), got " +
                                      std::to_string(variant));
        const unsigned grid = unsigned((B * 16 + 255) / 256);
        if (iters == 20)
          sinkhorn4_bwd_lane<20><<<grid, 256, 0, s>>>(ptr<const float>(src), ptr<const float>(g),
                                                     ptr<float>(dst), B, iters, float(eps));
        else
          sinkhorn4_bwd_lane<0><<<grid, 256, 0, s>>>(ptr<const float>(src), ptr<const float>(g),
                                                    ptr<float>(dst), B, iters, float(eps));
        check_launch("sinkhorn_bwd");
      },
      py::arg("src"), py::arg("grad"), py::arg("out"), py::arg("batch"), py::arg("iters"),
      py::arg("eps"), py::arg("variant"), py::arg("stream"));
}
