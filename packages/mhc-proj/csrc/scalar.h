// Scalar helpers shared by the CPU module and the CUDA kernels: the __host__ __device__
// macro, exp / log / reciprocals that map to the GPU's fast instructions on the device and
// to the C library on the host, and the solver's per-type limits.
//
// Conventions of every header here: one n x n matrix, row-major, n a compile-time
// constant N (2..8); S is the arithmetic type (float or double). The math is in
// docs/mhc-proj-math.md.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define MHC_HD __host__ __device__ __forceinline__
#else
#define MHC_HD inline
#endif

// Full unrolling on the device, except in the generic-n translation units (MHC_NO_UNROLL:
// they are the rare case and compile much faster rolled).
#if defined(__CUDACC__) && !defined(MHC_NO_UNROLL)
#define MHC_UNROLL _Pragma("unroll")
#else
#define MHC_UNROLL
#endif

namespace mhc {

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
// range and the last bit does not matter (the Sinkhorn-k steps, eps > 0).
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
MHC_HD float m_log(float x) { return logf(x); }
MHC_HD double m_log(double x) { return log(x); }
MHC_HD float m_log1p(float x) { return log1pf(x); }
MHC_HD double m_log1p(double x) { return log1p(x); }
MHC_HD float m_expm1(float x) { return expm1f(x); }
MHC_HD double m_expm1(double x) { return expm1(x); }
// expm1 for the float32 line search of the flat solve (newton.h): Taylor to x^6 / 720 for
// |x| < 1/4 (relative error < x^6 / 5040 < 5e-8), else m_exp(x) - 1 (>= 0.22 in magnitude there, so
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

// Index of the lowest set bit of x (x != 0).
MHC_HD int m_ctz(unsigned x) {
#if defined(__CUDA_ARCH__)
  return __ffs(int(x)) - 1;
#else
  return __builtin_ctz(x);
#endif
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

}  // namespace mhc
