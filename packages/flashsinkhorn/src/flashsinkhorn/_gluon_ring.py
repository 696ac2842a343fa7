"""The TMA ring and async-wgmma tile issue shared by the sm_90 Gluon kernels.

The softmin pass (``_softmin_hopper``), the plan application (``_plan_hopper``) and the
sampling pass (``_sample_hopper``) stream the same operands the same way: one CTA owns
``NUM_WG`` x 64 rows of x (resident in shared memory when they fit, else streamed with y),
the column tiles of y move by TMA through a ring of ``STAGES`` shared-memory stages, each
with a "ready" mbarrier (transaction bytes) and an "empty" mbarrier (one arrival per
consumer warpgroup), and each consumer warpgroup issues the async wgmma of a tile chunk by
chunk as the chunks land. The barrier protocol is model-checked by
``tools/flashsinkhorn/hopper_protocol_sim.py``; the schedule and its measurements are in
docs/design/flashsinkhorn-hopper.md.

SPEC, the kernels' compile-time mode, is one constexpr tuple whose first six entries are
``(NUM_K, STAGES, NUM_WG, X_RESIDENT, PIPE, PINGPONG)``; each kernel appends its own flags.
"""

from __future__ import annotations

import torch

try:  # Gluon ships inside triton (3.6 on the GPU host, 3.9 in CI); the API moved between them
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    # triton 3.6: tma.async_copy_global_to_shared; 3.9: tma.async_load (the old name raises)
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    HAS_GLUON = True
except Exception:  # pragma: no cover - triton missing or without the Hopper Gluon API
    HAS_GLUON = False

__all__ = [
    "HAS_GLUON",
    "MAX_D",
    "elem_bytes",
    "one_chunk_width",
    "operand_reason",
    "tma_ready",
    "compile_gluon_sm90",
]

MAX_D = 4096


def elem_bytes(dtype: torch.dtype) -> int:
    return 2 if dtype == torch.bfloat16 else 4


def one_chunk_width(D: int) -> int:
    """Features per shared-memory chunk when one chunk holds a whole row: the power of two
    at or above D (TMA boxes have power-of-two sides; at least 16, the wgmma K of bf16);
    the zero padding past D adds nothing to the dot products."""
    return max(16, 1 << (int(D) - 1).bit_length())


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous with a 16-byte aligned base (TMA descriptors need both)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def operand_reason(x: torch.Tensor, y: torch.Tensor, precision: str) -> str | None:
    """Why the sm_90 kernels cannot take these operands (None: they can): Gluon present,
    tf32 / bf16 operands of the matching dtype, (B, N, D) and (B, M, D) with 16-byte rows,
    no empty cloud, both on one sm_90 CUDA device. Cheap (no launch, no sync)."""
    if not HAS_GLUON:
        return "triton with the Hopper Gluon API (triton.experimental.gluon) is not installed"
    if precision not in ("tf32", "bf16"):
        return f"precision {precision!r} is not implemented in the Hopper kernel (tf32, bf16)"
    want = torch.bfloat16 if precision == "bf16" else torch.float32
    if x.dtype != want or y.dtype != want:
        return f"precision {precision!r} needs {want} operands; got {x.dtype} and {y.dtype}"
    if x.dim() != 3 or y.dim() != 3 or x.shape[0] != y.shape[0] or x.shape[2] != y.shape[2]:
        return f"x must be (B, N, D) and y (B, M, D); got {tuple(x.shape)} and {tuple(y.shape)}"
    D = x.shape[2]
    if (D * elem_bytes(want)) % 16 or D > MAX_D:
        return f"D = {D}: TMA needs 16-byte rows ({16 // elem_bytes(want)} | D), D <= {MAX_D}"
    if x.shape[1] == 0 or y.shape[1] == 0:
        return "empty point cloud"
    if x.device.type != "cuda" or y.device != x.device:
        return "the Hopper kernel needs both operands on one CUDA device"
    if torch.cuda.get_device_capability(x.device) != (9, 0):
        return "the Hopper kernel needs an sm_90 GPU (H100 / H200)"
    return None


def compile_gluon_sm90(fn, args, kwargs):
    """``triton.compile`` of the Gluon kernel ``fn`` for sm_90 as a launch with ``args`` /
    ``kwargs`` would specialize it (CPU tensors: only dtypes and alignment matter)."""
    if not HAS_GLUON:
        raise NotImplementedError("triton with the Hopper Gluon API is not installed")
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    src = GluonASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__)


if HAS_GLUON:

    @gluon.constexpr_function
    def stage_bytes(y_bytes, x_bytes, num_wg, x_resident):
        """Bytes one ring stage receives: the y chunk, plus the x chunks when streamed."""
        return y_bytes if x_resident else y_bytes + num_wg * x_bytes

    @gluon.constexpr_function
    def turn_after(num_k, stages):
        """Chunks a ping-pong consumer issues before the other may start the same tile: the
        whole tile when its chunks fit the ring, else stages - 1 (the other consumer must
        start releasing this tile's stages before the ring runs dry, or both wait; checked
        by tools/flashsinkhorn/hopper_protocol_sim.py)."""
        return max(1, min(num_k, stages - 1))

    @gluon.jit
    def load_chunk(t, x_desc, y_desc, x_smem, y_smem, ready, xrow0, yrow0, SPEC: gl.constexpr):
        """TMA loads of ring chunk ``t`` (column tile t // NUM_K, feature chunk t % NUM_K)
        into stage t % STAGES; completion is signalled on that stage's ready barrier."""
        NUM_K: gl.constexpr = SPEC[0]
        STAGES: gl.constexpr = SPEC[1]
        NUM_WG: gl.constexpr = SPEC[2]
        X_RESIDENT: gl.constexpr = SPEC[3]
        BN: gl.constexpr = y_desc.block_type.shape[0]
        BK: gl.constexpr = y_desc.block_type.shape[1]
        BM: gl.constexpr = x_desc.block_type.shape[0]
        s = t % STAGES
        j = t // NUM_K
        k = t % NUM_K
        bar = ready.index(s)
        nbytes: gl.constexpr = stage_bytes(
            y_desc.block_type.nbytes, x_desc.block_type.nbytes, NUM_WG, X_RESIDENT
        )
        mbarrier.expect(bar, nbytes)
        tma_load(y_desc, [yrow0 + j * BN, k * BK], bar, y_smem.index(s))
        if not X_RESIDENT:
            for w in gl.static_range(NUM_WG):
                tma_load(x_desc, [xrow0 + w * BM, k * BK], bar, x_smem.index(s * NUM_WG + w))

    @gluon.jit
    def load_x(x_desc, x_smem, x_bar, xrow0, SPEC: gl.constexpr):
        """The CTA's rows of x, every feature chunk, once (X_RESIDENT)."""
        NUM_K: gl.constexpr = SPEC[0]
        NUM_WG: gl.constexpr = SPEC[2]
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        mbarrier.expect(x_bar, NUM_WG * NUM_K * x_desc.block_type.nbytes)
        for w in gl.static_range(NUM_WG):
            for k in gl.static_range(NUM_K):
                tma_load(x_desc, [xrow0 + w * BM, k * BK], x_bar, x_smem.index(w * NUM_K + k))

    @gluon.jit
    def release(
        t,
        total,
        x_desc,
        y_desc,
        x_smem,
        y_smem,
        ready,
        empty,
        xrow0,
        yrow0,
        SPEC: gl.constexpr,
        INLINE_LOADS: gl.constexpr,
    ):
        """Chunk ``t``'s wgmma has retired: its stage may be refilled. The fallback launch
        (INLINE_LOADS) issues the refill itself (chunk t + STAGES); the warp-specialized
        consumers tell the producer through the stage's empty barrier (one arrival per
        consumer warpgroup)."""
        STAGES: gl.constexpr = SPEC[1]
        if INLINE_LOADS:
            if t + STAGES < total:
                load_chunk(t + STAGES, x_desc, y_desc, x_smem, y_smem, ready, xrow0, yrow0, SPEC)
        else:
            mbarrier.arrive(empty.index(t % STAGES), count=1)

    @gluon.jit
    def issue_tile(
        j,
        total,
        x_desc,
        y_desc,
        x_smem,
        y_smem,
        ready,
        empty,
        turn,
        xrow0,
        yrow0,
        SPEC: gl.constexpr,
        WG: gl.constexpr,
        MMA: gl.constexpr,
        INLINE_LOADS: gl.constexpr,
        EARLY_RELEASE: gl.constexpr,
    ):
        """Issue the async wgmma of column tile ``j`` for this warpgroup's 64 rows, chunk
        by chunk as the chunks land. EARLY_RELEASE: after each chunk, wait until at most
        one wgmma is in flight and release the previous chunk's stage (a GEMM main loop);
        otherwise every chunk stays in flight (the caller waits and releases them).
        PINGPONG: the two consumers take turns to start a tile (the other may start once
        TURN_AFTER chunks are issued), so that one's wgmma run while the other does its
        exps. Returns the in-flight accumulator (BLOCK_M, BN)."""
        NUM_K: gl.constexpr = SPEC[0]
        STAGES: gl.constexpr = SPEC[1]
        NUM_WG: gl.constexpr = SPEC[2]
        X_RESIDENT: gl.constexpr = SPEC[3]
        PINGPONG: gl.constexpr = SPEC[5]
        BN: gl.constexpr = y_desc.block_type.shape[0]
        BM: gl.constexpr = x_desc.block_type.shape[0]
        TURN_AFTER: gl.constexpr = turn_after(NUM_K, STAGES)
        if PINGPONG:
            # consumer 0 goes first (its first wait passes on the barrier's initial phase)
            mbarrier.wait(turn.index(WG), (j & 1) ^ (1 - WG))
        acc = gl.zeros([BM, BN], gl.float32, MMA)
        for k in gl.static_range(NUM_K):
            t = j * NUM_K + k
            s = t % STAGES
            mbarrier.wait(ready.index(s), (t // STAGES) & 1)
            if X_RESIDENT:
                a = x_smem.index(WG * NUM_K + k)
            else:
                a = x_smem.index(s * NUM_WG + WG)
            b = y_smem.index(s).permute((1, 0))
            acc = warpgroup_mma(a, b, acc, use_acc=k > 0, is_async=True)
            if PINGPONG and k == TURN_AFTER - 1:
                mbarrier.arrive(turn.index(1 - WG), count=1)
            if EARLY_RELEASE and k > 0:
                acc = warpgroup_mma_wait(1, deps=(acc,))
                release(
                    t - 1,
                    total,
                    x_desc,
                    y_desc,
                    x_smem,
                    y_smem,
                    ready,
                    empty,
                    xrow0,
                    yrow0,
                    SPEC,
                    INLINE_LOADS,
                )
        return acc

    @gluon.jit
    def release_tile(
        j,
        total,
        x_desc,
        y_desc,
        x_smem,
        y_smem,
        ready,
        empty,
        xrow0,
        yrow0,
        SPEC: gl.constexpr,
        INLINE_LOADS: gl.constexpr,
        EARLY_RELEASE: gl.constexpr,
    ):
        """Release the stages of tile ``j`` still held after its final wgmma wait."""
        NUM_K: gl.constexpr = SPEC[0]
        if EARLY_RELEASE:
            release(
                j * NUM_K + NUM_K - 1,
                total,
                x_desc,
                y_desc,
                x_smem,
                y_smem,
                ready,
                empty,
                xrow0,
                yrow0,
                SPEC,
                INLINE_LOADS,
            )
        else:
            for k in gl.static_range(NUM_K):
                release(
                    j * NUM_K + k,
                    total,
                    x_desc,
                    y_desc,
                    x_smem,
                    y_smem,
                    ready,
                    empty,
                    xrow0,
                    yrow0,
                    SPEC,
                    INLINE_LOADS,
                )

    @gluon.jit
    def produce(pargs, SPEC: gl.constexpr):
        """The producer warp's partition of a warp-specialized kernel: x once (when
        resident), then every ring chunk in order, each after its stage's empty barrier says
        all consumers are done with it. ``pargs``: (x_desc, y_desc, x_smem, y_smem, ready,
        empty, x_bar, n_tiles, xrow0, yrow0)."""
        x_desc, y_desc, x_smem, y_smem, ready, empty, x_bar, n_tiles, xrow0, yrow0 = pargs
        NUM_K: gl.constexpr = SPEC[0]
        STAGES: gl.constexpr = SPEC[1]
        if SPEC[3]:  # X_RESIDENT
            load_x(x_desc, x_smem, x_bar, xrow0, SPEC)
        for t in range(n_tiles * NUM_K):
            s = t % STAGES
            # mbarriers start in the completed state of phase "-1": the first round passes
            mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
            load_chunk(t, x_desc, y_desc, x_smem, y_smem, ready, xrow0, yrow0, SPEC)
