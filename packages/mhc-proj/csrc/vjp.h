// The implicit backward of the Birkhoff projection for one matrix, shared by the CPU
// module and the CUDA kernels: only T is needed (no unrolling of the forward), and the
// linear system is the same grounded graph Laplacian as the Newton step's, solved without
// subtractions (laplacian.h; derivation in docs/mhc-proj-math.md, section 4).
#pragma once

#include "laplacian.h"

namespace mhc {

// Implicit VJP: dA = T * (G - x 1^T - 1 y^T) with (I - T^T T) y = s - T^T r on the
// grounded Laplacian, rearranged without cancellation:
//   rhs_j  = sum_i sum_{k != j} T_ij T_ik (G_ij - G_ik)
//   dA_ij  = T_ij sum_{k != j} T_ik (Z_ij - Z_ik),   Z_ij = G_ij - y_j.
template <int N, typename S>
MHC_HD void implicit_vjp(const S (&t)[N][N], const S (&g)[N][N], S (&da)[N][N]) {
  S w[N][N], b[N], y[N];
  laplacian_weights<N, S>(t, w);
  MHC_UNROLL
  for (int j = 0; j < N; ++j) {
    S s = S(0);
    MHC_UNROLL
    for (int i = 0; i < N; ++i) {
      S inner = S(0);
      MHC_UNROLL
      for (int k = 0; k < N; ++k)
        if (k != j) inner += t[i][k] * (g[i][j] - g[i][k]);
      s += t[i][j] * inner;
    }
    b[j] = s;
  }
  // A disconnected support (blocks of a permutation, up to underflow) is grounded per
  // component inside the solve; any gauge per component gives the same dA.
  grounded_laplacian_solve<N, S>(w, b, y);
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    S z[N];
    MHC_UNROLL
    for (int j = 0; j < N; ++j) z[j] = g[i][j] - y[j];
    MHC_UNROLL
    for (int j = 0; j < N; ++j) {
      S s = S(0);
      MHC_UNROLL
      for (int k = 0; k < N; ++k)
        if (k != j) s += t[i][k] * (z[j] - z[k]);
      da[i][j] = t[i][j] * s;
    }
  }
}

// dA of one matrix stored row-major at tp (T) and gp (G), computed in S, written to dst.
template <int N, typename S, typename In, typename Out>
MHC_HD void vjp_matrix(const In* tp, const In* gp, Out* dst) {
  S t[N][N], g[N][N], da[N][N];
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) {
      t[i][j] = S(tp[i * N + j]);
      g[i][j] = S(gp[i * N + j]);
    }
  }
  implicit_vjp<N, S>(t, g, da);
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) dst[i * N + j] = Out(da[i][j]);
  }
}

}  // namespace mhc
