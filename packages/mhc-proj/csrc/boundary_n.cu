// The fused boundary's kernels for one n, selected by MHC_N: CMake compiles this file once
// per n (2..8) so the instantiations build in parallel. Each n has a float32 and a bf16
// stream kernel, each with vector accesses (V = vmax) and a scalar path (V = 1, any C).
#include <stdexcept>

#include "boundary_kernels.cuh"

#ifndef MHC_N
#error "compile with -DMHC_N=<n> (see CMakeLists.txt)"
#endif
#define MHC_CAT2(a, b) a##b
#define MHC_CAT(a, b) MHC_CAT2(a, b)

namespace mhc_bnd {
namespace {

template <typename E, int V>
void run_fwd(const FwdArgs& a, cudaStream_t s) {
  constexpr size_t bytes = fwd_smem_bytes<E, MHC_N>();
  auto kernel = bnd_fwd_kernel<E, MHC_N, V>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  const dim3 grid(unsigned((a.T + kFwdTile - 1) / kFwdTile), unsigned(a.S));
  kernel<<<grid, kThreads, bytes, s>>>(a);
}

template <typename E, int V>
void run_bwd(const BwdArgs& a, cudaStream_t s) {
  constexpr size_t bytes = bwd_smem_bytes<E, MHC_N>();
  auto kernel = bnd_bwd_kernel<E, MHC_N, V>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  const int group = bwd_group(MHC_N);
  const dim3 grid(unsigned((a.T + group - 1) / group), unsigned(a.S));
  kernel<<<grid, kThreads, bytes, s>>>(a);
}

}  // namespace

// dtype 0: float32 stream, 2: bf16; vec: the vector path (the caller checked C and the
// pointers' alignment against vmax)
void MHC_CAT(bnd_fwd_n, MHC_N)(const FwdArgs& a, int dtype, bool vec, cudaStream_t s) {
  if (dtype == 2)
    vec ? run_fwd<bf16, vmax<bf16, MHC_N, kFwdVecBytes>()>(a, s) : run_fwd<bf16, 1>(a, s);
  else
    vec ? run_fwd<float, vmax<float, MHC_N, kFwdVecBytes>()>(a, s) : run_fwd<float, 1>(a, s);
}

void MHC_CAT(bnd_bwd_n, MHC_N)(const BwdArgs& a, int dtype, bool vec, cudaStream_t s) {
  if (dtype == 2)
    vec ? run_bwd<bf16, vmax<bf16, MHC_N, kBwdVecBytes>()>(a, s) : run_bwd<bf16, 1>(a, s);
  else
    vec ? run_bwd<float, vmax<float, MHC_N, kBwdVecBytes>()>(a, s) : run_bwd<float, 1>(a, s);
}

}  // namespace mhc_bnd
