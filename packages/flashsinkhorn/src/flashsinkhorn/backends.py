"""``backend=``: which :class:`flashsinkhorn.problem.Problem` implementation a call builds.

- ``"dense"``: :class:`flashsinkhorn.dense.DenseProblem`, ``-C`` in memory and fused softmin;
  ``"auto"`` picks it on the CPU while one cost matrix fits ``_config.DENSE_MAX_BYTES`` and
  on CUDA up to ``_config.DENSE_MAX_SCORES_CUDA`` scores (B N M);
- ``"streaming"``: :class:`flashsinkhorn.streaming.StreamingProblem`, the tiled Triton and
  sm_90 Gluon kernels on CUDA, the blockwise torch path on CPU and for float64; ``"auto"``
  above those sizes;
- ``"triton"``, ``"torch"``: the streaming problem restricted to the portable Triton
  kernels / to the blockwise torch path (explicit only);
- ``"multiscale"``: :class:`flashsinkhorn.multiscale.MultiscaleProblem`, block-sparse passes
  over the tile pairs a bound cannot skip, annealing on coarse grid cells, a certificate that
  bounds the skipped mass; ``"auto"`` picks it past the dense budget for clouds of at most 3
  coordinates and a narrow kernel (:func:`flashsinkhorn.multiscale.auto_reason`).

Ragged batches (``varlen``) and sharded problems (``process_group=``) are chosen by the
input's form, not by this argument. The rule is :func:`auto_backend`; ``verbose=True``
prints its choice and the result records it (``SinkhornResult.backend``).
"""

from __future__ import annotations

import torch

from flashsinkhorn import _config
from flashsinkhorn.dense import DenseProblem, dense_bytes
from flashsinkhorn.multiscale import MultiscaleProblem, auto_reason
from flashsinkhorn.primitives import problem_backend
from flashsinkhorn.problem import Problem
from flashsinkhorn.streaming import StreamingProblem

__all__ = ["BACKENDS", "auto_backend", "build"]

BACKENDS = ("auto", "dense", "streaming", "triton", "torch", "multiscale")


def check_backend(backend) -> str:
    """``backend`` must be one of :data:`BACKENDS` (GeomLoss's "tensorized" / "online" are
    mapped by SamplesLoss before this)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    return backend


def auto_backend(B: int, N: int, M: int, device: torch.device, dtype: torch.dtype):
    """``backend="auto"``'s rule: ``(kind, reason)`` with kind "dense" or "streaming".

    CUDA: dense up to ``_config.DENSE_MAX_SCORES_CUDA`` scores (there a pass is a few
    microseconds of arithmetic and the launches decide: a dense pass is a handful of
    cuBLAS / elementwise launches with no per-pass host work), streaming above. CPU: dense
    while one cost matrix fits ``_config.DENSE_MAX_BYTES`` (a pass is then a few memory-bound
    sweeps of the stored matrix instead of a matrix product), streaming (the blockwise torch
    path, O((n + m) d) memory) above."""
    scores = B * N * M
    if device.type == "cuda":
        if scores <= _config.DENSE_MAX_SCORES_CUDA:
            return "dense", f"{scores} scores <= DENSE_MAX_SCORES_CUDA on CUDA"
        return "streaming", f"{scores} scores > DENSE_MAX_SCORES_CUDA on CUDA"
    nbytes = dense_bytes(B, N, M, dtype)
    if nbytes <= _config.DENSE_MAX_BYTES:
        return "dense", f"the {nbytes >> 20} MiB cost fits DENSE_MAX_BYTES on {device.type}"
    return "streaming", f"the {nbytes >> 20} MiB cost exceeds DENSE_MAX_BYTES on {device.type}"


def build(backend: str, *, eps=None, multiscale=None, **fields) -> tuple[Problem, str]:
    """The problem of ``fields`` (the keyword fields of :class:`Problem`: ``X, Y, a, b, cx,
    cy, c2, cost, cost_scale, labels, precision, center``) on ``backend``. ``eps``: the
    final temperature, where known (``"auto"`` weighs the multiscale problem with it);
    ``multiscale``: the multiscale problem's options (``truncate``, ``cluster_scale``).
    Returns ``(problem, reason)``: why this implementation (what ``verbose`` prints)."""
    check_backend(backend)
    X = fields["X"]
    B, N, M = X.shape[0], X.shape[1], fields["Y"].shape[1]
    if backend == "auto":
        kind, reason = auto_backend(B, N, M, X.device, X.dtype)
        big = X.device.type != "cuda" or B * N * M >= _config.MULTISCALE_MIN_SCORES_CUDA
        why = auto_reason(fields, eps, above_exact=kind == "streaming" and big)
        if why is not None:
            kind, reason = "multiscale", why
        reason = f"auto: {reason}"
    elif backend in ("dense", "multiscale"):
        kind, reason = backend, f"backend={backend!r}"
    else:
        kind, reason = "streaming", f"backend={backend!r}"
    if kind == "dense":
        return DenseProblem(**fields), reason
    if kind == "multiscale":
        # the Triton kernel on CUDA for float32 (and under the interpreter), torch otherwise
        be = problem_backend("auto", X.device, X.dtype)
        family = "triton" if be == "auto" else be
        return MultiscaleProblem(backend=family, **(multiscale or {}), **fields), reason
    family = "auto" if backend in ("auto", "streaming") else backend
    # float64 inputs stay float64 (the blockwise torch path) where the kernels would not
    be = problem_backend(family, X.device, X.dtype)
    return StreamingProblem(backend=be, **fields), reason
