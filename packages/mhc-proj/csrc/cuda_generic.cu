// Dispatch for n != 4 (n = 2..8) to the per-n translation units of cuda_generic_n.cu.
#include <stdexcept>
#include <string>

#include "birkhoff_kernels.cuh"

namespace mhc_cuda {

#define MHC_DECL(N)                                                                      \
  void fwd_n##N(const FwdArgs& a, int dtype, cudaStream_t s);                            \
  void bwd_n##N(const void* t, const void* g, void* da, int64_t batch, int dtype,       \
                cudaStream_t s);
MHC_DECL(2)
MHC_DECL(3)
MHC_DECL(5)
MHC_DECL(6)
MHC_DECL(7)
MHC_DECL(8)
#undef MHC_DECL

void generic_fwd(int n, const FwdArgs& a, int dtype, cudaStream_t s) {
  switch (n) {
    case 2: fwd_n2(a, dtype, s); break;
    case 3: fwd_n3(a, dtype, s); break;
    case 5: fwd_n5(a, dtype, s); break;
    case 6: fwd_n6(a, dtype, s); break;
    case 7: fwd_n7(a, dtype, s); break;
    case 8: fwd_n8(a, dtype, s); break;
    default: throw std::invalid_argument("n must be in 2..8, got " + std::to_string(n));
  }
}

void generic_bwd(int n, const void* t, const void* g, void* da, int64_t batch, int dtype,
                 cudaStream_t s) {
  switch (n) {
    case 2: bwd_n2(t, g, da, batch, dtype, s); break;
    case 3: bwd_n3(t, g, da, batch, dtype, s); break;
    case 5: bwd_n5(t, g, da, batch, dtype, s); break;
    case 6: bwd_n6(t, g, da, batch, dtype, s); break;
    case 7: bwd_n7(t, g, da, batch, dtype, s); break;
    case 8: bwd_n8(t, g, da, batch, dtype, s); break;
    default: throw std::invalid_argument("n must be in 2..8, got " + std::to_string(n));
  }
}

}  // namespace mhc_cuda
