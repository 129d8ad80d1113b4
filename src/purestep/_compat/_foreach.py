"""Guarded ``torch._foreach_*`` ops, each with a per-tensor loop fallback (bitwise equal).

Example:
    >>> import torch
    >>> from purestep._compat._foreach import foreach_add_
    >>> x = [torch.ones(2)]
    >>> _ = foreach_add_(x, [torch.ones(2)], alpha=2.0)
    >>> x[0]
    tensor([3., 3.])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from purestep._compat._probe import _choose, _clone, _probe_tensors, _same


def _arg(a: Any, i: int) -> Any:
    """The ``i``-th element of a per-tensor list argument, or the scalar/tensor itself."""
    return a[i] if isinstance(a, (list, tuple)) else a


def _loop_add_(self: Sequence[torch.Tensor], other: Any, *, alpha: float = 1) -> None:
    for i, t in enumerate(self):
        o = _arg(other, i)
        t.add_(o, alpha=alpha) if isinstance(o, torch.Tensor) else t.add_(o * alpha)


def _loop_add(self: Sequence[torch.Tensor], other: Any, *, alpha: float = 1) -> list[torch.Tensor]:
    out = []
    for i, t in enumerate(self):
        o = _arg(other, i)
        out.append(torch.add(t, o, alpha=alpha) if isinstance(o, torch.Tensor) else t + o * alpha)
    return out


def _loop_sub_(self: Sequence[torch.Tensor], other: Any, *, alpha: float = 1) -> None:
    for i, t in enumerate(self):
        o = _arg(other, i)
        t.sub_(o, alpha=alpha) if isinstance(o, torch.Tensor) else t.sub_(o * alpha)


_HALF = (torch.float16, torch.bfloat16)


def _loop_mul_(self: Sequence[torch.Tensor], other: Any) -> None:
    # ``_foreach_mul_`` applies a 0-dim tensor scalar in the op's math type (fp32 for
    # fp16/bf16) and rounds once; ``Tensor.mul_`` would round the scalar first.
    for i, t in enumerate(self):
        o = _arg(other, i)
        if t.dtype in _HALF and isinstance(o, torch.Tensor) and o.dim() == 0:
            t.copy_(t.float() * o.to(torch.float32))
        else:
            t.mul_(o)


def _loop_div_(self: Sequence[torch.Tensor], other: Any) -> None:
    for i, t in enumerate(self):
        t.div_(_arg(other, i))


def _loop_lerp_(self: Sequence[torch.Tensor], end: Sequence[torch.Tensor], weight: Any) -> None:
    for i, t in enumerate(self):
        t.lerp_(end[i], _arg(weight, i))


def _loop_lerp(
    self: Sequence[torch.Tensor], end: Sequence[torch.Tensor], weight: Any
) -> list[torch.Tensor]:
    return [torch.lerp(t, end[i], _arg(weight, i)) for i, t in enumerate(self)]


def _loop_addcmul_(
    self: Sequence[torch.Tensor],
    t1: Sequence[torch.Tensor],
    t2: Sequence[torch.Tensor],
    value: Any = 1,
) -> None:
    for i, t in enumerate(self):
        t.addcmul_(t1[i], t2[i], value=_arg(value, i))


def _loop_addcdiv_(
    self: Sequence[torch.Tensor],
    t1: Sequence[torch.Tensor],
    t2: Sequence[torch.Tensor],
    value: Any = 1,
) -> None:
    for i, t in enumerate(self):
        v = _arg(value, i)
        t.addcdiv_(t1[i], t2[i], value=v.item() if isinstance(v, torch.Tensor) else v)


def _loop_maximum_(self: Sequence[torch.Tensor], other: Sequence[torch.Tensor]) -> None:
    for i, t in enumerate(self):
        torch.maximum(t, other[i], out=t)


def _loop_sqrt(self: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.sqrt(t) for t in self]


def _loop_sign_(self: Sequence[torch.Tensor]) -> None:
    for t in self:
        t.sign_()


def _loop_copy_(self: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    for i, t in enumerate(self):
        t.copy_(src[i])


def _loop_norm(
    self: Sequence[torch.Tensor], ord: float = 2, dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    return [torch.linalg.vector_norm(t, ord, dtype=dtype) for t in self]


def _cast(arg: Any, dtype: torch.dtype) -> Any:
    """A probe argument for ``dtype``: tensor lists converted, scalars as they are."""
    if isinstance(arg, list) and arg and isinstance(arg[0], torch.Tensor):
        return [a.to(dtype) for a in arg]
    return arg


def _probe_inplace(
    name: str, loop: Callable[..., None], *args: Any, **kw: Any
) -> Callable[[], bool]:
    def probe() -> bool:
        for dtype in (torch.float32, torch.bfloat16):
            x, y = _probe_tensors(dtype), _probe_tensors(dtype)
            cast_args = [_cast(arg, dtype) for arg in args]
            getattr(torch, name)(x, *cast_args, **kw)
            loop(y, *cast_args, **kw)
            if not _same(x, y):
                return False
        return True

    return probe


def _probe_outofplace(
    name: str, loop: Callable[..., list[torch.Tensor]], *args: Any, **kw: Any
) -> Callable[[], bool]:
    def probe() -> bool:
        for dtype in (torch.float32, torch.bfloat16):
            x = _probe_tensors(dtype)
            before = _clone(x)
            cast_args = [_cast(arg, dtype) for arg in args]
            got = list(getattr(torch, name)(x, *cast_args, **kw))
            if not _same(got, loop(x, *cast_args, **kw)) or not _same(x, before):
                return False
        return True

    return probe


_OTHER = [torch.tensor([1.0, 0.5, -3.0]), torch.tensor([[0.25, 2.0], [-1.0, 4.0]])]
_POS = [torch.tensor([1.0, 0.5, 3.0]), torch.tensor([[0.25, 2.0], [1.0, 4.0]])]


def _foreach(name: str, loop: Callable[..., Any], probe: Callable[[], bool]) -> Any:
    return _choose(f"torch.{name}", probe, lambda: getattr(torch, name), loop)


foreach_add_: Callable[..., None] = _foreach(
    "_foreach_add_", _loop_add_, _probe_inplace("_foreach_add_", _loop_add_, _OTHER, alpha=-0.5)
)
foreach_add: Callable[..., list[torch.Tensor]] = _foreach(
    "_foreach_add", _loop_add, _probe_outofplace("_foreach_add", _loop_add, _OTHER, alpha=0.3)
)
foreach_sub_: Callable[..., None] = _foreach(
    "_foreach_sub_", _loop_sub_, _probe_inplace("_foreach_sub_", _loop_sub_, _OTHER)
)
foreach_mul_: Callable[..., None] = _foreach(
    "_foreach_mul_",
    _loop_mul_,
    _probe_inplace("_foreach_mul_", _loop_mul_, torch.tensor(1 - 1e-4, dtype=torch.float64)),
)
foreach_div_: Callable[..., None] = _foreach(
    "_foreach_div_", _loop_div_, _probe_inplace("_foreach_div_", _loop_div_, [0.75, 3.0])
)
foreach_lerp_: Callable[..., None] = _foreach(
    "_foreach_lerp_", _loop_lerp_, _probe_inplace("_foreach_lerp_", _loop_lerp_, _OTHER, 0.1)
)
foreach_lerp: Callable[..., list[torch.Tensor]] = _foreach(
    "_foreach_lerp", _loop_lerp, _probe_outofplace("_foreach_lerp", _loop_lerp, _OTHER, 0.1)
)
foreach_addcmul_: Callable[..., None] = _foreach(
    "_foreach_addcmul_",
    _loop_addcmul_,
    _probe_inplace("_foreach_addcmul_", _loop_addcmul_, _OTHER, _OTHER, 0.001),
)
foreach_addcdiv_: Callable[..., None] = _foreach(
    "_foreach_addcdiv_",
    _loop_addcdiv_,
    _probe_inplace("_foreach_addcdiv_", _loop_addcdiv_, _OTHER, _POS, -0.01),
)
foreach_maximum_: Callable[..., None] = _foreach(
    "_foreach_maximum_", _loop_maximum_, _probe_inplace("_foreach_maximum_", _loop_maximum_, _OTHER)
)
foreach_sqrt: Callable[..., list[torch.Tensor]] = _foreach(
    "_foreach_sqrt", _loop_sqrt, _probe_outofplace("_foreach_sqrt", _loop_sqrt)
)
foreach_sign_: Callable[..., None] = _foreach(
    "_foreach_sign_", _loop_sign_, _probe_inplace("_foreach_sign_", _loop_sign_)
)
foreach_copy_: Callable[..., None] = _foreach(
    "_foreach_copy_", _loop_copy_, _probe_inplace("_foreach_copy_", _loop_copy_, _OTHER)
)
foreach_norm: Callable[..., list[torch.Tensor]] = _foreach(
    "_foreach_norm",
    _loop_norm,
    _probe_outofplace("_foreach_norm", _loop_norm, 2, dtype=torch.float32),
)
