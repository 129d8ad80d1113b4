"""The DTensor-aware global L2 norm of a list of tensors, and a memo for it within a step.

One home for the gradient norm: a train step's ``grad_norm`` metric and
:func:`~purestep.optim.clip_by_global_norm` both take it, and inside
:func:`norm_memo` the second call reuses the first. Sharded (DTensor) leaves
contribute their *global* norm, reduced with one collective per (mesh,
placements) group. Public through :mod:`purestep.tree` (``tree.global_norm``,
``tree.norm_memo``); this module imports only torch and ``_compat``, so the
base modules can use it.

Example:
    >>> import torch
    >>> from purestep import tree
    >>> tree.global_norm([torch.tensor([3.0]), torch.tensor([4.0])])
    tensor(5.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import Any, cast

import torch

from purestep import _compat

__all__ = ["global_norm", "norm_memo"]

_NormKey = tuple[tuple[int, int], ...]
_NORM_MEMO: ContextVar[dict[_NormKey, tuple[Sequence[torch.Tensor], torch.Tensor]] | None] = (
    ContextVar("purestep_norm_memo", default=None)
)


@contextlib.contextmanager
def norm_memo() -> Iterator[None]:
    """Within the block, :func:`global_norm` of the same unchanged tensors is computed once.

    A train step takes the grads' norm for its ``grad_norm`` metric and
    :func:`~purestep.optim.clip_by_global_norm` takes it again to clip: one
    more full read of every gradient (and, for sharded grads, one more
    collective). Inside ``norm_memo()`` the second call returns the first
    result (a copy of it). Entries are keyed by each tensor's identity *and*
    version counter, so a tensor modified in place since (clipped grads, say)
    is a miss.

    Example:
        >>> g = [torch.tensor([3.0, 4.0])]
        >>> with norm_memo():
        ...     a = global_norm(g)
        ...     global_norm(g)
        tensor(5.)
        >>> with norm_memo():
        ...     a = global_norm(g)
        ...     _ = g[0].mul_(2)
        ...     global_norm(g)
        tensor(10.)
    """
    token = _NORM_MEMO.set({})
    try:
        yield
    finally:
        _NORM_MEMO.reset(token)


def _norm_key(tensors: Sequence[torch.Tensor]) -> _NormKey | None:
    try:
        return tuple((id(t), t._version) for t in tensors)
    except (AttributeError, RuntimeError):  # a tensor type without a version counter
        return None


def global_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all ``tensors`` taken together, as a float32 0-dim tensor.

    DTensor leaves (e.g. FSDP2-sharded grads) contribute their *global* norm:
    per-shard squared norms are reduced across the mesh, so every rank gets the
    same value. Stays on device (no host sync).

    Example:
        >>> global_norm([torch.tensor([3.0]), torch.tensor([4.0])])
        tensor(5.)
    """
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    memo = _NORM_MEMO.get()
    if memo is None:
        return _global_norm(tensors)
    key = _norm_key(tensors)
    if key is None:
        return _global_norm(tensors)
    hit = memo.get(key)
    if hit is None:
        # the entry keeps the tensors alive, so their ids cannot be reused meanwhile
        norm = _global_norm(tensors)
        memo[key] = (list(tensors), norm)
        return norm
    return hit[1].clone()  # a 0-dim copy: callers never share (and so alias) one tensor


def _global_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    if all(type(t) is torch.Tensor for t in tensors) and torch.float64 not in {
        t.dtype for t in tensors
    }:  # the common case: plain tensors, one foreach and one reduction
        each = _compat.foreach_norm(tensors, 2, dtype=torch.float32)
        with contextlib.suppress(RuntimeError):  # leaves on several devices: general path
            total: torch.Tensor = torch.linalg.vector_norm(torch.stack(each))
            return total
    plain: list[torch.Tensor] = []
    sharded: dict[tuple[Any, tuple[Any, ...]], list[torch.Tensor]] = {}
    for t in tensors:
        if hasattr(t, "full_tensor"):
            key = (getattr(t, "device_mesh"), tuple(getattr(t, "placements")))  # noqa: B009
            sharded.setdefault(key, []).append(cast(Any, t).to_local())  # the local shard
        else:
            plain.append(t)
    parts: list[torch.Tensor] = []
    for (mesh, placements), locs in sharded.items():
        # one collective per (mesh, placements) group, not per leaf: sum the local
        # squared norms over sharded mesh dims, keep them over replicated ones.
        parts.append(_reduce_sq_norm(locs, mesh, placements))
    by_dev: dict[tuple[torch.device, bool], list[torch.Tensor]] = {}
    for t in plain:
        by_dev.setdefault((t.device, t.dtype == torch.float64), []).append(t)
    device = parts[0].device if parts else tensors[0].device
    for dev_tensors in by_dev.values():
        norms = _foreach_norm32(dev_tensors)
        parts.append(torch.linalg.vector_norm(torch.stack(norms)).to(device) ** 2)
    return torch.stack([p.to(device) for p in parts]).sum().sqrt()


def _foreach_norm32(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-tensor L2 norms as float32, accumulated in at least float32 (float64 stays float64)."""
    if tensors[0].dtype == torch.float64:
        return [n.to(torch.float32) for n in _compat.foreach_norm(tensors, 2)]
    return list(_compat.foreach_norm(tensors, 2, dtype=torch.float32))


def _reduce_sq_norm(
    locs: list[torch.Tensor], mesh: Any, placements: tuple[Any, ...]
) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    by_kind: dict[bool, list[torch.Tensor]] = {}
    for t in locs:
        by_kind.setdefault(t.dtype == torch.float64, []).append(t)
    sq = sum(
        ((torch.stack(_foreach_norm32(ts)) ** 2).sum() for ts in by_kind.values()),
        torch.zeros((), device=locs[0].device),
    )
    reduce = [Partial("sum") if isinstance(p, Shard) else Replicate() for p in placements]
    full: torch.Tensor = DTensor.from_local(sq, mesh, reduce, run_check=False).full_tensor()
    return full
