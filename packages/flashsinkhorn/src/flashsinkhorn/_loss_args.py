"""The scalar arguments of ``SamplesLoss`` / ``sinkhorn_divergence``, checked: a bad one
is a ValueError that names it and says what is expected."""

from __future__ import annotations

import math

from flashsinkhorn.primitives import PRECISIONS
from flashsinkhorn.reference import rho_from_reach

__all__ = ["TOL_MAX_ITER", "check_loss_args", "check_multiscale_args", "positive_finite"]


def positive_finite(v, name):
    try:
        v = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a finite positive number; got {v!r}") from None
    if not (0 < v < float("inf")):
        raise ValueError(f"{name} must be a finite positive number; got {v}")
    return v


# SamplesLoss(tol=...): at most this many iterations at the final blur
TOL_MAX_ITER = 2000


def check_multiscale_args(backend, truncate, cluster_scale, tol, process_group, cu_seqlens):
    """The multiscale options and ``tol`` as forward options (an empty dict where they are
    the defaults of an exact run); a ValueError names a bad one."""
    out = {}
    if truncate is not None and not (isinstance(truncate, (int, float)) and truncate > 0):
        raise ValueError(f"truncate must be a positive number or None; got {truncate!r}")
    if cluster_scale is not None and not (
        isinstance(cluster_scale, (int, float))
        and math.isfinite(cluster_scale)
        and cluster_scale > 0
    ):
        raise ValueError(f"cluster_scale must be a positive number or None; got {cluster_scale!r}")
    if tol is not None and not (isinstance(tol, (int, float)) and tol > 0):
        raise ValueError(f"tol must be a positive number or None; got {tol!r}")
    if backend in ("auto", "multiscale") and (truncate != 5.0 or cluster_scale is not None):
        out["multiscale"] = {"truncate": truncate, "cluster_scale": cluster_scale}
    elif backend == "multiscale":
        out["multiscale"] = {}
    if tol is not None:
        out["tol"] = float(tol)
    if out and (process_group is not None or cu_seqlens is not None):
        if backend == "multiscale" or tol is not None:
            raise NotImplementedError(
                "backend='multiscale' and tol= run on one process and one problem batch "
                "(not with process_group or a ragged batch)"
            )
        out = {}
    return out


def check_loss_args(blur, reach, scaling, diameter=None, precision="tf32"):
    """The loss's scalar arguments, checked and normalized: ``(blur, reach, scaling,
    diameter)`` with ``reach`` a pair ``(reach_x, reach_y)`` (one per side, None or inf:
    balanced side; a number is both sides); a ValueError names the argument."""
    blur = positive_finite(blur, "blur")
    rx, ry = rho_from_reach(reach, 0.5)  # checks the values (positive, a number or a pair)
    pair = reach if isinstance(reach, (tuple, list)) else (reach, reach)
    reach = tuple(None if r is None else float(p) for r, p in zip((rx, ry), pair))
    try:
        scaling = float(scaling)
    except (TypeError, ValueError):
        raise ValueError(f"scaling must lie in (0, 1); got {scaling!r}") from None
    if not (0 < scaling < 1):
        raise ValueError(f"scaling must lie in (0, 1); got {scaling}")
    if diameter is not None:
        diameter = positive_finite(diameter, "diameter")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    return blur, reach, scaling, diameter
