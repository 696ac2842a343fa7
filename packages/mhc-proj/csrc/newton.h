// The Newton solve of the Birkhoff projection for one matrix, shared by the CPU module
// (cpu_module.cpp) and the CUDA kernels (birkhoff_kernels.cuh): the same functions on both,
// so the CPU tests check the GPU's algorithm. Semi-dual over the column potentials beta,
// T = rowsoftmax(a + beta); Newton direction from the grounded Laplacian (laplacian.h); a
// backtracking line search on the exact, cancellation-free objective change; a log-domain
// column step when Newton cannot move; continuation in the logit scale for large logits;
// then (float32 inputs) a float64 polish of the matrices that need it. Derivation:
// docs/mhc-proj-math.md; design decisions and their measurements: docs/design/mhc-proj.md.
//
// Two configurations of the same solve (Solve below), chosen per kernel at compile time:
//   kGeneric  every n in 2..8 and float64 inputs: continuation above logit range
//             Limits<S>::cont_range (16 in float32) with one Newton loop per stage, N log1p
//             per line-search trial, a float64 polish that recomputes its plans;
//   kFlat     n = 4 float32 (the tuned kernel): continuation from logit range 10 with all
//             stages inside one Newton loop (newton_project_flat), one log1p per trial
//             (armijo_log_sum, m_expm1_fast), and a float64 polish that updates its plans
//             from the accepted step (newton_step_update).
// Both stop at the same marginal tolerance and send the same kinds of matrices to float64.
#pragma once

#include "laplacian.h"
#include "support.h"

namespace mhc {

enum class Solve { kGeneric, kFlat };

// The continuation threshold of the flat solve (float32, n = 4): the first stage of a
// continued matrix then works on a range-10 problem (fewer Newton iterations at logit std
// 10 than from 16; docs/design/mhc-proj.md).
constexpr int kFlatContRange = 10;

// Potential spread (and, for matrices through reduce_support, logit span of the kept
// entries) above which a float32 solution is polished in float64 (project_matrix below).
constexpr double kPolishSpread = 1024.0;

// Info word written per matrix when requested: bits 0..15 iterations (float32 stage plus
// float64 stage), bit 16 set when the float64 stage ran, bit 17 set when converged (the
// returned T meets the tolerance, checked in double on the stored values), bit 18 set when
// the finite support admits no doubly stochastic matrix (the output is NaN).
constexpr int kInfoFallback = 1 << 16;
constexpr int kInfoConverged = 1 << 17;
constexpr int kInfoInfeasible = 1 << 18;

// project_matrix / polish_matrix statuses.
constexpr int kStatusNotConverged = 0;
constexpr int kStatusConverged = 1;
constexpr int kStatusPolish = 2;       // converged but to be polished in float64
constexpr int kStatusNonFinite = -1;   // a NaN or +inf entry: NaN output
constexpr int kStatusInfeasible = -2;  // no doubly stochastic matrix on the support: NaN

// ---------------------------------------------------------------- the plan
// Rows of T = rowsoftmax(a + 1 beta^T); column sums in c; returns the marginal error
// sum_i |r_i - 1| + sum_j |c_j - 1| (L1 of row and column deviations).
template <int N, typename S>
MHC_HD S plan(const S (&a)[N][N], const S (&beta)[N], S (&t)[N][N], S (&c)[N]) {
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

// ---------------------------------------------------------------- Newton's scalar decisions

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
// change with 1 log1pf instead of N (~36 SASS instructions each on sm_90): the flat solve
// (its float32 trials also use m_expm1_fast); the generic solve keeps the N log1p's. A trial
// whose change exceeds log(FLT_MAX) overflows the product and is rejected (one more halving).
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
// costs the generic n = 8 fp32 kernel 100 B of register spills, nvcc 13.0). LSP (a
// compile-time bool): the flat solve's line search (m_expm1_fast, armijo_log_sum).
#define MHC_NEWTON_STEP(N, S, t, c, beta, COL, LSP)                               \
  do {                                                                            \
    S w_[N][N], b_[N], d_[N];                                                     \
    laplacian_weights<N, S>(t, w_);                                               \
    MHC_UNROLL                                                                    \
    for (int j = 0; j < N; ++j) b_[j] = S(1) - c[j];                              \
    bool accepted_ = false;                                                       \
    const bool connected_ = grounded_laplacian_solve<N, S>(w_, b_, d_);           \
    S dmax_, slope_, sumd_, step_;                                                \
    if (line_search_start<N, S>(c, d_, dmax_, slope_, sumd_, step_)) {            \
      for (int ls = 0; ls < Limits<S>::max_halvings; ++ls) {                      \
        S em_[N];                                                                 \
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
// kStepColumn when the caller must run log_col_step first (MHC_NEWTON_STEP's COL). The
// objective change is armijo_log_sum's (one log1p). Used by the float64 polish of the flat
// solve (polish_matrix<..., Solve::kFlat>), where a plan costs 16 double exponentials and
// the update 16 multiplications and N divisions: rounding of the update is ~1e-16 relative
// per iteration, far below the float32 output's.
constexpr int kStepUpdated = 0;
constexpr int kStepReplan = 1;
constexpr int kStepColumn = 2;
constexpr double kUpdateMaxStep = 1.0;
template <int N, typename S>
MHC_HD int newton_step_update(S (&t)[N][N], S (&c)[N], S (&beta)[N], S& err) {
  S w[N][N], b[N], d[N], em[N];
  laplacian_weights<N, S>(t, w);
  MHC_UNROLL
  for (int j = 0; j < N; ++j) b[j] = S(1) - c[j];
  bool accepted = false;
  const bool connected = grounded_laplacian_solve<N, S>(w, b, d);
  S dmax, slope, sumd, step;
  if (line_search_start<N, S>(c, d, dmax, slope, sumd, step)) {
    for (int ls = 0; ls < Limits<S>::max_halvings; ++ls) {
      MHC_UNROLL
      for (int j = 0; j < N; ++j) em[j] = m_expm1(step * d[j]);
      S delta = -step * sumd;
      delta += armijo_log_sum<N, S>(t, em);
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
// UPDATE (the flat solve's float64 polish): accepted steps update the plan
// (newton_step_update, one-log1p line search) instead of recomputing it from a and beta;
// the same decisions, T equal to rowsoftmax(a + beta) up to rounding. Otherwise the step is
// MHC_NEWTON_STEP with N log1p per trial (the generic solve).
template <int N, typename S, bool UPDATE = false>
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
      const int u = newton_step_update<N, S>(t, c, beta, err);
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
      MHC_NEWTON_STEP(N, S, t, c, beta, col, false);
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

// Starts the continuation for a (row maxima 0) whose finite entries span the logit range
// range (finite_range): beta = 0, the schedule's first f. CONT_RANGE > 0: that logit range
// instead of Limits<S>::cont_range (the threshold of the continuation and the first stage's
// range; the flat solve uses kFlatContRange). range is finite, so f > 0 and the stages end
// after at most log8(range / CONT_RANGE) + 1 (43 in float32, 342 in double).
template <int N, typename S, int CONT_RANGE = 0>
MHC_HD void cont_begin(S range, ContState<N, S>& cs, S (&beta)[N]) {
  constexpr S kRange = CONT_RANGE > 0 ? S(CONT_RANGE) : Limits<S>::cont_range;
  MHC_UNROLL
  for (int j = 0; j < N; ++j) beta[j] = S(0);
  cs.total = 0;
  cs.plain = !(range > kRange);
  cs.last = cs.plain;
  if (cs.plain) return;
  MHC_UNROLL
  for (int j = 0; j < N; ++j) cs.phi[j] = S(0);
  cs.f = kRange / range;
  if (!(cs.f > S(0))) cs.f = S(1);  // never: range is finite (a guard against a hang)
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

// The flat solve (n = 4 float32): newton_project's stages in ONE Newton loop, from logit
// range kFlatContRange, with the one-log1p line search. The plain solve is a one-stage
// continuation with f = 1 (as = a * 1 = a, beta = 0), and a stage's end advances to the
// next stage inside the loop (next iteration: its column step) instead of leaving it: the
// same operations in the same order as newton_project would run with that range and line
// search. Why one loop: on the GPU newton_project's plain solve and its continuation are
// two inlined copies of the Newton loop and each stage a loop of its own, so a warp whose
// 32 matrices mix plain and continued ones runs the copies one after the other, each stage
// to its slowest matrix; here a warp runs to the largest total iteration count of its
// matrices (plus the column steps of stage changes, a divergent branch at the loop's top).
// H200: 0.55x the two-loop time at logit std 10, 1.06x at std 2 (docs/design/mhc-proj.md).
template <int N, typename S>
MHC_HD bool newton_project_flat(const S (&a)[N][N], S range, S (&t)[N][N], S tol,
                                int max_iter, int& iters, S (&beta)[N]) {
  ContState<N, S> cs;
  cont_begin<N, S, kFlatContRange>(range, cs, beta);
  const bool plain = cs.plain;
  if (plain) {
    cs.f = S(1);
    MHC_UNROLL
    for (int j = 0; j < N; ++j) cs.phi[j] = S(0);
  }
  S as[N][N], c[N];
  cont_stage<N, S>(a, cs, as, beta);
  S stol = cont_tol(cs, tol);
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
      MHC_NEWTON_STEP(N, S, t, c, beta, col, true);
      continue;
    }
    if (cs.last) {
      ok = r == kNewtonConverged;
      break;
    }
    cont_next<N, S>(cs, beta, s.it);  // an intermediate stage ended (converged or not)
    cont_stage<N, S>(a, cs, as, beta);
    stol = cont_tol(cs, tol);
    newton_iter_init(s);
    col = true;
  }
  iters = cs.total + s.it;
  return ok;
}

// The generic solve of one matrix. Small logit ranges: one Newton solve. Large ranges:
// continuation (ContState above); this keeps every stage well conditioned and makes
// logits of magnitude 1e4 converge in tens of iterations. The plain solve runs as a
// one-stage continuation with f = 1 (as = a * 1 = a exactly, beta = 0), so newton_core is
// inlined once (the same operations as a separate plain call; half the code, half the
// ptxas time of the generic and float64 kernels).
template <int N, typename S>
MHC_HD bool newton_project(const S (&a)[N][N], S range, S (&t)[N][N], S tol, int max_iter,
                           int& iters, S (&beta)[N]) {
  ContState<N, S> cs;
  cont_begin<N, S>(range, cs, beta);
  if (cs.plain) {
    cs.f = S(1);
    MHC_UNROLL
    for (int j = 0; j < N; ++j) cs.phi[j] = S(0);
  }
  bool ok = false;
  for (;;) {
    S as[N][N];
    cont_stage<N, S>(a, cs, as, beta);
    int it = 0;
    ok = newton_core<N, S>(as, beta, t, cont_tol(cs, tol), max_iter, it);
    if (!cont_next<N, S>(cs, beta, it)) break;
  }
  iters = cs.total;
  return ok;
}

// prepare_matrix's outcomes.
constexpr int kPrepOk = 0;
constexpr int kPrepNonFinite = 1;  // a NaN or +inf entry
constexpr int kPrepInfeasible = 2;  // no doubly stochastic matrix on the finite support
constexpr int kPrepWider = 3;  // (float32 only) a row range beyond FLT_MAX: solve in double

// Loads one matrix (any input type) into the solver's layout with row maxima subtracted,
// -inf entries kept as structural zeros, and sets range to the logit range of its finite
// entries. Matrices with structural zeros or a range above N kGapMargin go through
// reduce_support (support.h): cuts of negligible entries, the total-support core, gap
// compression, the feasibility test. A finite entry whose shifted value overflows (a row
// [2e38, -2e38, ...] in float32) is kPrepWider (the double stage shifts it exactly); in
// double (|x| near DBL_MAX) it is clamped to -DBL_MAX, a level no finite cut keeps.
template <int N, typename S, typename In>
MHC_HD int prepare_matrix(const In* src, S (&a)[N][N], S& range, bool& wide) {
  bool nonfinite = false, empty_row = false, special = false;
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    S m = -Limits<S>::huge;
    bool any = false;  // an entry other than -inf in the row
    MHC_UNROLL
    for (int j = 0; j < N; ++j) {
      const S v = S(src[i * N + j]);
      a[i][j] = v;
      nonfinite = nonfinite || !(v < S(INFINITY));  // NaN or +inf
      any = any || v != -S(INFINITY);
      m = m_max(m, v);
    }
    empty_row = empty_row || !any;  // a row of structural zeros cannot sum to 1
    MHC_UNROLL
    for (int j = 0; j < N; ++j) {
      const S v = a[i][j] - m;
      const bool zero = !(a[i][j] > -S(INFINITY));
      special = special || zero || !(v > -S(INFINITY));
      a[i][j] = zero ? -S(INFINITY) : (v > -S(INFINITY) ? v : -Limits<S>::huge);
    }
  }
  if (nonfinite) return kPrepNonFinite;
  if (empty_row) return kPrepInfeasible;
  range = finite_range<N, S>(a);
  wide = false;
  if (!special && !(range > S(N * kGapMargin))) return kPrepOk;  // the common case
  if constexpr (sizeof(S) == 4) {
    if (range >= Limits<S>::huge) return kPrepWider;  // an overflowed shift
  }
  S kept_level;
  if (reduce_support<N, S>(a, kept_level) == kSupportInfeasible) return kPrepInfeasible;
  range = finite_range<N, S>(a);
  wide = kept_level > S(kPolishSpread);
  return kPrepOk;
}

// The L1 marginal error of the stored T (Out values, summed in double): the certificate of
// what is returned, not of the solver's working copy. Not inlined on the host: GCC 12.2 at
// -O3 vectorizes double(float(x)) for a 3 x 3 T with the float rounding dropped in some
// lanes (its SLP pass; a float T with error 0 came out 2.4e-8), so the check reads the
// stored floats back from memory in a function of its own.
template <int N, typename Out>
#if defined(__CUDACC__)
MHC_HD
#else
__attribute__((noinline))
#endif
double stored_marginal_error(const Out* t) {
  double c[N], err = 0.0;
  MHC_UNROLL
  for (int j = 0; j < N; ++j) c[j] = 0.0;
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    double r = 0.0;
    MHC_UNROLL
    for (int j = 0; j < N; ++j) {
      const double v = double(t[i * N + j]);
      r += v;
      c[j] += v;
    }
    err += fabs(r - 1.0);
  }
  MHC_UNROLL
  for (int j = 0; j < N; ++j) err += fabs(c[j] - 1.0);
  return err;
}

// True when the stored T meets cert_tol: checked in double unless T was solved and stored
// in double (then the solver's own test, in the same precision, is the check).
template <int N, typename S, typename Out>
MHC_HD bool certified(bool ok, const Out* dst, double cert_tol) {
  if (!ok) return false;
  if constexpr (sizeof(S) == 8 && sizeof(Out) == 8) return true;
  return stored_marginal_error<N, Out>(dst) <= cert_tol;
}

template <int N, typename Out>
MHC_HD void store_nan(Out* dst) {
  MHC_UNROLL
  for (int e = 0; e < N * N; ++e) dst[e] = Out(NAN);
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

// Status of one projection: kStatusConverged (the stored T meets cert_tol), kStatusNotConverged,
// kStatusPolish (converged but ill-conditioned: min pivot < pivot_min, or potential spread >
// kPolishSpread, or the stored T misses cert_tol, when pivot_min > 0; its potentials go to
// beta_out for a warm-started float64 polish), kStatusNonFinite (a NaN or +inf entry) and
// kStatusInfeasible (the output is NaN; no other matrix is affected). A float32 matrix whose
// row range overflows float32 is kStatusNotConverged with a NaN output (the float64 stage
// solves it from scratch). SOLVE: newton_project_flat (kFlat) or newton_project (kGeneric).
// range_tol > 0 (float64 inputs with the default tolerance): tol and cert_tol are raised to
// range_tol * N * (logit range the solver sees), the rounding floor of a + beta in double.
template <int N, typename S, Solve SOLVE = Solve::kGeneric, typename In, typename Out>
MHC_HD int project_matrix(const In* src, Out* dst, S tol, int max_iter, int& iters,
                          double cert_tol, S pivot_min = S(0), float* beta_out = nullptr,
                          double range_tol = 0.0) {
  S a[N][N], t[N][N], range;
  bool wide;
  iters = 0;
  const int prep = prepare_matrix<N, S>(src, a, range, wide);
  if (prep != kPrepOk) {
    store_nan<N, Out>(dst);
    if (prep == kPrepWider) return kStatusNotConverged;
    return prep == kPrepInfeasible ? kStatusInfeasible : kStatusNonFinite;
  }
  if (range_tol > 0.0) {  // the tolerance floor of this matrix's logit range (float64 inputs)
    const double floor = range_tol * N * m_max(double(range), 1.0);
    tol = m_max(tol, S(floor));
    cert_tol = m_max(cert_tol, floor);
  }
  S beta[N];
  bool ok;
  if constexpr (SOLVE == Solve::kFlat)
    ok = newton_project_flat<N, S>(a, range, t, tol, max_iter, iters, beta);
  else
    ok = newton_project<N, S>(a, range, t, tol, max_iter, iters, beta);
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) dst[i * N + j] = Out(t[i][j]);
  }
  int st;
  if (certified<N, S>(ok, dst, cert_tol)) {
    // wide: the kept logits span more than kPolishSpread before compression (their float32
    // values and row shift carry that much rounding), as a large potential spread would
    const S spread = pivot_min > S(0) ? (wide ? S(INFINITY) : potential_spread<N, S>(beta)) : S(0);
    st = projection_status<N, S>(true, t, pivot_min, spread);
  } else {
    st = ok && pivot_min > S(0) ? kStatusPolish : kStatusNotConverged;
  }
  if (st == kStatusPolish && beta_out) {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) beta_out[j] = float(beta[j]);
  }
  return st;
}

// The float64 stage for one matrix: Newton warm-started from the float32 stage's
// potentials beta_in (1-2 iterations from a float32-accurate start) unless beta_in[0] is NaN
// (the float32 stage did not converge), then, if that did not converge, the generic solve
// from scratch. One function for both cases so the CUDA kernel inlines the float64 solve
// once. SOLVE == kFlat: the warm-started iterations update the plan (newton_core<..., true>).
// Returns kStatusConverged when the stored T meets cert_tol, else kStatusNotConverged (or
// project_matrix's negative statuses).
template <int N, typename S, Solve SOLVE = Solve::kGeneric, typename In, typename Out>
MHC_HD int polish_matrix(const In* src, Out* dst, const float* beta_in, S tol, int max_iter,
                         int& iters, double cert_tol) {
  S a[N][N], t[N][N], beta[N], range;
  bool wide;
  iters = 0;
  const int prep = prepare_matrix<N, S>(src, a, range, wide);
  if (prep != kPrepOk) {
    store_nan<N, Out>(dst);
    return prep == kPrepInfeasible ? kStatusInfeasible : kStatusNonFinite;
  }
  bool ok = false;
  if (!(beta_in[0] != beta_in[0])) {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) beta[j] = S(beta_in[j]) - S(beta_in[N - 1]);
    ok = newton_core<N, S, SOLVE == Solve::kFlat>(a, beta, t, tol, max_iter, iters, true);
  }
  if (!ok) {
    int it2 = 0;
    ok = newton_project<N, S>(a, range, t, tol, max_iter, it2, beta);
    iters += it2;
  }
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    MHC_UNROLL
    for (int j = 0; j < N; ++j) dst[i * N + j] = Out(t[i][j]);
  }
  return certified<N, S>(ok, dst, cert_tol) ? kStatusConverged : kStatusNotConverged;
}

}  // namespace mhc
