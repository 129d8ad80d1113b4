"""Guarded tensordict internals: the storage-dict walk (``PLAIN_TD``) and ``_new_unsafe`` (``new_td``).

Example:
    >>> import torch
    >>> from purestep._compat._tensordict import new_td
    >>> new_td({"a": torch.ones(2)}, batch_size=torch.Size([]))["a"]
    tensor([1., 1.])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict

from purestep._compat._probe import _choose


class _NoPlainNode:
    """Stands in for ``TensorDict`` in the fast-walk gates: no node is of this type."""


def _probe_td_storage() -> bool:
    a, b, c = torch.ones(2), torch.zeros(1), torch.full((3,), 2.0)
    td = TensorDict({"a": a, "n": {"b": b}}, [])
    d = td._tensordict
    if not isinstance(d, dict) or d["a"] is not a or type(d["n"]) is not TensorDict:
        return False
    if d["n"]._tensordict["b"] is not b:
        return False
    td.set("c", c)  # a live dict, in insertion order
    if list(d) != ["a", "n", "c"] or d["c"] is not c:
        return False
    return td._device is None and td._batch_size == torch.Size([])


def _probe_new_unsafe() -> bool:
    a, sub = torch.ones(2), TensorDict({"b": torch.zeros(1)}, [])
    td = TensorDict._new_unsafe({"a": a, "n": sub}, batch_size=torch.Size([]), nested=False)
    return (
        type(td) is TensorDict
        and td.get("a") is a
        and td.get("n") is sub
        and td.batch_size == torch.Size([])
        and td.device is None
        and not td.is_locked
    )


def _new_td_public(
    items: dict[str, Any], batch_size: torch.Size, nested: bool = False
) -> TensorDict:
    """The checked constructor: same result as ``_new_unsafe`` for the inputs purestep passes."""
    return TensorDict(items, batch_size=batch_size)


PLAIN_TD: type = _choose(
    "TensorDict._tensordict/_device/_batch_size",
    _probe_td_storage,
    lambda: TensorDict,
    _NoPlainNode,
)
"""``TensorDict`` when its private storage dict may be walked directly; else a type no
node has, so every tree walker in :mod:`purestep.tree` takes the generic API."""

new_td: Callable[..., TensorDict] = _choose(
    "TensorDict._new_unsafe",
    _probe_new_unsafe,
    lambda: TensorDict._new_unsafe,
    _new_td_public,
)
"""``new_td(items, batch_size=, nested=False)``: a TensorDict of ``items`` without copies."""
