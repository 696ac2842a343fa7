// Structural zeros and range reduction for one matrix, shared by the CPU module and the
// CUDA kernels (newton.h's prepare_matrix calls it). The input is the row-shifted logits a
// (every row maximum 0, -inf = a structural zero); work in "levels" l_ij = -a_ij >= 0.
//
// Why: a doubly stochastic T with T_ij = 0 wherever a_ij = -inf exists only when the
// support admits a perfect matching (Birkhoff-von Neumann), and T = diag(u) exp(A) diag(v)
// with finite u, v only on a support with total support (every entry on some perfect
// matching); the other entries of the support are 0 in the limit and drive Newton's
// potentials to infinity. Finite logits of enormous range (-1e30 masks, a row [2e38,
// -2e38, 0, 0]) are the same problem in disguise: the continuation would walk through 30
// decades of logit scale, and float32 cannot represent the potentials such masks need.
//
// The bound behind the cuts (docs/mhc-proj-math.md, section 6): let P be the entries of
// level <= v, and suppose P has a perfect matching sigma. For any permutation pi that uses
// an entry of level >= w, prod_i T_{i pi(i)} = prod K_pi / prod K_sigma * prod T_sigma <=
// exp(-(w - n v)), and T_{i pi(i)} >= lambda_pi for every pi of T's Birkhoff decomposition,
// so every entry of T that no perfect matching inside P reaches is at most
// n! exp(-(w - n v) / n). With w > n (v + kGapMargin) that is below 8! e^-50 < 1e-17: those
// entries are zeros of T to double precision (relative to its entries that carry mass),
// and the projection is the one of the total-support core of P alone.
#pragma once

#include "scalar.h"

namespace mhc {

// 8! exp(-50) < 1e-17: the gap in levels (beyond n times the lower levels) above which an
// entry of T is zero to double precision. Small on purpose: a compressed gap (below) is
// what the potentials must span, and the float64 plan rounds a + beta to ~|beta| 1e-16.
constexpr double kGapMargin = 50.0;

// prepare_matrix's outcomes (newton.h).
constexpr int kSupportFull = 0;        // all entries finite, no cut: a as it was
constexpr int kSupportCut = 1;         // entries set to -inf; the rest has total support
constexpr int kSupportInfeasible = 2;  // no doubly stochastic matrix on the finite support

// A perfect matching of the bipartite pattern adj (adj[i]: bit j set when row i may use
// column j), by augmenting paths found breadth first (Kuhn; n <= 8, so bit masks and
// arrays of n). col_of_row / row_of_col get the matching; false when none exists.
template <int N>
MHC_HD bool perfect_matching(const unsigned (&adj)[N], int (&col_of_row)[N], int (&row_of_col)[N]) {
  for (int k = 0; k < N; ++k) col_of_row[k] = row_of_col[k] = -1;
  for (int r = 0; r < N; ++r) {
    int queue[N], from[N];
    int head = 0, tail = 0, found = -1;
    unsigned seen = 0;
    queue[tail++] = r;
    while (head < tail && found < 0) {
      const int u = queue[head++];
      unsigned free_cols = adj[u] & ~seen;
      while (free_cols) {
        const int j = m_ctz(free_cols);
        free_cols &= free_cols - 1;
        seen |= 1u << j;
        from[j] = u;
        if (row_of_col[j] < 0) {
          found = j;
          break;
        }
        queue[tail++] = row_of_col[j];
      }
    }
    if (found < 0) return false;  // Hall's condition fails: no perfect matching
    for (int j = found;;) {  // flip the augmenting path back to r
      const int u = from[j];
      const int prev = col_of_row[u];
      row_of_col[j] = u;
      col_of_row[u] = j;
      if (u == r) break;
      j = prev;
    }
  }
  return true;
}

// Removes from adj every entry that lies on no perfect matching (adj has the matching
// col_of_row / row_of_col). Entry (i, col_of_row[v]), v != i, lies on one iff the
// alternating cycle exists: in the digraph on rows with u -> w when adj[u] has col_of_row[w]
// (row u can take w's column), v reaches i. Transitive closure by Warshall on bit masks.
template <int N>
MHC_HD void total_support(unsigned (&adj)[N], const int (&col_of_row)[N], const int (&row_of_col)[N]) {
  unsigned reach[N];
  for (int u = 0; u < N; ++u) {
    reach[u] = 0;
    for (int w = 0; w < N; ++w)
      if (w != u && ((adj[u] >> col_of_row[w]) & 1u)) reach[u] |= 1u << w;
  }
  for (int k = 0; k < N; ++k)
    for (int u = 0; u < N; ++u)
      if ((reach[u] >> k) & 1u) reach[u] |= reach[k];
  for (int i = 0; i < N; ++i) {
    unsigned keep = 0;
    for (int j = 0; j < N; ++j) {
      if (!((adj[i] >> j) & 1u)) continue;
      const int v = row_of_col[j];
      if (v == i || ((reach[v] >> i) & 1u)) keep |= 1u << j;
    }
    adj[i] = keep;
  }
}

// Largest level among the finite entries of a (the logit range the continuation sees).
template <int N, typename S>
MHC_HD S finite_range(const S (&a)[N][N]) {
  S range = S(0);
  MHC_UNROLL
  for (int i = 0; i < N; ++i) {
    MHC_UNROLL
    for (int j = 0; j < N; ++j)
      if (m_finite(a[i][j])) range = m_max(range, -a[i][j]);
  }
  return range;
}

// The level pass of reduce_support on row-shifted logits a (row maxima 0; -inf entries
// allowed; no NaN). Walks the distinct levels upward; at the first gap from level v to level w >
// n (v + kGapMargin) whose lower pattern (levels <= v) has a perfect matching, every entry
// above v becomes -inf, and the entries of the lower pattern on no perfect matching too
// (the bound above): kSupportCut. A gap whose lower pattern has no perfect matching cannot
// be cut (those entries carry mass), but its width beyond n (v + kGapMargin) changes T by
// less than double precision resolves (the same bound, applied to the compressed problem),
// so it is compressed to that width: the continuation then crosses a few stages instead of
// 30 decades. Only structural zeros above a pattern without a perfect matching:
// kSupportInfeasible. Call only when a has -inf entries or a level above n kGapMargin (else
// no gap can exist). O(n^4) comparisons; the matching only at gaps. kept_level gets an upper
// bound on the original (uncompressed) level of the entries kept: the precision the float32
// stage has for them (newton.h sends wide ones to the float64 polish).
template <int N, typename S>
MHC_HD int level_pass(S (&a)[N][N], S& kept_level) {
  S cur = S(0);  // every row has a level-0 entry (its maximum)
  S compressed = S(0);  // total width removed by compressions (all below cur)
  for (int step = 0; step < N * N; ++step) {
    S next = S(INFINITY);
    bool above = false;
    for (int i = 0; i < N; ++i)
      for (int j = 0; j < N; ++j) {
        const S l = -a[i][j];
        if (l > cur) {
          above = true;
          next = m_min(next, l);
        }
      }
    if (!above) {  // every level visited, no gap
      kept_level = cur + compressed;
      return kSupportFull;
    }
    const S thr = S(N) * (cur + S(kGapMargin));
    if (!(next > thr)) {
      cur = next;
      continue;
    }
    unsigned adj[N];
    for (int i = 0; i < N; ++i) {
      adj[i] = 0;
      for (int j = 0; j < N; ++j)
        if (-a[i][j] <= cur) adj[i] |= 1u << j;
    }
    int col_of_row[N], row_of_col[N];
    if (perfect_matching<N>(adj, col_of_row, row_of_col)) {
      total_support<N>(adj, col_of_row, row_of_col);
      for (int i = 0; i < N; ++i) {
        S m = -S(INFINITY);
        for (int j = 0; j < N; ++j) {
          if (!((adj[i] >> j) & 1u)) a[i][j] = -S(INFINITY);
          m = m_max(m, a[i][j]);
        }
        for (int j = 0; j < N; ++j) a[i][j] -= m;  // row maxima 0 again (m finite)
      }
      kept_level = cur + compressed;
      return kSupportCut;
    }
    if (!m_finite(next)) return kSupportInfeasible;
    // compress: every level above cur moves down by next - thr (new level thr + (l - next),
    // computed so that the offset of each level from next is kept exactly)
    for (int i = 0; i < N; ++i)
      for (int j = 0; j < N; ++j) {
        const S l = -a[i][j];
        if (l > cur && m_finite(l)) a[i][j] = -(thr + (l - next));
      }
    compressed += next - thr;
    cur = thr;
  }
  kept_level = Limits<S>::huge;  // (not reached: at most N * N distinct levels)
  return kSupportFull;
}

// The maximum-weight perfect matching on the finite entries of a (costs l = -a >= 0, -inf
// forbidden), by the Hungarian algorithm in its O(n^3) form with row and column potentials
// u, v (l_ij - u_i - v_j >= 0, tight on the matching). false when no perfect matching
// exists. Arrays are 1-based as in the textbook form (index 0: the virtual start column).
template <int N, typename S>
MHC_HD bool max_weight_matching(const S (&a)[N][N], S (&u)[N + 1], S (&v)[N + 1],
                                int (&row_of_col)[N + 1]) {
  int way[N + 1];
  for (int j = 0; j <= N; ++j) u[j] = v[j] = S(0), row_of_col[j] = 0, way[j] = 0;
  for (int i = 1; i <= N; ++i) {
    row_of_col[0] = i;
    int j0 = 0;
    S minv[N + 1];
    bool used[N + 1];
    for (int j = 0; j <= N; ++j) minv[j] = S(INFINITY), used[j] = false;
    do {
      used[j0] = true;
      const int i0 = row_of_col[j0];
      S delta = S(INFINITY);
      int j1 = 0;
      for (int j = 1; j <= N; ++j) {
        if (used[j]) continue;
        const S cur = -a[i0 - 1][j - 1] - u[i0] - v[j];  // +inf for a forbidden entry
        if (cur < minv[j]) minv[j] = cur, way[j] = j0;
        if (minv[j] < delta) delta = minv[j], j1 = j;
      }
      if (!(delta < S(INFINITY))) return false;  // no augmenting path: Hall fails
      for (int j = 0; j <= N; ++j) {
        if (used[j]) {
          u[row_of_col[j]] += delta;
          v[j] -= delta;
        } else {
          minv[j] -= delta;
        }
      }
      j0 = j1;
    } while (row_of_col[j0] != 0);
    do {
      const int j1 = way[j0];
      row_of_col[j0] = row_of_col[j1];
      j0 = j1;
    } while (j0);
  }
  return true;
}

// Replaces a by its reduced costs -(l_ij - u_i - v_j) <= 0 (a gauge change: the same
// projection), exactly 0 on the maximum-weight matching, so that the level-0 pattern has a
// perfect matching and the level pass cuts at the first gap. Rounding of the reduced costs
// is ~eps * max |a|: used only where the logits span too much for that to matter.
template <int N, typename S>
MHC_HD bool assignment_reduce(S (&a)[N][N]) {
  S u[N + 1], v[N + 1];
  int row_of_col[N + 1];
  if (!max_weight_matching<N, S>(a, u, v, row_of_col)) return false;
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < N; ++j)
      if (m_finite(a[i][j])) a[i][j] = m_min(S(0), a[i][j] + u[i + 1] + v[j + 1]);
  for (int j = 1; j <= N; ++j) a[row_of_col[j] - 1][j - 1] = S(0);
  for (int i = 0; i < N; ++i) {  // row maxima 0 (each row has its matched entry at 0)
    S m = -S(INFINITY);
    for (int j = 0; j < N; ++j) m = m_max(m, a[i][j]);
    for (int j = 0; j < N; ++j) a[i][j] -= m;
  }
  return true;
}

// Logit range of a reduced problem above which the level pass's compressions are given up
// for the reduced costs of the maximum-weight matching: chains of gaps whose lower
// patterns have no perfect matching compress to widths growing n-fold per gap (logits of
// magnitude 1e30 spread over a matrix: 8^20), beyond what a float64 Newton resolves.
constexpr double kMaxReducedRange = 1e6;

// The range reduction of row-shifted logits a (row maxima 0; -inf entries allowed; no
// NaN): the level pass, and when its compressed range exceeds kMaxReducedRange the level
// pass again on the reduced costs of the maximum-weight matching (which cuts at the first
// gap; those entries carry mass only below its rounding). kept_level: level_pass's.
template <int N, typename S>
MHC_HD int reduce_support(S (&a)[N][N], S& kept_level) {
  S a0[N][N];
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < N; ++j) a0[i][j] = a[i][j];
  const int st = level_pass<N, S>(a, kept_level);
  if (st == kSupportInfeasible || !(finite_range<N, S>(a) > S(kMaxReducedRange))) return st;
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < N; ++j) a[i][j] = a0[i][j];
  if (!assignment_reduce<N, S>(a)) return kSupportInfeasible;  // (level_pass found one)
  level_pass<N, S>(a, kept_level);
  kept_level = Limits<S>::huge;  // reduced costs: the float32 stage cannot be trusted
  return kSupportCut;
}

}  // namespace mhc
