// mhc_proj._cuda: the pybind11 bindings of the CUDA kernels (birkhoff_kernels.cuh for n = 4,
// cuda_generic.cu for the other n; sinkhorn_kernels.cuh). Bindings take raw device pointers,
// sizes and a cudaStream_t as an integer (the caller's current stream); no libtorch, static
// cudart, no host synchronization.
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "birkhoff_kernels.cuh"
#include "sinkhorn_kernels.cuh"

namespace py = pybind11;

namespace mhc_hc {
void register_hc(py::module_& m);  // the hyper-connection layer (cuda_hc.cu)
}
namespace mhc_bnd {
void register_boundary(py::module_& m);  // the fused layer boundary (cuda_boundary.cu)
}

namespace mhc_cuda {
void generic_fwd(int n, const FwdArgs& a, int dtype, cudaStream_t s);
void generic_bwd(int n, const void* t, const void* g, void* da, int64_t batch, int dtype,
                 cudaStream_t s);

__global__ void copy_kernel(const float* src, float* dst, int64_t count) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < count) dst[i] = src[i];
}

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

void check_iters(int iters) {
  if (iters < 1 || iters > kMaxSinkhornIters)
    throw std::invalid_argument("iters must be in 1.." + std::to_string(kMaxSinkhornIters) +
                                " on CUDA, got " + std::to_string(iters));
}

}  // namespace mhc_cuda

using namespace mhc_cuda;

namespace {
cudaStream_t as_stream(std::uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }
template <typename T>
T* ptr(std::uintptr_t p) {
  return reinterpret_cast<T*>(p);
}
}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "mhc-proj CUDA kernels (raw pointers + stream, no libtorch)";
  mhc_hc::register_hc(m);
  mhc_bnd::register_boundary(m);
  m.def("device_count", []() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return n;
  });
  m.def(
      "smoke_copy",
      [](std::uintptr_t src, std::uintptr_t dst, int64_t count, std::uintptr_t stream) {
        if (count > 0)
          copy_kernel<<<unsigned((count + 255) / 256), 256, 0, as_stream(stream)>>>(
              ptr<const float>(src), ptr<float>(dst), count);
        check_launch("smoke_copy");
      },
      py::arg("src"), py::arg("dst"), py::arg("count"), py::arg("stream"));
  m.def(
      "birkhoff_fwd",
      [](std::uintptr_t src, std::uintptr_t dst, std::uintptr_t info, std::uintptr_t work,
         int64_t B, int n, int dtype, double tol, int max_iter, double fb_tol, int fb_max_iter,
         double pivot_min, double range_tol, std::uintptr_t stream) {
        FwdArgs a{ptr<const void>(src), ptr<void>(dst), ptr<int>(info), ptr<int>(work), B,
                  tol, max_iter, fb_tol, fb_max_iter, pivot_min, range_tol};
        if (n == 4)
          launch_fwd<4>(a, dtype, as_stream(stream));
        else
          generic_fwd(n, a, dtype, as_stream(stream));
        check_launch("birkhoff_fwd");
      },
      "T for B matrices of n x n (dtype 0 float32, 1 float64); work: the float64 stage's list",
      py::arg("src"), py::arg("dst"), py::arg("info"), py::arg("work"), py::arg("batch"),
      py::arg("n"), py::arg("dtype"), py::arg("tol"), py::arg("max_iter"),
      py::arg("fallback_tol"), py::arg("fallback_max_iter"), py::arg("pivot_min"),
      py::arg("range_tol"), py::arg("stream"));
  m.def(
      "birkhoff_bwd",
      [](std::uintptr_t t, std::uintptr_t g, std::uintptr_t da, int64_t B, int n, int dtype,
         std::uintptr_t stream) {
        if (n == 4)
          launch_bwd<4>(ptr<const void>(t), ptr<const void>(g), ptr<void>(da), B, dtype,
                        as_stream(stream));
        else
          generic_bwd(n, ptr<const void>(t), ptr<const void>(g), ptr<void>(da), B, dtype,
                      as_stream(stream));
        check_launch("birkhoff_bwd");
      },
      "the implicit VJP dA for B matrices T, G of n x n",
      py::arg("t"), py::arg("grad"), py::arg("out"), py::arg("batch"), py::arg("n"),
      py::arg("dtype"), py::arg("stream"));
  m.def(
      "sinkhorn_fwd",
      [](std::uintptr_t src, std::uintptr_t dst, int64_t B, int iters, double eps,
         std::uintptr_t stream) {
        check_iters(iters);
        launch_sinkhorn_fwd(ptr<const float>(src), ptr<float>(dst), B, iters, float(eps),
                            as_stream(stream));
        check_launch("sinkhorn_fwd");
      },
      "Sinkhorn-iters of B float32 4 x 4 matrices",
      py::arg("src"), py::arg("dst"), py::arg("batch"), py::arg("iters"), py::arg("eps"),
      py::arg("stream"));
  m.def(
      "sinkhorn_bwd",
      [](std::uintptr_t src, std::uintptr_t g, std::uintptr_t dst, int64_t B, int iters,
         double eps, std::uintptr_t stream) {
        check_iters(iters);
        launch_sinkhorn_bwd(ptr<const float>(src), ptr<const float>(g), ptr<float>(dst), B,
                            iters, float(eps), as_stream(stream));
        check_launch("sinkhorn_bwd");
      },
      "the exact VJP of Sinkhorn-iters at B float32 4 x 4 logits",
      py::arg("src"), py::arg("grad"), py::arg("out"), py::arg("batch"), py::arg("iters"),
      py::arg("eps"), py::arg("stream"));
}
