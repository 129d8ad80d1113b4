"""Microbatch gradients accumulate the way the imperative loop accumulates them: in ``.grad``.

:func:`purestep.accumulate` computes ``acc = sum_i w_i * g_i`` over microbatches.
With a :class:`MicrobatchGrads` in scope, :func:`purestep.value_and_grad` makes its
requires-grad leaves once per ``accumulate`` call (:meth:`MicrobatchGrads.leaves_for`)
and reuses them on every microbatch, running ``torch.autograd.backward(w * loss,
inputs=leaves)``: the first gradient that reaches a leaf becomes its ``.grad``
(with the parameter's memory layout), later ones are added into it by
autograd's own ``AccumulateGrad``, with no Python per leaf. This is exactly the
imperative loop's arithmetic (``(loss * w).backward()`` per microbatch), so the
two agree bit for bit, and a leaf that no microbatch reaches has no gradient,
as in torch.

A sink serves one ``grad_fn`` call per microbatch (the first that takes it).
The leaves are private to the sink, which dies with its ``accumulate`` call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import attrs
import torch

__all__ = ["MicrobatchGrads", "sink_scope", "take_sink"]


@attrs.define
class MicrobatchGrads:
    """Requires-grad leaves shared by the microbatches of one ``accumulate`` call.

    Attributes:
        weight: the current microbatch's weight ``n_i / B``.
        taken: whether a ``grad_fn`` call has used the sink in this microbatch.
        tracked: ``{role: (params, tracked params, leaves)}``: the leaves made
            for ``params`` on the first microbatch, reused after.
        served: roles whose gradients went into the leaves' ``.grad`` in this
            microbatch (weighted by ``weight``).
        copies: ``{role: indices}`` of the leaves made as copies of the params
            (``None``: all of them), for ``value_and_grad``'s purity checks.

    Example:
        >>> MicrobatchGrads().weight
        1.0
    """

    weight: float = 1.0
    taken: bool = False
    tracked: dict[str, tuple[Any, Any, list[torch.Tensor]]] = attrs.field(factory=dict)
    served: set[str] = attrs.field(factory=set)
    copies: dict[str, frozenset[int] | None] = attrs.field(factory=dict)

    def leaves_for(
        self, role: str, params: Any, make: Callable[[Any], tuple[Any, list[torch.Tensor]]]
    ) -> tuple[Any, list[torch.Tensor]]:
        """``make(params)`` on the first call for ``role`` (and ``params``), the same result after.

        If a later microbatch brings other ``params`` objects for the role (a
        ``grad_fn`` wrapper that rebuilds them per call), the new leaves take
        the gradients accumulated so far as their ``.grad``, so the sum carries on.
        """
        hit = self.tracked.get(role)
        if hit is not None and hit[0] is params:
            return hit[1], hit[2]
        tracked, leaves = make(params)
        if hit is not None:
            old = hit[2]
            if len(old) != len(leaves):
                raise ValueError(
                    f"accumulate: role {role!r} has {len(leaves)} params on this microbatch, "
                    f"{len(old)} on earlier ones"
                )
            for t, o in zip(leaves, old, strict=True):
                t.grad = o.grad
        self.tracked[role] = (params, tracked, leaves)
        return tracked, leaves

    def grads(self, role: str) -> list[torch.Tensor | None]:
        """The accumulated gradient of each leaf of ``role`` (None where none arrived)."""
        return [t.grad for t in self.tracked[role][2]]


_SINK: ContextVar[MicrobatchGrads | None] = ContextVar("purestep_grad_sink", default=None)


@contextlib.contextmanager
def sink_scope(sink: MicrobatchGrads, weight: float) -> Iterator[None]:
    """Make ``sink`` available to the next ``grad_fn`` call, for a microbatch of ``weight``.

    Example:
        >>> s = MicrobatchGrads()
        >>> with sink_scope(s, 0.5):
        ...     take_sink() is s, take_sink()
        (True, None)
    """
    sink.weight = weight
    sink.taken = False
    sink.served = set()
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)


def take_sink() -> MicrobatchGrads | None:
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
