"""Every setting of mhc-proj in one place.

There are no environment switches: each op has one kernel per case (n = 4 float32 on CUDA
the tuned one, every other case the generic one), chosen from the input, and nothing is
read from the environment. The numbers below are the defaults of the public functions'
arguments and the float64 stage's fixed parameters (README, "Configuration"). Build-time
options (``MHC_PROJ_CUDA``, ``CMAKE_CUDA_ARCHITECTURES``) are CMake's, given to pip.
"""

from __future__ import annotations

# birkhoff_project. float32 (and bfloat16 / float16, computed in float32): stop at an L1
# marginal error of 4e-6 (the float32 rounding floor of the check is ~1e-6); matrices that
# miss it, or whose Hessian has a pivot below PIVOT_MIN (nearly disconnected support: T
# and its VJP most sensitive to rounding), or whose potentials spread over more than 1024
# (csrc/newton.h, kPolishSpread), are re-solved in float64 to FALLBACK_TOL. float64 inputs
# are solved in float64 to TOL_F64. max_iter counts Newton iterations per continuation stage
# (an explicit max_iter caps the float64 stage too; by default it has FALLBACK_MAX_ITER).
# The float64 stage solves to min(FALLBACK_TOL, tol); ``converged`` certifies the returned T
# (its marginal error summed in double <= tol), whatever stage produced it.
TOL_F32, MAX_ITER_F32 = 4e-6, 30
TOL_F64, MAX_ITER_F64 = 1e-13, 100
FALLBACK_TOL, FALLBACK_MAX_ITER = 1e-10, 200
PIVOT_MIN = 2e-4
# float64 logits with the default tol: a matrix's tolerance is raised to
# RANGE_TOL_F64 * n * (its logit range as the solver sees it, after csrc/support.h's
# reduction): the floor at which a double plan resolves a + beta. 1e-13 stays the
# tolerance up to a range of ~28 / n (found by test_fuzz.py: N(0,1e3^2) float64 logits and
# masked float64 matrices stalled at 1e-13..7e-11 under the plain 1e-13).
RANGE_TOL_F64 = 16 * 2.0**-52
# The largest max_iter / iters accepted (the info word counts iterations up to 65535).
MAX_ITER_LIMIT = 10_000

# sinkhorn_project (the DeepSeek / TileKernels defaults). CUDA kernels exist for n = 4
# float32 and iters <= SINKHORN_CUDA_MAX_ITERS; other CUDA cases run the same iteration in
# torch ops.
SINKHORN_ITERS, SINKHORN_EPS = 20, 1e-6
SINKHORN_CUDA_MAX_ITERS = 64
SINKHORN_MAX_ITERS = 10_000

# Supported matrix sizes: the compiled kernels are instantiated for n = 2..N_MAX_KERNEL;
# n up to N_MAX runs torch ops (the projection: the float64 Newton solve of
# mhc_proj.reference; the layer: its maps and mix in torch ops). 16 is the top of the range
# other mHC implementations state (Liger-Kernel's LigerMHC: hc in 2..16).
N_MIN, N_MAX_KERNEL, N_MAX = 2, 8, 16

# The hyper-connection layer (mhc_proj.nn.HyperConnection, Liger-Kernel's LigerMHC defaults):
# the RMS epsilon of inv_r, the additive epsilon of H_pre, the multiplier of H_post; the
# initial alphas (the mHC paper's gating-factor init, 0.01) and the std of phi's init.
HC_RMS_EPS, HC_PRE_EPS, HC_POST_MULT = 1e-6, 0.0, 2.0
HC_ALPHA_INIT, HC_PHI_STD = 0.01, 0.02
# formulation="deepseek" (DeepSeek-V4's config and TileKernels' defaults): hc_eps, added to
# H_pre (and, for Sinkhorn, its eps too: the same 1e-6 as SINKHORN_EPS).
DEEPSEEK_HC_EPS = 1e-6

# The fused layer boundary (mhc_proj.boundary): each token's row of C columns is summed in
# splits of BND_SPLIT_COLUMNS columns (rounded to whole chunks), the splits' partials added
# in order. The deterministic mode (and the CPU) always uses this split, so a token's
# results do not depend on its batch; the default on CUDA uses narrower splits when the
# tokens alone would not fill the GPU.
BND_SPLIT_COLUMNS = 1024
