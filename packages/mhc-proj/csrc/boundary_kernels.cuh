// CUDA kernels of the fused layer boundary (boundary.h has the math and the split / chunk
// scheme; boundary_n.cu instantiates them per n, cuda_boundary.cu has the bindings).
//
// bnd_fwd_kernel: one block per (tile of 128 tokens, split). Per chunk of W columns (all n
//   rows): the tile's x1 = post-mix of x and f, written once (x_next) and staged in shared
//   memory as bf16 (float32 streams: hi + lo), then h += x1 phi on tensor cores (wmma
//   16x16x16, bf16 operands, float32 accumulation; phi as hi + lo: 16 significant bits).
//   Writes the split's partial h per token; the pre kernel of hc_kernels.cuh then forms the
//   maps and y = H_pre x1.
// bnd_bwd_kernel: one block per (group of 256 tokens (128 for n > 4), split); chunks outer,
//   the group's tiles of 64 tokens inner, so each chunk of phi is loaded once per group and
//   dL/dphi's partial for the chunk stays in tensor-core accumulators over the group. Per
//   tile and chunk: g_h phi^T on tensor cores (g_h and phi as hi + lo), then per element the
//   whole dL/dx1, the post-mix's backward (dL/dx, dL/df written once) and dL/dH's partials
//   (kept in shared memory for the group's tokens), x1 recomputed from x and f and staged
//   for dL/dphi += x1^T g_h.
// Threads: 256; 4 consecutive lanes share one token's W columns of a chunk (W / 4 columns
// each, interleaved in vectors), so a token's sums are a fixed butterfly over those lanes plus a fixed order over
// chunks: no atomics, and nothing depends on the token's position or the batch size.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>
#include <cstring>

#include "boundary.h"

namespace mhc_bnd {

namespace wmma = nvcuda::wmma;
using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kLanesPerToken = 4;
constexpr int kFwdTile = 16 * kWarps;  // tokens per forward block: one row of tiles per warp
constexpr int kBwdTile = 64;           // tokens per backward tile
// tokens per backward block (its dL/dH accumulators live in shared memory)
__host__ __device__ constexpr int bwd_group(int n) { return n <= 4 ? 256 : 128; }
// The widest vector (elements) per access: BYTES bytes, at most the W / 4 columns of an
// item. The forward reads 16 bytes per access; the backward 8 (it holds n vectors of x and
// of the gradient at once: 16-byte vectors took 255 registers at n = 4, one block per SM).
template <typename E, int N, int BYTES>
__host__ __device__ constexpr int vmax() {
  return (BYTES / int(sizeof(E))) < mhc::bnd_width(N) / kLanesPerToken
             ? BYTES / int(sizeof(E))
             : mhc::bnd_width(N) / kLanesPerToken;
}
constexpr int kFwdVecBytes = 16, kBwdVecBytes = 8;

// ---------------------------------------------------------------- element access
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(bf16 v) { return __bfloat162float(v); }
template <typename E>
__device__ __forceinline__ float round_to(float v);
template <>
__device__ __forceinline__ float round_to<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float round_to<bf16>(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

// V consecutive elements at p (V sizeof(E) bytes, aligned to that) as floats.
template <typename E, int V>
__device__ __forceinline__ void load_v(const E* p, float (&o)[V]) {
  constexpr int kBytes = V * int(sizeof(E));
  if constexpr (V == 1) {
    o[0] = to_f(__ldg(p));
  } else {
    uint32_t w[kBytes / 4];
    if constexpr (kBytes == 16) {
      const uint4 q = __ldg(reinterpret_cast<const uint4*>(p));
      w[0] = q.x, w[1] = q.y, w[2] = q.z, w[3] = q.w;
    } else if constexpr (kBytes == 8) {
      const uint2 q = __ldg(reinterpret_cast<const uint2*>(p));
      w[0] = q.x, w[1] = q.y;
    } else {
      static_assert(kBytes == 4, "vector of 4, 8 or 16 bytes");
      w[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
    }
    if constexpr (sizeof(E) == 4) {
#pragma unroll
      for (int i = 0; i < V; ++i) o[i] = __uint_as_float(w[i]);
    } else {
#pragma unroll
      for (int i = 0; i < V / 2; ++i) {  // element 2i in the low half (little-endian)
        o[2 * i] = __uint_as_float(w[i] << 16);
        o[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
      }
    }
  }
}

template <typename E, int V>
__device__ __forceinline__ void store_v(E* p, const float (&v)[V]) {
  constexpr int kBytes = V * int(sizeof(E));
  if constexpr (V == 1) {
    if constexpr (sizeof(E) == 4)
      *reinterpret_cast<float*>(p) = v[0];
    else
      *reinterpret_cast<bf16*>(p) = __float2bfloat16_rn(v[0]);
  } else {
    uint32_t w[kBytes / 4];
    if constexpr (sizeof(E) == 4) {
#pragma unroll
      for (int i = 0; i < V; ++i) w[i] = __float_as_uint(v[i]);
    } else {
#pragma unroll
      for (int i = 0; i < V / 2; ++i) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
        std::memcpy(&w[i], &h, 4);
      }
    }
    if constexpr (kBytes == 16)
      *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    else if constexpr (kBytes == 8)
      *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
    else
      *reinterpret_cast<unsigned int*>(p) = w[0];
  }
}

// v = hi + lo, both bf16 (16 significant bits; hi alone is exact for a bf16 value)
__device__ __forceinline__ void split_bf16(float v, bf16& hi, bf16& lo) {
  hi = __float2bfloat16_rn(v);
  lo = __float2bfloat16_rn(v - __bfloat162float(hi));
}

// phi's chunk: rows k W + j (stream k, column c0 + j) of the padded (n, Cp, MP) halves
// into shared memory [K][LDP], 16-byte copies.
template <int N>
__device__ __forceinline__ void load_phi_chunk(const bf16* __restrict__ hi,
                                               const bf16* __restrict__ lo, int64_t Cp,
                                               int64_t c0, bf16* s_hi, bf16* s_lo, int ldp) {
  constexpr int W = mhc::bnd_width(N), K = N * W, MP = mhc::bnd_mpad(N);
  constexpr int kVecs = K * MP / 8;
  for (int v = threadIdx.x; v < kVecs; v += kThreads) {
    const int e = v / (MP / 8), m = (v % (MP / 8)) * 8;
    const int k = e / W, j = e % W;
    const int64_t src = (int64_t(k) * Cp + c0 + j) * MP + m;
    *reinterpret_cast<uint4*>(s_hi + e * ldp + m) = __ldg(reinterpret_cast<const uint4*>(hi + src));
    *reinterpret_cast<uint4*>(s_lo + e * ldp + m) = __ldg(reinterpret_cast<const uint4*>(lo + src));
  }
}

// ---------------------------------------------------------------- arguments
struct FwdArgs {
  const void* x;            // (T, n, C) the stream entering the boundary
  const void* f;            // (T, C) the sublayer's output (has_post)
  const float* maps_prev;   // (T, 2n): H_pre, H_post of the previous layer (has_post)
  const float* hres_prev;   // (T, n, n) (has_post)
  const bf16* phi_hi;       // (n, Cp, MP) the next layer's phi, padded, hi half (has_pre)
  const bf16* phi_lo;       // lo half
  void* x_next;             // (T, n, C) x1 (has_post)
  float* h_part;            // (S, T, M) partial h per split (has_pre)
  int64_t T, C, Cp, nchunks;
  int S, cps;
  bool has_post, has_pre;
};

struct BwdArgs {
  const void* x;           // (T, n, C)
  const void* f;           // (T, C) (has_post)
  const float* maps_prev;  // (T, 2n) (has_post)
  const float* hres_prev;  // (T, n, n) (has_post)
  const void* g_next;      // (T, n, C) dL/dx1 from the next boundary, or null (zero)
  const void* g_y;         // (T, C) (has_pre)
  const float* maps;       // (T, 2n) this boundary's maps: H_pre in the first n (has_pre)
  const float* coef;       // (T,) the RMS norm's coefficient (of inv_r x1) (has_pre)
  const float* inv_r;      // (T,) (has_pre)
  const float* g_mix;      // (T, M) dL/dh (has_pre)
  const bf16* phi_hi;      // (n, Cp, MP) (has_pre)
  const bf16* phi_lo;
  void* g_x;               // (T, n, C)
  void* g_f;               // (T, C) (has_post)
  float* dh_part;          // (S, T, n^2 + n): dL/dH_res, dL/dH_post per split (has_post)
  float* dphi_part;        // (groups, n, Cp, MP) dL/dphi per group of tokens (has_pre)
  int64_t T, C, Cp, nchunks;
  int S, cps;
  bool has_post, has_pre;
};

// shared-memory strides (elements): rows skewed by 16 bytes against bank conflicts, and
// every tile's 16-row block 32-byte aligned as wmma requires
template <int N>
struct Layout {
  static constexpr int W = mhc::bnd_width(N), K = N * W, M = N * N + 2 * N;
  static constexpr int MP = mhc::bnd_mpad(N), NMAP = N * N + N;
  static constexpr int LDA = K + 8;   // bf16 tiles of K columns
  static constexpr int LDP = MP + 8;  // bf16 tiles of MP columns
  static constexpr int LDG = K + 4;   // float tiles of K columns
  static constexpr int LDO = MP + 4;  // float tiles of MP columns
};

template <typename E, int N>
__host__ __device__ constexpr size_t fwd_smem_bytes() {
  using L = Layout<N>;
  constexpr bool kSplitX = sizeof(E) == 4;
  return size_t(2 * L::K * L::LDP + (kSplitX ? 2 : 1) * kFwdTile * L::LDA) * 2 +
         size_t(kFwdTile * L::NMAP) * 4;
}

template <typename E, int N>
__host__ __device__ constexpr size_t bwd_smem_bytes() {
  using L = Layout<N>;
  constexpr bool kSplitX = sizeof(E) == 4;
  constexpr int NTOK = L::NMAP + N + 2;
  return size_t(2 * L::K * L::LDP + 2 * kBwdTile * L::LDP + (kSplitX ? 2 : 1) * kBwdTile * L::LDA) *
             2 +
         size_t(kBwdTile * L::LDG + kBwdTile * NTOK + bwd_group(N) * L::NMAP) * 4;
}

// ---------------------------------------------------------------- forward
template <typename E, int N, int V>
__global__ void __launch_bounds__(kThreads, 2) bnd_fwd_kernel(FwdArgs a) {
  using L = Layout<N>;
  constexpr int W = L::W, K = L::K, M = L::M, MP = L::MP, NMAP = L::NMAP;
  constexpr int TM = kFwdTile, CPI = W / kLanesPerToken, NV = CPI / V;
  constexpr int ITEMS = TM * kLanesPerToken / kThreads;
  constexpr int MF = MP / 16;
  constexpr bool kSplitX = sizeof(E) == 4;
  static_assert(CPI % V == 0 && TM == 16 * kWarps, "tile geometry");
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* s_phi_hi = reinterpret_cast<bf16*>(smem);  // K x LDP
  bf16* s_phi_lo = s_phi_hi + K * L::LDP;
  bf16* s_a_hi = s_phi_lo + K * L::LDP;  // TM x LDA: x1 (hi)
  bf16* s_a_lo = s_a_hi + TM * L::LDA;   // (kSplitX)
  float* s_maps = reinterpret_cast<float*>(s_a_lo + (kSplitX ? TM * L::LDA : 0));  // TM x NMAP
  float* s_out = reinterpret_cast<float*>(smem);  // TM x LDO, over phi and x1 after the loop

  const int tid = threadIdx.x, warp = tid >> 5;
  const int64_t t0 = int64_t(blockIdx.x) * TM, T = a.T, C = a.C;
  const int s = blockIdx.y;
  const E* __restrict__ x = static_cast<const E*>(a.x);
  const E* __restrict__ f = static_cast<const E*>(a.f);
  E* __restrict__ x_next = static_cast<E*>(a.x_next);

  if (a.has_post) {
    for (int i = tid; i < TM * NMAP; i += kThreads) {
      const int tl = i / NMAP, q = i % NMAP;
      const int64_t t = t0 + tl;
      float v = 0.0f;
      if (t < T)
        v = q < N * N ? a.hres_prev[t * N * N + q] : a.maps_prev[t * 2 * N + N + (q - N * N)];
      s_maps[i] = v;
    }
  }
  __syncthreads();

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[MF];
#pragma unroll
  for (int j = 0; j < MF; ++j) wmma::fill_fragment(acc[j], 0.0f);

  int64_t first, last;
  mhc::bnd_split_chunks(s, a.cps, a.nchunks, first, last);
  for (int64_t ch = first; ch < last; ++ch) {
    const int64_t c0 = ch * W;
    if (a.has_pre) load_phi_chunk<N>(a.phi_hi, a.phi_lo, a.Cp, c0, s_phi_hi, s_phi_lo, L::LDP);
#pragma unroll
    for (int r = 0; r < ITEMS; ++r) {
      const int tl = tid / kLanesPerToken + r * (kThreads / kLanesPerToken);
      const int q = tid % kLanesPerToken;
      const int64_t t = t0 + tl;
      const float* mp = s_maps + tl * NMAP;
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        // column in the chunk: the token's 4 lanes read 4 V consecutive columns together
        const int jc = v * (kLanesPerToken * V) + q * V;
        const int64_t c = c0 + jc;
        float xv[N][V];
        if (t < T && c < C) {  // C % V == 0 on the vector path: a vector is all in or all out
#pragma unroll
          for (int j = 0; j < N; ++j) load_v<E, V>(x + (t * N + j) * C + c, xv[j]);
          if (a.has_post) {
            float fv[V];
            load_v<E, V>(f + t * C + c, fv);
#pragma unroll
            for (int e = 0; e < V; ++e) {
              float col[N];
#pragma unroll
              for (int j = 0; j < N; ++j) col[j] = xv[j][e];
#pragma unroll
              for (int i = 0; i < N; ++i)
                xv[i][e] = round_to<E>(mhc::bnd_post(N, mp + i * N, mp[N * N + i], col, fv[e]));
            }
#pragma unroll
            for (int i = 0; i < N; ++i) store_v<E, V>(x_next + (t * N + i) * C + c, xv[i]);
          }
        } else {
#pragma unroll
          for (int j = 0; j < N; ++j)
#pragma unroll
            for (int e = 0; e < V; ++e) xv[j][e] = 0.0f;
        }
        if (a.has_pre) {
#pragma unroll
          for (int k = 0; k < N; ++k)
#pragma unroll
            for (int e = 0; e < V; ++e) {
              bf16 hi, lo;
              split_bf16(xv[k][e], hi, lo);
              s_a_hi[tl * L::LDA + k * W + jc + e] = hi;
              if constexpr (kSplitX) s_a_lo[tl * L::LDA + k * W + jc + e] = lo;
            }
        }
      }
    }
    if (!a.has_pre) continue;  // the last layer's post-mix: nothing to multiply
    __syncthreads();
    // warp w: the tile's tokens 16 w .. 16 w + 15, every column block of h
#pragma unroll
    for (int ks = 0; ks < K / 16; ++ks) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> ah, al;
      wmma::load_matrix_sync(ah, s_a_hi + warp * 16 * L::LDA + ks * 16, L::LDA);
      if constexpr (kSplitX) wmma::load_matrix_sync(al, s_a_lo + warp * 16 * L::LDA + ks * 16, L::LDA);
#pragma unroll
      for (int j = 0; j < MF; ++j) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> bh, bl;
        wmma::load_matrix_sync(bh, s_phi_hi + ks * 16 * L::LDP + j * 16, L::LDP);
        wmma::load_matrix_sync(bl, s_phi_lo + ks * 16 * L::LDP + j * 16, L::LDP);
        wmma::mma_sync(acc[j], ah, bh, acc[j]);
        wmma::mma_sync(acc[j], ah, bl, acc[j]);
        if constexpr (kSplitX) wmma::mma_sync(acc[j], al, bh, acc[j]);
      }
    }
    __syncthreads();  // the next chunk overwrites phi and x1
  }
  if (!a.has_pre) return;
#pragma unroll
  for (int j = 0; j < MF; ++j)
    wmma::store_matrix_sync(s_out + warp * 16 * L::LDO + j * 16, acc[j], L::LDO, wmma::mem_row_major);
  __syncthreads();
  for (int i = tid; i < TM * M; i += kThreads) {
    const int tl = i / M, m = i % M;
    const int64_t t = t0 + tl;
    if (t < T) a.h_part[(int64_t(s) * T + t) * M + m] = s_out[tl * L::LDO + m];
  }
}

// ---------------------------------------------------------------- backward
template <typename E, int N, int V>
__global__ void __launch_bounds__(kThreads, 2) bnd_bwd_kernel(BwdArgs a) {
  using L = Layout<N>;
  constexpr int W = L::W, K = L::K, M = L::M, MP = L::MP, NMAP = L::NMAP;
  constexpr int NTOK = NMAP + N + 2;  // H_res, H_post (previous layer), H_pre, coef, inv_r
  constexpr int TM = kBwdTile, GT = bwd_group(N), CPI = W / kLanesPerToken, NV = CPI / V;
  constexpr int KF = K / 16, MF = MP / 16, TF = TM / 16;
  constexpr int NDF = KF * MF, DPW = (NDF + kWarps - 1) / kWarps;
  constexpr bool kSplitX = sizeof(E) == 4;
  static_assert(CPI % V == 0 && TM * kLanesPerToken == kThreads, "tile geometry");
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* s_phi_hi = reinterpret_cast<bf16*>(smem);  // K x LDP
  bf16* s_phi_lo = s_phi_hi + K * L::LDP;
  bf16* s_gm_hi = s_phi_lo + K * L::LDP;  // TM x LDP: g_h of the tile
  bf16* s_gm_lo = s_gm_hi + TM * L::LDP;
  bf16* s_x_hi = s_gm_lo + TM * L::LDP;  // TM x LDA: x1 of the tile
  bf16* s_x_lo = s_x_hi + TM * L::LDA;   // (kSplitX)
  float* s_gh = reinterpret_cast<float*>(s_x_lo + (kSplitX ? TM * L::LDA : 0));  // TM x LDG
  float* s_tok = s_gh + TM * L::LDG;  // TM x NTOK
  float* s_acc = s_tok + TM * NTOK;   // GT x NMAP: dL/dH of the group's tokens

  const int tid = threadIdx.x, warp = tid >> 5;
  const int tl = tid / kLanesPerToken, q = tid % kLanesPerToken;
  const int64_t g0 = int64_t(blockIdx.x) * GT, T = a.T, C = a.C;
  const int s = blockIdx.y;
  const E* __restrict__ x = static_cast<const E*>(a.x);
  const E* __restrict__ f = static_cast<const E*>(a.f);
  const E* __restrict__ g_next = static_cast<const E*>(a.g_next);
  const E* __restrict__ g_y = static_cast<const E*>(a.g_y);
  E* __restrict__ g_x = static_cast<E*>(a.g_x);
  E* __restrict__ g_f = static_cast<E*>(a.g_f);

  for (int i = tid; i < GT * NMAP; i += kThreads) s_acc[i] = 0.0f;

  int64_t first, last;
  mhc::bnd_split_chunks(s, a.cps, a.nchunks, first, last);
  for (int64_t ch = first; ch < last; ++ch) {
    const int64_t c0 = ch * W;
    if (a.has_pre) load_phi_chunk<N>(a.phi_hi, a.phi_lo, a.Cp, c0, s_phi_hi, s_phi_lo, L::LDP);
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> dacc[DPW];
#pragma unroll
    for (int d = 0; d < DPW; ++d) wmma::fill_fragment(dacc[d], 0.0f);

    for (int tile = 0; tile < GT / TM; ++tile) {
      const int64_t tt0 = g0 + int64_t(tile) * TM;
      if (tt0 >= T) break;  // the same for the whole block
      __syncthreads();      // the previous tile's readers are done; phi is in place
      for (int i = tid; i < TM * NTOK; i += kThreads) {
        const int r = i / NTOK, p = i % NTOK;
        const int64_t t = tt0 + r;
        float v = 0.0f;
        if (t < T) {
          if (p < N * N)
            v = a.has_post ? a.hres_prev[t * N * N + p] : 0.0f;
          else if (p < NMAP)
            v = a.has_post ? a.maps_prev[t * 2 * N + N + (p - N * N)] : 0.0f;
          else if (p < NMAP + N)
            v = a.has_pre ? a.maps[t * 2 * N + (p - NMAP)] : 0.0f;
          else if (p == NMAP + N)
            v = a.has_pre ? a.coef[t] : 0.0f;
          else
            v = a.has_pre ? a.inv_r[t] : 0.0f;
        }
        s_tok[i] = v;
      }
      if (a.has_pre) {
        for (int i = tid; i < TM * MP; i += kThreads) {
          const int r = i / MP, m = i % MP;
          const int64_t t = tt0 + r;
          const float v = (t < T && m < M) ? a.g_mix[t * M + m] : 0.0f;
          split_bf16(v, s_gm_hi[r * L::LDP + m], s_gm_lo[r * L::LDP + m]);
        }
      }
      __syncthreads();
      if (a.has_pre) {  // g_h phi^T for the tile and chunk (TM x K)
        for (int fi = warp; fi < TF * KF; fi += kWarps) {
          const int fr = fi % TF, fc = fi / TF;
          wmma::fragment<wmma::accumulator, 16, 16, 16, float> gh;
          wmma::fill_fragment(gh, 0.0f);
#pragma unroll
          for (int ks = 0; ks < MF; ++ks) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> ah, al;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> bh, bl;
            wmma::load_matrix_sync(ah, s_gm_hi + fr * 16 * L::LDP + ks * 16, L::LDP);
            wmma::load_matrix_sync(al, s_gm_lo + fr * 16 * L::LDP + ks * 16, L::LDP);
            // B(m, e) = phi[e][m], stored at s_phi[e LDP + m]: column-major
            wmma::load_matrix_sync(bh, s_phi_hi + fc * 16 * L::LDP + ks * 16, L::LDP);
            wmma::load_matrix_sync(bl, s_phi_lo + fc * 16 * L::LDP + ks * 16, L::LDP);
            wmma::mma_sync(gh, ah, bh, gh);
            wmma::mma_sync(gh, ah, bl, gh);
            wmma::mma_sync(gh, al, bh, gh);
          }
          wmma::store_matrix_sync(s_gh + fr * 16 * L::LDG + fc * 16, gh, L::LDG,
                                  wmma::mem_row_major);
        }
        __syncthreads();
      }
      // one item per thread: token tl of the tile, columns q CPI .. q CPI + CPI of the chunk
      const int64_t t = tt0 + tl;
      const float* tok = s_tok + tl * NTOK;
      const float* hres = tok;
      const float* hpost = tok + N * N;
      const float* hpre = tok + NMAP;
      const float cf = tok[NMAP + N], r = tok[NMAP + N + 1];
      float accd[NMAP];
#pragma unroll
      for (int p = 0; p < NMAP; ++p) accd[p] = 0.0f;
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        const int jc = v * (kLanesPerToken * V) + q * V;
        const int64_t c = c0 + jc;
        if (t < T && c < C) {
          float xv[N][V], gv[N][V], fv[V], gyv[V];
#pragma unroll
          for (int j = 0; j < N; ++j) {
            load_v<E, V>(x + (t * N + j) * C + c, xv[j]);
            if (g_next) {
              load_v<E, V>(g_next + (t * N + j) * C + c, gv[j]);
            } else {
#pragma unroll
              for (int e = 0; e < V; ++e) gv[j][e] = 0.0f;
            }
          }
          if (a.has_post) load_v<E, V>(f + t * C + c, fv);
          if (a.has_pre) load_v<E, V>(g_y + t * C + c, gyv);
#pragma unroll
          for (int e = 0; e < V; ++e) {
            float col[N], x1[N], gt[N];
#pragma unroll
            for (int j = 0; j < N; ++j) col[j] = xv[j][e];
#pragma unroll
            for (int i = 0; i < N; ++i)
              x1[i] = a.has_post
                          ? round_to<E>(mhc::bnd_post(N, hres + i * N, hpost[i], col, fv[e]))
                          : col[i];
            if (a.has_pre) {  // x1 for dL/dphi, and all of dL/dx1
#pragma unroll
              for (int k = 0; k < N; ++k) {
                bf16 hi, lo;
                split_bf16(x1[k], hi, lo);
                s_x_hi[tl * L::LDA + k * W + jc + e] = hi;
                if constexpr (kSplitX) s_x_lo[tl * L::LDA + k * W + jc + e] = lo;
                gt[k] = mhc::bnd_stream_grad(gv[k][e], hpre[k], gyv[e],
                                             s_gh[tl * L::LDG + k * W + jc + e], cf, r, x1[k]);
              }
            } else {
#pragma unroll
              for (int k = 0; k < N; ++k) gt[k] = gv[k][e];
            }
            if (a.has_post) {
              float gx[N];
              fv[e] = mhc::bnd_post_backward(N, hres, hpost, gt, col, fv[e], gx, accd,
                                             accd + N * N);  // fv[e] now holds dL/df
#pragma unroll
              for (int j = 0; j < N; ++j) gv[j][e] = gx[j];
            } else {
#pragma unroll
              for (int k = 0; k < N; ++k) gv[k][e] = gt[k];
            }
          }
#pragma unroll
          for (int j = 0; j < N; ++j) store_v<E, V>(g_x + (t * N + j) * C + c, gv[j]);
          if (a.has_post) store_v<E, V>(g_f + t * C + c, fv);
        } else if (a.has_pre) {  // outside the tokens or the row: zeros for dL/dphi
#pragma unroll
          for (int k = 0; k < N; ++k)
#pragma unroll
            for (int e = 0; e < V; ++e) {
              s_x_hi[tl * L::LDA + k * W + jc + e] = __float2bfloat16_rn(0.0f);
              if constexpr (kSplitX) s_x_lo[tl * L::LDA + k * W + jc + e] = __float2bfloat16_rn(0.0f);
            }
        }
      }
      if (a.has_post) {
        // the token's 4 lanes: a fixed butterfly (every lane ends with the same sums)
#pragma unroll
        for (int p = 0; p < NMAP; ++p) {
          float v = accd[p];
          v += __shfl_xor_sync(0xffffffffu, v, 1);
          v += __shfl_xor_sync(0xffffffffu, v, 2);
          accd[p] = v;
        }
        if (q == 0) {
          float* dst = s_acc + (tile * TM + tl) * NMAP;
#pragma unroll
          for (int p = 0; p < NMAP; ++p) dst[p] += accd[p];
        }
      }
      if (a.has_pre) {  // dL/dphi (K x MP) += x1^T g_h over the tile's tokens
        __syncthreads();
#pragma unroll
        for (int d = 0; d < DPW; ++d) {
          const int fi = warp + d * kWarps;
          if (fi < NDF) {
            const int fe = fi / MF, fm = fi % MF;
#pragma unroll
            for (int tk = 0; tk < TF; ++tk) {
              wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::col_major> xh, xl;
              wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> gh, gl;
              // A(e, t) = x1[t][e], stored at s_x[t LDA + e]: column-major
              wmma::load_matrix_sync(xh, s_x_hi + tk * 16 * L::LDA + fe * 16, L::LDA);
              wmma::load_matrix_sync(gh, s_gm_hi + tk * 16 * L::LDP + fm * 16, L::LDP);
              wmma::load_matrix_sync(gl, s_gm_lo + tk * 16 * L::LDP + fm * 16, L::LDP);
              wmma::mma_sync(dacc[d], xh, gh, dacc[d]);
              wmma::mma_sync(dacc[d], xh, gl, dacc[d]);
              if constexpr (kSplitX) {
                wmma::load_matrix_sync(xl, s_x_lo + tk * 16 * L::LDA + fe * 16, L::LDA);
                wmma::mma_sync(dacc[d], xl, gh, dacc[d]);
              }
            }
          }
        }
      }
    }
    if (a.has_pre) {
#pragma unroll
      for (int d = 0; d < DPW; ++d) {
        const int fi = warp + d * kWarps;
        if (fi < NDF) {
          const int fe = fi / MF, fm = fi % MF;
          const int k = fe * 16 / W, j0 = fe * 16 % W;  // W % 16 == 0: one stream per block
          float* dst = a.dphi_part +
                       ((int64_t(blockIdx.x) * N + k) * a.Cp + c0 + j0) * MP + fm * 16;
          wmma::store_matrix_sync(dst, dacc[d], MP, wmma::mem_row_major);
        }
      }
    }
  }
  if (!a.has_post) return;
  __syncthreads();
  for (int i = tid; i < GT * NMAP; i += kThreads) {
    const int64_t t = g0 + i / NMAP;
    if (t < T) a.dh_part[(int64_t(s) * T + t) * NMAP + i % NMAP] = s_acc[i];
  }
}

}  // namespace mhc_bnd
