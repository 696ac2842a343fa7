// Sinkhorn-k in the DeepSeek / TileKernels convention, for one matrix, shared by the CPU
// module and the CUDA kernels:
//   P = rowsoftmax(A) + eps;  P /= colsum(P) + eps;
//   repeat iters - 1 times: P /= rowsum(P) + eps; P /= colsum(P) + eps.
// Normalization step k (0-based, 2 iters - 1 of them): even k are column steps.
//
// Scaling form. Every state of the iteration is
//   p = P0 (.) r c^T,   P0 = rowsoftmax(A) + eps,   r = c = 1 before step 0,
// and a normalization step rescales one of the two vectors:
//   column step: c_j <- c_j / (c_j (P0^T r)_j + eps),   row step: r_i <- r_i / (r_i (P0 c)_i + eps),
// the same iteration as dividing P by its line sums (same eps placement, same order); only
// the rounding differs. The forward keeps P0 and two N-vectors (a step is one N x N
// mat-vec and N reciprocals); the backward keeps the vector each step updated (N numbers
// per step instead of N x N), replays the forward once, then runs the adjoint of each step
// in reverse on a rescaled adjoint that needs no division. Derivation:
// docs/mhc-proj-math.md, section 5; measurements: docs/design/mhc-proj.md.
#pragma once

#include "scalar.h"

namespace mhc {

// Row softmax with the row maximum subtracted (the first state's P0 - eps).
template <int N, typename S>
MHC_HD void softmax_rows(const S (&a)[N][N], S (&p)[N][N]) {
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    S m = a[i][0];
    MHC_UNROLL
    for (int j = 1; j < N; ++j) m = m_max(m, a[i][j]);
    S s = S(0);
    MHC_UNROLL
    for (int j = 0; j < N; ++j) {
      p[i][j] = m_exp(a[i][j] - m);
      s += p[i][j];
    }
    const S inv = m_rcp(s);
    MHC_UNROLL
    for (int j = 0; j < N; ++j) p[i][j] *= inv;
  }
}

// The softmax backward: d (the adjoint of P0 = sm + eps) becomes dA.
template <int N, typename S>
MHC_HD void softmax_rows_bwd(const S (&sm)[N][N], S (&d)[N][N]) {
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    S dot = S(0);
    MHC_UNROLL
    for (int j = 0; j < N; ++j) dot += d[i][j] * sm[i][j];
    MHC_UNROLL
    for (int j = 0; j < N; ++j) d[i][j] = sm[i][j] * (d[i][j] - dot);
  }
}

// P0 = rowsoftmax(a) + eps: the first state of the iteration and the fixed matrix of the
// scaling form; sm gets the softmax.
template <int N, typename S>
MHC_HD void sk_p0(const S (&a)[N][N], S eps, S (&sm)[N][N], S (&p0)[N][N]) {
  softmax_rows<N, S>(a, sm);
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) p0[i][j] = sm[i][j] + eps;
  }
}

// y += P0^T x (transpose: column step) or y += P0 x (row step).
template <int N, typename S>
MHC_HD void sk_matvec_acc(const S (&p0)[N][N], const S (&x)[N], S (&y)[N], bool transpose) {
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) {
      if (transpose)
        y[j] += p0[i][j] * x[i];
      else
        y[i] += p0[i][j] * x[j];
    }
  }
}

// ---------------------------------------------------------------- forward
// One normalization step in the scaling form: out = in / (in (.) M other + eps), where M is
// P0^T for a column step (other = r, in = c) and P0 for a row step (other = c, in = r).
// out may be in (an in-place update).
template <int N, typename S>
MHC_HD void sk_scaling_step(const S (&p0)[N][N], const S (&other)[N], const S (&in)[N],
                            S (&out)[N], bool column, S eps) {
  S u[N];
  MHC_UNROLL
  for (int j = 0; j < N; ++j) u[j] = S(0);
  sk_matvec_acc<N, S>(p0, other, u, column);
  MHC_UNROLL
  for (int j = 0; j < N; ++j) out[j] = in[j] * m_rcp_approx(in[j] * u[j] + eps);
}

// Sinkhorn-k forward: P0 = rowsoftmax(a) + eps, the 2 iters - 1 vector steps of
// sk_scaling_step (column steps update c, row steps r, from r = c = 1), then
// P = P0 (.) r c^T, formed once. The state is P0 and two N-vectors; a step costs one
// N x N mat-vec and N reciprocals (GPU: MUFU.RCP). ITERS > 0: compile-time iteration count
// (iters is ignored, the loop unrolls); ITERS == 0: run-time count.
template <int N, typename S, int ITERS = 0>
MHC_HD void sinkhorn_forward(const S (&a)[N][N], S (&p)[N][N], int iters, S eps) {
  const int n_iters = ITERS > 0 ? ITERS : iters;
  S sm[N][N], p0[N][N], r[N], c[N];
  sk_p0<N, S>(a, eps, sm, p0);
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    r[i] = S(1);
    c[i] = S(1);
  }
  sk_scaling_step<N, S>(p0, r, c, c, true, eps);  // step 0: columns
  MHC_UNROLL
  for (int it = 1; it < n_iters; ++it) {
    sk_scaling_step<N, S>(p0, c, r, r, false, eps);  // step 2 it - 1: rows
    sk_scaling_step<N, S>(p0, r, c, c, true, eps);   // step 2 it: columns
  }
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) p[i][j] = (p0[i][j] * r[i]) * c[j];
  }
}

// ---------------------------------------------------------------- backward
// The exact VJP of the truncated iteration, in two phases.
//
// Replay in reciprocal form. A column step c' = c / (c (.) u + eps), u = P0^T r, is
// c' = 1 / ĉ' with
//   ĉ' = u + eps ĉ,   ĉ = 1 / c (the previous column step's denominator, kept),
// so a step is N multiplications (eps ĉ, the mat-vec's start, off the dependency chain),
// N^2 FMAs and N reciprocals, and the reciprocal follows the mat-vec directly (a short
// dependency chain: mat-vec, MUFU). Row steps likewise with the roles of r and c swapped.
// Mathematically the forward's iteration; the rounding differs (not bitwise its vectors).
//
// Reverse sweep on the rescaled adjoint e = d (.) r c^T (d: the adjoint of the state
// p = P0 (.) r c^T, with the r, c of that state). The reverse of a column step k (out
// c' = slot k, r = slot k - 1) is
//   S_j = sum_i e_ij P0_ij  (= <dq, q> along column j),   e_ij -= r_i (S_j c'_j),
// and of a row step k (out r' = slot k, c = slot k - 1)
//   T_i = sum_j e_ij P0_ij,                               e_ij -= (T_i r'_i) c_j,
// because the step's factor f = c' / c cancels against the rescaling (f c = c'): no
// division, one reduction and one rank-1 update per step. At the start e = G (.) r c^T
// with the final vectors; after step 0 (r = c = 1) e is P0's adjoint, then the softmax
// backward.
//
// The step vectors go through `vec`, a storage with put(k, v) / get(k, v) (copies of N
// numbers): the replay writes each once, the reverse reads each once (slot k - 1 at step
// k; slot k is the previous step's read), so a kernel can keep some of them outside
// registers (shared memory) without changing the math.
template <int N, typename S>
MHC_HD void sk_recip_step(const S (&p0)[N][N], const S (&other)[N], S (&hat)[N], S (&out)[N],
                          bool column, S eps) {
  MHC_UNROLL
  for (int j = 0; j < N; ++j) hat[j] *= eps;
  sk_matvec_acc<N, S>(p0, other, hat, column);
  MHC_UNROLL
  for (int j = 0; j < N; ++j) out[j] = m_rcp_approx(hat[j]);
}

// Plain-array storage of the step vectors (the CPU, and the CUDA kernels' registers or
// local memory): slot k at v[k].
template <int N, typename S>
struct SkVecArray {
  S (*v)[N];
  MHC_HD void put(int k, const S (&x)[N]) {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) v[k][j] = x[j];
  }
  MHC_HD void get(int k, S (&x)[N]) const {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) x[j] = v[k][j];
  }
};

// Phase 1: sm = rowsoftmax(a), p0 = sm + eps, the replay into vec, and the final r, c.
// Split from phase 2 so a kernel can load G between them (G is not live during the replay).
template <int N, typename S, int ITERS = 0, typename Store>
MHC_HD void sinkhorn_replay(const S (&a)[N][N], int iters, S eps, S (&sm)[N][N],
                            S (&p0)[N][N], S (&r)[N], S (&c)[N], Store& vec) {
  const int steps = 2 * (ITERS > 0 ? ITERS : iters) - 1;
  S rh[N], ch[N];
  sk_p0<N, S>(a, eps, sm, p0);
  MHC_UNROLL
  for (int i = 0; i < N; ++i) r[i] = c[i] = rh[i] = ch[i] = S(1);
  // slot k = the vector step k updated (c for even k, r for odd k)
  MHC_UNROLL
  for (int k = 0; k < steps; ++k) {
    if ((k & 1) == 0) {
      sk_recip_step<N, S>(p0, r, ch, c, true, eps);
      vec.put(k, c);
    } else {
      sk_recip_step<N, S>(p0, c, rh, r, false, eps);
      vec.put(k, r);
    }
  }
}

// One step of the reverse sweep: step k's output vector in `out` (registers), its other
// vector = slot k - 1 of vec (1 for k = 0), read here and left in `out` for step k - 1.
template <int N, typename S, typename Store>
MHC_HD void sk_rescaled_step_bwd(const S (&p0)[N][N], S (&g)[N][N], S (&out)[N], int k,
                                 Store& vec) {
  const bool column = (k & 1) == 0;
  S other[N];
  if (k >= 1) {
    vec.get(k - 1, other);
  } else {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) other[j] = S(1);
  }
  S h[N];
  MHC_UNROLL
  for (int l = 0; l < N; ++l) h[l] = S(0);
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) {
      if (column)
        h[j] += g[i][j] * p0[i][j];
      else
        h[i] += g[i][j] * p0[i][j];
    }
  }
  MHC_UNROLL
  for (int l = 0; l < N; ++l) h[l] *= out[l];
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) {
      if (column)
        g[i][j] -= other[i] * h[j];
      else
        g[i][j] -= h[i] * other[j];
    }
  }
  MHC_UNROLL
  for (int j = 0; j < N; ++j) out[j] = other[j];
}

// Phase 2: g = the output gradient on entry, dA on return; r, c: phase 1's final vectors.
template <int N, typename S, int ITERS = 0, typename Store>
MHC_HD void sinkhorn_reverse(const S (&sm)[N][N], const S (&p0)[N][N], const S (&r)[N],
                             const S (&c)[N], S (&g)[N][N], int iters, Store& vec) {
  const int steps = 2 * (ITERS > 0 ? ITERS : iters) - 1;
  // e = G (.) r c^T with the final vectors (r = 1 for iters = 1)
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) g[i][j] = (g[i][j] * r[i]) * c[j];
  }
  // out = slot k, other = slot k - 1 (1 for k = 0)
  S out[N];
  MHC_UNROLL
  for (int j = 0; j < N; ++j) out[j] = c[j];
  MHC_UNROLL
  for (int k = steps - 1; k >= 0; --k) sk_rescaled_step_bwd<N, S>(p0, g, out, k, vec);
  softmax_rows_bwd<N, S>(sm, g);
}

// The VJP of one matrix: g = the output gradient on entry, dA on return.
template <int N, typename S, int ITERS = 0, typename Store>
MHC_HD void sinkhorn_vjp(const S (&a)[N][N], S (&g)[N][N], int iters, S eps, Store& vec) {
  S sm[N][N], p0[N][N], r[N], c[N];
  sinkhorn_replay<N, S, ITERS>(a, iters, eps, sm, p0, r, c, vec);
  sinkhorn_reverse<N, S, ITERS>(sm, p0, r, c, g, iters, vec);
}

}  // namespace mhc
