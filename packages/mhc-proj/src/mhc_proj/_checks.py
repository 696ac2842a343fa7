"""Argument checks of the public functions: each bad argument gets a ValueError or
TypeError that names it and says what is expected (README, "Bad input")."""

from __future__ import annotations

import math
import numbers
import operator

import torch

from mhc_proj._config import N_MAX, N_MIN

# The dtypes a projection can return (out_dtype); T is computed in float32 (float64 for
# float64 logits) and cast.
OUT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def logits(x: object) -> torch.Tensor:
    """``x`` as validated logits: a floating tensor of shape (..., n, n), n in 2..8, on a
    CPU or CUDA device."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor; got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(
            "logits must have a floating dtype (float32, bfloat16, float16 or float64); "
            f"got {x.dtype}"
        )
    shape = x.shape
    if len(shape) < 2 or shape[-1] != shape[-2]:
        raise ValueError(f"logits must have shape (..., n, n); got {tuple(shape)}")
    n = shape[-1]
    if not N_MIN <= n <= N_MAX:
        raise ValueError(f"logits: n must be in {N_MIN}..{N_MAX}; got n={n}")
    if not (x.is_cuda or x.is_cpu):
        raise ValueError(f"logits must be on a CPU or CUDA device; got {x.device}")
    return x


def integer(name: str, value: object, lo: int, hi: int) -> int:
    """``value`` as an int in lo..hi (bools, floats and strings are refused, also 3.0)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer in {lo}..{hi}; got {value!r}") from None
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be an integer in {lo}..{hi}; got {v}")
    return v


def positive(name: str, value: object, allow_zero: bool = False, hi: float = math.inf) -> float:
    """``value`` as a finite float > 0 (>= 0 with allow_zero), at most hi. Comparisons only
    (no math.isfinite): under torch.compile(dynamic=True) a float argument is a SymFloat,
    and math.isfinite of one is a torch op returning a bool, which dynamo cannot trace."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.SymFloat)):
        raise ValueError(f"{name} must be a finite real number; got {value!r}")
    # NaN fails every comparison; +inf fails v < inf
    if (value >= 0 if allow_zero else value > 0) and value <= hi and value < math.inf:
        return value if isinstance(value, torch.SymFloat) else float(value)
    if hi < math.inf:
        expected = f"in {'0 <=' if allow_zero else '0 <'} {name} <= {hi:g}"
    else:
        expected = f"finite and {'>=' if allow_zero else '>'} 0"
    raise ValueError(f"{name} must be {expected}; got {float(value)!r}")


def finite(name: str, value: object) -> float:
    """``value`` as a finite float (any sign)."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.SymFloat)):
        raise ValueError(f"{name} must be a finite real number; got {value!r}")
    if -math.inf < value < math.inf:
        return value if isinstance(value, torch.SymFloat) else float(value)
    raise ValueError(f"{name} must be a finite real number; got {float(value)!r}")


def flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False; got {value!r}")
    return value


def out_dtype(value: object, default: torch.dtype) -> torch.dtype:
    if value is None:
        return default
    if value not in OUT_DTYPES:
        names = ", ".join(str(d) for d in OUT_DTYPES)
        raise ValueError(f"out_dtype must be None or one of {names}; got {value!r}")
    return value  # type: ignore[return-value]
