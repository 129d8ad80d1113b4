"""Per-parameter step counts: Adam's bias correction counts each parameter's own updates.

``torch.optim`` keeps ``state["step"]`` per parameter, so a parameter without a
gradient in some step keeps its count; purestep keeps them as a tree ``steps``
like the params. Advancing 150 separate 0-dim CPU counts costs one dispatch
each (``_foreach_add_``: ~300 µs a step on the 150-tensor benchmark model), so
:func:`pack_steps` makes them views of one 1-D buffer and :func:`bump_steps`
advances a donated state's counts with one ``add_`` on that buffer, after
checking that the counts are still exactly its elements.
"""

from __future__ import annotations

import torch

from purestep import _compat

__all__ = ["bump_steps", "pack_steps", "steps_by_value"]


def pack_steps(steps: list[torch.Tensor]) -> list[torch.Tensor]:
    """``steps`` (0-dim step counts) as views of one new 1-D buffer, when they can share one.

    Per-parameter counts that are views of one buffer are advanced by one
    ``add_`` (see :func:`bump_steps`) instead of one dispatch per parameter.
    Counts on several devices or dtypes, DTensors and fake tensors stay as they
    are (copied only by the caller's own path).

    Example:
        >>> s = pack_steps([torch.tensor(1.0), torch.tensor(2.0)])
        >>> s, s[0]._base is s[1]._base
        ([tensor(1.), tensor(2.)], True)
    """
    if not _packable(steps):
        return steps
    return list(torch.stack(steps).unbind())


def _packable(steps: list[torch.Tensor]) -> bool:
    if not steps:
        return False
    first = steps[0]
    dev, dtype, plain = first.device, first.dtype, torch.Tensor
    return all(
        type(t) is plain and t.device == dev and t.dtype == dtype and not t.dim() for t in steps
    )


def _packed(steps: list[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D buffer whose elements are exactly ``steps`` (each once), or None."""
    first = steps[0]
    base = first._base
    if (
        type(first) is not torch.Tensor
        or base is None
        or base.dim() != 1
        or base.numel() != len(steps)
        or base.stride(0) != 1
        or base.storage_offset() != 0
        or base._base is not None
    ):
        return None
    if not all(t._base is base and not t.dim() for t in steps):
        return None
    if len({t.storage_offset() for t in steps}) != len(steps):
        return None  # one element listed twice (another one missing)
    return base


def bump_steps(steps: list[torch.Tensor], *, donate: bool) -> list[torch.Tensor]:
    """Every per-parameter step count plus one.

    Donated counts that are views of one buffer (:func:`pack_steps`, as
    ``init`` builds them) are advanced in place by one ``add_`` on the buffer:
    ``_foreach_add_`` over 150 CPU scalars costs about 300 µs, a dispatch per
    tensor. Otherwise the new counts are gathered into a new buffer (pure steps,
    or counts that are no longer views of one buffer: after a checkpoint load,
    for a subset of the params), so the next donated step takes the fast path;
    counts that cannot share a buffer (several devices, DTensors, the fake
    tensors of ``purestep.compile``'s trace) take ``_foreach_add``.

    Example:
        >>> s = pack_steps([torch.tensor(0.0), torch.tensor(3.0)])
        >>> bump_steps(s, donate=True) is s, s
        (True, [tensor(1.), tensor(4.)])
    """
    if donate:
        base = _packed(steps)
        if base is not None:
            base.add_(1.0)
            return steps
    if _packable(steps):
        return list(torch.stack(steps).add_(1.0).unbind())
    if donate:
        _compat.foreach_add_(steps, 1.0)
        return steps
    return list(_compat.foreach_add(steps, 1.0))


def steps_by_value(steps: list[torch.Tensor]) -> dict[float, list[int]]:
    """Indices of ``steps`` grouped by their value (host reads: CPU step tensors).

    Example:
        >>> steps_by_value([torch.tensor(2.0), torch.tensor(1.0), torch.tensor(2.0)])
        {2.0: [0, 2], 1.0: [1]}
    """
    out: dict[float, list[int]] = {}
    for i, s in enumerate(steps):
        out.setdefault(float(s), []).append(i)
    return out
