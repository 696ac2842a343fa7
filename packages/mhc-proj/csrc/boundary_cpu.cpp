// The fused layer boundary's CPU path (boundary.h has the math; boundary_kernels.cuh the
// CUDA kernels): the same splits and chunks, token by token, float32 arithmetic (the
// mixing GEMMs with float32 phi), bf16 or float32 stream. Registered into mhc_proj._cpu by
// cpu_module.cpp (register_boundary).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "boundary.h"
#include "hc_layer.h"

namespace mhc_bnd_cpu {

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

struct Geometry {
  int n, M, MP, W;
  int64_t T, C, Cp, nchunks;
  int S, cps;
  Geometry(int64_t T_, int n_, int64_t C_, int S_, int cps_)
      : n(n_), M(n_ * n_ + 2 * n_), MP(mhc::bnd_mpad(n_)), W(mhc::bnd_width(n_)), T(T_), C(C_),
        S(S_), cps(cps_) {
    nchunks = (C + W - 1) / W;
    Cp = nchunks * W;
    if (S < 1 || cps < 1 || int64_t(S) * cps < nchunks || int64_t(S - 1) * cps >= nchunks)
      throw std::invalid_argument("splits: S = " + std::to_string(S) + " of " +
                                  std::to_string(cps) + " chunks do not cover " +
                                  std::to_string(nchunks) + " chunks");
  }
};

// x1 of token t at column c (n values, rounded to the stream dtype E): the post-mix of the
// previous layer, or x itself at the first layer.
template <typename E>
void stream_column(const E* x, const E* f, const float* hpost, const float* hres, bool has_post,
                   int64_t t, int64_t c, const Geometry& g, float* xv, float* x1) {
  const int n = g.n;
  for (int j = 0; j < n; ++j) xv[j] = host_to_float(x[(t * n + j) * g.C + c]);
  if (!has_post) {
    for (int i = 0; i < n; ++i) x1[i] = xv[i];
    return;
  }
  const float fv = host_to_float(f[t * g.C + c]);
  for (int i = 0; i < n; ++i)
    x1[i] = host_to_float(host_from_float<E>(mhc::bnd_post(n, hres + i * n, hpost[i], xv, fv)));
}

// Forward: x_next (has_post) and the split partials of h = vec(x1) phi (has_pre).
template <typename E>
void fwd_main(const E* x, const E* f, const float* maps_prev, const float* hres_prev,
              const float* phi, E* x_next, float* h_part, const Geometry& g, bool has_post,
              bool has_pre) {
  const int n = g.n, M = g.M;
  for (int64_t t = 0; t < g.T; ++t) {
    const float* hpost = has_post ? maps_prev + t * 2 * n + n : nullptr;
    const float* hres = has_post ? hres_prev + t * n * n : nullptr;
    for (int s = 0; s < g.S; ++s) {
      float acc[kMaxN * kMaxN + 2 * kMaxN] = {};
      int64_t first, last;
      mhc::bnd_split_chunks(s, g.cps, g.nchunks, first, last);
      for (int64_t ch = first; ch < last; ++ch) {
        const int64_t end = (ch + 1) * g.W < g.C ? (ch + 1) * g.W : g.C;
        for (int64_t c = ch * g.W; c < end; ++c) {
          float xv[kMaxN], x1[kMaxN];
          stream_column(x, f, hpost, hres, has_post, t, c, g, xv, x1);
          if (has_post)
            for (int i = 0; i < n; ++i) x_next[(t * n + i) * g.C + c] = host_from_float<E>(x1[i]);
          if (!has_pre) continue;
          for (int k = 0; k < n; ++k) {
            const float* pr = phi + (k * g.C + c) * M;
            for (int m = 0; m < M; ++m) acc[m] = fmaf(x1[k], pr[m], acc[m]);
          }
        }
      }
      if (has_pre)
        for (int m = 0; m < M; ++m) h_part[(int64_t(s) * g.T + t) * M + m] = acc[m];
    }
  }
}

// Backward: dL/dx (the whole stream gradient of x), dL/df and the split partials of
// dL/dH_res, dL/dH_post (has_post); dL/dphi accumulated into dphi (n, Cp, MP) (has_pre).
template <typename E>
void bwd_main(const E* x, const E* f, const float* maps_prev, const float* hres_prev,
              const E* g_next, const E* g_y, const float* maps, const float* coef,
              const float* inv_r, const float* g_mix, const float* phi, E* g_x, E* g_f, float* dh_part, float* dphi,
              const Geometry& g, bool has_post, bool has_pre) {
  const int n = g.n, M = g.M, K = n * n + n;
  for (int64_t t = 0; t < g.T; ++t) {
    const float* hpost = has_post ? maps_prev + t * 2 * n + n : nullptr;
    const float* hres = has_post ? hres_prev + t * n * n : nullptr;
    const float* hpre = has_pre ? maps + t * 2 * n : nullptr;
    const float* gm = has_pre ? g_mix + t * M : nullptr;
    const float cf = has_pre ? coef[t] : 0.0f, r = has_pre ? inv_r[t] : 0.0f;
    for (int s = 0; s < g.S; ++s) {
      float acc[kMaxN * kMaxN + kMaxN] = {};
      int64_t first, last;
      mhc::bnd_split_chunks(s, g.cps, g.nchunks, first, last);
      for (int64_t ch = first; ch < last; ++ch) {
        const int64_t end = (ch + 1) * g.W < g.C ? (ch + 1) * g.W : g.C;
        for (int64_t c = ch * g.W; c < end; ++c) {
          float xv[kMaxN], x1[kMaxN], gt[kMaxN];
          stream_column(x, f, hpost, hres, has_post, t, c, g, xv, x1);
          const float gy = has_pre ? host_to_float(g_y[t * g.C + c]) : 0.0f;
          for (int k = 0; k < n; ++k) {
            const float gn = g_next ? host_to_float(g_next[(t * n + k) * g.C + c]) : 0.0f;
            if (!has_pre) {
              gt[k] = gn;
              continue;
            }
            const float* pr = phi + (k * g.C + c) * M;
            float gh = 0.0f;
            for (int m = 0; m < M; ++m) gh = fmaf(gm[m], pr[m], gh);
            gt[k] = mhc::bnd_stream_grad(gn, hpre[k], gy, gh, cf, r, x1[k]);
            float* dr = dphi + (k * g.Cp + c) * g.MP;
            for (int m = 0; m < M; ++m) dr[m] = fmaf(x1[k], gm[m], dr[m]);
          }
          if (!has_post) {
            for (int k = 0; k < n; ++k) g_x[(t * n + k) * g.C + c] = host_from_float<E>(gt[k]);
            continue;
          }
          float gx[kMaxN];
          const float fv = host_to_float(f[t * g.C + c]);
          const float gf = mhc::bnd_post_backward(n, hres, hpost, gt, xv, fv, gx, acc, acc + n * n);
          for (int j = 0; j < n; ++j) g_x[(t * n + j) * g.C + c] = host_from_float<E>(gx[j]);
          g_f[t * g.C + c] = host_from_float<E>(gf);
        }
      }
      if (has_post)
        for (int q = 0; q < K; ++q) dh_part[(int64_t(s) * g.T + t) * K + q] = acc[q];
    }
  }
}

// dtype 0: float32 stream, 2: bfloat16 stream
template <typename F>
void by_dtype(int dtype, int n, F&& fn) {
  if (n < 2 || n > kMaxN) throw std::invalid_argument("n must be in 2..8, got " + std::to_string(n));
  if (dtype == 0)
    fn(float{});
  else if (dtype == 2)
    fn(bf16_bits{});
  else
    throw std::invalid_argument("stream dtype code must be 0 (float32) or 2 (bfloat16), got " +
                                std::to_string(dtype));
}

void register_boundary(py::module_& m) {
  m.def("bnd_fwd_main", [](u x, u f, u maps_prev, u hres_prev, u phi, u x_next, u h_part,
                           int64_t T, int n, int64_t C, int dtype, bool has_post, bool has_pre,
                           int S, int cps) {
    const Geometry g(T, n, C, S, cps);
    py::gil_scoped_release nogil;
    by_dtype(dtype, n, [&](auto e) {
      using E = decltype(e);
      fwd_main<E>(ptr<const E>(x), ptr<const E>(f), ptr<const float>(maps_prev),
                  ptr<const float>(hres_prev), ptr<const float>(phi), ptr<E>(x_next),
                  ptr<float>(h_part), g, has_post, has_pre);
    });
  });
  m.def("bnd_bwd_main", [](u x, u f, u maps_prev, u hres_prev, u g_next, u g_y, u maps, u coef,
                           u inv_r, u g_mix, u phi, u g_x, u g_f, u dh_part, u dphi, int64_t T, int n,
                           int64_t C, int dtype, bool has_post, bool has_pre, int S, int cps) {
    const Geometry g(T, n, C, S, cps);
    py::gil_scoped_release nogil;
    by_dtype(dtype, n, [&](auto e) {
      using E = decltype(e);
      bwd_main<E>(ptr<const E>(x), ptr<const E>(f), ptr<const float>(maps_prev),
                  ptr<const float>(hres_prev), ptr<const E>(g_next), ptr<const E>(g_y),
                  ptr<const float>(maps), ptr<const float>(coef), ptr<const float>(inv_r),
                  ptr<const float>(g_mix),
                  ptr<const float>(phi), ptr<E>(g_x), ptr<E>(g_f), ptr<float>(dh_part),
                  ptr<float>(dphi), g, has_post, has_pre);
    });
  });
  m.def("bnd_sum_splits", [](u part, u out, int S, int64_t count) {
    py::gil_scoped_release nogil;
    const float* p = ptr<const float>(part);
    float* o = ptr<float>(out);
    for (int64_t i = 0; i < count; ++i) {
      float acc = p[i];
      for (int s = 1; s < S; ++s) acc += p[int64_t(s) * count + i];
      o[i] = acc;
    }
  });
}

}  // namespace mhc_bnd_cpu
