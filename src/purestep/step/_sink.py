"""Accumulate microbatch grads the way the imperative loop does: in ``.grad``.

:func:`purestep.accumulate` computes ``acc = sum_i w_i * g_i`` over microbatches.
Collecting a whole microbatch's grads first (``torch.autograd.grad``) and then
adding them holds a second full set of grads at the end of every backward, and
makes one more pass over memory than the imperative loop, whose
``AccumulateGrad`` adds each gradient while it is still in cache.

With a :class:`GradSink` in scope, the functional path of
:func:`purestep.value_and_grad` makes its requires-grad leaves once per
``accumulate`` call (:meth:`GradSink.leaves_for`) and reuses them on every
microbatch, running ``torch.autograd.backward(w * loss, inputs=leaves)``: the
first microbatch's grad becomes each leaf's ``.grad`` (no copy), later ones are
added into it by autograd's own ``AccumulateGrad``, with no Python per leaf.
This is exactly the imperative loop's arithmetic (``(loss * w).backward()`` per
microbatch into ``.grad``), so the two agree bit for bit. Scaling the loss
instead of the grads rounds differently when ``w`` is not a power of two: the
result equals the grad-list path of ``accumulate`` (``_foreach_mul_`` /
``_foreach_add_(..., alpha=w)``) up to float rounding. A leaf that no grad
reaches counts as zeros.

A sink serves one ``grad_fn`` call per microbatch (the first that takes it);
``accumulate`` uses its accumulators only when the returned grads are them.
The leaves are private to the sink, which dies with its ``accumulate`` call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import attrs
import torch

__all__ = ["GradSink", "sink_scope", "take_sink"]


@attrs.define
class GradSink:
    """Per-role gradient accumulators shared by the microbatches of one ``accumulate`` call.

    Attributes:
        weight: the current microbatch's weight ``n_i / B``.
        acc: ``{role: [accumulated grad per leaf]}`` for the roles seen so far.
        taken: whether a ``grad_fn`` call has used the sink in this microbatch.
        blocked: roles that ``accumulate`` accumulates outside the sink (their
            first grads did not come through it); a backward with any of them
            does not use the sink.
        tracked: ``{role: (params, tracked params, leaves)}``: the requires-grad
            leaves made for ``params`` on the first microbatch, reused after.

    Example:
        >>> GradSink().weight
        1.0
    """

    weight: float = 1.0
    acc: dict[str, list[torch.Tensor]] = attrs.field(factory=dict)
    taken: bool = False
    blocked: set[str] = attrs.field(factory=set)
    tracked: dict[str, tuple[Any, Any, list[torch.Tensor]]] = attrs.field(factory=dict)

    def accepts(self, losses: dict[str, torch.Tensor]) -> bool:
        """Whether the sink can take the backward of ``losses`` (no blocked role)."""
        return not self.blocked.intersection(losses)

    def leaves_for(
        self, role: str, params: Any, make: Callable[[Any], tuple[Any, list[torch.Tensor]]]
    ) -> tuple[Any, list[torch.Tensor]]:
        """``make(params)`` on the first call for ``role`` (and ``params``), the same result after.

        If a later microbatch brings other ``params`` objects for the role (a
        ``grad_fn`` wrapper that rebuilds them per call), the new leaves take the
        accumulators so far as their ``.grad``, so the sum carries on.
        """
        hit = self.tracked.get(role)
        if hit is not None and hit[0] is params:
            return hit[1], hit[2]
        tracked, leaves = make(params)
        self.tracked[role] = (params, tracked, leaves)
        acc = self.acc.get(role)
        if acc is not None:
            if len(acc) != len(leaves):
                raise ValueError(
                    f"accumulate: role {role!r} has {len(leaves)} params on this microbatch, "
                    f"{len(acc)} on earlier ones"
                )
            for t, a in zip(leaves, acc, strict=True):
                t.grad = a
        return tracked, leaves

    def backward(
        self, losses: dict[str, torch.Tensor], leaves: dict[str, list[torch.Tensor]]
    ) -> dict[str, list[torch.Tensor]]:
        """Backward of ``losses`` into the leaves' ``.grad``; returns ``{role: accumulators}``."""
        w = self.weight

        def weighted(loss: torch.Tensor) -> torch.Tensor:
            return loss * w if w != 1.0 else loss

        if len({id(v) for v in losses.values()}) == 1:
            # one scalar loss for every live role: a single backward pass
            flat = [t for r in losses for t in leaves[r]]
            torch.autograd.backward(weighted(next(iter(losses.values()))), inputs=flat)
        else:
            items = list(losses.items())
            for j, (role, loss) in enumerate(items):
                torch.autograd.backward(
                    weighted(loss), inputs=leaves[role], retain_graph=j < len(items) - 1
                )
        for r in losses:
            acc: list[torch.Tensor] = []
            for t in leaves[r]:
                g = t.grad
                if g is None:  # no grad has reached this leaf yet: zeros, accumulated into later
                    g = t.grad = torch.zeros_like(t)
                acc.append(g)
            self.acc[r] = acc
        return {r: self.acc[r] for r in losses}


_SINK: ContextVar[GradSink | None] = ContextVar("purestep_grad_sink", default=None)


@contextlib.contextmanager
def sink_scope(sink: GradSink, weight: float) -> Iterator[None]:
    """Make ``sink`` available to the next ``grad_fn`` call, for a microbatch of ``weight``.

    Example:
        >>> s = GradSink()
        >>> with sink_scope(s, 0.5):
        ...     take_sink() is s, take_sink()
        (True, None)
    """
    sink.weight = weight
    sink.taken = False
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)


def take_sink() -> GradSink | None:
    """The sink in scope if no ``grad_fn`` call has taken it in this microbatch (then taken).

    Example:
        >>> take_sink() is None
        True
    """
    sink = _SINK.get()
    if sink is None or sink.taken:
        return None
    sink.taken = True
    return sink
