// Launchers and pybind11 bindings of the hyper-connection layer's CUDA kernels
// (hc_kernels.cuh), registered into mhc_proj._cuda by cuda_module.cu. Raw device pointers,
// sizes and the caller's stream; no host synchronization (capturable). dtype: 0 float32,
// 2 bfloat16 (the stream's dtype; every map is float32).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "hc_kernels.cuh"

namespace py = pybind11;

namespace mhc_hc {
namespace {

enum Dtype : int { kF32 = 0, kBf16 = 2 };
// Rows up to this many bytes are staged in shared memory by hc_pre_fwd (2 blocks per SM
// at the limit; n = 4, C = 7168 bf16 is 56 KB: 4 blocks).
constexpr int64_t kStageMaxBytes = 112 * 1024;

cudaStream_t as_stream(std::uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }
template <typename T>
T* ptr(std::uintptr_t p) {
  return reinterpret_cast<T*>(p);
}
unsigned blocks_for(int64_t work, int per_block) {
  return unsigned((work + per_block - 1) / per_block);
}
void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
// 16-byte accesses need C % V == 0 and every stream pointer 16-byte aligned
bool vec_ok(int dtype, int64_t C, std::initializer_list<std::uintptr_t> ps) {
  const int v = dtype == kBf16 ? 8 : 4;
  if (C % v) return false;
  for (std::uintptr_t p : ps)
    if (p % 16) return false;
  return true;
}

template <typename E, int N, int V>
struct PreFwd {
  static void run(const PreFwdArgs& a, cudaStream_t s) {
    const int64_t bytes = int64_t(N) * a.C * int64_t(sizeof(E));
    if (bytes <= kStageMaxBytes) {
      auto kernel = hc_pre_fwd_kernel<E, N, V, true>;
      if (bytes > 48 * 1024)
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(kStageMaxBytes));
      kernel<<<unsigned(a.T), kRowThreads, size_t(bytes), s>>>(a);
    } else {
      hc_pre_fwd_kernel<E, N, V, false><<<unsigned(a.T), kRowThreads, 0, s>>>(a);
    }
  }
};
template <typename E, int N, int V>
struct PostBwd {
  static void run(const PostBwdArgs& a, cudaStream_t s) {
    hc_post_bwd_kernel<E, N, V><<<unsigned(a.T), kRowThreads, 0, s>>>(a);
  }
};
template <typename E, int N, int V>
struct PreBwdReduce {
  static void run(const PreBwdReduceArgs& a, cudaStream_t s) {
    hc_pre_bwd_reduce_kernel<E, N, V><<<unsigned(a.T), kRowThreads, 0, s>>>(a);
  }
};
template <typename E, int N, int V>
struct PostFwd {
  static void run(const void* x, const void* f, const float* maps, const float* hres, void* out,
                  int64_t T, int64_t C, cudaStream_t s) {
    hc_post_fwd_kernel<E, N, V><<<blocks_for(T * (C / V), kElemThreads), kElemThreads, 0, s>>>(
        static_cast<const E*>(x), static_cast<const E*>(f), maps, hres, static_cast<E*>(out), T,
        C);
  }
};
template <typename E, int N, int V>
struct PreBwd {
  static void run(const void* gout, const void* gy, const void* gx, const void* x,
                  const float* maps, const float* hres, const float* coef, const float* inv_r,
                  void* g_x, int64_t T, int64_t C, cudaStream_t s) {
    hc_pre_bwd_kernel<E, N, V><<<blocks_for(T * (C / V), kElemThreads), kElemThreads, 0, s>>>(
        static_cast<const E*>(gout), static_cast<const E*>(gy), static_cast<const E*>(gx),
        static_cast<const E*>(x), maps, hres, coef, inv_r, static_cast<E*>(g_x), T, C);
  }
};

template <template <typename, int, int> class Op, typename E, int V, typename... A>
void by_n(int n, A... args) {
  switch (n) {
    case 2: Op<E, 2, V>::run(args...); break;
    case 3: Op<E, 3, V>::run(args...); break;
    case 4: Op<E, 4, V>::run(args...); break;
    case 5: Op<E, 5, V>::run(args...); break;
    case 6: Op<E, 6, V>::run(args...); break;
    case 7: Op<E, 7, V>::run(args...); break;
    case 8: Op<E, 8, V>::run(args...); break;
    default: throw std::invalid_argument("n must be in 2..8, got " + std::to_string(n));
  }
}

template <template <typename, int, int> class Op, typename... A>
void dispatch(int dtype, int n, bool vec, A... args) {
  if (dtype == kBf16) {
    if (vec)
      by_n<Op, __nv_bfloat16, 8>(n, args...);
    else
      by_n<Op, __nv_bfloat16, 1>(n, args...);
  } else if (dtype == kF32) {
    if (vec)
      by_n<Op, float, 4>(n, args...);
    else
      by_n<Op, float, 1>(n, args...);
  } else {
    throw std::invalid_argument("stream dtype code must be 0 (float32) or 2 (bfloat16), got " +
                                std::to_string(dtype));
  }
}

}  // namespace

void register_hc(py::module_& m) {
  using u = std::uintptr_t;
  m.def(
      "hc_pre_fwd",
      [](u x, u mix, int parts, u alpha, u bias, u y, u maps, u lres, u inv_r, int64_t T, int n,
         int64_t C, int dtype, double rms_eps, double pre_eps, double post_mult, u stream) {
        if (T == 0) return;
        PreFwdArgs a{ptr<const void>(x), ptr<const float>(mix), parts, ptr<const float>(alpha),
                     ptr<const float>(bias), ptr<void>(y), ptr<float>(maps), ptr<float>(lres),
                     ptr<float>(inv_r), T, C, float(rms_eps), float(pre_eps), float(post_mult)};
        dispatch<PreFwd>(dtype, n, vec_ok(dtype, C, {x, y}), a, as_stream(stream));
        check_launch("hc_pre_fwd");
      },
      "inv_r, the maps and y = H_pre x for T tokens of n x C (one read of x)");
  m.def(
      "hc_post_fwd",
      [](u x, u f, u maps, u hres, u out, int64_t T, int n, int64_t C, int dtype, u stream) {
        if (T == 0 || C == 0) return;
        dispatch<PostFwd>(dtype, n, vec_ok(dtype, C, {x, f, out}), ptr<const void>(x),
                          ptr<const void>(f), ptr<const float>(maps), ptr<const float>(hres),
                          ptr<void>(out), T, C, as_stream(stream));
        check_launch("hc_post_fwd");
      },
      "out = H_post f + H_res x for T tokens");
  m.def(
      "hc_post_bwd",
      [](u gout, u x, u f, u maps, u gf, u g_hpost, u g_hres, int64_t T, int n, int64_t C,
         int dtype, u stream) {
        if (T == 0) return;
        PostBwdArgs a{ptr<const void>(gout), ptr<const void>(x),  ptr<const void>(f),
                      ptr<const float>(maps), ptr<void>(gf),     ptr<float>(g_hpost),
                      ptr<float>(g_hres),     T,                  C};
        dispatch<PostBwd>(dtype, n, vec_ok(dtype, C, {gout, x, f, gf}), a, as_stream(stream));
        check_launch("hc_post_bwd");
      },
      "g_f, dL/dH_post and dL/dH_res for T tokens");
  m.def(
      "hc_pre_bwd_reduce",
      [](u gy, u x, u maps, u g_maps, u g_lres, u mix, int parts, u inv_r, u alpha, u g_logit,
         u g_mix, u g_alpha, u coef, int64_t T, int n, int64_t C, int dtype, double pre_eps,
         double post_mult, u stream) {
        if (T == 0) return;
        PreBwdReduceArgs a{ptr<const void>(gy),      ptr<const void>(x),
                           ptr<const float>(maps),   ptr<const float>(g_maps),
                           ptr<const float>(g_lres), ptr<const float>(mix),
                           parts,                    ptr<const float>(inv_r),
                           ptr<const float>(alpha),  ptr<float>(g_logit),
                           ptr<float>(g_mix),        ptr<float>(g_alpha),
                           ptr<float>(coef),         T,
                           C,                        float(pre_eps),
                           float(post_mult)};
        dispatch<PreBwdReduce>(dtype, n, vec_ok(dtype, C, {gy, x}), a, as_stream(stream));
        check_launch("hc_pre_bwd_reduce");
      },
      "dL/dH_pre, then dL/dlogits, dL/dh, per-token dL/dalpha and the inv_r coefficient");
  m.def(
      "hc_pre_bwd",
      [](u gout, u gy, u gx, u x, u maps, u hres, u coef, u inv_r, u g_x, int64_t T, int n,
         int64_t C, int dtype, u stream) {
        if (T == 0 || C == 0) return;
        dispatch<PreBwd>(dtype, n, vec_ok(dtype, C, {gout, gy, gx, x, g_x}),
                         ptr<const void>(gout), ptr<const void>(gy), ptr<const void>(gx),
                         ptr<const void>(x), ptr<const float>(maps), ptr<const float>(hres),
                         ptr<const float>(coef), ptr<const float>(inv_r), ptr<void>(g_x), T, C,
                         as_stream(stream));
        check_launch("hc_pre_bwd");
      },
      "the stream's gradient g_x for T tokens");
}

}  // namespace mhc_hc
