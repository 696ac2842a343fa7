// The hyper-connection layer's CPU path (hc_layer.h has the math): the same five steps as
// the CUDA kernels (hc_kernels.cuh), token by token, float32 arithmetic, bf16 or float32
// stream. Included once, by cpu_module.cpp, which calls register_hc().
#pragma once

#include <pybind11/pybind11.h>

#include <cfloat>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "hc_layer.h"

namespace mhc_hc_cpu {

namespace py = pybind11;
using mhc::bf16_bits;
using mhc::host_from_float;
using mhc::host_to_float;
using u = std::uintptr_t;
constexpr int kMaxN = 8;

template <typename T>
T* ptr(u p) {
  return reinterpret_cast<T*>(p);
}

template <typename E>
void pre_fwd(const E* x, const float* mix, int parts, const float* alpha, const float* bias,
             E* y, float* maps, float* lres, float* inv_r, int64_t T, int n, int64_t C,
             float rms_eps, float pre_eps, float post_mult) {
  const int M = mhc::hc_outputs(n);
  for (int64_t t = 0; t < T; ++t) {
    const E* xr = x + t * n * C;
    float ss = 0.0f;
    for (int64_t e = 0; e < n * C; ++e) {
      const float q = host_to_float(xr[e]);
      ss += q * q;
    }
    float r = mhc::hc_inv_rms(ss, n * C, rms_eps);
    if (!(ss <= FLT_MAX)) {  // overflowed (or a non-finite entry: stays so)
      float s2 = 0.0f;
      for (int64_t e = 0; e < n * C; ++e) {
        const float q = host_to_float(xr[e]) * mhc::kRmsScale;
        s2 += q * q;
      }
      r = mhc::hc_inv_rms_scaled(s2, n * C, rms_eps);
    }
    inv_r[t] = r;
    for (int m = 0; m < M; ++m) {
      float h = mix[t * parts * M + m];
      if (parts == 2) h += mix[t * parts * M + M + m];
      mhc::hc_map_forward(m, n, h, alpha[mhc::hc_group(m, n)], bias[m], r, pre_eps, post_mult,
                          maps + t * 2 * n, lres + t * n * n);
    }
    const float* hp = maps + t * 2 * n;
    for (int64_t c = 0; c < C; ++c) {
      float acc = 0.0f;
      for (int k = 0; k < n; ++k) acc += hp[k] * host_to_float(xr[k * C + c]);
      y[t * C + c] = host_from_float<E>(acc);
    }
  }
}

template <typename E>
void post_fwd(const E* x, const E* f, const float* maps, const float* hres, E* out, int64_t T,
              int n, int64_t C) {
  for (int64_t t = 0; t < T; ++t) {
    const float* hp = maps + t * 2 * n + n;
    const float* hr = hres + t * n * n;
    for (int i = 0; i < n; ++i) {
      for (int64_t c = 0; c < C; ++c) {
        float acc = hp[i] * host_to_float(f[t * C + c]);
        for (int j = 0; j < n; ++j) acc += hr[i * n + j] * host_to_float(x[(t * n + j) * C + c]);
        out[(t * n + i) * C + c] = host_from_float<E>(acc);
      }
    }
  }
}

template <typename E>
void post_bwd(const E* gout, const E* x, const E* f, const float* maps, E* gf, float* g_hpost,
              float* g_hres, int64_t T, int n, int64_t C) {
  for (int64_t t = 0; t < T; ++t) {
    const float* hp = maps + t * 2 * n + n;
    float acc_r[kMaxN * kMaxN] = {}, acc_p[kMaxN] = {};
    for (int64_t c = 0; c < C; ++c) {
      float g[kMaxN];
      const float fv = host_to_float(f[t * C + c]);
      float gfv = 0.0f;
      for (int i = 0; i < n; ++i) {
        g[i] = host_to_float(gout[(t * n + i) * C + c]);
        gfv += hp[i] * g[i];
        acc_p[i] += g[i] * fv;
      }
      gf[t * C + c] = host_from_float<E>(gfv);
      for (int j = 0; j < n; ++j) {
        const float xv = host_to_float(x[(t * n + j) * C + c]);
        for (int i = 0; i < n; ++i) acc_r[i * n + j] += g[i] * xv;
      }
    }
    for (int q = 0; q < n * n; ++q) g_hres[t * n * n + q] = acc_r[q];
    for (int i = 0; i < n; ++i) g_hpost[t * n + i] = acc_p[i];
  }
}

template <typename E>
void pre_bwd_reduce(const E* gy, const E* x, const float* maps, const float* g_maps,
                    const float* g_lres, const float* mix, int parts, const float* inv_r,
                    const float* alpha, float* g_logit, float* g_mix, float* g_alpha,
                    float* coef, int64_t T, int n, int64_t C, float pre_eps, float post_mult) {
  const int M = mhc::hc_outputs(n);
  for (int64_t t = 0; t < T; ++t) {
    float g_hpre[kMaxN] = {};
    for (int k = 0; k < n; ++k) {
      for (int64_t c = 0; c < C; ++c)
        g_hpre[k] += host_to_float(gy[t * C + c]) * host_to_float(x[(t * n + k) * C + c]);
      g_hpre[k] += g_maps[t * 2 * n + k];  // H_pre used outside the layer too
    }
    const float r = inv_r[t];
    // parts of dL/dalpha (dl_m / dalpha = h_m inv_r) and of dL/dinv_r times inv_r (dl_m /
    // dinv_r = alpha h_m), both from the normalised h_m inv_r: finite for a stream near
    // FLT_MAX, where h_m alone is ~1e37 (hc_kernels.cuh, the same order)
    float ga[3] = {0.0f, 0.0f, 0.0f}, g_inv_r_r = 0.0f;
    for (int m = 0; m < M; ++m) {
      float h = mix[t * parts * M + m];
      if (parts == 2) h += mix[t * parts * M + M + m];
      const float gl = mhc::hc_map_backward(m, n, maps + t * 2 * n, g_hpre,
                                            g_maps + t * 2 * n + n, g_lres + t * n * n, pre_eps,
                                            post_mult);
      const int g = mhc::hc_group(m, n);
      g_logit[t * M + m] = gl;
      g_mix[t * M + m] = gl * alpha[g] * r;
      const float part = gl * (h * r);
      ga[g] += part;
      g_inv_r_r += alpha[g] * part;
    }
    for (int g = 0; g < 3; ++g) g_alpha[t * 3 + g] = ga[g];
    // dL/dx gets coef * (inv_r x): inv_r^3 x as inv_r^2 (inv_r x), so that a stream near
    // FLT_MAX (inv_r ~1e-38: inv_r^2 underflows) keeps the term
    coef[t] = -g_inv_r_r * r / float(n * C);
  }
}

template <typename E>
void pre_bwd(const E* gout, const E* gy, const E* gx, const E* x, const float* maps,
             const float* hres, const float* coef, const float* inv_r, E* g_x, int64_t T, int n,
             int64_t C) {
  for (int64_t t = 0; t < T; ++t) {
    const float* hr = hres + t * n * n;
    const float r = inv_r[t];
    for (int k = 0; k < n; ++k) {
      const float hp = maps[t * 2 * n + k];
      for (int64_t c = 0; c < C; ++c) {
        float acc = hp * host_to_float(gy[t * C + c]);
        for (int i = 0; i < n; ++i) acc += hr[i * n + k] * host_to_float(gout[(t * n + i) * C + c]);
        acc += coef[t] * (r * host_to_float(x[(t * n + k) * C + c]));
        g_x[(t * n + k) * C + c] = host_from_float<E>(acc + host_to_float(gx[(t * n + k) * C + c]));
      }
    }
  }
}

// dtype 0: float32 stream, 2: bfloat16 stream
template <typename F>
void by_dtype(int dtype, int n, F&& f) {
  if (n < 2 || n > kMaxN) throw std::invalid_argument("n must be in 2..8, got " + std::to_string(n));
  if (dtype == 0)
    f(float{});
  else if (dtype == 2)
    f(bf16_bits{});
  else
    throw std::invalid_argument("stream dtype code must be 0 (float32) or 2 (bfloat16), got " +
                                std::to_string(dtype));
}

inline void register_hc(py::module_& m) {
  m.def("hc_pre_fwd", [](u x, u mix, int parts, u alpha, u bias, u y, u maps, u lres, u inv_r,
                         int64_t T, int n, int64_t C, int dtype, double rms_eps, double pre_eps,
                         double post_mult) {
    py::gil_scoped_release nogil;
    by_dtype(dtype, n, [&](auto e) {
      using E = decltype(e);
      pre_fwd<E>(ptr<const E>(x), ptr<const float>(mix), parts, ptr<const float>(alpha),
                 ptr<const float>(bias), ptr<E>(y), ptr<float>(maps), ptr<float>(lres),
                 ptr<float>(inv_r), T, n, C, float(rms_eps), float(pre_eps), float(post_mult));
    });
  });
  m.def("hc_post_fwd", [](u x, u f, u maps, u hres, u out, int64_t T, int n, int64_t C,
                          int dtype) {
    py::gil_scoped_release nogil;
    by_dtype(dtype, n, [&](auto e) {
      using E = decltype(e);
      post_fwd<E>(ptr<const E>(x), ptr<const E>(f), ptr<const float>(maps),
                  ptr<const float>(hres), ptr<E>(out), T, n, C);
    });
  });
  m.def("hc_post_bwd", [](u gout, u x, u f, u maps, u gf, u g_hpost, u g_hres, int64_t T, int n,
                          int64_t C, int dtype) {
    py::gil_scoped_release nogil;
    by_dtype(dtype, n, [&](auto e) {
      using E = decltype(e);
      post_bwd<E>(ptr<const E>(gout), ptr<const E>(x), ptr<const E>(f), ptr<const float>(maps),
                  ptr<E>(gf), ptr<float>(g_hpost), ptr<float>(g_hres), T, n, C);
    });
  });
  m.def("hc_pre_bwd_reduce", [](u gy, u x, u maps, u g_maps, u g_lres, u mix, int parts,
                                u inv_r, u alpha, u g_logit, u g_mix, u g_alpha, u coef,
                                int64_t T, int n, int64_t C, int dtype, double pre_eps,
                                double post_mult) {
    py::gil_scoped_release nogil;
    by_dtype(dtype, n, [&](auto e) {
      using E = decltype(e);
      pre_bwd_reduce<E>(ptr<const E>(gy), ptr<const E>(x), ptr<const float>(maps),
                        ptr<const float>(g_maps), ptr<const float>(g_lres),
                        ptr<const float>(mix), parts, ptr<const float>(inv_r),
                        ptr<const float>(alpha), ptr<float>(g_logit), ptr<float>(g_mix),
                        ptr<float>(g_alpha), ptr<float>(coef), T, n, C, float(pre_eps),
                        float(post_mult));
    });
  });
  m.def("hc_pre_bwd", [](u gout, u gy, u gx, u x, u maps, u hres, u coef, u inv_r, u g_x,
                         int64_t T, int n, int64_t C, int dtype) {
    py::gil_scoped_release nogil;
    by_dtype(dtype, n, [&](auto e) {
      using E = decltype(e);
      pre_bwd<E>(ptr<const E>(gout), ptr<const E>(gy), ptr<const E>(gx), ptr<const E>(x),
                 ptr<const float>(maps), ptr<const float>(hres), ptr<const float>(coef),
                 ptr<const float>(inv_r), ptr<E>(g_x), T, n, C);
    });
  });
}

}  // namespace mhc_hc_cpu
