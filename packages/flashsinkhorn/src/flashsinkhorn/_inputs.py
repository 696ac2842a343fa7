"""Input validation shared by :func:`flashsinkhorn.solve` and ``SamplesLoss``.

Bad input gets an error naming the argument and what was expected (shape, dtype, device,
value range). The data-dependent checks (finite values, nonnegative weights, label range)
need a host sync; under ``torch.compile`` they run inside the custom ops instead.
"""

from __future__ import annotations

import math

import torch


def _as_tensor(t, name, dtype=None, device=None):
    """Tensors pass through; numpy arrays and other array-likes (lists, scalars' sequences)
    become tensors (``torch.as_tensor``; POT users pass numpy arrays). Anything else is a
    TypeError naming the argument."""
    if isinstance(t, torch.Tensor):
        return t
    if isinstance(t, (str, bytes, dict, set)) or t is None:
        raise TypeError(f"{name} must be a torch.Tensor or an array-like; got {type(t).__name__}")
    try:
        return torch.as_tensor(t, dtype=dtype, device=device)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(
            f"{name} must be a torch.Tensor or an array-like of numbers; got "
            f"{type(t).__name__} ({err})"
        ) from None


def _as_weights(w, name, B, n, like):
    if w is None:
        return torch.full((B, n), 1.0 / max(n, 1), dtype=like.dtype, device=like.device)
    w = _as_tensor(w, name, dtype=like.dtype, device=like.device)
    if w.device != like.device:
        raise ValueError(
            f"{name} is on device {w.device} but the points are on device {like.device}"
        )
    if w.dtype != like.dtype:
        raise ValueError(f"{name} has dtype {w.dtype} but the points have dtype {like.dtype}")
    if w.dim() == 1:
        w = w.unsqueeze(0).expand(B, -1) if B > 1 else w.unsqueeze(0)
    if w.shape != (B, n):
        raise ValueError(f"{name} must have shape ({n},) or ({B}, {n}); got {tuple(w.shape)}")
    return w


def _weight_flags(w):
    """Device flags of a weight tensor: non-finite, negative, a zero-sum problem."""
    return torch.stack((~torch.isfinite(w).all(), (w < 0).any(), (w.sum(-1) <= 0).any()))


_WEIGHT_ERRORS = (
    "{} contains non-finite values",
    "{} must be nonnegative",
    "{} must have a positive sum in every problem (got a zero sum)",
)


def _point_flags(x, y):
    """Device flags of the points: x non-finite, y non-finite, squared distances that
    overflow the compute dtype (float32 for half inputs)."""
    big = torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).max
    lo = torch.minimum(x.amin(dim=(-2, -1)), y.amin(dim=(-2, -1))).double()
    hi = torch.maximum(x.amax(dim=(-2, -1)), y.amax(dim=(-2, -1))).double()
    spread2 = ((hi - lo) ** 2 * x.shape[-1]).max()
    return torch.stack((~torch.isfinite(x).all(), ~torch.isfinite(y).all(), ~(spread2 < big / 4)))


def _raise_first(x, y, flags, names):
    """Raise the error of the first set flag, in the order points, then each weight."""
    for k, bad in enumerate(flags):
        if not bad:
            continue
        if k < 2:
            raise ValueError(f"{'xy'[k]} contains non-finite values")
        if k == 2:
            span = torch.maximum(x.amax(dim=(-2, -1)), y.amax(dim=(-2, -1))).double()
            span = span - torch.minimum(x.amin(dim=(-2, -1)), y.amin(dim=(-2, -1))).double()
            raise ValueError(
                f"x and y: coordinates span {float(span.max()):.3g}, so squared distances "
                f"overflow {x.dtype if x.dtype == torch.float64 else torch.float32}; rescale "
                "the points (and eps) or pass float64"
            )
        w = (k - 3) // 3
        raise ValueError(_WEIGHT_ERRORS[(k - 3) % 3].format(names[w]))


def check_values(x, y, a, b):
    """The data-dependent checks of :func:`prepare_inputs` (finite points whose squared
    distances fit the compute dtype, finite nonnegative weights with positive sums): the
    flags computed on the device and read in ONE host read (a GPU call pays one
    synchronisation for all of them). Under torch.compile they run inside the custom ops."""
    flags = torch.cat((_point_flags(x, y), _weight_flags(a), _weight_flags(b)))
    _raise_first(x, y, flags.tolist(), ("a", "b"))


def prepare_inputs(x, y, a=None, b=None, *, check_data=True):
    """Validate and batch inputs: returns ``(x (B,N,D), y (B,M,D), a (B,N), b (B,M), batched)``.

    Half-precision points (float16, bfloat16) come back in float32 (differentiably): every
    cost term, weight and potential is computed in float32 (the kernels' precision), so a
    half input solves the problem of its own values, not one rounded again to 3 digits.
    Weights given in the points' dtype follow them. ``check_data=False`` skips the
    data-dependent checks (see :func:`check_values`)."""
    x, y = _as_tensor(x, "x"), _as_tensor(y, "y")
    for name, t in (("x", x), ("y", y)):
        if t.dim() not in (2, 3):
            raise ValueError(f"{name} must be (N, D) or (B, N, D); got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor; got {t.dtype}")
    if x.dim() != y.dim():
        raise ValueError(f"x and y must both be 2D or both 3D; got {x.dim()}D and {y.dim()}D")
    if x.device != y.device:
        raise ValueError(f"x is on device {x.device} but y is on device {y.device}")
    if x.dtype != y.dtype:
        raise ValueError(f"x has dtype {x.dtype} but y has dtype {y.dtype}")
    batched = x.dim() == 3
    if not batched:
        x, y = x.unsqueeze(0), y.unsqueeze(0)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"batch sizes differ: x {x.shape[0]}, y {y.shape[0]}")
    if x.shape[-1] != y.shape[-1]:
        raise ValueError(
            f"x and y must have the same dimension D; got {x.shape[-1]} and {y.shape[-1]}"
        )
    if x.shape[0] == 0:
        raise ValueError(
            f"x and y must hold at least one problem; got a batch of 0: x {tuple(x.shape)}, "
            f"y {tuple(y.shape)}"
        )
    if x.shape[1] == 0 or y.shape[1] == 0:
        raise ValueError(f"empty point cloud: x has {x.shape[1]} points, y has {y.shape[1]}")
    if x.shape[-1] == 0:
        raise ValueError("points must have dimension D >= 1")
    B, N, M = x.shape[0], x.shape[1], y.shape[1]
    if x.dtype in (torch.float16, torch.bfloat16):
        half = x.dtype
        x, y = x.float(), y.float()
        a = a.float() if isinstance(a, torch.Tensor) and a.dtype == half else a
        b = b.float() if isinstance(b, torch.Tensor) and b.dtype == half else b
    a = None if a is None else _as_tensor(a, "a", dtype=x.dtype, device=x.device)
    b = None if b is None else _as_tensor(b, "b", dtype=x.dtype, device=x.device)
    a, b = _column_weights(a, "a", N, batched), _column_weights(b, "b", M, batched)
    a = _as_weights(a, "a", B, N, x)
    b = _as_weights(b, "b", B, M, x)
    if check_data:
        check_values(x, y, a, b)
    return x, y, a, b, batched


def _column_weights(w, name, n, batched):
    """Weights given as a column, ``(N, 1)`` (``(B, N, 1)`` batched), as flash-sinkhorn and
    GeomLoss accept them, become ``(N,)`` (``(B, N)``); a 2-D ``w`` of an unbatched problem
    must be that column."""
    if w is None:
        return None
    if w.dim() == (3 if batched else 2) and w.shape[-1] == 1 and w.shape[-2] == n:
        return w[..., 0]
    if w.dim() == 2 and not batched:
        raise ValueError(
            f"{name} must be ({n},) or ({n}, 1) for unbatched points; got {tuple(w.shape)}"
        )
    return w


def check_masses(a, b, rx, ry, unbalanced="rho"):
    """Balanced OT needs equal masses (``a.sum() == b.sum()`` to 1e-5 relative)."""
    if rx is None and ry is None:
        ma, mb = a.sum(-1), b.sum(-1)
        if bool(((ma - mb).abs() > 1e-5 * torch.maximum(ma, mb)).any()):
            raise ValueError(
                "balanced OT needs a.sum() == b.sum() for every problem; got "
                f"{ma.tolist()[:4]} and {mb.tolist()[:4]}: normalize the weights or pass "
                f"{unbalanced}= for unbalanced OT"
            )


def check_eps(eps):
    try:
        eps = float(eps)
    except (TypeError, ValueError):
        raise ValueError(f"eps must be a positive number; got {eps!r}") from None
    if not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps must be a finite positive number; got {eps}")
    return eps


def label_tuple(label_cost, B, N, M, device, label_scale=1.0, check_range=True):
    if label_cost is None:
        return None
    try:
        lx, ly, W = label_cost
    except (TypeError, ValueError):
        raise ValueError("label_cost must be a tuple (labels_x, labels_y, W)") from None
    if W.dim() != 2:
        raise ValueError(f"label_cost W must be (K1, K2); got {tuple(W.shape)}")
    out = []
    for name, l, n, K in (("labels_x", lx, N, W.shape[0]), ("labels_y", ly, M, W.shape[1])):
        if l.dim() == 1:
            l = l.unsqueeze(0).expand(B, -1)
        if l.shape != (B, n):
            raise ValueError(f"{name} must be ({n},) or ({B}, {n}); got {tuple(l.shape)}")
        if l.dtype.is_floating_point:
            raise ValueError(f"{name} must be an integer tensor; got {l.dtype}")
        if check_range:
            check_label_range(name, l, W, K)
        out.append(l.to(device))
    return (out[0], out[1], W.to(device), float(label_scale))


def check_label_range(name, l, W, K):
    if l.numel() and (int(l.min()) < 0 or int(l.max()) >= K):
        raise ValueError(f"{name} must lie in [0, {K}); W is {tuple(W.shape)}")
