// CUDA kernels of the hyper-connection layer around the mixing GEMM (hc_layer.h has the
// math; cuda_hc.cu the launchers and bindings). The stream is bf16 or float32, row-major
// (T tokens, n rows, C columns); every map is float32.
//
// Two kinds of kernels, both reading each stream element once:
// - row kernels (one block of kRowThreads per token) where a token needs a reduction over
//   its whole stream: hc_pre_fwd (sum of squares -> inv_r -> maps -> y = H_pre x; the
//   token's n x C row is staged in shared memory with cp.async between the two passes),
//   hc_post_bwd (dL/dH_res, dL/dH_post, g_f), hc_pre_bwd_reduce (dL/dH_pre, then the maps'
//   backward);
// - element kernels (one thread per V consecutive columns of one token, all n rows):
//   hc_post_fwd (out = H_post f + H_res x) and hc_pre_bwd (the stream's gradient).
// Reductions are warp butterflies then a fixed-order sum over warps: no atomics, the same
// result every run. V = 16 / sizeof(E) uses 16-byte accesses (C % V == 0 and 16-byte
// aligned pointers), V = 1 is the scalar path for any C.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <cstring>

#include "hc_layer.h"

namespace mhc_hc {

constexpr int kRowThreads = 128;
constexpr int kElemThreads = 256;

// ---------------------------------------------------------------- element access
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename E>
__device__ __forceinline__ E from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// V consecutive elements at p as floats (V > 1: one 16-byte load, p 16-byte aligned).
// LDG: through the read-only path (inputs of the kernel, never written by it); else a
// plain load (shared memory).
template <typename E, int V, bool LDG = true>
__device__ __forceinline__ void load_v(const E* p, float (&o)[V]) {
  if constexpr (V == 1) {
    o[0] = to_f(LDG ? __ldg(p) : *p);
  } else if constexpr (sizeof(E) == 4) {
    static_assert(V == 4, "float32: 4 per 16 bytes");
    const float4 q = LDG ? __ldg(reinterpret_cast<const float4*>(p))
                         : *reinterpret_cast<const float4*>(p);
    o[0] = q.x;
    o[1] = q.y;
    o[2] = q.z;
    o[3] = q.w;
  } else {
    static_assert(V == 8, "bf16: 8 per 16 bytes");
    const uint4 q = LDG ? __ldg(reinterpret_cast<const uint4*>(p))
                        : *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // element 2i in the low half (little-endian)
      o[2 * i] = __uint_as_float(w[i] << 16);
      o[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
}

template <typename E, int V>
__device__ __forceinline__ void store_v(E* p, const float (&v)[V]) {
  if constexpr (V == 1) {
    *p = from_f<E>(v[0]);
  } else if constexpr (sizeof(E) == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
      std::memcpy(&w[i], &h, 4);
    }
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
#else
  *reinterpret_cast<uint4*>(smem) = __ldg(reinterpret_cast<const uint4*>(gmem));
#endif
}
__device__ __forceinline__ void cp_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
#endif
}

// Sums each of the K per-thread values over the block; afterwards red[q] holds sum q for
// every thread. Lane order and warp order are fixed, so the result is the same every run.
template <int K>
__device__ __forceinline__ void block_sum(float (&v)[K], float* scratch /* warps*K */,
                                          float* red /* K */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  constexpr int kWarps = kRowThreads / 32;
#pragma unroll
  for (int q = 0; q < K; ++q) {
    float s = v[q];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) scratch[warp * K + q] = s;
  }
  __syncthreads();
  for (int q = threadIdx.x; q < K; q += kRowThreads) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += scratch[w * K + q];
    red[q] = s;
  }
  __syncthreads();
}

// ---------------------------------------------------------------- arguments
struct PreFwdArgs {
  const void* x;      // (T, n, C)
  const float* mix;   // (T, parts * M): the GEMM output, parts summed here
  int parts;
  const float* alpha;  // (3,): alpha_pre, alpha_post, alpha_res
  const float* bias;   // (M,)
  void* y;             // (T, C)
  float* maps;         // (T, 2n): H_pre, H_post
  float* lres;         // (T, n, n): residual logits (the projection's input)
  float* inv_r;        // (T,)
  int64_t T, C;
  float rms_eps, pre_eps, post_mult;
};

struct PostBwdArgs {
  const void* gout;   // (T, n, C)
  const void* x;      // (T, n, C)
  const void* f;      // (T, C)
  const float* maps;  // (T, 2n)
  void* gf;           // (T, C)
  float* g_hpost;     // (T, n)
  float* g_hres;      // (T, n, n)
  int64_t T, C;
};

struct PreBwdReduceArgs {
  const void* gy;        // (T, C)
  const void* x;         // (T, n, C)
  const float* maps;     // (T, 2n)
  const float* g_maps;   // (T, 2n): dL/dH_pre from outside the layer's own use, dL/dH_post
  const float* g_lres;   // (T, n, n)
  const float* mix;      // (T, parts * M)
  int parts;
  const float* inv_r;  // (T,)
  const float* alpha;  // (3,)
  float* g_logit;      // (T, M): dL/dl (its column sums are dL/dbias)
  float* g_mix;        // (T, M): dL/dh, the GEMM's output gradient
  float* g_alpha;      // (T, 3): per-token parts of dL/dalpha
  float* coef;         // (T,): dL/dx gets coef * (inv_r x) from inv_r
  int64_t T, C;
  float pre_eps, post_mult;
};

// ---------------------------------------------------------------- row kernels
// y = H_pre x with the maps, one block per token. STAGE: the row goes to shared memory
// (dynamic, n C sizeof(E) bytes) by cp.async and both passes read it there; else the
// second pass reads global memory again (rows too large to stage).
template <typename E, int N, int V, bool STAGE>
__global__ void __launch_bounds__(kRowThreads) hc_pre_fwd_kernel(PreFwdArgs a) {
  extern __shared__ uint4 smem_row[];
  __shared__ float scratch[kRowThreads / 32], red[1], hpre[N];
  constexpr int M = N * N + 2 * N;
  const int64_t t = blockIdx.x;
  const int64_t C = a.C, vecs = N * C / V;
  const E* xr = static_cast<const E*>(a.x) + t * N * C;
  const E* src = xr;
  if constexpr (STAGE) {
    E* srow = reinterpret_cast<E*>(smem_row);
    for (int64_t v = threadIdx.x; v < vecs; v += kRowThreads) {
      if constexpr (V > 1)
        cp_async16(srow + v * V, xr + v * V);
      else
        srow[v] = xr[v];
    }
    cp_async_wait_all();
    __syncthreads();
    src = srow;
  }
  float ss[1] = {0.0f};
  for (int64_t v = threadIdx.x; v < vecs; v += kRowThreads) {
    float q[V];
    load_v<E, V, !STAGE>(src + v * V, q);
#pragma unroll
    for (int e = 0; e < V; ++e) ss[0] = fmaf(q[e], q[e], ss[0]);
  }
  block_sum<1>(ss, scratch, red);
  float inv_r = mhc::hc_inv_rms(red[0], N * C, a.rms_eps);
  if (!(red[0] <= FLT_MAX)) {  // overflowed (block-uniform: red is shared); rare
    float s2[1] = {0.0f};
    for (int64_t v = threadIdx.x; v < vecs; v += kRowThreads) {
      float q[V];
      load_v<E, V, !STAGE>(src + v * V, q);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float z = q[e] * mhc::kRmsScale;
        s2[0] = fmaf(z, z, s2[0]);
      }
    }
    block_sum<1>(s2, scratch, red);
    inv_r = mhc::hc_inv_rms_scaled(red[0], N * C, a.rms_eps);
  }
  if (threadIdx.x == 0) a.inv_r[t] = inv_r;
  if (threadIdx.x < M) {
    const int m = threadIdx.x;
    float mix = a.mix[t * a.parts * M + m];
    if (a.parts == 2) mix += a.mix[t * a.parts * M + M + m];
    float* maps = a.maps + t * 2 * N;
    mhc::hc_map_forward(m, N, mix, a.alpha[mhc::hc_group(m, N)], a.bias[m], inv_r, a.pre_eps,
                        a.post_mult, maps, a.lres + t * N * N);
    if (m < N) hpre[m] = maps[m];
  }
  __syncthreads();
  E* __restrict__ y = static_cast<E*>(a.y) + t * C;
  for (int64_t cv = threadIdx.x; cv < C / V; cv += kRowThreads) {
    float acc[V] = {};
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float q[V];
      load_v<E, V, !STAGE>(src + k * C + cv * V, q);
#pragma unroll
      for (int e = 0; e < V; ++e) acc[e] = fmaf(hpre[k], q[e], acc[e]);
    }
    store_v<E, V>(y + cv * V, acc);
  }
}

// dL/dH_res[i][j] = <g_out_i, x_j>, dL/dH_post[i] = <g_out_i, f>, g_f = sum_i H_post_i g_out_i.
template <typename E, int N, int V>
__global__ void __launch_bounds__(kRowThreads) hc_post_bwd_kernel(PostBwdArgs a) {
  constexpr int K = N * N + N;
  __shared__ float scratch[(kRowThreads / 32) * K], red[K];
  const int64_t t = blockIdx.x, C = a.C;
  // restrict: the loads of the next columns may move above the store of g_f
  const E* __restrict__ go = static_cast<const E*>(a.gout) + t * N * C;
  const E* __restrict__ xr = static_cast<const E*>(a.x) + t * N * C;
  const E* __restrict__ fr = static_cast<const E*>(a.f) + t * C;
  E* __restrict__ gf = static_cast<E*>(a.gf) + t * C;
  float hp[N];
#pragma unroll
  for (int i = 0; i < N; ++i) hp[i] = __ldg(a.maps + t * 2 * N + N + i);
  float acc[K] = {};  // [i * N + j]: res, then [N * N + i]: post
  for (int64_t cv = threadIdx.x; cv < C / V; cv += kRowThreads) {
    const int64_t c = cv * V;
    float g[N][V], fv[V], gfv[V] = {};
    load_v<E, V>(fr + c, fv);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      load_v<E, V>(go + i * C + c, g[i]);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        gfv[e] = fmaf(hp[i], g[i][e], gfv[e]);
        acc[N * N + i] = fmaf(g[i][e], fv[e], acc[N * N + i]);
      }
    }
    store_v<E, V>(gf + c, gfv);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      float xv[V];
      load_v<E, V>(xr + j * C + c, xv);
#pragma unroll
      for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < V; ++e) acc[i * N + j] = fmaf(g[i][e], xv[e], acc[i * N + j]);
    }
  }
  block_sum<K>(acc, scratch, red);
  for (int q = threadIdx.x; q < K; q += kRowThreads) {
    if (q < N * N)
      a.g_hres[t * N * N + q] = red[q];
    else
      a.g_hpost[t * N + q - N * N] = red[q];
  }
}

// dL/dH_pre[k] = <g_y, x_k> (+ the gradient of H_pre from outside the layer), then the
// maps' backward for the token.
template <typename E, int N, int V>
__global__ void __launch_bounds__(kRowThreads) hc_pre_bwd_reduce_kernel(PreBwdReduceArgs a) {
  constexpr int M = N * N + 2 * N;
  __shared__ float scratch[(kRowThreads / 32) * N], red[N], part[M];
  const int64_t t = blockIdx.x, C = a.C;
  const E* __restrict__ gy = static_cast<const E*>(a.gy) + t * C;
  const E* __restrict__ xr = static_cast<const E*>(a.x) + t * N * C;
  float acc[N] = {};
  for (int64_t cv = threadIdx.x; cv < C / V; cv += kRowThreads) {
    float g[V];
    load_v<E, V>(gy + cv * V, g);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float q[V];
      load_v<E, V>(xr + k * C + cv * V, q);
#pragma unroll
      for (int e = 0; e < V; ++e) acc[k] = fmaf(g[e], q[e], acc[k]);
    }
  }
  block_sum<N>(acc, scratch, red);
  if (threadIdx.x < N) red[threadIdx.x] += a.g_maps[t * 2 * N + threadIdx.x];
  __syncthreads();
  const float inv_r = a.inv_r[t];
  if (threadIdx.x < M) {
    const int m = threadIdx.x;
    float mix = a.mix[t * a.parts * M + m];
    if (a.parts == 2) mix += a.mix[t * a.parts * M + M + m];
    const float gl = mhc::hc_map_backward(m, N, a.maps + t * 2 * N, red,
                                          a.g_maps + t * 2 * N + N, a.g_lres + t * N * N,
                                          a.pre_eps, a.post_mult);
    const float alpha = a.alpha[mhc::hc_group(m, N)];
    a.g_logit[t * M + m] = gl;
    a.g_mix[t * M + m] = gl * alpha * inv_r;
    // dl_m / dalpha = h_m inv_r; dl_m / dinv_r = alpha h_m: both parts from the normalised
    // h_m inv_r (finite for a stream near FLT_MAX, where h_m alone is ~1e37)
    part[m] = gl * (mix * inv_r);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float ga[3] = {0.0f, 0.0f, 0.0f}, g_inv_r_r = 0.0f;  // dL/dinv_r * inv_r
    for (int m = 0; m < M; ++m) {
      const int g = mhc::hc_group(m, N);
      ga[g] += part[m];
      g_inv_r_r = fmaf(a.alpha[g], part[m], g_inv_r_r);
    }
#pragma unroll
    for (int g = 0; g < 3; ++g) a.g_alpha[t * 3 + g] = ga[g];
    // inv_r = (S / (n C) + eps)^(-1/2): d inv_r / dx = -inv_r^3 x / (n C). dL/dx gets
    // coef * (inv_r x): inv_r^3 x as inv_r^2 (inv_r x), so that a stream near FLT_MAX
    // (inv_r ~1e-38: inv_r^2 underflows) keeps the term
    a.coef[t] = -g_inv_r_r * inv_r / float(N * C);
  }
}

// ---------------------------------------------------------------- element kernels
// out[i] = H_post[i] f + sum_j H_res[i][j] x[j] for V columns of one token.
template <typename E, int N, int V>
__global__ void __launch_bounds__(kElemThreads)
    hc_post_fwd_kernel(const E* __restrict__ x, const E* __restrict__ f,
                       const float* __restrict__ maps, const float* __restrict__ hres,
                       E* __restrict__ out, int64_t T, int64_t C) {
  const int64_t slots = C / V;
  const int64_t s = blockIdx.x * int64_t(kElemThreads) + threadIdx.x;
  if (s >= T * slots) return;
  const int64_t t = s / slots, c = (s - t * slots) * V;
  float xv[N][V], fv[V];
  load_v<E, V>(f + t * C + c, fv);
#pragma unroll
  for (int j = 0; j < N; ++j) load_v<E, V>(x + (t * N + j) * C + c, xv[j]);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float hp = __ldg(maps + t * 2 * N + N + i);
    float h[N];
#pragma unroll
    for (int j = 0; j < N; ++j) h[j] = __ldg(hres + (t * N + i) * N + j);
    float o[V];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      float acc = hp * fv[e];
#pragma unroll
      for (int j = 0; j < N; ++j) acc = fmaf(h[j], xv[j][e], acc);
      o[e] = acc;
    }
    store_v<E, V>(out + (t * N + i) * C + c, o);
  }
}

// g_x[k] = H_pre[k] g_y + sum_i H_res[i][k] g_out[i] + coef (inv_r x[k]) + gx[k],
// gx = g_mix phi^T (the GEMM's share, computed by cuBLAS before this kernel).
template <typename E, int N, int V>
__global__ void __launch_bounds__(kElemThreads)
    hc_pre_bwd_kernel(const E* __restrict__ gout, const E* __restrict__ gy,
                      const E* __restrict__ gx, const E* __restrict__ x,
                      const float* __restrict__ maps, const float* __restrict__ hres,
                      const float* __restrict__ coef, const float* __restrict__ inv_r,
                      E* __restrict__ g_x, int64_t T, int64_t C) {
  const int64_t slots = C / V;
  const int64_t s = blockIdx.x * int64_t(kElemThreads) + threadIdx.x;
  if (s >= T * slots) return;
  const int64_t t = s / slots, c = (s - t * slots) * V;
  float g[N][V], gyv[V];
  load_v<E, V>(gy + t * C + c, gyv);
#pragma unroll
  for (int i = 0; i < N; ++i) load_v<E, V>(gout + (t * N + i) * C + c, g[i]);
  const float cf = __ldg(coef + t), r = __ldg(inv_r + t);
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const float hp = __ldg(maps + t * 2 * N + k);
    float h[N];
#pragma unroll
    for (int i = 0; i < N; ++i) h[i] = __ldg(hres + (t * N + i) * N + k);
    float xv[V], gxv[V], o[V];
    load_v<E, V>(x + (t * N + k) * C + c, xv);
    load_v<E, V>(gx + (t * N + k) * C + c, gxv);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      float acc = hp * gyv[e];
#pragma unroll
      for (int i = 0; i < N; ++i) acc = fmaf(h[i], g[i][e], acc);
      acc = fmaf(cf, r * xv[e], acc);
      o[e] = acc + gxv[e];
    }
    store_v<E, V>(g_x + (t * N + k) * C + c, o);
  }
}

}  // namespace mhc_hc
