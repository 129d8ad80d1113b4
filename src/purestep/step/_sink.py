"""Fold each microbatch's grads into the accumulators as backward produces them.

:func:`purestep.accumulate` computes ``acc = sum_i w_i * g_i`` over microbatches.
Collecting a whole microbatch's grads first (``torch.autograd.grad``) and then
adding them holds a second full set of grads at the end of every backward, and
makes one more pass over memory than the imperative loop, whose
``AccumulateGrad`` adds each gradient while it is still in cache.

With a :class:`GradSink` in scope, the functional path of
:func:`purestep.value_and_grad` instead runs ``torch.autograd.backward(w *
loss, inputs=leaves)`` on its fresh leaves and, in a post-accumulate-grad hook
per leaf, folds the leaf's grad into the role's accumulator and drops it: on a
role's first microbatch the grad becomes the accumulator (no copy), later
``acc.add_(g)``; a leaf that gets no grad counts as zeros. This is exactly the
imperative loop's arithmetic (``(loss * w).backward()`` per microbatch into
``.grad``), so the two agree bit for bit, with no pass over memory to scale
grads. Scaling the loss instead of the grads rounds differently when ``w`` is
not a power of two: the result equals the grad-list path of ``accumulate``
(``_foreach_mul_`` / ``_foreach_add_(..., alpha=w)``) up to float rounding.

A sink serves one ``grad_fn`` call per microbatch (the first that takes it);
``accumulate`` uses its accumulators only when the returned grads are them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

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

    Example:
        >>> GradSink().weight
        1.0
    """

    weight: float = 1.0
    acc: dict[str, list[torch.Tensor]] = attrs.field(factory=dict)
    taken: bool = False
    blocked: set[str] = attrs.field(factory=set)

    def accepts(self, losses: dict[str, torch.Tensor]) -> bool:
        """Whether the sink can take the backward of ``losses`` (no blocked role)."""
        return not self.blocked.intersection(losses)

    def backward(
        self, losses: dict[str, torch.Tensor], leaves: dict[str, list[torch.Tensor]]
    ) -> dict[str, list[torch.Tensor]]:
        """Backward of ``losses`` into the accumulators; returns ``{role: accumulators}``."""
        w = self.weight
        news = {r: r not in self.acc for r in losses}
        for r, new in news.items():
            if new:
                self.acc[r] = [torch.empty(0)] * len(leaves[r])
        got: dict[str, list[bool]] = {r: [False] * len(leaves[r]) for r in losses}

        def hook_for(role: str, i: int) -> None:
            acc, new, seen = self.acc[role], news[role], got[role]

            def hook(t: torch.Tensor) -> None:
                g = t.grad
                assert g is not None
                t.grad = None
                if new:
                    acc[i] = g
                else:
                    acc[i].add_(g)
                seen[i] = True

            leaves[role][i].register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]

        for r in losses:
            for i in range(len(leaves[r])):
                hook_for(r, i)

        def weighted(loss: torch.Tensor) -> torch.Tensor:
            return loss * w if w != 1.0 else loss

        distinct = {id(v) for v in losses.values()}
        if len(distinct) == 1:
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
            acc = self.acc[r]
            for i, seen in enumerate(got[r]):
                if not seen and news[r]:  # no grad reached this leaf: it counts as zeros
                    acc[i] = torch.zeros_like(leaves[r][i])
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
