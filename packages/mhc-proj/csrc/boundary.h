// The per-element math of the fused layer boundary (mhc_proj.boundary), shared by the CPU
// loops (boundary_cpu.cpp) and the CUDA kernels (boundary_kernels.cuh).
//
// A boundary joins the post-mix of layer l and the pre-mix of layer l + 1. Per token, with
// the stream x (n rows of C), the sublayer output f (C), layer l's maps H_post (n) and
// H_res (n x n), and layer l + 1's mixing weights phi (n C x M, M = n^2 + 2n):
//
//   x1[i]  = H_post[i] f + sum_j H_res[i][j] x[j]        rounded to the stream dtype
//   h      = vec(x1) phi                                  (M outputs; partial sums per split)
//   then layer l + 1's maps from h (hc_layer.h) and y = H_pre x1 (the existing pre kernel).
//
// Backward, with G = dL/dx1 from the next boundary and g_y = dL/dy:
//
//   Gt[k]  = G[k] + H_pre[k] g_y + (g_h phi^T)[k] + coef inv_r x1[k]   (all of dL/dx1)
//   dL/dx[j] = sum_i H_res[i][j] Gt[i],   dL/df = sum_i H_post[i] Gt[i]
//   dL/dH_res[i][j] += <Gt[i], x[j]>,    dL/dH_post[i] += <Gt[i], f>
//   dL/dphi += vec(x1)^T g_h
//
// x1 is never read back in the backward: it is recomputed from x and f (read anyway for
// dL/dH), by the same function, so it is bitwise the stored x1. The row of C columns is cut
// into chunks of W columns (all n rows of a chunk: K = n W <= 128 elements) and the chunks
// into S splits; a token's partial sums run over one split's chunks in order, and the S
// partials are summed in order s = 0..S-1, so the result depends on S (chosen in Python, a
// fixed function of n and C in the deterministic mode) and never on the token's position or
// the batch. The derivation is in docs/design/mhc-proj.md ("The fused layer boundary").
#pragma once

#include <cstdint>

#include "scalar.h"

namespace mhc {

// columns per chunk: n W <= 128 and W a multiple of 16 (the tensor-core tiles)
MHC_HD constexpr int bnd_width(int n) { return n <= 2 ? 64 : (n <= 4 ? 32 : 16); }
// M = n^2 + 2n rounded up to 16 (the padded column count of phi's tiles)
MHC_HD constexpr int bnd_mpad(int n) { return (n * n + 2 * n + 15) / 16 * 16; }

// Products and sums rounded as written (no contraction into an FMA the other pass may not
// make): the forward and the backward recompute x1 with this code and must agree bitwise.
MHC_HD float bnd_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
MHC_HD float bnd_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// x1[i] at one column: H_post[i] f + sum_j H_res[i][j] x[j] (before rounding to the stream
// dtype). hres_row: H_res[i][0..n).
MHC_HD float bnd_post(int n, const float* hres_row, float hpost, const float* x, float f) {
  float acc = bnd_mul(hpost, f);
  MHC_UNROLL
  for (int j = 0; j < n; ++j) acc = fmaf(hres_row[j], x[j], acc);
  return acc;
}

// dL/dx1[k] at one column: the gradient from the next boundary g, the pre-mix's share
// H_pre[k] g_y, the mixing GEMM's share gh = (g_h phi^T)[k] and the RMS norm's term
// coef (inv_r x1[k]) (coef and inv_r from the layer's hc_pre_bwd_reduce / hc_pre_fwd: the
// product inv_r x1 stays finite for a stream near FLT_MAX, hc_layer.h).
MHC_HD float bnd_stream_grad(float g, float hpre, float gy, float gh, float coef, float inv_r,
                             float x1) {
  return fmaf(coef, bnd_mul(inv_r, x1), bnd_add(fmaf(hpre, gy, g), gh));
}

// The post-mix's backward at one column: writes dL/dx[0..n) and returns dL/df; adds the
// column's terms to acc_res[i n + j] (dL/dH_res) and acc_post[i] (dL/dH_post).
MHC_HD float bnd_post_backward(int n, const float* hres, const float* hpost, const float* gt,
                               const float* x, float f, float* gx, float* acc_res,
                               float* acc_post) {
  float gf = 0.0f;
  MHC_UNROLL
  for (int j = 0; j < n; ++j) gx[j] = 0.0f;
  MHC_UNROLL
  for (int i = 0; i < n; ++i) {
    gf = fmaf(hpost[i], gt[i], gf);
    acc_post[i] = fmaf(gt[i], f, acc_post[i]);
    MHC_UNROLL
    for (int j = 0; j < n; ++j) {
      gx[j] = fmaf(hres[i * n + j], gt[i], gx[j]);
      acc_res[i * n + j] = fmaf(gt[i], x[j], acc_res[i * n + j]);
    }
  }
  return gf;
}

// The chunks [first, last) of split s when each split takes cps chunks.
MHC_HD void bnd_split_chunks(int s, int cps, int64_t nchunks, int64_t& first, int64_t& last) {
  first = int64_t(s) * cps;
  last = first + cps < nchunks ? first + cps : nchunks;
}

}  // namespace mhc
