"""The kernel operands: centering, tf32 rounding and the cost in kernel form.

Every cost flashsinkhorn supports is written ``C_ij = cx_i + cy_j - c2 <X_i - c, Y_j - c>``
(:func:`cost_features`); the kernels get ``X - c`` and ``Y - c`` prepared once per problem
(:func:`kernel_operands`), in their dtype and, for tf32, rounded to nearest tf32 so that the
tensor-core products are exact.
"""

from __future__ import annotations

import torch

from flashsinkhorn.primitives import resolve_backend

COSTS = ("sqeuclidean", "cosine", "dot")


def kernel_operands(X, Y, center, precision="tf32", backend="auto"):
    """The softmin kernel's operands ``(X - c, Y - c)`` in the kernel's dtype, computed once
    per problem (an O((N + M) D) pass) so that the kernels' inner loops are pure
    load -> dot (no subtraction or cast between the pipelined loads and ``tl.dot``).
    ``X is Y`` gives one shared copy. Without a center, on the torch backend, the inputs
    themselves are returned (no copy)."""
    with torch.no_grad():
        same = X is Y
        X, Y = X.detach(), Y.detach()
        dt = X.dtype if X.dtype in (torch.float32, torch.float64) else torch.float32
        if center is not None:
            c = center.detach().to(dt)[:, None, :]
            Xk = X.to(dt) - c
            Yk = Xk if same else Y.to(dt) - c
        else:
            Xk, Yk = X, Y
        be = resolve_backend(backend, X.device)
        if be == "triton":
            kdt = torch.bfloat16 if precision == "bf16" else torch.float32
            Xk = Xk.to(kdt).contiguous()
            Yk = Xk if same else Yk.to(kdt).contiguous()
            if precision == "tf32":
                # tf32 operands rounded to nearest once, here, instead of converted by the
                # tensor cores inside every pass: the H200 run of 2026-12-01 measured the
                # SamplesLoss value 2.3e-5 off float64 with raw fp32 operands (flash-sinkhorn,
                # which rounds its operands, 9.4e-8); a float64 emulation of this loop gives
                # 1.3e-4 for truncated operands and 1.4e-7 for rounded ones
                # (docs/design/flashsinkhorn.md).
                # In place on our own copy (no copy was made without a center).
                Xk = round_to_tf32_(Xk if center is not None else Xk.clone())
                Yk = Xk if same else round_to_tf32_(Yk if center is not None else Yk.clone())
        return Xk, Yk


def round_to_tf32_(t: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
    """Round a contiguous float32 tensor in place to the nearest tf32 value (10 explicit
    mantissa bits, ties to even) and return it: its tf32 tensor-core products are then
    exact. Integer operations on the bits, in chunks of ``chunk`` elements (one int32
    temporary of at most that size). Finite values above the largest tf32 value round to
    +-inf as in any round-to-nearest; inf stays inf (NaN is not expected here: the solvers
    reject non-finite inputs)."""
    if t.dtype != torch.float32 or not t.is_contiguous():
        raise TypeError(
            f"round_to_tf32_: t must be a contiguous float32 tensor, got {t.dtype} "
            f"(contiguous: {t.is_contiguous()})"
        )
    bits = t.view(-1).view(torch.int32)
    for i0 in range(0, bits.numel(), chunk):
        b = bits[i0 : i0 + chunk]
        lsb = torch.bitwise_right_shift(b, 13).bitwise_and_(1)  # ties go to the even side
        b.add_(lsb.add_(0x0FFF)).bitwise_and_(~0x1FFF)
    return t


def round_to_tf32(t: torch.Tensor) -> torch.Tensor:
    """:func:`round_to_tf32_` on a copy of ``t`` (float32)."""
    if t.dtype != torch.float32:
        raise TypeError(f"round_to_tf32: t must be float32, got {t.dtype}")
    return round_to_tf32_(t.contiguous().clone())


def common_center(x, y):
    """(B, D) mean of both clouds (no grad): the squared-Euclidean cost is invariant under a
    common translation, and centered operands make tf32/bf16 dot products more accurate."""
    with torch.no_grad():
        return (x.sum(-2) + y.sum(-2)) / (x.shape[-2] + y.shape[-2])


def centered_sqnorm(x, c, chunk=1 << 14):
    """``|x_i - c|^2`` (B, N) without a full-size temporary (row chunks)."""
    with torch.no_grad():
        out = torch.empty(x.shape[:-1], dtype=x.dtype, device=x.device)
        for i0 in range(0, x.shape[-2], chunk):
            xi = x[:, i0 : i0 + chunk] - c[:, None, :]
            out[:, i0 : i0 + chunk] = (xi * xi).sum(-1)
        return out


def unit_rows(x):
    """``x / |x|`` per row (differentiable), exact for any nonzero scale: the row is first
    divided by its largest entry, so tiny (even subnormal) or huge rows neither underflow
    nor overflow in the norm. Zero rows stay zero (the solvers reject them for cosine)."""
    m = x.detach().abs().amax(dim=-1, keepdim=True)
    m = torch.where(m > 0, m, torch.ones_like(m))
    xs = x / m
    return xs / xs.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)


def cost_features(x, y, cost, cost_scale, center=True):
    """Return ``(X, Y, cx, cy, c2, c)`` with ``C = cost_scale * cost(x, y)`` in kernel form
    ``C_ij = cx_i + cy_j - c2 <X_i - c, Y_j - c>`` (``c`` (B, D) or None).

    X, Y keep the autograd graph (the cosine normalization); cx, cy are detached.
    """
    s = float(cost_scale)
    if cost == "sqeuclidean":
        X, Y, c2, k = x, y, 2.0 * s, s
    elif cost == "cosine":
        X, Y = unit_rows(x), unit_rows(y)
        # 1 - <X, Y> = |X - Y|^2 / 2 on the sphere: sqeuclidean with scale s/2
        c2, k = s, 0.5 * s
    elif cost == "dot":
        z = x.new_zeros(x.shape[:-1])
        return x, y, z, y.new_zeros(y.shape[:-1]), s, None
    else:
        raise ValueError(f"cost must be one of {COSTS}; got {cost!r}")
    Xd, Yd = X.detach(), Y.detach()
    if center:
        c = common_center(Xd, Yd)
        return X, Y, k * centered_sqnorm(Xd, c), k * centered_sqnorm(Yd, c), c2, c
    return X, Y, k * (Xd * Xd).sum(-1), k * (Yd * Yd).sum(-1), c2, None
