// Launchers and pybind11 bindings of the fused layer boundary's CUDA kernels
// (boundary_kernels.cuh, instantiated per n by boundary_n.cu), registered into
// mhc_proj._cuda by cuda_module.cu. Raw device pointers, sizes and the caller's stream; no
// host synchronization (capturable). dtype: 0 float32, 2 bfloat16 (the stream's dtype).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "boundary_kernels.cuh"

namespace py = pybind11;

namespace mhc_bnd {

#define MHC_DECL(N)                                                              \
  void bnd_fwd_n##N(const FwdArgs& a, int dtype, bool vec, cudaStream_t s);      \
  void bnd_bwd_n##N(const BwdArgs& a, int dtype, bool vec, cudaStream_t s);
MHC_DECL(2)
MHC_DECL(3)
MHC_DECL(4)
MHC_DECL(5)
MHC_DECL(6)
MHC_DECL(7)
MHC_DECL(8)
#undef MHC_DECL

namespace {

using u = std::uintptr_t;
cudaStream_t as_stream(u s) { return reinterpret_cast<cudaStream_t>(s); }
template <typename T>
T* ptr(u p) {
  return reinterpret_cast<T*>(p);
}
void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// elements of the widest access of a kernel reading `bytes` per access (vmax)
int vec_elems(int dtype, int n, int bytes) {
  const int per = bytes / (dtype == 2 ? 2 : 4);
  const int cpi = mhc::bnd_width(n) / kLanesPerToken;
  return per < cpi ? per : cpi;
}
// the vector path: C a multiple of the vector and every (non-null) stream pointer aligned
bool vec_ok(int dtype, int n, int bytes_per_access, int64_t C, std::initializer_list<u> ps) {
  const int v = vec_elems(dtype, n, bytes_per_access);
  const int bytes = v * (dtype == 2 ? 2 : 4);
  if (C % v) return false;
  for (u p : ps)
    if (p % bytes) return false;
  return true;
}

void check_args(int n, int dtype, int64_t T, int64_t C, int S, int cps, int64_t& nchunks,
                int64_t& Cp) {
  if (n < 2 || n > 8) throw std::invalid_argument("n must be in 2..8, got " + std::to_string(n));
  if (dtype != 0 && dtype != 2)
    throw std::invalid_argument("stream dtype code must be 0 (float32) or 2 (bfloat16), got " +
                                std::to_string(dtype));
  const int W = mhc::bnd_width(n);
  nchunks = (C + W - 1) / W;
  Cp = nchunks * W;
  if (T < 0 || C < 1 || S < 1 || S > 65535 || cps < 1 || int64_t(S) * cps < nchunks ||
      int64_t(S - 1) * cps >= nchunks)
    throw std::invalid_argument("splits: S = " + std::to_string(S) + " of " + std::to_string(cps) +
                                " chunks do not cover " + std::to_string(nchunks) + " chunks");
}

__global__ void sum_splits_kernel(const float* __restrict__ part, float* __restrict__ out, int S,
                                  int64_t count) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= count) return;
  float acc = part[i];
  for (int s = 1; s < S; ++s) acc = __fadd_rn(acc, part[int64_t(s) * count + i]);
  out[i] = acc;
}

}  // namespace

void register_boundary(py::module_& m) {
  m.def(
      "bnd_fwd_main",
      [](u x, u f, u maps_prev, u hres_prev, u phi_hi, u phi_lo, u x_next, u h_part, int64_t T,
         int n, int64_t C, int dtype, bool has_post, bool has_pre, int S, int cps, u stream) {
        int64_t nchunks, Cp;
        check_args(n, dtype, T, C, S, cps, nchunks, Cp);
        if (T == 0) return;
        FwdArgs a{ptr<const void>(x),       ptr<const void>(f),       ptr<const float>(maps_prev),
                  ptr<const float>(hres_prev), ptr<const bf16>(phi_hi), ptr<const bf16>(phi_lo),
                  ptr<void>(x_next),        ptr<float>(h_part),       T,
                  C,                        Cp,                       nchunks,
                  S,                        cps,                      has_post,
                  has_pre};
        const bool vec = vec_ok(dtype, n, kFwdVecBytes, C, {x, f, x_next});
        const cudaStream_t s = as_stream(stream);
        switch (n) {
          case 2: bnd_fwd_n2(a, dtype, vec, s); break;
          case 3: bnd_fwd_n3(a, dtype, vec, s); break;
          case 4: bnd_fwd_n4(a, dtype, vec, s); break;
          case 5: bnd_fwd_n5(a, dtype, vec, s); break;
          case 6: bnd_fwd_n6(a, dtype, vec, s); break;
          case 7: bnd_fwd_n7(a, dtype, vec, s); break;
          default: bnd_fwd_n8(a, dtype, vec, s); break;
        }
        check_launch("bnd_fwd_main");
      },
      "x_next = the post-mix, and the split partials of h = vec(x_next) phi");
  m.def(
      "bnd_bwd_main",
      [](u x, u f, u maps_prev, u hres_prev, u g_next, u g_y, u maps, u coef, u inv_r, u g_mix,
         u phi_hi, u phi_lo, u g_x, u g_f, u dh_part, u dphi_part, int64_t T, int n, int64_t C,
         int dtype, bool has_post, bool has_pre, int S, int cps, int64_t groups, u stream) {
        int64_t nchunks, Cp;
        check_args(n, dtype, T, C, S, cps, nchunks, Cp);
        const int group = bwd_group(n);
        if (has_pre && groups != (T + group - 1) / group)
          throw std::invalid_argument("dL/dphi partials: " + std::to_string(groups) +
                                      " groups given, the kernel writes " +
                                      std::to_string((T + group - 1) / group));
        if (T == 0) return;
        BwdArgs a{ptr<const void>(x),        ptr<const void>(f),        ptr<const float>(maps_prev),
                  ptr<const float>(hres_prev), ptr<const void>(g_next), ptr<const void>(g_y),
                  ptr<const float>(maps),    ptr<const float>(coef),    ptr<const float>(inv_r),
                  ptr<const float>(g_mix),
                  ptr<const bf16>(phi_hi),   ptr<const bf16>(phi_lo),   ptr<void>(g_x),
                  ptr<void>(g_f),            ptr<float>(dh_part),       ptr<float>(dphi_part),
                  T,                         C,                         Cp,
                  nchunks,                   S,                         cps,
                  has_post,                  has_pre};
        const bool vec = vec_ok(dtype, n, kBwdVecBytes, C, {x, f, g_next, g_y, g_x, g_f});
        const cudaStream_t s = as_stream(stream);
        switch (n) {
          case 2: bnd_bwd_n2(a, dtype, vec, s); break;
          case 3: bnd_bwd_n3(a, dtype, vec, s); break;
          case 4: bnd_bwd_n4(a, dtype, vec, s); break;
          case 5: bnd_bwd_n5(a, dtype, vec, s); break;
          case 6: bnd_bwd_n6(a, dtype, vec, s); break;
          case 7: bnd_bwd_n7(a, dtype, vec, s); break;
          default: bnd_bwd_n8(a, dtype, vec, s); break;
        }
        check_launch("bnd_bwd_main");
      },
      "dL/dx, dL/df and the split / group partials of dL/dH and dL/dphi");
  m.def(
      "bnd_sum_splits",
      [](u part, u out, int S, int64_t count, u stream) {
        if (count == 0) return;
        sum_splits_kernel<<<unsigned((count + 255) / 256), 256, 0, as_stream(stream)>>>(
            ptr<const float>(part), ptr<float>(out), S, count);
        check_launch("bnd_sum_splits");
      },
      "out[i] = sum over s = 0..S-1 (in order) of part[s][i]");
}

}  // namespace mhc_bnd
