"""The low-rank part of FlashMuon's momentum (issue #31).

Muon's momentum is stored as ``P R^T + residual``: bf16 factors ``P`` (rows x k) and ``R``
(cols x k), k = ``reference.MUON_RANK``, and the residual in int8 codes rounded to nearest.
Newton-Schulz maps every singular value of the direction towards 1, so an error that is
small against the whole momentum is lifted to the size of its weak directions; the int8
codes' error is set by the group maxima, which the top singular directions dominate. With
those directions kept in the factors, the residual's codes are several times finer
(docs/design/flashoptim.md: the update's cosine to the fp32 momentum's 0.919 -> 0.994 at k =
4, against 0.987 for a bf16 momentum).

The factors follow the momentum by one power iteration per step, warm-started from the last
``R``: ``P = orth(u R)``, ``R = m^T P`` with ``m`` recovered from the direction ``u`` the step
wrote (``u = mu m + (1 - mu) g`` with Nesterov); any factors serve, since the residual is
taken exactly against the ones stored. The low-rank part is materialized once per step as
``bf16(P R^T)`` (``lowrank_into``), the same tensor for the passes of the CPU path and the
kernels. float64 reference: ``reference.lowrank_factors_ref`` / ``lowrank_ref``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .reference import MUON_RANK


def uses_lowrank(shape: tuple[int, int]) -> bool:
    """Whether an (A, B) matrix keeps a low-rank part: both sides at least 8 k (32), so that
    the factors cost at most 2 k (A + B) / (A B) <= 0.5 bytes per element (0.031 at 512 x
    512, 0.0195 at 512 x 2048)."""
    return min(shape) >= 8 * MUON_RANK


def init_factors(rows: int, cols: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, R) before the first step: P = 0 (no low-rank part yet), R a fixed draw (the
    power iteration's start), the same on every rank for one ``seed``."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(cols, MUON_RANK, generator=g) / math.sqrt(cols)
    p = torch.zeros(rows, MUON_RANK, dtype=torch.bfloat16)
    return p.to(device), r.bfloat16().to(device)


def update_factors(
    u: torch.Tensor,
    g: torch.Tensor,
    R: torch.Tensor,
    mu: float,
    nesterov: bool,
    reduce: Callable | None = None,
    g_sign: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """New (P, R), bf16, from the step's direction ``u`` (..., A, B; bf16), its gradient
    ``g`` (times ``g_sign``: -1 under ``maximize``) and the last ``R`` (..., B, k): one power
    iteration. Only thin products touch the matrices (``u R``, ``u^T P``, ``g^T P``, in fp32,
    ``ROWS`` rows at a time: no temporary of the matrix's size), ``m^T P = (u^T P - (1 - mu)
    g^T P) / mu`` with Nesterov. ``reduce``: the sum over the ranks that hold other rows of the same
    matrices (None: one process); ``Y^T Y`` and ``m^T P`` are sums over rows."""
    reduce = reduce or (lambda t: t)
    # Y^T Y in float64: the squares of a large momentum's products overflow fp32 (a 1e30
    # gradient made them inf and the weights NaN)
    # R's scale is the momentum's (P = orth(u R) does not depend on it): u R at unit scale,
    # else a momentum of 1e20 overflows fp32 in u R (1e40)
    Rf = R.float()
    Rf = Rf / Rf.abs().amax(dim=(-2, -1), keepdim=True).clamp(min=2.0**-126)
    y = _rows_times(u, Rf).double()
    gram = reduce(y.mT @ y)
    k = gram.shape[-1]
    trace = gram.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None]
    eye = torch.eye(k, dtype=torch.float64, device=gram.device)
    # (cholesky_ex: no error check, no host sync; a skipped step's garbage is dropped)
    chol = torch.linalg.cholesky_ex(gram + (1e-12 * trace + 1e-300) * eye).L
    P = torch.linalg.solve_triangular(chol, y.mT, upper=False).mT.bfloat16()
    t = _rows_t_times(u, P.float())
    if nesterov and mu > 0:
        t = (t - (1 - mu) * g_sign * _rows_t_times(g, P.float())) / mu
    # u R = 0 (a zero gradient on the first step, a zero momentum): P = 0, and R keeps its
    # last value, the power iteration's start; R = m^T P = 0 would stay 0 for good (u R = 0
    # at every later step: whole codes from then on)
    return P, torch.where(trace > 0, reduce(t).bfloat16(), R)


# rows of a matrix converted to fp32 at a time by the thin products (a bounded temporary)
ROWS = 2048


def _rows_times(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x @ y`` in fp32 for a large ``x`` (..., A, B) of any float dtype and a thin fp32
    ``y`` (..., B, k), ``ROWS`` rows of ``x`` at a time."""
    return torch.cat(
        [x[..., i : i + ROWS, :].float() @ y for i in range(0, x.shape[-2], ROWS)]
        or [x.new_zeros(*x.shape[:-1], y.shape[-1], dtype=torch.float32)],
        dim=-2,
    )


def _rows_t_times(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x^T @ y`` in fp32 for a large ``x`` (..., A, B) and a thin fp32 ``y`` (..., A, k),
    summed over blocks of ``ROWS`` rows (fp32 products and sums throughout: the row
    shards of one matrix sum the same terms in another order only)."""
    out = torch.zeros(*x.shape[:-2], x.shape[-1], y.shape[-1], device=x.device)
    for i in range(0, x.shape[-2], ROWS):
        out += x[..., i : i + ROWS, :].float().mT @ y[..., i : i + ROWS, :]
    return out


def lowrank(P: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """The stored low-rank part ``bf16(P R^T)`` (fp32 products)."""
    return (P.float() @ R.float().mT).bfloat16()


def factors_of(m: torch.Tensor, seed: int, reduce: Callable | None = None, iterations: int = 8):
    """(P, R) of a whole fp32 momentum ``m`` (its local rows, A x B) for a checkpoint
    without factors: power iterations from ``init_factors``'s start (``reduce``: as in
    ``update_factors``)."""
    _, R = init_factors(m.shape[0], m.shape[1], seed, m.device)
    P = None
    for _ in range(iterations):
        P, R = update_factors(m, m, R, 1.0, False, reduce)
    return P, R
