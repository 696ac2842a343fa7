// The n = 4 Birkhoff projection in the published layout: 16 lanes per matrix, lane
// l = 4 i + j holding entry (i, j) (two matrices per warp on the GPU). Row sums are
// butterflies over the 4 lanes of a row (lane xor 1, 2), column sums over the 4 rows (xor
// 4, 8); the 3 x 3 grounded-Laplacian solve and every scalar decision (convergence,
// stagnation, line-search acceptance) are computed redundantly in each lane from values
// that are bitwise the same in all 16 lanes, so all lanes of a matrix take the same branch.
// This is the algorithm of mhc_math.h's newton_core / newton_project / project_matrix and
// implicit_vjp step for step (same tolerances, caps, stall rule, status codes); it calls
// the same scalar helpers (m_exp, grounded_laplacian_solve, newton_stalled,
// line_search_start, armijo_accepts, min_pivot_w) and differs from the thread-per-matrix
// code only in the order of the 4-term sums (butterflies instead of left-to-right).
//
// The code is written once against a lane policy L:
//   L::V                 one lane's value (GPU: float; host emulation: 16 floats)
//   row_sum / col_sum    sum over the lanes of the row / of the column, in every one of them
//   row_max / col_max / all_max
//   row_xor(v, k)        v of lane (i, j ^ k), k = 1..3
//   from_col(v, k)       v of lane (i, k)
//   by_col(x)            x[j] for the lane's column j (x: 4 uniform scalars)
//   sel_col(a, b, cols)  a in the lanes whose column j has bit j set in cols, else b
//   uni(v)               v as a scalar; v must be the same in every lane (the host
//                        emulation checks that and counts violations)
//   all_finite(v)        every lane's v is finite
// The GPU policy (cuda_module.cu) uses __shfl_xor_sync / __shfl_sync with the 16-lane mask
// of the matrix; the host policy (mhc_lane16_host.h) runs the 16 lanes in lockstep on the
// CPU for the tests. Butterfly sums must round each addend before adding (the GPU policy
// uses __fadd_rn: a contracted FMA would round differently in each lane).
#pragma once

#include "mhc_math.h"

namespace mhc {
namespace lane16 {

// Row softmax of a + beta (this lane: entry (i, j); beta: the lane's column potential),
// its column sums c; returns the L1 marginal error sum_i |r_i - 1| + sum_j |c_j - 1|.
template <class L, class V>
MHC_HD float plan(L& l, const V& a, const V& beta, V& t, V& c) {
  const V x = a + beta;
  const V e = m_exp(x - l.row_max(x));
  t = e * m_rcp(l.row_sum(e));
  const V r = l.row_sum(t);
  c = l.col_sum(t);
  // |r_i - 1| is the same along a row, so its column sum is sum_i in every lane (and
  // likewise for the columns)
  return l.uni(l.col_sum(m_abs(r - 1.0f))) + l.uni(l.row_sum(m_abs(c - 1.0f)));
}

// mhc::log_col_step: one Sinkhorn column step in the log domain, gauge beta_3 = 0.
template <class L, class V>
MHC_HD void log_col_step(L& l, const V& a, V& beta) {
  const V x = a + beta;
  const V m = l.row_max(x);
  const V y = x - (m + m_log(l.row_sum(m_exp(x - m))));  // a + beta - lse_i
  const V mc = l.col_max(y);
  beta = beta - (mc + m_log(l.col_sum(m_exp(y - mc))));
  beta = beta - l.from_col(beta, 3);
}

// The Laplacian weights W_jk = sum_i t_ij t_ik (mhc::laplacian_weights) in every lane.
// t1, t2, t3: t of the row partners j ^ 1, j ^ 2, j ^ 3 (row_xor). Lane (i, j) forms its
// products with them, summed over the rows: p_k = W_{j, j^k}. The other pair of each
// perfect matching {j, j^k} sits in lane j ^ 2 (k = 1) or j ^ 1 (k = 2, 3): one more
// shuffle each, then a per-column choice puts the 6 weights in fixed places.
template <class L, class V>
MHC_HD void weights(L& l, const V& t, const V& t1, const V& t2, const V& t3, float (&w)[4][4]) {
  const V p1 = l.col_sum(t * t1), p2 = l.col_sum(t * t2), p3 = l.col_sum(t * t3);
  const V q1 = l.row_xor(p1, 2), q2 = l.row_xor(p2, 1), q3 = l.row_xor(p3, 1);
  // p1 = W01 in columns 0, 1 and W23 in 2, 3; p2 = W02 in 0, 2, W13 in 1, 3; p3 = W03 in
  // 0, 3, W12 in 1, 2; q_k holds the other one
  const float w01 = l.uni(l.sel_col(p1, q1, 0x3)), w23 = l.uni(l.sel_col(q1, p1, 0x3));
  const float w02 = l.uni(l.sel_col(p2, q2, 0x5)), w13 = l.uni(l.sel_col(q2, p2, 0x5));
  const float w03 = l.uni(l.sel_col(p3, q3, 0x9)), w12 = l.uni(l.sel_col(q3, p3, 0x9));
  w[0][0] = w[1][1] = w[2][2] = w[3][3] = 0.0f;
  w[0][1] = w[1][0] = w01;
  w[0][2] = w[2][0] = w02;
  w[0][3] = w[3][0] = w03;
  w[1][2] = w[2][1] = w12;
  w[1][3] = w[3][1] = w13;
  w[2][3] = w[3][2] = w23;
}

template <class L, class V>
MHC_HD void weights(L& l, const V& t, float (&w)[4][4]) {
  weights(l, t, l.row_xor(t, 1), l.row_xor(t, 2), l.row_xor(t, 3), w);
}

// mhc::newton_core<4, float> in the lane layout.
template <class L, class V>
MHC_HD bool newton_core(L& l, const V& a, V& beta, V& t, float tol, int max_iter, int& iters,
                        bool warm = false) {
  if (!warm) log_col_step(l, a, beta);
  float best = Limits<float>::huge;
  int stall = 0;
  int it = 0;
  bool ok = false;
  for (;;) {
    V cj;
    const float err = plan(l, a, beta, t, cj);
    if (err <= tol) {
      ok = true;
      break;
    }
    if (!m_finite(err) || it >= max_iter) break;
    if (newton_stalled(err, best, stall)) break;
    ++it;
    float w[4][4], c[4], b[4], d[4];
    weights(l, t, w);
    MHC_UNROLL
    for (int j = 0; j < 4; ++j) {
      c[j] = l.uni(l.from_col(cj, j));
      b[j] = 1.0f - c[j];
    }
    bool accepted = false;
    const bool connected = grounded_laplacian_solve<4, float>(w, b, d);
    float dmax, slope, sumd, step;
    if (line_search_start<4, float>(c, d, dmax, slope, sumd, step)) {
      const V dj = l.by_col(d);
      for (int ls = 0; ls < Limits<float>::max_halvings; ++ls) {
        // sum_i log1p(sum_j T_ij expm1(step d_j)): expm1 of the lane's column, log1p of
        // its row (the same in the 4 lanes of the row)
        const V y = l.row_sum(t * m_expm1(step * dj));
        float delta = -step * sumd;
        delta += l.uni(l.col_sum(m_log1p(y)));
        if (armijo_accepts<4, float>(delta, step, slope, dmax)) {
          accepted = true;
          break;
        }
        step *= 0.5f;
      }
      if (accepted) beta = beta + step * dj;
    }
    if (!accepted || !connected) log_col_step(l, a, beta);
  }
  iters = it;
  return ok;
}

// mhc::newton_project<4, float>: continuation in the logit scale for ranges above
// Limits::cont_range; beta: the lane's column potential at the end.
template <class L, class V>
MHC_HD bool newton_project(L& l, const V& a, V& t, float tol, int max_iter, int& iters,
                           V& beta) {
  const float range = m_max(0.0f, l.uni(l.all_max(-a)));
  beta = V(0.0f);
  if (!(range > Limits<float>::cont_range)) return newton_core(l, a, beta, t, tol, max_iter, iters);
  V phi(0.0f);
  float f = Limits<float>::cont_range / range;
  int total = 0;
  bool ok = false;
  for (;;) {
    const bool last = !(f < 1.0f);
    if (last) f = 1.0f;
    const V as = a * f;
    beta = phi * f;
    int it = 0;
    ok = newton_core(l, as, beta, t, last ? tol : float(kContStageTol), max_iter, it);
    total += it;
    if (last) break;
    phi = beta / f;
    f *= float(kContGrowth);
  }
  iters = total;
  return ok;
}

// mhc::project_matrix<4, float> for the lane's logit x: status 1 converged, 0 not
// converged, 2 converged but ill-conditioned (min pivot < pivot_min; beta then holds the
// lane's column potential for the float64 polish), -1 non-finite input (t = NaN).
template <class L, class V>
MHC_HD int project_matrix(L& l, const V& x, V& t, V& beta, float tol, int max_iter, int& iters,
                          float pivot_min) {
  iters = 0;
  if (!l.all_finite(x)) {
    t = V(NAN);
    return -1;
  }
  const V a = x - l.row_max(x);
  const bool ok = newton_project(l, a, t, tol, max_iter, iters, beta);
  if (!ok) return 0;
  if (pivot_min > 0.0f) {  // mhc::projection_status: large potential spread or small pivot
    if (l.uni(l.all_max(beta)) + l.uni(l.all_max(-beta)) > float(kPolishSpread)) return 2;
    float w[4][4];
    weights(l, t, w);
    if (min_pivot_w<4, float>(w) < pivot_min) return 2;
  }
  return 1;
}

// mhc::implicit_vjp<4, float>: dA = T * (G - x 1^T - 1 y^T), cancellation-free form, for
// the lane's entries t, g of T and the upstream gradient; returns the lane's dA entry.
template <class L, class V>
MHC_HD V implicit_vjp(L& l, const V& t, const V& g) {
  const V t1 = l.row_xor(t, 1), t2 = l.row_xor(t, 2), t3 = l.row_xor(t, 3);
  const V g1 = l.row_xor(g, 1), g2 = l.row_xor(g, 2), g3 = l.row_xor(g, 3);
  float w[4][4], b[4], y[4];
  weights(l, t, t1, t2, t3, w);
  // rhs_j = sum_i T_ij sum_{k != j} T_ik (G_ij - G_ik)
  const V rhs = l.col_sum(t * (t1 * (g - g1) + t2 * (g - g2) + t3 * (g - g3)));
  MHC_UNROLL
  for (int j = 0; j < 3; ++j) b[j] = l.uni(l.from_col(rhs, j));
  b[3] = 0.0f;  // the ground node's equation is not used
  grounded_laplacian_solve<4, float>(w, b, y);
  // dA_ij = T_ij sum_{k != j} T_ik (Z_ij - Z_ik), Z = G - 1 y^T; y_{j^k} by selection
  float y1[4], y2[4], y3[4];
  MHC_UNROLL
  for (int j = 0; j < 4; ++j) {
    y1[j] = y[j ^ 1];
    y2[j] = y[j ^ 2];
    y3[j] = y[j ^ 3];
  }
  const V z = g - l.by_col(y);
  return t * (t1 * (z - (g1 - l.by_col(y1))) + t2 * (z - (g2 - l.by_col(y2))) +
              t3 * (z - (g3 - l.by_col(y3))));
}

}  // namespace lane16
}  // namespace mhc
