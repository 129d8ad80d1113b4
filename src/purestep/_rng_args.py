"""Argument checks of :mod:`purestep.rng`: each bad argument fails naming itself.

Example:
    >>> from purestep._rng_args import shape
    >>> shape((2, 3), "uniform")
    (2, 3)
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch

__all__ = [
    "DIGITS",
    "I64_MAX",
    "I64_MIN",
    "U64",
    "ShapeLike",
    "as_int",
    "broadcasts_to",
    "check_index",
    "check_key",
    "describe",
    "finite",
    "float_dtype",
    "shape",
    "signed",
]

ShapeLike = int | Sequence[int]

U64 = 1 << 64
I64_MIN = -(1 << 63)
I64_MAX = (1 << 63) - 1
DIGITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}
"""Significand digits ``D`` of each float dtype a draw can return."""


def signed(u: int) -> int:
    """The int64 two's-complement value of the unsigned 64-bit word ``u mod 2**64``.

    Example:
        >>> signed(2**64 - 1)
        -1
    """
    u %= U64
    return u - U64 if u > I64_MAX else u


def describe(x: object) -> str:
    """A short description of ``x`` for error messages.

    Example:
        >>> describe(torch.zeros(2))
        'Tensor(shape=(2,), dtype=torch.float32, device=cpu)'
    """
    if isinstance(x, torch.Tensor):
        return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype}, device={x.device})"
    return f"{type(x).__name__} {x!r}"


def as_int(x: object, what: str, lo: int, hi: int) -> int:
    """``x`` as a Python int in ``[lo, hi]``; ``what`` names the argument in errors.

    Example:
        >>> as_int(3, "n", 0, 10)
        3
    """
    if isinstance(x, bool | torch.Tensor):
        raise TypeError(f"{what} must be an int, got {describe(x)}")
    try:
        v = operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be an int, got {describe(x)}") from None
    if not lo <= v <= hi:
        raise ValueError(f"{what} must be in [{lo}, {hi}], got {v}")
    return v


def check_key(k: object, fn: str, *, scalar: bool) -> torch.Tensor:
    """``k`` if it is an int64 key tensor (0-dim when ``scalar``), else a ``TypeError``.

    Example:
        >>> check_key(torch.tensor(1), "uniform", scalar=True).dtype
        torch.int64
    """
    if not isinstance(k, torch.Tensor) or k.dtype != torch.int64 or (scalar and k.dim() != 0):
        need = "a 0-dim int64 tensor" if scalar else "an int64 tensor"
        hint = f"; make one with rng.key({k!r})" if isinstance(k, int) else ""
        raise TypeError(
            f"{fn}: key must be {need} (from rng.key/fold_in/split), got {describe(k)}{hint}"
        )
    return k


def shape(shape: ShapeLike, fn: str) -> tuple[int, ...]:
    """A draw's shape as a tuple of non-negative ints.

    Example:
        >>> shape(4, "normal")
        (4,)
    """
    if isinstance(shape, torch.Tensor | str):
        raise TypeError(f"{fn}: shape must be an int or a sequence of ints, got {describe(shape)}")
    dims = [shape] if not isinstance(shape, Sequence) else list(shape)
    out = tuple(
        # a symbolic size (a batch traced by purestep.compile(dynamic=True)) stays symbolic
        d
        if isinstance(d, torch.SymInt)
        else as_int(d, f"{fn}: shape {tuple(dims)!r} entry", 0, I64_MAX)
        for d in dims
    )
    if any(isinstance(d, torch.SymInt) for d in out):
        return out  # its element count is checked where it is concrete
    n = math.prod(out)
    if n > MAX_ELEMENTS:
        raise ValueError(
            f"{fn}: shape {out} has {n} elements (about 2**{n.bit_length() - 1}), more than a "
            f"tensor can index (at most 2**{MAX_ELEMENTS.bit_length() - 1}); check the shape"
        )
    return out


# Draws index their words with int64 arithmetic and take up to two words per element.
MAX_ELEMENTS = 1 << 62


def check_index(index: object, fn: str) -> torch.Tensor:
    """``index`` if it is a 1-D int64 tensor of sample ids, else a ``TypeError``.

    Example:
        >>> check_index(torch.arange(3), "normal").shape
        torch.Size([3])
    """
    if not isinstance(index, torch.Tensor) or index.dtype != torch.int64 or index.dim() != 1:
        raise TypeError(
            f"{fn}: index must be a 1-D int64 tensor of sample ids, got {describe(index)}"
        )
    return index


def broadcasts_to(src: tuple[int, ...], dst: tuple[int, ...]) -> bool:
    """Whether a tensor of shape ``src`` broadcasts to exactly ``dst``.

    Example:
        >>> broadcasts_to((1, 3), (2, 3)), broadcasts_to((2,), (2, 3))
        (True, False)
    """
    if len(src) > len(dst):
        return False
    return all(a in (1, b) for a, b in zip(reversed(src), reversed(dst), strict=False))


def float_dtype(dtype: torch.dtype | None, fn: str) -> torch.dtype:
    """``dtype`` (default ``torch.get_default_dtype()``) if a draw can return it.

    Example:
        >>> float_dtype(torch.bfloat16, "uniform")
        torch.bfloat16
    """
    dt = torch.get_default_dtype() if dtype is None else dtype
    if dt not in DIGITS:
        raise TypeError(f"{fn}: dtype must be one of {sorted(map(str, DIGITS))}, got {dt}")
    return dt


def finite(x: object, what: str) -> float:
    """``x`` as a finite Python float, else a ``ValueError`` naming ``what``.

    Example:
        >>> finite(1, "low")
        1.0
    """
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        raise ValueError(f"{what} must be a finite float, got {describe(x)}")
    return float(x)
