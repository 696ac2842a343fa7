// The per-token math of the hyper-connection layer (mhc_proj.HyperConnection), shared by
// the CPU loops (hc_cpu.h) and the CUDA kernels (hc_kernels.cuh). One token: a stream of
// n rows of C elements x[k][c] (bf16 or float), and the M = n^2 + 2n outputs of the mixing
// GEMM h = vec(x) phi, ordered [pre (n), post (n), res (n x n, row-major)]:
//
//   inv_r  = 1 / sqrt(sum x^2 / (n C) + rms_eps)
//   l_m    = alpha_g(m) * h_m * inv_r + b_m          (g: 0 pre, 1 post, 2 res)
//   H_pre  = sigmoid(l_pre) + pre_eps,  H_post = post_mult * sigmoid(l_post)
//   H_res  = the projection of l_res (done by the Birkhoff / Sinkhorn kernels)
//   y[c]   = sum_k H_pre[k] x[k][c]                   (the sublayer's input)
//   out[i][c] = H_post[i] f[c] + sum_j H_res[i][j] x[j][c]   (f = sublayer(y))
//
// Everything is computed in float32; the stream is read and written in its own dtype.
// The derivation of the backward is in docs/mhc-proj-layer.md.
#pragma once

#include <cstdint>
#include <cstring>

#include "scalar.h"

namespace mhc {

MHC_HD int hc_outputs(int n) { return n * n + 2 * n; }
// which learnable scale (alpha_pre, alpha_post, alpha_res) output m uses
MHC_HD int hc_group(int m, int n) { return m < n ? 0 : (m < 2 * n ? 1 : 2); }
// full-precision exp on both sides (not the GPU's __expf): the maps are float32-accurate
MHC_HD float hc_sigmoid(float z) { return 1.0f / (1.0f + expf(-z)); }
// sigmoid'(l) from s = sigmoid(l) as stored by the forward
MHC_HD float hc_dsigmoid(float s) { return s * (1.0f - s); }
MHC_HD float hc_inv_rms(float sumsq, int64_t count, float eps) {
  return 1.0f / sqrtf(sumsq / float(count) + eps);
}
// A finite stream whose sum of squares overflows float32 (|x| above ~1e19) gets a second
// pass over (x * kRmsScale)^2: with kRmsScale = 2^-75 a square of FLT_MAX scaled is ~8e31,
// so sums of millions of them stay finite, and entries small enough to vanish in the scaled
// squares are below 1e-30 of the sum. inv_r from the scaled sum (eps scaled alike).
constexpr float kRmsScale = 2.6469779601696886e-23f;  // 2^-75
MHC_HD float hc_inv_rms_scaled(float scaled_sumsq, int64_t count, float eps) {
  return kRmsScale / sqrtf(scaled_sumsq / float(count) + eps * kRmsScale * kRmsScale);
}

// Output m of the maps: writes H_pre / H_post into maps[0..2n) or the residual logit into
// lres[0..n^2), and returns the logit. mix: the GEMM output (already summed over parts).
MHC_HD float hc_map_forward(int m, int n, float mix, float alpha, float bias, float inv_r,
                            float pre_eps, float post_mult, float* maps, float* lres) {
  const float l = alpha * (mix * inv_r) + bias;
  if (m < n)
    maps[m] = hc_sigmoid(l) + pre_eps;
  else if (m < 2 * n)
    maps[m] = post_mult * hc_sigmoid(l);
  else
    lres[m - 2 * n] = l;
  return l;
}

// dL/dl_m from the gradients of the maps: g_hpre[n], g_hpost[n] (dL/dH), g_lres[n^2]
// (dL/dl_res from the projection's backward) and the maps H_pre / H_post of the forward.
MHC_HD float hc_map_backward(int m, int n, const float* maps, const float* g_hpre,
                             const float* g_hpost, const float* g_lres, float pre_eps,
                             float post_mult) {
  if (m < n) return g_hpre[m] * hc_dsigmoid(maps[m] - pre_eps);
  if (m < 2 * n) return g_hpost[m - n] * post_mult * hc_dsigmoid(maps[m] / post_mult);
  return g_lres[m - 2 * n];
}

// ---------------------------------------------------------------- host bf16
// bfloat16 as its 16 bits (the CPU module sees torch's bfloat16 storage as uint16).
struct bf16_bits {
  uint16_t v;
};
inline float host_to_float(float x) { return x; }
inline float host_to_float(bf16_bits x) {
  const uint32_t u = uint32_t(x.v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
template <typename E>
inline E host_from_float(float f);
template <>
inline float host_from_float<float>(float f) {
  return f;
}
// round to nearest even, NaN kept quiet (torch's and CUDA's __float2bfloat16_rn rule)
template <>
inline bf16_bits host_from_float<bf16_bits>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_bits{uint16_t((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16_bits{uint16_t(u >> 16)};
}

}  // namespace mhc
