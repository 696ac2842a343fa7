// mhc_proj._cpu: the C++ CPU path. Bindings take raw pointers and sizes (no libtorch); the
// Python layer passes tensor.data_ptr(). Every function loops over B matrices of n x n and
// calls the per-matrix math the CUDA kernels call (newton.h, vjp.h, sinkhorn.h), with the
// same solve per n (the flat solve for n = 4 float32, as the CUDA kernel): the CPU tests
// check the GPU's algorithm, host arithmetic standing in for the device's fast intrinsics.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "hc_cpu.h"
#include "newton.h"
#include "sinkhorn.h"
#include "vjp.h"

namespace py = pybind11;

namespace mhc_bnd_cpu {
void register_boundary(py::module_& m);  // the fused layer boundary (boundary_cpu.cpp)
}

namespace {

enum Dtype : int { kF32 = 0, kF64 = 1 };

template <typename T>
T* ptr(std::uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

// The solve each n runs: birkhoff_kernels.cuh's kSolve.
template <int N>
constexpr mhc::Solve kSolve = N == 4 ? mhc::Solve::kFlat : mhc::Solve::kGeneric;

// The info word's flags for a final status (converged / infeasible).
inline int status_flags(int st) {
  return st == mhc::kStatusConverged ? mhc::kInfoConverged
         : st == mhc::kStatusInfeasible ? mhc::kInfoInfeasible
                                        : 0;
}

// float32: the float32 solve, then (not converged, or to be polished) the float64 stage for
// that matrix, as the CUDA kernels' two stages. tol certifies the stored float32 T; the
// float64 stage solves to fb_tol (the caller passes min(its tolerance, tol)). Returns the
// info word.
template <int N>
int fp32_project(const float* s, float* d, double tol, int max_iter, double fb_tol,
                 int fb_max_iter, double pivot_min) {
  float beta[N];
  int iters = 0;
  int st = mhc::project_matrix<N, float, kSolve<N>>(s, d, float(tol), max_iter, iters, tol,
                                                    float(pivot_min), beta);
  if (st != mhc::kStatusNotConverged && st != mhc::kStatusPolish)
    return iters | status_flags(st);  // converged, or a NaN output (non-finite, infeasible)
  int it2 = 0;
  if (st != mhc::kStatusPolish) beta[0] = NAN;  // from scratch
  st = mhc::polish_matrix<N, double, kSolve<N>>(s, d, beta, fb_tol, fb_max_iter, it2, tol);
  const int word = (iters + it2 > 0xffff ? 0xffff : iters + it2) | mhc::kInfoFallback;
  return word | status_flags(st);
}

template <int N>
void birkhoff_fwd_n(std::uintptr_t src, std::uintptr_t dst, std::uintptr_t info, int64_t B,
                    int dtype, double tol, int max_iter, double fb_tol, int fb_max_iter,
                    double pivot_min, double range_tol) {
  int* inf = info ? ptr<int>(info) : nullptr;
  constexpr int E = N * N;
  for (int64_t b = 0; b < B; ++b) {
    int word = 0;
    if (dtype == kF32) {
      word = fp32_project<N>(ptr<const float>(src) + b * E, ptr<float>(dst) + b * E, tol,
                             max_iter, fb_tol, fb_max_iter, pivot_min);
    } else {
      int iters = 0;
      const int st = mhc::project_matrix<N, double>(ptr<const double>(src) + b * E,
                                                    ptr<double>(dst) + b * E, tol, max_iter,
                                                    iters, tol, 0.0, nullptr, range_tol);
      word = iters | status_flags(st);
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

template <int N, typename S>
void sinkhorn_fwd_t(const S* src, S* dst, int64_t B, int iters, S eps) {
  constexpr int E = N * N;
  for (int64_t b = 0; b < B; ++b) {
    S a[N][N], p[N][N];
    load<N, S>(src + b * E, a);
    mhc::sinkhorn_forward<N, S>(a, p, iters, eps);
    store<N, S>(p, dst + b * E);
  }
}

template <int N, typename S>
void sinkhorn_bwd_t(const S* src, const S* gsrc, S* dst, int64_t B, int iters, S eps) {
  constexpr int E = N * N;
  std::unique_ptr<S[][N]> vec(new S[2 * iters - 1][N]);  // the step vectors
  mhc::SkVecArray<N, S> slots{vec.get()};
  for (int64_t b = 0; b < B; ++b) {
    S a[N][N], d[N][N];
    load<N, S>(src + b * E, a);
    load<N, S>(gsrc + b * E, d);
    mhc::sinkhorn_vjp<N, S>(a, d, iters, eps, slots);
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
  static void run(std::uintptr_t s, std::uintptr_t d, int64_t B, int iters, double eps, int dt) {
    if (dt == kF32)
      sinkhorn_fwd_t<N, float>(ptr<const float>(s), ptr<float>(d), B, iters, float(eps));
    else
      sinkhorn_fwd_t<N, double>(ptr<const double>(s), ptr<double>(d), B, iters, eps);
  }
};
template <int N>
struct SkBwdF {
  static void run(std::uintptr_t s, std::uintptr_t g, std::uintptr_t d, int64_t B, int iters,
                  double eps, int dt) {
    if (dt == kF32)
      sinkhorn_bwd_t<N, float>(ptr<const float>(s), ptr<const float>(g), ptr<float>(d), B, iters,
                               float(eps));
    else
      sinkhorn_bwd_t<N, double>(ptr<const double>(s), ptr<const double>(g), ptr<double>(d), B,
                                iters, eps);
  }
};

void check_iters(int iters) {
  if (iters < 1) throw std::invalid_argument("iters must be >= 1, got " + std::to_string(iters));
}

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
  mhc_hc_cpu::register_hc(m);  // the hyper-connection layer (hc_cpu.h)
  mhc_bnd_cpu::register_boundary(m);
  m.def(
      "birkhoff_fwd",
      [](std::uintptr_t src, std::uintptr_t dst, std::uintptr_t info, int64_t B, int n, int dtype,
         double tol, int max_iter, double fb_tol, int fb_max_iter, double pivot_min,
         double range_tol) {
        py::gil_scoped_release nogil;
        dispatch_n<FwdF>(n, src, dst, info, B, dtype, tol, max_iter, fb_tol, fb_max_iter,
                         pivot_min, range_tol);
      },
      "T for B matrices of n x n (dtype 0 float32, 1 float64); info: int32 words or 0",
      py::arg("src"), py::arg("dst"), py::arg("info"), py::arg("batch"), py::arg("n"),
      py::arg("dtype"), py::arg("tol"), py::arg("max_iter"), py::arg("fallback_tol"),
      py::arg("fallback_max_iter"), py::arg("pivot_min"), py::arg("range_tol"));
  m.def(
      "birkhoff_bwd",
      [](std::uintptr_t t, std::uintptr_t g, std::uintptr_t da, int64_t B, int n, int dtype) {
        py::gil_scoped_release nogil;
        dispatch_n<BwdF>(n, t, g, da, B, dtype);
      },
      "the implicit VJP dA for B matrices T, G of n x n",
      py::arg("t"), py::arg("grad"), py::arg("out"), py::arg("batch"), py::arg("n"),
      py::arg("dtype"));
  m.def(
      "sinkhorn_fwd",
      [](std::uintptr_t src, std::uintptr_t dst, int64_t B, int n, int iters, double eps,
         int dtype) {
        check_iters(iters);
        py::gil_scoped_release nogil;
        dispatch_n<SkFwdF>(n, src, dst, B, iters, eps, dtype);
      },
      "Sinkhorn-iters of B matrices of n x n",
      py::arg("src"), py::arg("dst"), py::arg("batch"), py::arg("n"), py::arg("iters"),
      py::arg("eps"), py::arg("dtype"));
  m.def(
      "sinkhorn_bwd",
      [](std::uintptr_t src, std::uintptr_t g, std::uintptr_t dst, int64_t B, int n, int iters,
         double eps, int dtype) {
        check_iters(iters);
        py::gil_scoped_release nogil;
        dispatch_n<SkBwdF>(n, src, g, dst, B, iters, eps, dtype);
      },
      "the exact VJP of Sinkhorn-iters at B logits of n x n",
      py::arg("src"), py::arg("grad"), py::arg("out"), py::arg("batch"), py::arg("n"),
      py::arg("iters"), py::arg("eps"), py::arg("dtype"));
}
