"""Donated states: a state given to a donating step is marked, and using it again raises.

A step built with ``donate=True`` updates params and optimizer state in the
input state's own buffers. The input is then invalid: its leaves hold the new
values (or, after a failure, a mix), and a second step on it would apply a
second update to the same buffers while the returned state also points at
them. So a donating step returns a *new* top-level TensorDict (sharing the
subtrees, no copies: about a microsecond) and marks the input as donated; every
step, ``apply_gradients`` and wrapper checks the mark on entry
(:func:`check_live`: one dictionary lookup) and raises
:class:`~purestep.errors.DonatedStateError`.

The mark lives on the TensorDict object itself (its ``__dict__``), so it goes
away with it. A copy made *before* donating (``state.copy()`` shares the leaves)
is not marked: it is invalidated all the same, as documented for ``donate``.

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> s = TensorDict({"step": torch.zeros((), dtype=torch.int64)}, [])
    >>> out = fresh_top(s)
    >>> out is s, out["step"] is s["step"]
    (False, True)
    >>> mark_donated(s, "a donated train_step at step 0")
    >>> check_live(s, "train_step")
    Traceback (most recent call last):
    ...
    purestep.errors.DonatedStateError: train_step: this state was donated to a donated train_step at step 0 ...
"""

from __future__ import annotations

import weakref
from typing import Any

from tensordict import TensorDict, TensorDictBase

from purestep.errors import DonatedStateError

__all__ = ["check_live", "fresh_top", "is_donated", "mark_donated"]

_MARK = "purestep_donated"
# States without a ``__dict__`` (other TensorDictBase types): id -> (weak reference, mark).
_OTHER: dict[int, tuple[weakref.ref[Any], str]] = {}


def _mark_of(state: TensorDictBase) -> str | None:
    d = getattr(state, "__dict__", None)
    if d is not None:
        mark: str | None = d.get(_MARK)
        return mark
    entry = _OTHER.get(id(state))
    if entry is not None and entry[0]() is state:
        return entry[1]
    return None


def is_donated(state: TensorDictBase) -> bool:
    """Whether ``state`` was donated to a step (and so may not be used again).

    Example:
        >>> from tensordict import TensorDict
        >>> is_donated(TensorDict({}, []))
        False
    """
    return _mark_of(state) is not None


def mark_donated(state: TensorDictBase, what: str) -> None:
    """Mark ``state`` as donated to ``what`` (e.g. ``"a donated train_step at step 3"``).

    Example:
        >>> from tensordict import TensorDict
        >>> s = TensorDict({}, [])
        >>> mark_donated(s, "a test"); is_donated(s)
        True
    """
    d = getattr(state, "__dict__", None)
    if d is not None:
        d[_MARK] = what
        return
    key = id(state)
    try:
        ref = weakref.ref(state, lambda _: _OTHER.pop(key, None))
    except TypeError:  # neither a __dict__ nor weak references: cannot be marked
        return
    _OTHER[key] = (ref, what)


def check_live(state: TensorDictBase, who: str) -> None:
    """Raise :class:`~purestep.errors.DonatedStateError` when ``state`` was donated before.

    Example:
        >>> from tensordict import TensorDict
        >>> check_live(TensorDict({}, []), "train_step")
    """
    mark = _mark_of(state)
    if mark is not None:
        raise DonatedStateError(
            f"{who}: this state was donated to {mark} (donate=True), which updated its "
            "buffers in place and returned a new state that owns them; using this one again "
            "would apply a second update to the same buffers. Continue from the state that "
            "step returned (state, metrics = step(state, batch)), or build the step with "
            "donate=False to keep its input"
        )


def _has_names(state: TensorDict) -> bool:
    return any(n is not None for n in state.names)


def fresh_top(state: TensorDictBase) -> TensorDictBase:
    """A new top-level TensorDict holding ``state``'s entries (the subtrees are shared, not copied).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> s = TensorDict({"a": {"w": torch.ones(1)}}, [])
        >>> t = fresh_top(s)
        >>> t is s, t["a"] is s["a"]
        (False, True)
    """
    if type(state) is TensorDict:
        return TensorDict._new_unsafe(
            dict(state._tensordict),
            batch_size=state.batch_size,
            device=state.device,
            names=state.names if state.batch_dims and _has_names(state) else None,
            nested=False,
        )
    return state.copy()
