// Host emulation of the 16-lane layout of mhc_lane16.h, for the tests (no GPU needed): the
// 16 lanes of one matrix run in lockstep, a lane value is an array of 16 floats, and the
// shuffles are the same lane permutations the GPU policy performs (butterfly sums add the
// lane's own value and its partner's in that order, as __fadd_rn(v, __shfl_xor_sync(...))
// does). uni() checks that a value the algorithm branches on is bitwise the same in all
// 16 lanes and counts violations: the property that keeps the GPU kernel free of
// divergence within a matrix. Arithmetic is the host's (expf, IEEE reciprocals, no FMA
// contraction), so the emulation differs from the GPU kernel by rounding only.
#pragma once

#include <cstdint>
#include <cstring>

#include "mhc_lane16.h"

namespace mhc {
namespace lane16 {

struct V16 {
  float v[16];
  V16() = default;
  explicit V16(float x) {
    for (float& e : v) e = x;
  }
};

template <class F>
inline V16 map(const V16& a, F f) {
  V16 r;
  for (int l = 0; l < 16; ++l) r.v[l] = f(a.v[l]);
  return r;
}
template <class F>
inline V16 map(const V16& a, const V16& b, F f) {
  V16 r;
  for (int l = 0; l < 16; ++l) r.v[l] = f(a.v[l], b.v[l]);
  return r;
}

inline V16 operator+(const V16& a, const V16& b) {
  return map(a, b, [](float x, float y) { return x + y; });
}
inline V16 operator-(const V16& a, const V16& b) {
  return map(a, b, [](float x, float y) { return x - y; });
}
inline V16 operator*(const V16& a, const V16& b) {
  return map(a, b, [](float x, float y) { return x * y; });
}
inline V16 operator-(const V16& a) { return map(a, [](float x) { return -x; }); }
inline V16 operator+(const V16& a, float s) { return map(a, [s](float x) { return x + s; }); }
inline V16 operator-(const V16& a, float s) { return map(a, [s](float x) { return x - s; }); }
inline V16 operator*(const V16& a, float s) { return map(a, [s](float x) { return x * s; }); }
inline V16 operator*(float s, const V16& a) { return map(a, [s](float x) { return s * x; }); }
inline V16 operator/(const V16& a, float s) { return map(a, [s](float x) { return x / s; }); }

// mhc_math.h's scalar helpers, lane by lane (found by argument-dependent lookup)
inline V16 m_exp(const V16& a) { return map(a, [](float x) { return mhc::m_exp(x); }); }
inline V16 m_log(const V16& a) { return map(a, [](float x) { return mhc::m_log(x); }); }
inline V16 m_rcp(const V16& a) { return map(a, [](float x) { return mhc::m_rcp(x); }); }
inline V16 m_expm1(const V16& a) { return map(a, [](float x) { return mhc::m_expm1(x); }); }
inline V16 m_log1p(const V16& a) { return map(a, [](float x) { return mhc::m_log1p(x); }); }
inline V16 m_abs(const V16& a) { return map(a, [](float x) { return mhc::m_abs(x); }); }

// The lane policy (see mhc_lane16.h); lane l = 4 i + j.
struct HostLanes {
  using V = V16;
  int64_t violations = 0;  // uni() calls whose value differed between lanes

  static V perm_xor(const V& v, int m) {
    V r;
    for (int l = 0; l < 16; ++l) r.v[l] = v.v[l ^ m];
    return r;
  }
  static V bfly_sum(const V& v, int m) { return v + perm_xor(v, m); }
  static V bfly_max(const V& v, int m) {
    return map(v, perm_xor(v, m), [](float x, float y) { return fmaxf(x, y); });
  }

  V row_sum(const V& v) const { return bfly_sum(bfly_sum(v, 1), 2); }
  V col_sum(const V& v) const { return bfly_sum(bfly_sum(v, 4), 8); }
  V row_max(const V& v) const { return bfly_max(bfly_max(v, 1), 2); }
  V col_max(const V& v) const { return bfly_max(bfly_max(v, 4), 8); }
  V all_max(const V& v) const { return bfly_max(bfly_max(row_max(v), 4), 8); }
  V row_xor(const V& v, int k) const { return perm_xor(v, k); }
  V from_col(const V& v, int k) const {
    V r;
    for (int l = 0; l < 16; ++l) r.v[l] = v.v[(l & ~3) | k];
    return r;
  }
  V by_col(const float (&x)[4]) const {
    V r;
    for (int l = 0; l < 16; ++l) r.v[l] = x[l & 3];
    return r;
  }
  V sel_col(const V& a, const V& b, int cols) const {
    V r;
    for (int l = 0; l < 16; ++l) r.v[l] = (cols >> (l & 3)) & 1 ? a.v[l] : b.v[l];
    return r;
  }
  float uni(const V& v) {
    uint32_t b0;
    std::memcpy(&b0, &v.v[0], 4);
    for (int l = 1; l < 16; ++l) {
      uint32_t bl;
      std::memcpy(&bl, &v.v[l], 4);
      if (bl != b0 && !(v.v[l] != v.v[l] && v.v[0] != v.v[0])) {
        ++violations;
        break;
      }
    }
    return v.v[0];
  }
  bool all_finite(const V& v) const {
    for (float x : v.v)
      if (!mhc::m_finite(x)) return false;
    return true;
  }
};

}  // namespace lane16
}  // namespace mhc
