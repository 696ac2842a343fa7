// mhc_proj._cpu: the C++ CPU path. Bindings take raw pointers and sizes (no libtorch);
// the Python layer passes tensor.data_ptr(). Every function loops over B matrices of
// n x n, calling the shared per-matrix math of mhc_math.h.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#define MHC_PROFILE 1  // work counters of mhc_math.h (host only), for birkhoff_fwd_profile
#include "mhc_lane16_host.h"
#include "mhc_math.h"

namespace py = pybind11;

namespace {

enum Dtype : int { kF32 = 0, kF64 = 1 };

template <typename T>
T* ptr(std::uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

// The float64 stage of the fp32 path for one matrix, after the fp32 stage returned status
// st (project_matrix's codes) in iters iterations with potentials beta: the info word.
// variant >= 1 (layouts "thread-fb2*", "thread-c10"): the warm-started polish updates its
// plans (mhc::polish_matrix<N, double, true>), as the CUDA kernel
// birkhoff_fwd_fallback<N, true>.
template <int N>
int fp32_finish(int st, int iters, const float* s, float* d, const float* beta, double fb_tol,
                int fb_max_iter, int variant = 0) {
  int word = iters;
  if (st == 1) {
    word |= mhc::kInfoConverged;
  } else if (st == 0 || st == 2) {
    int it2 = 0;
    st = st == 2 ? (variant >= 3
                        ? mhc::polish_matrix<N, double, true, true>(s, d, beta, fb_tol,
                                                                    fb_max_iter, it2)
                    : variant >= 1
                        ? mhc::polish_matrix<N, double, true>(s, d, beta, fb_tol, fb_max_iter, it2)
                        : mhc::polish_matrix<N, double>(s, d, beta, fb_tol, fb_max_iter, it2))
                 : mhc::project_matrix<N, double>(s, d, fb_tol, fb_max_iter, it2);
    word = (iters + it2 > 0xffff ? 0xffff : iters + it2) | mhc::kInfoFallback;
    if (st == 1) word |= mhc::kInfoConverged;
  }
  return word;
}

// The fp32 stage: variant 2 (layout "thread-c10") continues from logit range 10 (the CUDA
// kernel birkhoff_fwd_f32_thread<N, 10>), else from 16; variant 3 ("thread-c10ls"): range
// 10 and the one-log1p line search (birkhoff_fwd_f32_thread<N, 10, true>), whose float64
// stage also uses it; variant 4 ("thread-flat"): variant 3's math in one loop for all
// continuation stages (mhc::newton_project_flat; bitwise variant 3's results).
template <int N>
int fp32_stage1(const float* s, float* d, double tol, int max_iter, int& iters, double pivot_min,
                float* beta, int variant) {
  if (variant == 2)
    return mhc::project_matrix<N, float, 10>(s, d, float(tol), max_iter, iters, float(pivot_min),
                                            beta);
  if (variant == 3)
    return mhc::project_matrix<N, float, 10, true>(s, d, float(tol), max_iter, iters,
                                                  float(pivot_min), beta);
  if (variant == 4)
    return mhc::project_matrix<N, float, 10, true, true>(s, d, float(tol), max_iter, iters,
                                                        float(pivot_min), beta);
  return mhc::project_matrix<N, float>(s, d, float(tol), max_iter, iters, float(pivot_min),
                                       beta);
}

// fp32: Newton in float, then a float64 re-solve of only the matrices that did not
// converge. fp64: Newton in double. There is one layout on the CPU (a matrix per loop
// iteration): the CUDA binding's layout argument has no CPU counterpart.
template <int N>
void birkhoff_fwd_n(std::uintptr_t src, std::uintptr_t dst, std::uintptr_t info, int64_t B,
                    int dtype, double tol, int max_iter, double fb_tol, int fb_max_iter,
                    double pivot_min, int variant) {
  int* inf = info ? ptr<int>(info) : nullptr;
  constexpr int E = N * N;
  for (int64_t b = 0; b < B; ++b) {
    int iters = 0, word = 0;
    if (dtype == kF32) {
      const float* s = ptr<const float>(src) + b * E;
      float* d = ptr<float>(dst) + b * E;
      float beta[N];
      const int st = fp32_stage1<N>(s, d, tol, max_iter, iters, pivot_min, beta, variant);
      word = fp32_finish<N>(st, iters, s, d, beta, fb_tol, fb_max_iter, variant);
    } else {
      const double* s = ptr<const double>(src) + b * E;
      double* d = ptr<double>(dst) + b * E;
      int st = mhc::project_matrix<N, double>(s, d, tol, max_iter, iters);
      word = iters | (st == 1 ? mhc::kInfoConverged : 0);
    }
    if (inf) inf[b] = word;
  }
}

template <int N>
void birkhoff_bwd_n(std::uintptr_t t, std::uintptr_t g, std::uintptr_t da, int64_t B, int dtype) {
  constexpr int E = N * N;
  for (int64_t b = 0; b < B; ++b) {
    if (dtype == kF32) {
      mhc::vjp_matrix<N, float>(ptr<const float>(t) + b * E, ptr<const float>(g) + b * E,
                                ptr<float>(da) + b * E);
    } else {
      mhc::vjp_matrix<N, double>(ptr<const double>(t) + b * E, ptr<const double>(g) + b * E,
                                 ptr<double>(da) + b * E);
    }
  }
}

// Host emulation of the CUDA 16-lane n = 4 kernels (mhc_lane16.h run by HostLanes), for
// the tests: the same algorithm as birkhoff4_fwd_f32_lane / birkhoff4_bwd_lane, without a
// GPU. fp32 only; the forward's flagged matrices go through the same float64 stage as
// birkhoff_fwd_n. Returns the number of uniformity violations (values a branch depends on
// that differed between the 16 lanes of a matrix; must be 0).
int64_t lane16_fwd_f32(const float* src, float* dst, int* info, int64_t B, double tol,
                       int max_iter, double fb_tol, int fb_max_iter, double pivot_min) {
  mhc::lane16::HostLanes l;
  for (int64_t b = 0; b < B; ++b) {
    const float* s = src + b * 16;
    float* d = dst + b * 16;
    mhc::lane16::V16 x, t, beta;
    std::memcpy(x.v, s, sizeof(x.v));
    int iters = 0;
    const int st = mhc::lane16::project_matrix(l, x, t, beta, float(tol), max_iter, iters,
                                               float(pivot_min));
    std::memcpy(d, t.v, sizeof(t.v));
    const int word = fp32_finish<4>(st, iters, s, d, beta.v, fb_tol, fb_max_iter);  // lanes (0, j)
    if (info) info[b] = word;
  }
  return l.violations;
}

int64_t lane16_bwd_f32(const float* t, const float* g, float* da, int64_t B) {
  mhc::lane16::HostLanes l;
  for (int64_t b = 0; b < B; ++b) {
    mhc::lane16::V16 tv, gv;
    std::memcpy(tv.v, t + b * 16, sizeof(tv.v));
    std::memcpy(gv.v, g + b * 16, sizeof(gv.v));
    const mhc::lane16::V16 d = mhc::lane16::implicit_vjp(l, tv, gv);
    std::memcpy(da + b * 16, d.v, sizeof(d.v));
  }
  return l.violations;
}

void check_variant(int variant) {
  if (variant < 0 || variant > 4)
    throw std::invalid_argument("birkhoff_fwd: variant must be 0, 1, 2, 3 or 4, got " +
                                std::to_string(variant));
}

// Cost proxies of the CUDA n = 4 fp32 forward (tests and NOTES.md): birkhoff_fwd_n's fp32
// path per matrix, with the work counters of mhc_math.h written to prof (B x kProfCols
// int64): stage-1 iterations, info word, then fp32 plan, step, trial, colstep, pivot, stage,
// update counts and the same seven for float64 (the float64 stage).
constexpr int kProfCols = 16;
void birkhoff_fwd_profile4(const float* src, float* dst, int64_t* prof, int64_t B, double tol,
                           int max_iter, double fb_tol, int fb_max_iter, double pivot_min,
                           int variant) {
  for (int64_t b = 0; b < B; ++b) {
    mhc::prof() = mhc::ProfCounters{};
    const float* s = src + b * 16;
    float* d = dst + b * 16;
    float beta[4];
    int iters = 0;
    const int st = fp32_stage1<4>(s, d, tol, max_iter, iters, pivot_min, beta, variant);
    const int word = fp32_finish<4>(st, iters, s, d, beta, fb_tol, fb_max_iter, variant);
    const mhc::ProfCounters& c = mhc::prof();
    int64_t* o = prof + b * kProfCols;
    o[0] = iters;
    o[1] = word;
    for (int k = 0; k < 2; ++k) {
      o[2 + 7 * k] = c.plan[k];
      o[3 + 7 * k] = c.step[k];
      o[4 + 7 * k] = c.trial[k];
      o[5 + 7 * k] = c.colstep[k];
      o[6 + 7 * k] = c.pivot[k];
      o[7 + 7 * k] = c.stage[k];
      o[8 + 7 * k] = c.update[k];
    }
  }
}

template <int N, typename S>
void load(const S* src, S (&a)[N][N]) {
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < N; ++j) a[i][j] = src[i * N + j];
}
template <int N, typename S>
void store(const S (&a)[N][N], S* dst) {
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < N; ++j) dst[i * N + j] = a[i][j];
}

// Forward variants (the codes of the CUDA binding): 0 and 1 (CUDA: 16 lanes / thread per
// matrix) run the iteration on the full state here; 2 runs the scaling form
// (mhc::sinkhorn_fwd_scaling, the code of the CUDA scaling kernel).
constexpr int kSkFwdScaling = 2;

template <int N, typename S>
void sinkhorn_fwd_t(const S* src, S* dst, int64_t B, int iters, S eps, int variant) {
  constexpr int E = N * N;
  for (int64_t b = 0; b < B; ++b) {
    S a[N][N], p[N][N];
    load<N, S>(src + b * E, a);
    if (variant == kSkFwdScaling)
      mhc::sinkhorn_fwd_scaling<N, S>(a, p, iters, eps);
    else
      mhc::sinkhorn_fwd_state<N, S>(a, p, iters, eps);
    store<N, S>(p, dst + b * E);
  }
}

// Exact backward of the truncated iteration: the recompute formulation of the shared
// header (scaling vectors, N numbers per step), the same code the CUDA thread-per-matrix
// backward runs.
// variant 3 (CUDA "thread-e"): the rescaled-adjoint reverse sweep
// (mhc::sinkhorn_vjp_rescaled); variant 4 (CUDA "thread-r-occ3" / "thread-rs"): the same
// sweep after the reciprocal-form replay (mhc::sinkhorn_vjp_recip); other variants:
// mhc::sinkhorn_vjp_scaling.
constexpr int kSkBwdRescaled = 3;
constexpr int kSkBwdRecip = 4;
constexpr int kSkBwdRecipPipe = 5;  // CUDA "thread-rp": the two-matrix pipeline, one "thread"

// The thread-rp kernel's view of its matrices (here: all B, contiguous).
template <int N, typename S>
struct SkIoHost {
  const S* src;
  const S* gsrc;
  S* dst;
  int64_t n;
  int64_t count() const { return n; }
  void load_a(int64_t i, S (&a)[N][N]) const { load<N, S>(src + i * N * N, a); }
  void load_g(int64_t i, S (&g)[N][N]) const { load<N, S>(gsrc + i * N * N, g); }
  void store(int64_t i, const S (&d)[N][N]) const { ::store<N, S>(d, dst + i * N * N); }
};

template <int N, typename S>
void sinkhorn_bwd_t(const S* src, const S* gsrc, S* dst, int64_t B, int iters, S eps,
                    int variant) {
  constexpr int E = N * N;
  const int steps = 2 * iters - 1;
  std::unique_ptr<S[][N]> vec(new S[steps][N]);
  if (variant == kSkBwdRecipPipe) {
    SkIoHost<N, S> io{src, gsrc, dst, B};
    mhc::SkVecArray<N, S> store{vec.get()};
    mhc::sinkhorn_vjp_recip_pipe<N, S>(io, iters, eps, store);
    return;
  }
  for (int64_t b = 0; b < B; ++b) {
    S a[N][N], d[N][N];
    load<N, S>(src + b * E, a);
    load<N, S>(gsrc + b * E, d);
    if (variant == kSkBwdRecip) {
      mhc::SkVecArray<N, S> store{vec.get()};
      mhc::sinkhorn_vjp_recip<N, S>(a, d, iters, eps, store);
    } else if (variant == kSkBwdRescaled)
      mhc::sinkhorn_vjp_rescaled<N, S>(a, d, iters, eps, vec.get());
    else
      mhc::sinkhorn_vjp_scaling<N, S>(a, d, iters, eps, vec.get());
    store<N, S>(d, dst + b * E);
  }
}

template <template <int> class F, typename... Args>
void dispatch_n(int n, Args... args) {
  switch (n) {
    case 2: F<2>::run(args...); break;
    case 3: F<3>::run(args...); break;
    case 4: F<4>::run(args...); break;
    case 5: F<5>::run(args...); break;
    case 6: F<6>::run(args...); break;
    case 7: F<7>::run(args...); break;
    case 8: F<8>::run(args...); break;
    default: throw std::invalid_argument("n must be in 2..8, got " + std::to_string(n));
  }
}

template <int N>
struct FwdF {
  template <typename... A>
  static void run(A... a) { birkhoff_fwd_n<N>(a...); }
};
template <int N>
struct BwdF {
  template <typename... A>
  static void run(A... a) { birkhoff_bwd_n<N>(a...); }
};
template <int N>
struct SkFwdF {
  static void run(std::uintptr_t s, std::uintptr_t d, int64_t B, int iters, double eps, int dt,
                  int variant) {
    if (dt == kF32)
      sinkhorn_fwd_t<N, float>(ptr<const float>(s), ptr<float>(d), B, iters, float(eps),
                               variant);
    else
      sinkhorn_fwd_t<N, double>(ptr<const double>(s), ptr<double>(d), B, iters, eps, variant);
  }
};
template <int N>
struct SkBwdF {
  static void run(std::uintptr_t s, std::uintptr_t g, std::uintptr_t d, int64_t B, int iters,
                  double eps, int dt, int variant) {
    if (dt == kF32)
      sinkhorn_bwd_t<N, float>(ptr<const float>(s), ptr<const float>(g), ptr<float>(d), B, iters,
                               float(eps), variant);
    else
      sinkhorn_bwd_t<N, double>(ptr<const double>(s), ptr<const double>(g), ptr<double>(d), B,
                                iters, eps, variant);
  }
};

}  // namespace

PYBIND11_MODULE(_cpu, m) {
  m.doc() = "mhc-proj C++ CPU path (raw pointers, no libtorch)";
  m.def(
      "smoke_copy",
      [](std::uintptr_t src, std::uintptr_t dst, int64_t count) {
        std::memcpy(ptr<float>(dst), ptr<const float>(src), sizeof(float) * count);
      },
      py::arg("src"), py::arg("dst"), py::arg("count"));
  m.def("device_count", []() { return 0; });
  m.def(
      "birkhoff_fwd",
      [](std::uintptr_t src, std::uintptr_t dst, std::uintptr_t info, int64_t B, int n, int dtype,
         double tol, int max_iter, double fb_tol, int fb_max_iter, double pivot_min,
         int variant) {
        check_variant(variant);
        py::gil_scoped_release nogil;
        dispatch_n<FwdF>(n, src, dst, info, B, dtype, tol, max_iter, fb_tol, fb_max_iter,
                         pivot_min, variant);
      },
      "variant: 0 the default, 1 the float64 stage of layout \"thread-fb2\" (plan updates in "
      "the warm-started polish), 2 that and the fp32 continuation of layout \"thread-c10\", "
      "3 that and the one-log1p line search of \"thread-c10ls\", 4 that in one loop for all "
      "continuation stages (\"thread-flat\"; the same results)",
      py::arg("src"), py::arg("dst"), py::arg("info"), py::arg("batch"), py::arg("n"),
      py::arg("dtype"), py::arg("tol"), py::arg("max_iter"), py::arg("fallback_tol"),
      py::arg("fallback_max_iter"), py::arg("pivot_min"), py::arg("variant") = 0);
  m.def(
      "birkhoff_bwd",
      [](std::uintptr_t t, std::uintptr_t g, std::uintptr_t da, int64_t B, int n, int dtype) {
        py::gil_scoped_release nogil;
        dispatch_n<BwdF>(n, t, g, da, B, dtype);
      },
      py::arg("t"), py::arg("grad"), py::arg("out"), py::arg("batch"), py::arg("n"),
      py::arg("dtype"));
  m.def(
      "lane16_fwd_emulated",
      [](std::uintptr_t src, std::uintptr_t dst, std::uintptr_t info, int64_t B, double tol,
         int max_iter, double fb_tol, int fb_max_iter, double pivot_min) {
        py::gil_scoped_release nogil;
        return lane16_fwd_f32(ptr<const float>(src), ptr<float>(dst),
                              info ? ptr<int>(info) : nullptr, B, tol, max_iter, fb_tol,
                              fb_max_iter, pivot_min);
      },
      "Host emulation of the CUDA 16-lane n = 4 fp32 forward (tests); returns the count of "
      "lane-uniformity violations",
      py::arg("src"), py::arg("dst"), py::arg("info"), py::arg("batch"), py::arg("tol"),
      py::arg("max_iter"), py::arg("fallback_tol"), py::arg("fallback_max_iter"),
      py::arg("pivot_min"));
  m.def(
      "birkhoff_fwd_profile",
      [](std::uintptr_t src, std::uintptr_t dst, std::uintptr_t prof, int64_t B, double tol,
         int max_iter, double fb_tol, int fb_max_iter, double pivot_min, int variant) {
        check_variant(variant);
        py::gil_scoped_release nogil;
        birkhoff_fwd_profile4(ptr<const float>(src), ptr<float>(dst), ptr<int64_t>(prof), B, tol,
                              max_iter, fb_tol, fb_max_iter, pivot_min, variant);
      },
      "n = 4 fp32 forward with per-matrix work counters (B x 16 int64; cost proxies)",
      py::arg("src"), py::arg("dst"), py::arg("prof"), py::arg("batch"), py::arg("tol"),
      py::arg("max_iter"), py::arg("fallback_tol"), py::arg("fallback_max_iter"),
      py::arg("pivot_min"), py::arg("variant") = 0);
  m.def(
      "lane16_bwd_emulated",
      [](std::uintptr_t t, std::uintptr_t g, std::uintptr_t da, int64_t B) {
        py::gil_scoped_release nogil;
        return lane16_bwd_f32(ptr<const float>(t), ptr<const float>(g), ptr<float>(da), B);
      },
      "Host emulation of the CUDA 16-lane n = 4 fp32 backward (tests); returns the count of "
      "lane-uniformity violations",
      py::arg("t"), py::arg("grad"), py::arg("out"), py::arg("batch"));
  m.def(
      "sinkhorn_fwd",
      [](std::uintptr_t src, std::uintptr_t dst, int64_t B, int n, int iters, double eps,
         int dtype, int variant) {
        if (variant < 0 || variant > kSkFwdScaling)
          throw std::invalid_argument("sinkhorn_fwd: variant must be 0, 1 (full state) or 2 "
                                      "(scaling form), got " +
                                      std::to_string(variant));
        py::gil_scoped_release nogil;
        dispatch_n<SkFwdF>(n, src, dst, B, iters, eps, dtype, variant);
      },
      py::arg("src"), py::arg("dst"), py::arg("batch"), py::arg("n"), py::arg("iters"),
      py::arg("eps"), py::arg("dtype"), py::arg("variant") = 1);
  m.def(
      "sinkhorn_bwd",
      [](std::uintptr_t src, std::uintptr_t g, std::uintptr_t dst, int64_t B, int n, int iters,
         double eps, int dtype, int variant) {
        if (variant < 0 || variant > kSkBwdRecipPipe)
          throw std::invalid_argument("sinkhorn_bwd: variant must be 0..5, got " +
                                      std::to_string(variant));
        py::gil_scoped_release nogil;
        dispatch_n<SkBwdF>(n, src, g, dst, B, iters, eps, dtype, variant);
      },
      "variant 3 (\"thread-e\"): the rescaled-adjoint reverse sweep; 4 (\"thread-r*\"): "
      "the same after the reciprocal-form replay; 5 (\"thread-rp\"): 4 as a two-matrix "
      "pipeline; else the recompute formulation of the thread kernel",
      py::arg("src"), py::arg("grad"), py::arg("out"), py::arg("batch"), py::arg("n"),
      py::arg("iters"), py::arg("eps"), py::arg("dtype"), py::arg("variant") = 1);
}
