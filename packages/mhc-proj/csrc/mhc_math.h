// Shared __host__ __device__ math of mhc-proj: the per-matrix Newton solve of the
// Birkhoff projection, its implicit backward, and the Sinkhorn-k compatibility
// iteration. The CPU module (cpu_module.cpp) and the CUDA kernels (cuda_module.cu)
// include this header and call the same functions, so the two paths run the same
// algorithm. The derivation is in docs/mhc-proj-math.md.
//
// Conventions: one n x n matrix, row-major, n a compile-time constant N (2..8).
// S is the arithmetic type (float or double).
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define MHC_HD __host__ __device__ __forceinline__
#else
#define MHC_HD inline
#endif

#if defined(__CUDACC__) && !defined(MHC_NO_UNROLL)
#define MHC_UNROLL _Pragma("unroll")
#else
#define MHC_UNROLL
#endif

namespace mhc {

// ---------------------------------------------------------------- scalar helpers
MHC_HD float m_exp(float x) {
#if defined(__CUDA_ARCH__)
  return __expf(x);
#else
  return expf(x);
#endif
}
MHC_HD double m_exp(double x) { return exp(x); }
// Correctly rounded reciprocal: bitwise equal to 1.0f / x, cheaper on the GPU.
MHC_HD float m_rcp(float x) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(x);
#else
  return 1.0f / x;
#endif
}
MHC_HD double m_rcp(double x) { return 1.0 / x; }
// Approximate reciprocal (GPU: one MUFU.RCP, max error 1 ulp, subnormal inputs and results
// flushed to zero; host: 1 / x). Used where the operand is bounded away from the subnormal
// range and the last bit does not matter (the Sinkhorn backward's recompute, eps > 0).
MHC_HD float m_rcp_approx(float x) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#else
  return 1.0f / x;
#endif
}
MHC_HD double m_rcp_approx(double x) { return 1.0 / x; }
// a / b: GPU: approximate reciprocal and one residual correction (4 instructions, within
// ~1 ulp, no slow path; b normal); host: the IEEE division.
MHC_HD float m_div_approx(float a, float b) {
#if defined(__CUDA_ARCH__)
  const float r = m_rcp_approx(b);
  const float q = a * r;
  return fmaf(fmaf(-q, b, a), r, q);
#else
  return a / b;
#endif
}
MHC_HD double m_div_approx(double a, double b) { return a / b; }
MHC_HD float m_log(float x) { return logf(x); }
MHC_HD double m_log(double x) { return log(x); }
MHC_HD float m_log1p(float x) { return log1pf(x); }
MHC_HD double m_log1p(double x) { return log1p(x); }
MHC_HD float m_expm1(float x) { return expm1f(x); }
MHC_HD double m_expm1(double x) { return expm1(x); }
// expm1 for the fp32 line search of the "ls" layouts: Taylor to x^6 / 720 for |x| < 1/4
// (relative error < x^6 / 5040 < 5e-8), else m_exp(x) - 1 (>= 0.22 in magnitude there, so
// no cancellation; on the GPU __expf's error, ~2 ulp + |x| 2^-22 relative). ~12 SASS
// instructions against expm1f's ~28. double: the library expm1.
MHC_HD float m_expm1_fast(float x) {
  const float p =
      x * (1.0f + x * (0.5f + x * (1.0f / 6 + x * (1.0f / 24 + x * (1.0f / 120 + x * (1.0f / 720))))));
  return fabsf(x) < 0.25f ? p : m_exp(x) - 1.0f;
}
MHC_HD double m_expm1_fast(double x) { return expm1(x); }
MHC_HD float m_abs(float x) { return fabsf(x); }
MHC_HD double m_abs(double x) { return fabs(x); }
template <typename S>
MHC_HD S m_max(S a, S b) {
  return a > b ? a : b;
}
template <typename S>
MHC_HD S m_min(S a, S b) {
  return a < b ? a : b;
}
template <typename S>
MHC_HD bool m_finite(S x) {
  return x - x == S(0);  // false for NaN and +-Inf
}

template <typename S>
struct Limits;
template <>
struct Limits<float> {
  static constexpr float eps = FLT_EPSILON;
  static constexpr float step_cap = 24.0f;  // max |Newton step| per iteration
  static constexpr int max_halvings = 12;
  static constexpr float huge = FLT_MAX;
  static constexpr float cont_range = 16.0f;  // logit range above which we use continuation
  static constexpr int stall = 5;  // iterations without a 10% error decrease before giving up
};
template <>
struct Limits<double> {
  static constexpr double eps = DBL_EPSILON;
  static constexpr double step_cap = 64.0;
  static constexpr int max_halvings = 24;
  static constexpr double huge = DBL_MAX;
  static constexpr double cont_range = 64.0;
  static constexpr int stall = 40;
};

// Info word written per matrix when requested: bits 0..15 iterations (fp32 stage plus
// fallback stage), bit 16 set when the float64 fallback ran, bit 17 set when converged.
constexpr int kInfoFallback = 1 << 16;
constexpr int kInfoConverged = 1 << 17;


// ---------------------------------------------------------------- CPU work counters
// MHC_PROFILE (the CPU module defines it; never the device code): per-thread counts of the
// solver's pieces, for the CPU cost proxies of the GPU kernels (birkhoff_fwd_profile).
#if defined(MHC_PROFILE) && !defined(__CUDA_ARCH__)
struct ProfCounters {
  long long plan[2], step[2], trial[2], colstep[2], pivot[2], stage[2], update[2];
};
inline ProfCounters& prof() {
  static thread_local ProfCounters c;
  return c;
}
#define MHC_PROF(field, S) (++::mhc::prof().field[sizeof(S) == 8 ? 1 : 0])
#else
#define MHC_PROF(field, S) ((void)0)
#endif

// ---------------------------------------------------------------- forward pieces

// Rows of T = rowsoftmax(a + 1 beta^T); column sums in c; returns the marginal error
// sum_i |r_i - 1| + sum_j |c_j - 1| (L1 of row and column deviations).
template <int N, typename S>
MHC_HD S plan(const S (&a)[N][N], const S (&beta)[N], S (&t)[N][N], S (&c)[N]) {
  MHC_PROF(plan, S);
  MHC_UNROLL
  for (int j = 0; j < N; ++j) c[j] = S(0);
  S err = S(0);
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    S x[N];
    S m = a[i][0] + beta[0];
    MHC_UNROLL
    for (int j = 0; j < N; ++j) {
      x[j] = a[i][j] + beta[j];
      m = m_max(m, x[j]);
    }
    S s = S(0);
    MHC_UNROLL
    for (int j = 0; j < N; ++j) {
      x[j] = m_exp(x[j] - m);
      s += x[j];
    }
    const S inv = m_rcp(s);
    S r = S(0);
    MHC_UNROLL
    for (int j = 0; j < N; ++j) {
      t[i][j] = x[j] * inv;
      r += t[i][j];
      c[j] += t[i][j];
    }
    err += m_abs(r - S(1));
  }
  MHC_UNROLL
  for (int j = 0; j < N; ++j) err += m_abs(c[j] - S(1));
  return err;
}

// One Sinkhorn column step computed entirely in the log domain, so it is defined even
// when a column's mass underflows: beta_j -= log sum_i rowsoftmax(a + beta)_ij. This is
// exact block-coordinate descent on the dual and never increases the semi-dual
// objective: the globalization's fallback step. Gauge beta_{N-1} = 0 afterwards.
template <int N, typename S>
MHC_HD void log_col_step(const S (&a)[N][N], S (&beta)[N]) {
  MHC_PROF(colstep, S);
  S lse[N];
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    S m = a[i][0] + beta[0];
    MHC_UNROLL
    for (int j = 1; j < N; ++j) m = m_max(m, a[i][j] + beta[j]);
    S s = S(0);
    MHC_UNROLL
    for (int j = 0; j < N; ++j) s += m_exp(a[i][j] + beta[j] - m);
    lse[i] = m + m_log(s);
  }
  S lc[N];
  MHC_UNROLL
  for (int j = 0; j < N; ++j) {
    S m = a[0][j] + beta[j] - lse[0];
    MHC_UNROLL
    for (int i = 1; i < N; ++i) m = m_max(m, a[i][j] + beta[j] - lse[i]);
    S s = S(0);
    MHC_UNROLL
    for (int i = 0; i < N; ++i) s += m_exp(a[i][j] + beta[j] - lse[i] - m);
    lc[j] = m + m_log(s);
  }
  MHC_UNROLL
  for (int j = 0; j < N; ++j) beta[j] -= lc[j];
  const S g = beta[N - 1];
  MHC_UNROLL
  for (int j = 0; j < N; ++j) beta[j] -= g;
}

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

// Smallest pivot of the grounded-Laplacian elimination of W (the Hessian's conditioning
// in the semi-dual): small values mean nearly disconnected supports, where T and its
// VJP are most sensitive to rounding in T.
// min_pivot_w: the same from the weights W (overwritten), for callers that form them
// another way (the 16-lane kernel).
template <int N, typename S>
MHC_HD S min_pivot_w(S (&w)[N][N]) {
  S mp = Limits<S>::huge;
  MHC_UNROLL
  for (int p = 0; p < N - 1; ++p) {
    const S d = gth_pivot<N, S>(w, p);
    mp = d < mp ? d : mp;
    if (!(d > S(0))) return S(0);
    gth_eliminate<N, S>(w, p, m_rcp(d), static_cast<S*>(nullptr));
  }
  return mp;
}
template <int N, typename S>
MHC_HD S min_pivot(const S (&t)[N][N]) {
  MHC_PROF(pivot, S);
  S w[N][N];
  laplacian_weights<N, S>(t, w);
  return min_pivot_w<N, S>(w);
}

// ---------------------------------------------------------------- Newton's scalar decisions
// Shared by newton_core and the 16-lane kernel (mhc_lane16.h), which must take the same
// decisions from the same scalars.

// Stagnation: true when the error has not dropped below 0.9 x the best one for
// Limits::stall consecutive iterations (best and stall carry the state).
template <typename S>
MHC_HD bool newton_stalled(S err, S& best, int& stall) {
  if (err < S(0.9) * best) {
    best = err;
    stall = 0;
    return false;
  }
  return ++stall >= Limits<S>::stall;
}

// Before the line search along the Newton direction d (c: column sums, the gradient is
// c - 1): max |d|, the slope (c - 1)^T d and sum d. Returns false when d is not a finite
// descent direction (no search); otherwise step gets the first trial, capped so that
// max |step d| <= Limits::step_cap.
template <int N, typename S>
MHC_HD bool line_search_start(const S (&c)[N], const S (&d)[N], S& dmax, S& slope, S& sumd,
                              S& step) {
  dmax = S(0);
  slope = S(0);
  sumd = S(0);
  MHC_UNROLL
  for (int j = 0; j < N; ++j) {
    dmax = m_max(dmax, m_abs(d[j]));
    slope += (c[j] - S(1)) * d[j];
    sumd += d[j];
  }
  if (!(m_finite(dmax) && m_finite(slope) && slope < S(0))) return false;
  step = dmax > Limits<S>::step_cap ? Limits<S>::step_cap / dmax : S(1);
  return true;
}

// Armijo with a rounding allowance: the decrease delta is computed to about
// N * eps * |step * d|, below which it cannot be resolved.
template <int N, typename S>
MHC_HD bool armijo_accepts(S delta, S step, S slope, S dmax) {
  const S thr = S(1e-4) * step * slope + S(4 * N) * Limits<S>::eps * step * dmax;
  return m_finite(delta) && delta <= thr;
}

// sum_i log1p(y_i), y_i = sum_j t_ij em_j, as ONE log1p: log1p(q) with 1 + q = prod_i (1 +
// y_i), q accumulated as q + y + q y (no 1 + y rounding, so tiny y keep their precision; the
// error of q is ~N eps |q|-ish like the sum of N log1p's). The line search's objective
// change with 1 log1pf instead of N (~36 SASS instructions each on sm_90): the "ls" layouts
// (LSP; their fp32 trials also use m_expm1_fast); the default keeps the N log1p's.
template <int N, typename S>
MHC_HD S armijo_log_sum(const S (&t)[N][N], const S (&em)[N]) {
  S q = S(0);
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    S y = S(0);
    MHC_UNROLL
    for (int j = 0; j < N; ++j) y += t[i][j] * em[j];
    q = q + y + q * y;
  }
  return m_log1p(q);
}

// Continuation schedule (newton_project): intermediate stages stop at this tolerance and
// the logit scale grows by this factor per stage.
constexpr double kContStageTol = 1e-2;
constexpr int kContGrowth = 8;

// ---------------------------------------------------------------- Newton iteration state
// The stagnation tracker and the iteration count of one Newton solve (the caller owns beta,
// T and the column sums).
template <typename S>
struct NewtonIter {
  S best;
  int stall;
  int it;
};
template <typename S>
MHC_HD void newton_iter_init(NewtonIter<S>& s) {
  s.best = Limits<S>::huge;
  s.stall = 0;
  s.it = 0;
}

// newton_decide's outcomes. kNewtonStep: take an iteration; kNewtonConverged /
// kNewtonFailed: the solve ended at the current beta (t is its plan).
constexpr int kNewtonStep = 0;
constexpr int kNewtonConverged = 1;
constexpr int kNewtonFailed = 2;

// The decisions of one Newton iteration from the plan's error: kNewtonConverged (err <=
// tol), kNewtonFailed (not finite, iteration limit, stagnation), else kNewtonStep with the
// iteration counted.
template <typename S>
MHC_HD int newton_decide(S err, S tol, int max_iter, NewtonIter<S>& s) {
  if (err <= tol) return kNewtonConverged;
  if (!m_finite(err) || s.it >= max_iter) return kNewtonFailed;
  if (newton_stalled(err, s.best, s.stall)) return kNewtonFailed;
  ++s.it;
  return kNewtonStep;
}

// The Newton step at the plan (t, c): the direction from the grounded Laplacian solve and a
// backtracking line search on the exact objective decrease, written cancellation-free as
//   f(beta + s d) - f(beta) = sum_i log1p(sum_j T_ij expm1(s d_j)) - s sum_j d_j,
// with a step cap; COL (a bool lvalue) becomes true when the caller must run log_col_step on
// beta (no acceptable step, or a disconnected support: Newton cannot move mass between
// components that are disconnected to working precision; the log-domain column step can,
// it is exact block-coordinate descent). A macro, not a function, on purpose: expanded in
// newton_core's loop it compiles as the loop body always did (as an inlined function it
// costs the generic n = 8 fp32 kernel 100 B of register spills, nvcc 13.0).
#define MHC_NEWTON_STEP(N, S, t, c, beta, COL, LSP)                               \
  do {                                                                            \
    S w_[N][N], b_[N], d_[N];                                                     \
    MHC_PROF(step, S);                                                            \
    laplacian_weights<N, S>(t, w_);                                               \
    MHC_UNROLL                                                                    \
    for (int j = 0; j < N; ++j) b_[j] = S(1) - c[j];                              \
    bool accepted_ = false;                                                       \
    const bool connected_ = grounded_laplacian_solve<N, S>(w_, b_, d_);           \
    S dmax_, slope_, sumd_, step_;                                                \
    if (line_search_start<N, S>(c, d_, dmax_, slope_, sumd_, step_)) {            \
      for (int ls = 0; ls < Limits<S>::max_halvings; ++ls) {                      \
        S em_[N];                                                                 \
        MHC_PROF(trial, S);                                                       \
        MHC_UNROLL                                                                \
        for (int j = 0; j < N; ++j)                                               \
          em_[j] = LSP ? m_expm1_fast(step_ * d_[j]) : m_expm1(step_ * d_[j]);    \
        S delta_ = -step_ * sumd_;                                                \
        if constexpr (LSP) {                                                      \
          delta_ += armijo_log_sum<N, S>(t, em_);                                 \
        } else {                                                                  \
          MHC_UNROLL                                                              \
          for (int i = 0; i < N; ++i) {                                           \
            S y_ = S(0);                                                          \
            MHC_UNROLL                                                            \
            for (int j = 0; j < N; ++j) y_ += t[i][j] * em_[j];                   \
            delta_ += m_log1p(y_);                                                \
          }                                                                       \
        }                                                                         \
        if (armijo_accepts<N, S>(delta_, step_, slope_, dmax_)) {                 \
          accepted_ = true;                                                       \
          break;                                                                  \
        }                                                                         \
        step_ *= S(0.5);                                                          \
      }                                                                           \
      if (accepted_) {                                                            \
        MHC_UNROLL                                                                \
        for (int j = 0; j < N; ++j) beta[j] += step_ * d_[j];                     \
      }                                                                           \
    }                                                                             \
    COL = !accepted_ || !connected_;                                              \
  } while (0)

// Row-normalizes t (N x N, positive) in place and returns the plan's error with the column
// sums in c: the last part of plan() (same sums in the same order) for a T that is not
// formed from exponentials (newton_step_update).
template <int N, typename S>
MHC_HD S plan_normalize(S (&t)[N][N], S (&c)[N]) {
  MHC_UNROLL
  for (int j = 0; j < N; ++j) c[j] = S(0);
  S err = S(0);
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    S s = S(0);
    MHC_UNROLL
    for (int j = 0; j < N; ++j) s += t[i][j];
    const S inv = m_rcp(s);
    S r = S(0);
    MHC_UNROLL
    for (int j = 0; j < N; ++j) {
      t[i][j] = t[i][j] * inv;
      r += t[i][j];
      c[j] += t[i][j];
    }
    err += m_abs(r - S(1));
  }
  MHC_UNROLL
  for (int j = 0; j < N; ++j) err += m_abs(c[j] - S(1));
  return err;
}

// MHC_NEWTON_STEP's iteration (same direction, line search and decisions) that also
// updates the plan without exponentials when the accepted step is small: rowsoftmax(a +
// beta + s d) = T (.) (1 + expm1(s d_j)) renormalized per row, with the expm1 values the
// accepted trial computed. Returns kStepUpdated when (t, c, err) now hold the plan at the
// new beta; kStepReplan when the caller must form the plan anew (a step with max |s d_j| >
// kUpdateMaxStep: entries that underflowed in T could not grow back by multiplication);
// kStepColumn when the caller must run log_col_step first (MHC_NEWTON_STEP's COL). Used by
// the float64 stage of the fp32 path (polish_matrix<..., true>), where a plan costs 16
// double exponentials and the update 16 multiplications and N divisions: rounding of the
// update is ~1e-16 relative per iteration, far below the fp32 output's.
constexpr int kStepUpdated = 0;
constexpr int kStepReplan = 1;
constexpr int kStepColumn = 2;
constexpr double kUpdateMaxStep = 1.0;
template <int N, typename S, bool LSP = false>
MHC_HD int newton_step_update(S (&t)[N][N], S (&c)[N], S (&beta)[N], S& err) {
  S w[N][N], b[N], d[N], em[N];
  MHC_PROF(step, S);
  laplacian_weights<N, S>(t, w);
  MHC_UNROLL
  for (int j = 0; j < N; ++j) b[j] = S(1) - c[j];
  bool accepted = false;
  const bool connected = grounded_laplacian_solve<N, S>(w, b, d);
  S dmax, slope, sumd, step;
  if (line_search_start<N, S>(c, d, dmax, slope, sumd, step)) {
    for (int ls = 0; ls < Limits<S>::max_halvings; ++ls) {
      MHC_PROF(trial, S);
      MHC_UNROLL
      for (int j = 0; j < N; ++j) em[j] = m_expm1(step * d[j]);
      S delta = -step * sumd;
      if constexpr (LSP) {
        delta += armijo_log_sum<N, S>(t, em);
      } else {
        MHC_UNROLL
        for (int i = 0; i < N; ++i) {
          S y = S(0);
          MHC_UNROLL
          for (int j = 0; j < N; ++j) y += t[i][j] * em[j];
          delta += m_log1p(y);
        }
      }
      if (armijo_accepts<N, S>(delta, step, slope, dmax)) {
        accepted = true;
        break;
      }
      step *= S(0.5);
    }
    if (accepted) {
      MHC_UNROLL
      for (int j = 0; j < N; ++j) beta[j] += step * d[j];
    }
  }
  if (!accepted || !connected) return kStepColumn;
  if (!(step * dmax <= S(kUpdateMaxStep))) return kStepReplan;
  MHC_PROF(update, S);
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) t[i][j] += t[i][j] * em[j];
  }
  err = plan_normalize<N, S>(t, c);
  return kStepUpdated;
}

// Newton's method for one matrix: log-domain column step (unless warm), then iterations
// (newton_decide, MHC_NEWTON_STEP) until the solve ends. Stops when the L1
// marginal error of the T it returns is <= tol. a must have row maxima 0 (the caller
// subtracts them). Returns converged; iters gets the number of iterations used; t holds
// rowsoftmax(a + beta) at the final beta.
// UPDATE: accepted steps update the plan (newton_step_update) instead of recomputing it
// from a and beta (the float64 stage of the fp32 path, layout "thread-fb2"); same
// decisions, T equal to rowsoftmax(a + beta) up to rounding.
// LSP: the line search's objective change with one log1p (armijo_log_sum; "ls" layouts).
template <int N, typename S, bool UPDATE = false, bool LSP = false>
MHC_HD bool newton_core(const S (&a)[N][N], S (&beta)[N], S (&t)[N][N], S tol, int max_iter,
                        int& iters, bool warm = false) {
  if (!warm) log_col_step<N, S>(a, beta);
  S c[N];
  NewtonIter<S> s;
  newton_iter_init(s);
  bool ok = false;
  if constexpr (UPDATE) {
    bool fresh = false;  // t, c, err hold the plan at beta (after an updated step)
    S err = S(0);
    for (;;) {
      if (!fresh) err = plan<N, S>(a, beta, t, c);
      const int r = newton_decide<S>(err, tol, max_iter, s);
      if (r == kNewtonConverged) {
        ok = true;
        break;
      }
      if (r == kNewtonFailed) break;
      const int u = newton_step_update<N, S, LSP>(t, c, beta, err);
      fresh = u == kStepUpdated;
      if (u == kStepColumn) log_col_step<N, S>(a, beta);
    }
  } else {
    for (;;) {
      const S err = plan<N, S>(a, beta, t, c);
      const int r = newton_decide<S>(err, tol, max_iter, s);
      if (r == kNewtonConverged) {
        ok = true;
        break;
      }
      if (r == kNewtonFailed) break;
      bool col = false;
      MHC_NEWTON_STEP(N, S, t, c, beta, col, LSP);
      if (col) log_col_step<N, S>(a, beta);
    }
  }
  iters = s.it;
  return ok;
}

// Continuation in the logit scale (epsilon-scaling) for large logit ranges: stages solve
// for f * a with f growing by kContGrowth up to 1, keeping the potentials in logit units
// (phi = beta / f) as the warm start; intermediate stages stop at kContStageTol. plain:
// range <= cont_range, one stage on a itself (f = 1). total: iterations of ended stages.
template <int N, typename S>
struct ContState {
  S f;
  S phi[N];
  bool plain;
  bool last;
  int total;
};

// Starts the continuation for a (row maxima 0): beta = 0, the schedule's first f.
// CONT_RANGE > 0: that logit range instead of Limits<S>::cont_range (the threshold of the
// continuation and the first stage's range; layout "thread-c10" uses 10 for fp32).
template <int N, typename S, int CONT_RANGE = 0>
MHC_HD void cont_begin(const S (&a)[N][N], ContState<N, S>& cs, S (&beta)[N]) {
  constexpr S kRange = CONT_RANGE > 0 ? S(CONT_RANGE) : Limits<S>::cont_range;
  S range = S(0);
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) range = m_max(range, -a[i][j]);
  }
  MHC_UNROLL
  for (int j = 0; j < N; ++j) beta[j] = S(0);
  cs.total = 0;
  cs.plain = !(range > kRange);
  cs.last = cs.plain;
  if (cs.plain) return;
  MHC_UNROLL
  for (int j = 0; j < N; ++j) cs.phi[j] = S(0);
  cs.f = kRange / range;
}

// Sets up the current stage of a continuation (not plain): as = f a, beta = f phi.
template <int N, typename S>
MHC_HD void cont_stage(const S (&a)[N][N], ContState<N, S>& cs, S (&as)[N][N], S (&beta)[N]) {
  cs.last = !(cs.f < S(1));
  if (cs.last) cs.f = S(1);
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) as[i][j] = a[i][j] * cs.f;
  }
  MHC_UNROLL
  for (int j = 0; j < N; ++j) beta[j] = cs.phi[j] * cs.f;
}

// The tolerance of the current stage.
template <int N, typename S>
MHC_HD S cont_tol(const ContState<N, S>& cs, S tol) {
  return cs.last ? tol : S(kContStageTol);
}

// After a stage of it iterations ended at beta: true when another stage follows (then
// phi and f are advanced; call cont_stage next).
template <int N, typename S>
MHC_HD bool cont_next(ContState<N, S>& cs, const S (&beta)[N], int it) {
  cs.total += it;
  if (cs.last) return false;
  MHC_UNROLL
  for (int j = 0; j < N; ++j) cs.phi[j] = beta[j] / cs.f;
  cs.f *= S(kContGrowth);
  return true;
}

// newton_project in ONE loop for every matrix (layout "thread-flat"): the plain solve is a
// one-stage continuation with f = 1 (as = a * 1 = a, beta = 0), and a stage's end advances
// to the next stage inside the Newton loop (next iteration: its column step) instead of
// leaving it. Same operations in the same order as newton_project, so bitwise its results
// on the CPU. Why (NOTES.md, 2026-12-01): on the GPU newton_project's plain solve and its
// continuation loop are two inlined copies of the Newton loop, and each continuation stage
// a loop of its own; a warp whose 32 matrices mix plain and continued ones (all warps at
// N(0, 3^2) with range 10) runs the copies one after the other, and each stage's loop to its
// slowest matrix. Here a warp runs to the largest total iteration count of its matrices
// (plus the column steps of stage changes, a divergent branch at the loop's top).
template <int N, typename S, int CONT_RANGE = 0, bool LSP = false>
MHC_HD bool newton_project_flat(const S (&a)[N][N], S (&t)[N][N], S tol, int max_iter,
                                int& iters, S (&beta)[N]) {
  ContState<N, S> cs;
  cont_begin<N, S, CONT_RANGE>(a, cs, beta);
  const bool plain = cs.plain;
  if (plain) {
    cs.f = S(1);
    MHC_UNROLL
    for (int j = 0; j < N; ++j) cs.phi[j] = S(0);
  }
  S as[N][N], c[N];
  cont_stage<N, S>(a, cs, as, beta);
  S stol = cont_tol(cs, tol);
  if (!plain) MHC_PROF(stage, S);
  NewtonIter<S> s;
  newton_iter_init(s);
  bool col = true;  // newton_core starts every stage with a column step
  bool ok = false;
  for (;;) {
    if (col) log_col_step<N, S>(as, beta);
    col = false;
    const S err = plan<N, S>(as, beta, t, c);
    const int r = newton_decide<S>(err, stol, max_iter, s);
    if (r == kNewtonStep) {
      MHC_NEWTON_STEP(N, S, t, c, beta, col, LSP);
      continue;
    }
    if (cs.last) {
      ok = r == kNewtonConverged;
      break;
    }
    cont_next<N, S>(cs, beta, s.it);  // an intermediate stage ended (converged or not)
    cont_stage<N, S>(a, cs, as, beta);
    stol = cont_tol(cs, tol);
    MHC_PROF(stage, S);
    newton_iter_init(s);
    col = true;
  }
  iters = cs.total + s.it;
  return ok;
}

// The projection of one matrix. Small logit ranges: one Newton solve. Large ranges:
// continuation (ContState above); this keeps every stage well conditioned and makes
// logits of magnitude 1e4 converge in tens of iterations.
template <int N, typename S, int CONT_RANGE = 0, bool LSP = false>
MHC_HD bool newton_project(const S (&a)[N][N], S (&t)[N][N], S tol, int max_iter, int& iters,
                           S (&beta)[N]) {
  ContState<N, S> cs;
  cont_begin<N, S, CONT_RANGE>(a, cs, beta);
  if (cs.plain) return newton_core<N, S, false, LSP>(a, beta, t, tol, max_iter, iters);
  bool ok = false;
  for (;;) {
    S as[N][N];
    cont_stage<N, S>(a, cs, as, beta);
    int it = 0;
    MHC_PROF(stage, S);
    ok = newton_core<N, S, false, LSP>(as, beta, t, cont_tol(cs, tol), max_iter, it);
    if (!cont_next<N, S>(cs, beta, it)) break;
  }
  iters = cs.total;
  return ok;
}

// Loads one matrix (any input type) into the solver's layout with row maxima subtracted.
// Returns false if any entry is not finite.
template <int N, typename S, typename In>
MHC_HD bool load_shifted(const In* src, S (&a)[N][N]) {
  bool finite = true;
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    S m = S(src[i * N]);
    MHC_UNROLL
    for (int j = 0; j < N; ++j) {
      a[i][j] = S(src[i * N + j]);
      finite = finite && m_finite(a[i][j]);
      m = m_max(m, a[i][j]);
    }
    MHC_UNROLL
    for (int j = 0; j < N; ++j) a[i][j] -= m;
  }
  return finite;
}

// ---------------------------------------------------------------- backward
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

// ---------------------------------------------------------------- Sinkhorn-k
// The DeepSeek / TileKernels convention:
//   P = rowsoftmax(A) + eps;  P /= colsum(P) + eps;
//   repeat iters - 1 times: P /= rowsum(P) + eps; P /= colsum(P) + eps.
// Normalization step k (0-based, 2 * iters - 1 of them): even k are column steps.
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

// Entry e of line l of p along a normalization step's axis: column l (e runs over rows)
// for a column step, row l (e over columns) for a row step. COLUMN is a compile-time
// constant, so this is a plain index (registers on the GPU after unrolling). S may be
// const-qualified (read-only access).
template <bool COLUMN, int N, typename S>
MHC_HD S& at_axis(S (&p)[N][N], int l, int e) {
  return COLUMN ? p[e][l] : p[l][e];
}

// A normalization step's factor for line l: 1 / (sum of the line + eps).
template <bool COLUMN, int N, typename S>
MHC_HD S line_inv(const S (&p)[N][N], int l, S eps) {
  S s = S(0);
  MHC_UNROLL
  for (int e = 0; e < N; ++e) s += at_axis<COLUMN>(p, l, e);
  return m_rcp(s + eps);
}

template <bool COLUMN, int N, typename S>
MHC_HD void sinkhorn_step_axis(S (&p)[N][N], S eps) {
  MHC_UNROLL
  for (int l = 0; l < N; ++l) {
    const S inv = line_inv<COLUMN>(p, l, eps);
    MHC_UNROLL
    for (int e = 0; e < N; ++e) at_axis<COLUMN>(p, l, e) *= inv;
  }
}

template <int N, typename S>
MHC_HD void sinkhorn_step(S (&p)[N][N], bool column, S eps) {
  if (column)
    sinkhorn_step_axis<true>(p, eps);
  else
    sinkhorn_step_axis<false>(p, eps);
}

// P0 = rowsoftmax(a) + eps: the first state of the iteration (and the fixed matrix of the
// scaling form below); sm gets the softmax.
template <int N, typename S>
MHC_HD void sk_p0(const S (&a)[N][N], S eps, S (&sm)[N][N], S (&p0)[N][N]) {
  softmax_rows<N, S>(a, sm);
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) p0[i][j] = sm[i][j] + eps;
  }
}

// Sinkhorn-k forward on the full N x N state: P0, then the 2 iters - 1 steps of
// sinkhorn_step (run-time loop; the CPU module's variants 0 and 1, the CUDA default).
template <int N, typename S>
MHC_HD void sinkhorn_fwd_state(const S (&a)[N][N], S (&p)[N][N], int iters, S eps) {
  S sm[N][N];
  sk_p0<N, S>(a, eps, sm, p);
  for (int k = 0; k < 2 * iters - 1; ++k) sinkhorn_step<N, S>(p, (k & 1) == 0, eps);
}

template <bool COLUMN, int N, typename S>
MHC_HD void sinkhorn_step_bwd_axis(const S (&p)[N][N], S (&dq)[N][N], S eps) {
  MHC_UNROLL
  for (int l = 0; l < N; ++l) {
    const S inv = line_inv<COLUMN>(p, l, eps);
    S dot = S(0);
    MHC_UNROLL
    for (int e = 0; e < N; ++e) dot += at_axis<COLUMN>(dq, l, e) * (at_axis<COLUMN>(p, l, e) * inv);
    MHC_UNROLL
    for (int e = 0; e < N; ++e) {
      S& d = at_axis<COLUMN>(dq, l, e);
      d = (d - dot) * inv;
    }
  }
}

// Backward of one normalization step q = p / (sum + eps), given p (its input) and dq;
// overwrites dq with dp.
template <int N, typename S>
MHC_HD void sinkhorn_step_bwd(const S (&p)[N][N], S (&dq)[N][N], bool column, S eps) {
  if (column)
    sinkhorn_step_bwd_axis<true>(p, dq, eps);
  else
    sinkhorn_step_bwd_axis<false>(p, dq, eps);
}

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

// ---------------------------------------------------------------- Sinkhorn-k backward
// Recompute formulation (scaling form). Every state of the iteration is
//   p = P0 (.) r c^T,   P0 = rowsoftmax(A) + eps,   r = c = 1 before step 0,
// and a normalization step rescales one of the two vectors:
//   column step: c_j <- c_j / (c_j (P0^T r)_j + eps),   row step: r_i <- r_i / (r_i (P0 c)_i + eps),
// which is the same iteration as sinkhorn_step (same eps placement, same order); only the
// rounding of the states differs (the products are formed in another order). The backward
// keeps the vector each step updated (N numbers per step instead of N x N), replays the
// forward once, then runs sinkhorn_step_bwd's adjoint of each step in reverse, forming the
// state it needs from the vectors: <dq, q> along a column j is c'_j sum_i dq_ij P0_ij r_i,
// and the step's factor 1 / (sum + eps) is c'_j / c_j. Derivation: docs/mhc-proj-math.md.

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

// Sinkhorn-k forward in the scaling form: P0 = rowsoftmax(a) + eps, the 2 iters - 1 vector
// steps of sk_scaling_step (column steps update c, row steps r, from r = c = 1), then
// P = P0 (.) r c^T. The steps are the calls sinkhorn_vjp_scaling's replay makes, in the
// same order on the same operands, so the forward's r and c are bitwise those the backward
// recomputes. The state is P0 and two N-vectors; a step costs one N x N mat-vec and N
// reciprocals, and the N x N result is formed once at the end. ITERS > 0: compile-time
// iteration count (iters is ignored, the loop unrolls); ITERS == 0: run-time count.
template <int N, typename S, int ITERS = 0>
MHC_HD void sinkhorn_fwd_scaling(const S (&a)[N][N], S (&p)[N][N], int iters, S eps) {
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

// Adjoint of one normalization step q = p / (sum + eps) (sum along the step's axis), with
// the states in the scaling form: q = P0 (.) r c^T after the step, the step's factor
// f = out / in. d: the adjoint of q on entry, that of p on return (sinkhorn_step_bwd's math:
// dp = (dq - <dq, q>) f along the axis).
template <int N, typename S>
MHC_HD void sk_scaling_step_bwd(const S (&p0)[N][N], const S (&other)[N], const S (&in)[N],
                                const S (&out)[N], S (&d)[N][N], bool column) {
  S h[N], f[N];
  MHC_UNROLL
  for (int j = 0; j < N; ++j) h[j] = S(0);
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) {
      const S dp = d[i][j] * p0[i][j];
      if (column)
        h[j] += dp * other[i];
      else
        h[i] += dp * other[j];
    }
  }
  MHC_UNROLL
  for (int j = 0; j < N; ++j) {
    f[j] = m_div_approx(out[j], in[j]);  // recovers the forward's factor (in ~ 1 ulp)
    h[j] = (h[j] * out[j]) * f[j];  // <dq, q> along the axis, times f
  }
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) d[i][j] = column ? d[i][j] * f[j] - h[j] : d[i][j] * f[i] - h[i];
  }
}

// The forward replay both VJPs below start with: sm = rowsoftmax(a), p0 = sm + eps, one = 1,
// and vec[k] = the vector step k of the scaling form updated (c for even k, r for odd k),
// steps = 2 iters - 1 calls of sk_scaling_step (the forward's, bitwise). steps is a
// compile-time constant after inlining when the caller's ITERS > 0 (the loop unrolls and
// vec stays in registers on the GPU).
template <int N, typename S>
MHC_HD void sk_replay(const S (&a)[N][N], int steps, S eps, S (&sm)[N][N], S (&p0)[N][N],
                      S (&one)[N], S (*vec)[N]) {
  sk_p0<N, S>(a, eps, sm, p0);
  MHC_UNROLL
  for (int i = 0; i < N; ++i) one[i] = S(1);
  MHC_UNROLL
  for (int k = 0; k < steps; ++k) {
    const S(&other)[N] = k >= 1 ? vec[k - 1] : one;
    const S(&in)[N] = k >= 2 ? vec[k - 2] : one;
    sk_scaling_step<N, S>(p0, other, in, vec[k], (k & 1) == 0, eps);
  }
}

// Exact VJP of sinkhorn_step's iteration (iters iterations, 2 iters - 1 steps) at logits a:
// g holds the output gradient on entry and dA on return. vec: workspace of 2 iters - 1
// vectors of N. ITERS > 0: compile-time iteration count (iters is ignored; the loops unroll
// and the GPU keeps vec in registers); ITERS == 0: run-time count.
template <int N, typename S, int ITERS = 0>
MHC_HD void sinkhorn_vjp_scaling(const S (&a)[N][N], S (&g)[N][N], int iters, S eps,
                                 S (*vec)[N]) {
  const int steps = 2 * (ITERS > 0 ? ITERS : iters) - 1;
  S sm[N][N], p0[N][N], one[N];
  sk_replay<N, S>(a, steps, eps, sm, p0, one, vec);
  // reverse sweep on the adjoint of the state (g: adjoint of the output state on entry)
  MHC_UNROLL
  for (int k = steps - 1; k >= 0; --k) {
    const S(&other)[N] = k >= 1 ? vec[k - 1] : one;
    const S(&in)[N] = k >= 2 ? vec[k - 2] : one;
    sk_scaling_step_bwd<N, S>(p0, other, in, vec[k], g, (k & 1) == 0);
  }
  // P0 = sm + eps: dA = the softmax backward of P0's adjoint
  softmax_rows_bwd<N, S>(sm, g);
}

// The same VJP with a division-free reverse sweep ("rescaled adjoint"; CUDA backward variant
// 3, "thread-e"; derivation in packages/mhc-proj/NOTES.md, "Sinkhorn-20 backward:
// rescaled adjoint"). Carry e = d (.) r c^T instead of the state adjoint d, with r, c the
// scaling vectors of the current state. The reverse of a column step k (out c' = vec[k],
// r = vec[k - 1]) is then
//   S_j = sum_i e_ij P0_ij  (= <dq, q> along column j),   e_ij -= r_i (S_j c'_j),
// and of a row step k (out r' = vec[k], c = vec[k - 1])
//   T_i = sum_j e_ij P0_ij,                               e_ij -= (T_i r'_i) c_j,
// because the step's factor f = c' / c cancels against the rescaling (f c = c'). At the
// start e = G (.) r c^T (the final vectors); after step 0 (r = c = 1) e is P0's adjoint.
// Per step one N x N reduction, N multiplications and one rank-1 update (2 N^2 + N FMA-type
// instructions) instead of sinkhorn_vjp_scaling's 3 N^2 + 2 N plus N quotients; the forward
// replay is the same (bitwise the same vectors).
template <int N, typename S, int ITERS = 0>
MHC_HD void sinkhorn_vjp_rescaled(const S (&a)[N][N], S (&g)[N][N], int iters, S eps,
                                  S (*vec)[N]) {
  const int steps = 2 * (ITERS > 0 ? ITERS : iters) - 1;
  S sm[N][N], p0[N][N], one[N];
  sk_replay<N, S>(a, steps, eps, sm, p0, one, vec);
  // e = G (.) r c^T: the last step is a column step (even), so c = vec[steps - 1] and
  // r = vec[steps - 2] (1 for iters = 1)
  {
    const S(&c)[N] = vec[steps - 1];
    const S(&r)[N] = steps >= 2 ? vec[steps - 2] : one;
    MHC_UNROLL
    for (int i = 0; i < N; ++i) {
      MHC_UNROLL
      for (int j = 0; j < N; ++j) g[i][j] = (g[i][j] * r[i]) * c[j];
    }
  }
  MHC_UNROLL
  for (int k = steps - 1; k >= 0; --k) {
    const S(&out)[N] = vec[k];
    const S(&other)[N] = k >= 1 ? vec[k - 1] : one;
    const bool column = (k & 1) == 0;
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
  }
  softmax_rows_bwd<N, S>(sm, g);
}

// The rescaled VJP with the replay in reciprocal form (CUDA backward variants 5 and 6,
// "thread-r-occ3" / "thread-rs"; CPU variant 4; NOTES.md, "Sinkhorn-20 backward: reciprocal
// replay"). A column step c' = c / (c (.) u + eps), u = P0^T r, is c' = 1 / ĉ' with
//   ĉ' = u + eps ĉ,   ĉ = 1 / c (the previous column step's denominator, kept),
// so a step is N multiplications (eps ĉ, the mat-vec's start, off the dependency chain),
// N^2 FMAs and N reciprocals: N fewer instructions than sk_scaling_step's N^2 + 3 N (no
// in (.) u + eps; no in * rcp), and the reciprocal follows the mat-vec directly (a shorter
// dependency chain per step: mat-vec, MUFU instead of mat-vec, FFMA, MUFU, FMUL). Mathematically the
// same iteration; the rounding differs (not bitwise sinkhorn_fwd_scaling's vectors). The
// reverse sweep is sinkhorn_vjp_rescaled's. The step vectors go through `vec`, a storage
// with put(k, v) / get(k, v) (copies of N numbers): the replay writes each once, the
// reverse reads each once (vec[k - 1] at step k; vec[k] is the previous step's read), so a
// kernel can keep some of them outside registers (shared memory) without changing the math.
// The replay's last r, c stay in registers for e = G (.) r c^T.
template <int N, typename S>
MHC_HD void sk_recip_step(const S (&p0)[N][N], const S (&other)[N], S (&hat)[N], S (&out)[N],
                          bool column, S eps) {
  MHC_UNROLL
  for (int j = 0; j < N; ++j) hat[j] *= eps;
  sk_matvec_acc<N, S>(p0, other, hat, column);
  MHC_UNROLL
  for (int j = 0; j < N; ++j) out[j] = m_rcp_approx(hat[j]);
}

// Plain-array storage for sinkhorn_vjp_recip (the CPU, and the CUDA kernels' registers or
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

// Phase 1 of sinkhorn_vjp_recip: sm = rowsoftmax(a), p0 = sm + eps, the replay into vec,
// and the final r, c. Split from phase 2 so a kernel can load G between them (G is not
// live during the replay).
template <int N, typename S, int ITERS = 0, typename Store>
MHC_HD void sk_recip_replay(const S (&a)[N][N], int iters, S eps, S (&sm)[N][N],
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

// One step of the rescaled reverse sweep (sinkhorn_vjp_rescaled's): step k's output vector
// in `out` (registers), its other vector = slot k - 1 of vec (1 for k = 0), read here and
// left in `out` for step k - 1.
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
MHC_HD void sk_recip_reverse(const S (&sm)[N][N], const S (&p0)[N][N], const S (&r)[N],
                             const S (&c)[N], S (&g)[N][N], int iters, Store& vec) {
  const int steps = 2 * (ITERS > 0 ? ITERS : iters) - 1;
  // e = G (.) r c^T with the final vectors (r = 1 for iters = 1)
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) g[i][j] = (g[i][j] * r[i]) * c[j];
  }
  // sinkhorn_vjp_rescaled's reverse sweep: out = slot k, other = slot k - 1 (1 for k = 0)
  S out[N];
  MHC_UNROLL
  for (int j = 0; j < N; ++j) out[j] = c[j];
  MHC_UNROLL
  for (int k = steps - 1; k >= 0; --k) sk_rescaled_step_bwd<N, S>(p0, g, out, k, vec);
  softmax_rows_bwd<N, S>(sm, g);
}

template <int N, typename S, int ITERS = 0, typename Store>
MHC_HD void sinkhorn_vjp_recip(const S (&a)[N][N], S (&g)[N][N], int iters, S eps,
                               Store& vec) {
  S sm[N][N], p0[N][N], r[N], c[N];
  sk_recip_replay<N, S, ITERS>(a, iters, eps, sm, p0, r, c, vec);
  sk_recip_reverse<N, S, ITERS>(sm, p0, r, c, g, iters, vec);
}

// Two matrices in flight per thread (CUDA backward variant 7, "thread-rp"; CPU variant 5):
// the reverse sweep of matrix i runs step by step interleaved with the replay of matrix
// i + 1, so each thread carries an FMA-only chain (reverse) and a MUFU-heavy chain (replay)
// at once. The slots are shared: at combined step t the reverse reads slot K - 2 - t of
// matrix i (K = 2 iters - 1 slots) and has consumed slots K - 1 - t..K - 1; the replay
// writes slot t of matrix i + 1 into the place of matrix i's slot K - 1 - t (read at step
// t - 1; slot K - 1 is never read back, the reverse starts from the replay's final c).
// So matrix i + 1's slot k lives where matrix i's slot K - 1 - k did: the mapping mirrors
// from one matrix to the next (SkMirror<FLIP>), and a thread needs K slots in all, as
// sinkhorn_vjp_recip. Io: count(), load_a(i, a), load_g(i, g), store(i, d) over the
// thread's matrices 0..count - 1; the last matrix's phase replays a copy of itself (results
// dropped) so every phase has the same code. Same operations as sinkhorn_vjp_recip per
// matrix: the same results (bitwise on the CPU).
template <bool FLIP, typename Store>
struct SkMirror {
  Store& s;
  int last;  // K - 1
  template <typename V>
  MHC_HD void put(int k, const V& x) {
    s.put(FLIP ? last - k : k, x);
  }
  template <typename V>
  MHC_HD void get(int k, V& x) const {
    s.get(FLIP ? last - k : k, x);
  }
};

template <int N, typename S>
struct SkReplayed {  // a replayed matrix: softmax, P0, final r and c
  S sm[N][N], p0[N][N], r[N], c[N];
};

// Reverse matrix i (state cur, vectors in mirror FLIP) interleaved with the replay of
// matrix i + 1 (or of i again, if last) into nxt and mirror !FLIP.
template <int N, typename S, int ITERS, bool FLIP, typename Io, typename Store>
MHC_HD void sk_pipe_phase(Io& io, int64_t i, int iters, S eps, Store& vec,
                          SkReplayed<N, S>& cur, SkReplayed<N, S>& nxt) {
  const int steps = 2 * (ITERS > 0 ? ITERS : iters) - 1;
  SkMirror<FLIP, Store> vin{vec, steps - 1};
  SkMirror<!FLIP, Store> vout{vec, steps - 1};
  S g[N][N], rh[N], ch[N], out[N];
  {
    S a[N][N];
    io.load_a(i + 1 < io.count() ? i + 1 : i, a);
    sk_p0<N, S>(a, eps, nxt.sm, nxt.p0);
  }
  io.load_g(i, g);
  MHC_UNROLL
  for (int j = 0; j < N; ++j) nxt.r[j] = nxt.c[j] = rh[j] = ch[j] = S(1);
  MHC_UNROLL
  for (int a = 0; a < N; ++a) {
    MHC_UNROLL
    for (int b = 0; b < N; ++b) g[a][b] = (g[a][b] * cur.r[a]) * cur.c[b];
  }
  MHC_UNROLL
  for (int j = 0; j < N; ++j) out[j] = cur.c[j];
  MHC_UNROLL
  for (int t = 0; t < steps; ++t) {
    sk_rescaled_step_bwd<N, S>(cur.p0, g, out, steps - 1 - t, vin);
    if ((t & 1) == 0) {
      sk_recip_step<N, S>(nxt.p0, nxt.r, ch, nxt.c, true, eps);
      vout.put(t, nxt.c);
    } else {
      sk_recip_step<N, S>(nxt.p0, nxt.c, rh, nxt.r, false, eps);
      vout.put(t, nxt.r);
    }
  }
  softmax_rows_bwd<N, S>(cur.sm, g);
  io.store(i, g);
}

template <int N, typename S, int ITERS = 0, typename Io, typename Store>
MHC_HD void sinkhorn_vjp_recip_pipe(Io& io, int iters, S eps, Store& vec) {
  const int64_t n = io.count();
  if (n <= 0) return;
  const int steps = 2 * (ITERS > 0 ? ITERS : iters) - 1;
  SkReplayed<N, S> x, y;
  {
    S a[N][N];
    io.load_a(0, a);
    SkMirror<false, Store> v0{vec, steps - 1};
    sk_recip_replay<N, S, ITERS>(a, iters, eps, x.sm, x.p0, x.r, x.c, v0);
  }
  for (int64_t i = 0; i < n; i += 2) {  // two phases per trip: the mirror alternates
    sk_pipe_phase<N, S, ITERS, false>(io, i, iters, eps, vec, x, y);
    if (i + 1 < n) sk_pipe_phase<N, S, ITERS, true>(io, i + 1, iters, eps, vec, y, x);
  }
}

// ---------------------------------------------------------------- per-matrix drivers
// project_matrix's status from the solve's outcome and the final T. Ill-conditioned (nearly
// disconnected) matrices are flagged so the caller polishes them in float64: there fp32
// rounding of the potentials shows up in T and, amplified, in its VJP.
// Large logits: the fp32 plan rounds a + beta to ~|beta| x 2^-24, and T inherits that
// error amplified by its sensitivity to the logits, which the pivot does not measure: at
// N(0, 1e4^2) ~85 of 1M matrices (two-permutation mixtures, an 8-cycle support, pivot
// ~0.1) met the marginal tolerance in fp32 but sat 3e-6..2.6e-5 from the float64 solution
// (error <= ~9e-10 x logit range, CPU). The entries that carry mass have a_ij within ~17 of
// -beta_j (up to a row constant), so the spread of the potentials bounds the logits that
// matter: a spread above kPolishSpread also sends a matrix to the float64 polish (<= ~1e-6
// below it). At N(0, 10^2) spreads stay below ~80 (no change); at 1e4 it adds the other
// 0.01% of the matrices. Uses beta, which is live anyway: no register across the solve.
constexpr double kPolishSpread = 1024.0;
template <int N, typename S>
MHC_HD S potential_spread(const S (&beta)[N]) {
  S lo = beta[0], hi = beta[0];
  MHC_UNROLL
  for (int j = 1; j < N; ++j) {
    lo = m_min(lo, beta[j]);
    hi = m_max(hi, beta[j]);
  }
  return hi - lo;
}
template <int N, typename S>
MHC_HD int projection_status(bool ok, const S (&t)[N][N], S pivot_min, S spread = S(0)) {
  if (!ok) return 0;
  if (pivot_min > S(0) && (spread > S(kPolishSpread) || min_pivot<N, S>(t) < pivot_min))
    return 2;
  return 1;
}

// Status of one projection: 1 converged, 0 not converged, 2 converged but
// ill-conditioned (min pivot < pivot_min, or potential spread > kPolishSpread when
// pivot_min > 0;
// its potentials go to beta_out for a warm-started
// float64 polish), -1 non-finite input (the output is NaN; no other matrix is affected).
// CONT_RANGE: newton_project's continuation threshold (0: Limits<S>::cont_range).
// FLAT: newton_project_flat (the same results; one loop for all stages, layout "thread-flat").
template <int N, typename S, int CONT_RANGE = 0, bool LSP = false, bool FLAT = false,
          typename In, typename Out>
MHC_HD int project_matrix(const In* src, Out* dst, S tol, int max_iter, int& iters,
                          S pivot_min = S(0), float* beta_out = nullptr) {
  S a[N][N], t[N][N];
  iters = 0;
  if (!load_shifted<N, S>(src, a)) {
    MHC_UNROLL
    for (int e = 0; e < N * N; ++e) dst[e] = Out(NAN);
    return -1;
  }
  S beta[N];
  const bool ok = FLAT ? newton_project_flat<N, S, CONT_RANGE, LSP>(a, t, tol, max_iter, iters, beta)
                      : newton_project<N, S, CONT_RANGE, LSP>(a, t, tol, max_iter, iters, beta);
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) dst[i * N + j] = Out(t[i][j]);
  }
  const S spread = pivot_min > S(0) ? potential_spread<N, S>(beta) : S(0);
  const int st = projection_status<N, S>(ok, t, pivot_min, spread);
  if (st == 2 && beta_out) {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) beta_out[j] = float(beta[j]);
  }
  return st;
}

// Float64 polish: Newton warm-started from potentials of the fp32 stage (1-2 iterations
// from an fp32-accurate start); a full solve from scratch if that does not converge.
// UPDATE: the warm-started iterations update the plan (newton_core<..., true>).
template <int N, typename S, bool UPDATE = false, bool LSP = false, typename In, typename Out>
MHC_HD int polish_matrix(const In* src, Out* dst, const float* beta_in, S tol, int max_iter,
                         int& iters) {
  S a[N][N], t[N][N], beta[N];
  iters = 0;
  if (!load_shifted<N, S>(src, a)) return -1;
  MHC_UNROLL
  for (int j = 0; j < N; ++j) beta[j] = S(beta_in[j]) - S(beta_in[N - 1]);
  bool ok = newton_core<N, S, UPDATE, LSP>(a, beta, t, tol, max_iter, iters, true);
  if (!ok) {
    int it2 = 0;
    ok = newton_project<N, S>(a, t, tol, max_iter, it2, beta);
    iters += it2;
  }
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) dst[i * N + j] = Out(t[i][j]);
  }
  return ok ? 1 : 0;
}

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
