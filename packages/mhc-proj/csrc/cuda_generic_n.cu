// Thread-per-matrix kernels for one n != 4, selected by MHC_N. CMake compiles this file
// once per n (2, 3, 5, 6, 7, 8) so the instantiations build in parallel.
// Generic n is the rare case: no forced unrolling keeps these translation units quick to
// compile (the n = 4 kernels in cuda_module.cu are fully unrolled).
#define MHC_NO_UNROLL
#include "birkhoff_kernels.cuh"

#ifndef MHC_N
#error "compile with -DMHC_N=<n> (see CMakeLists.txt)"
#endif
#define MHC_CAT2(a, b) a##b
#define MHC_CAT(a, b) MHC_CAT2(a, b)

namespace mhc_cuda {

void MHC_CAT(fwd_n, MHC_N)(const FwdArgs& a, int dtype, cudaStream_t s) {
  launch_fwd<MHC_N>(a, dtype, s);
}

void MHC_CAT(bwd_n, MHC_N)(const void* t, const void* g, void* da, int64_t batch, int dtype,
                           cudaStream_t s) {
  launch_bwd<MHC_N>(t, g, da, batch, dtype, s);
}

}  // namespace mhc_cuda
