"""What a ``grad_fn`` call is computing: the live roles and the microbatch (context variables)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import attrs

__all__ = ["Microbatch", "current_microbatch", "live_roles", "live_scope", "microbatch_scope"]


@attrs.frozen
class Microbatch:
    """Where a ``grad_fn`` call sits inside :func:`purestep.accumulate`.

    Attributes:
        index: 0-based microbatch number.
        count: number of microbatches ``k``.
        weight: this microbatch's share of the full batch (``size / B``).

    Example:
        >>> Microbatch(index=1, count=2, weight=0.5).is_last
        True
    """

    index: int = 0
    count: int = 1
    weight: float = 1.0

    @property
    def is_last(self) -> bool:
        """True on the final microbatch (when bound roles sync and harvest grads)."""
        return self.index == self.count - 1


_LIVE: ContextVar[frozenset[str] | None] = ContextVar("purestep_live_roles", default=None)
_MICRO: ContextVar[Microbatch] = ContextVar("purestep_microbatch", default=Microbatch())  # noqa: B039 (frozen)


def live_roles() -> frozenset[str] | None:
    """The roles whose gradients the current ``grad_fn`` call computes.

    A loss function can skip the work of roles that are not live on this step
    (e.g. DMD2's student on non-update steps). ``None`` outside a ``grad_fn`` call.

    Example:
        >>> live_roles() is None
        True
    """
    return _LIVE.get()


@contextlib.contextmanager
def live_scope(roles: frozenset[str]) -> Iterator[None]:
    """Mark ``roles`` as the live roles of the enclosed loss (used by ``value_and_grad``).

    Example:
        >>> with live_scope(frozenset({"s"})):
        ...     sorted(live_roles())
        ['s']
    """
    token = _LIVE.set(roles)
    try:
        yield
    finally:
        _LIVE.reset(token)


def current_microbatch() -> Microbatch:
    """The :class:`Microbatch` being computed (``Microbatch()`` outside accumulation).

    Example:
        >>> current_microbatch().is_last
        True
    """
    return _MICRO.get()


@contextlib.contextmanager
def microbatch_scope(mb: Microbatch) -> Iterator[None]:
    """Mark the enclosed ``grad_fn`` call as microbatch ``mb`` (used by ``accumulate``).

    Example:
        >>> with microbatch_scope(Microbatch(index=0, count=2, weight=0.5)):
        ...     current_microbatch().count
        2
    """
    token = _MICRO.set(mb)
    try:
        yield
    finally:
        _MICRO.reset(token)
