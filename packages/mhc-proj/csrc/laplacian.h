// The graph Laplacian shared by the Newton step (newton.h) and the implicit backward
// (vjp.h): the semi-dual's Hessian diag(c) - T^T T equals diag(W 1) - W with the positive
// weights W_jk = sum_i T_ij T_ik, solved by elimination in the Grassmann-Taufer-Heyman
// arrangement, which never subtracts (docs/mhc-proj-math.md, sections 2-3).
#pragma once

#include "scalar.h"

namespace mhc {

// Off-diagonal weights W_jk = sum_i T_ij T_ik (j != k). The Hessian of the semi-dual
// (and the backward system) is the graph Laplacian diag(W 1) - W: its diagonal is a sum
// of positive products, never 1 - sum_i T_ij^2 (which cancels for large logits).
template <int N, typename S>
MHC_HD void laplacian_weights(const S (&t)[N][N], S (&w)[N][N]) {
  MHC_UNROLL
  for (int j = 0; j < N; ++j) {
    w[j][j] = S(0);
    MHC_UNROLL
    for (int k = j + 1; k < N; ++k) {
      S s = S(0);
      MHC_UNROLL
      for (int i = 0; i < N; ++i) s += t[i][j] * t[i][k];
      w[j][k] = s;
      w[k][j] = s;
    }
  }
}

// Pivot p of the grounded-Laplacian elimination of w: the sum of node p's weights to the
// nodes not yet eliminated (ground, node N-1, included).
template <int N, typename S>
MHC_HD S gth_pivot(const S (&w)[N][N], int p) {
  S d = S(0);
  MHC_UNROLL
  for (int k = p + 1; k < N; ++k) d += w[p][k];
  return d;
}

// Eliminates node p (inv = 1 / its pivot): the remaining weights become their Schur
// complement, w_ij += w_ip w_pj / pivot (symmetric; only additions of positive terms).
// b: right-hand side updated alongside (b_i += w_ip / pivot b_p), or null.
template <int N, typename S>
MHC_HD void gth_eliminate(S (&w)[N][N], int p, S inv, S* b) {
  MHC_UNROLL
  for (int i = p + 1; i < N; ++i) {
    const S wip = w[i][p] * inv;
    MHC_UNROLL
    for (int j = i + 1; j < N; ++j) {
      const S v = w[i][j] + wip * w[p][j];
      w[i][j] = v;
      w[j][i] = v;
    }
    if (b && i < N - 1) b[i] += wip * b[p];
  }
}

// Solves L x = b for the Laplacian L = diag(W 1) - W grounded at node N-1 (x_{N-1} = 0)
// by Gaussian elimination in the Grassmann-Taufer-Heyman arrangement: every pivot is a
// sum of positive off-diagonal weights (including the edge to ground), and the Schur
// complement of a Laplacian is again a Laplacian, so no subtraction ever occurs in the
// elimination. Overwrites w. A zero pivot (below eps times the largest degree) means node
// p has no edge left to the rest of the graph (incl. ground): its component is grounded
// at p instead (x_p = 0, a valid gauge there). Returns false if that happened.
template <int N, typename S>
MHC_HD bool grounded_laplacian_solve(S (&w)[N][N], S (&b)[N], S (&x)[N]) {
  S piv[N];
  bool all_pos = true;
  S maxdeg = S(0);
  MHC_UNROLL
  for (int p = 0; p < N; ++p) {
    S d0 = S(0);
    MHC_UNROLL
    for (int k = 0; k < N; ++k)
      if (k != p) d0 += w[p][k];
    maxdeg = m_max(maxdeg, d0);
  }
  const S zero_piv = Limits<S>::eps * maxdeg;
  MHC_UNROLL
  for (int p = 0; p < N - 1; ++p) {
    const S d = gth_pivot<N, S>(w, p);
    // A pivot below eps times the largest degree is zero to working precision: node p's
    // component is cut off from ground (e.g. the ground column is isolated).
    if (!(d > zero_piv) || !(d > S(0)) || !m_finite(d)) {
      all_pos = false;
      piv[p] = S(0);
      continue;  // no edges from p to the remaining nodes: nothing to eliminate
    }
    piv[p] = d;
    gth_eliminate<N, S>(w, p, m_rcp(d), b);
  }
  x[N - 1] = S(0);
  MHC_UNROLL
  for (int p = N - 2; p >= 0; --p) {
    S s = b[p];
    MHC_UNROLL
    for (int k = p + 1; k < N - 1; ++k) s += w[p][k] * x[k];
    x[p] = piv[p] > S(0) ? s / piv[p] : S(0);
  }
  return all_pos;
}

// Smallest nonzero pivot of the grounded-Laplacian elimination of W (the Hessian's
// conditioning in the semi-dual): small values mean nearly disconnected supports, where T
// and its VJP are most sensitive to rounding in T. A pivot of exactly 0 ends a component
// that is disconnected from the rest (structural zeros of T, or entries that underflowed):
// components are independent problems (grounded_laplacian_solve grounds each one), so it
// is skipped rather than counted as ill-conditioned.
template <int N, typename S>
MHC_HD S min_pivot(const S (&t)[N][N]) {
  S w[N][N];
  laplacian_weights<N, S>(t, w);
  S mp = Limits<S>::huge;
  MHC_UNROLL
  for (int p = 0; p < N - 1; ++p) {
    const S d = gth_pivot<N, S>(w, p);
    if (!(d > S(0))) continue;  // node p closes a disconnected component
    mp = d < mp ? d : mp;
    gth_eliminate<N, S>(w, p, m_rcp(d), static_cast<S*>(nullptr));
  }
  return mp;
}

}  // namespace mhc
