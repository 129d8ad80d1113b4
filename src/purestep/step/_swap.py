"""Where a module keeps its tensors, and putting a tree of tensors into those places.

:func:`purestep.call` runs a module with other tensors in place of its own
parameters and buffers. This module is its engine:

* A **layout** (:mod:`purestep._layout`) lists every parameter and buffer
  *slot* of a module tree under every path that reaches it (tied and shared
  tensors included; compile wrappers transparent).
* A **plan** maps the leaves of a tree (keyed by module path) to *all* the
  slots of the objects they name, so every aliased slot of a tied parameter
  receives the same tensor (and autograd sums the gradients of all its uses).
* :func:`swap` puts the leaves in, :func:`restore` puts the module's own
  tensors back; a tensor the module *replaced* during the call (a buffer
  reassigned by ``forward``) is written back into the tree.

A thread that swaps into slots another
thread is using gets a clear error (:class:`ModuleInUseError`) instead of
silently running with the other thread's tensors.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from tensordict import TensorDict
    >>> lin = nn.Linear(1, 1)
    >>> w = TensorDict({"weight": torch.full((1, 1), 2.0), "bias": torch.zeros(1)}, [])
    >>> p = plan_for(lin, w)
    >>> held = swap(p, w)
    >>> lin.weight
    tensor([[2.]])
    >>> restore(p, held, w)
    >>> isinstance(lin.weight, nn.Parameter)
    True
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

from purestep import tree
from purestep._layout import KeyPath, Layout, layout_of, unwrap
from purestep.errors import ModuleInUseError

__all__ = [
    "KeyPath",
    "Layout",
    "ModuleInUseError",
    "Plan",
    "acquire",
    "layout_of",
    "plan_and_leaves",
    "plan_for",
    "release",
    "restore",
    "swap",
    "unwrap",
]

_Slot = tuple[dict[str, Any], str]


class Plan:
    """Which slots each leaf of a tree goes into (all aliases), for one module layout.

    Attributes:
        entries: ``(slots dict, key, leaf index)`` for every slot to fill.
        dict_ids: ids of the distinct slot dicts (the unit of thread ownership).
        paths: the tree's leaf paths (leaf order).
    """

    __slots__ = ("dict_ids", "entries", "paths")

    def __init__(self, layout: Layout, paths: list[KeyPath], module: nn.Module) -> None:
        self.paths = paths
        self.entries: list[tuple[dict[str, Any], str, int]] = []
        owner: dict[tuple[int, str], int] = {}
        for i, path in enumerate(paths):
            slots = layout.slots.get(path)
            if slots is None:
                raise KeyError(
                    f"call: {type(module).__name__} has no parameter or buffer "
                    f"{tree.format_path(path)!r} (the tree's keys must follow the module's "
                    "named_parameters()/named_buffers() paths)"
                )
            for d, key in slots:
                if d.get(key) is None:
                    raise ValueError(
                        f"call: {type(module).__name__}.{tree.format_path(path)} is None; "
                        "there is no tensor to replace"
                    )
                prev = owner.get((id(d), key))
                if prev is not None:
                    raise ValueError(
                        f"call: {tree.format_path(paths[prev])!r} and {tree.format_path(path)!r} "
                        f"name the same tied tensor of {type(module).__name__}; give it once "
                        f"(its canonical key is {tree.format_path(layout.canonical[path])!r})"
                    )
                owner[(id(d), key)] = i
                self.entries.append((d, key, i))
        self.dict_ids = list({id(d): None for d, _, _ in self.entries})


def plan_for(module: nn.Module, td: TensorDictBase) -> Plan:
    """The cached :class:`Plan` for putting ``td``'s leaves into ``module`` (unwrapped).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from tensordict import TensorDict
        >>> len(plan_for(nn.Linear(1, 1), TensorDict({"bias": torch.zeros(1)}, [])).entries)
        1
    """
    return plan_and_leaves(module, td)[0]


def plan_and_leaves(module: nn.Module, td: TensorDictBase) -> tuple[Plan, list[torch.Tensor]]:
    """:func:`plan_for` and ``tree.leaves(td)``, from one walk of ``td``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from tensordict import TensorDict
        >>> plan, leaves = plan_and_leaves(nn.Linear(1, 1), TensorDict({"bias": torch.ones(1)}, []))
        >>> plan.paths, leaves
        ([('bias',)], [tensor([1.])])
    """
    layout = layout_of(module)
    key, leaves = tree.keyed_leaves(td)
    plan = layout.plans.get(key)
    if plan is None:
        plan = layout.plans[key] = Plan(layout, tree.paths(td), unwrap(module))
    return plan, leaves


# Thread ownership of slot dicts: id(dict) -> (thread ident, nesting depth).
_OWNERS: dict[int, tuple[int, int]] = {}
_OWNERS_LOCK = threading.Lock()


def acquire(plan: Plan, module: nn.Module) -> None:
    """Mark ``plan``'s slots as used by this thread; raise if another thread uses them.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from tensordict import TensorDict
        >>> lin = nn.Linear(1, 1)
        >>> p = plan_for(lin, TensorDict({"bias": torch.zeros(1)}, []))
        >>> acquire(p, lin); release(p)
    """
    me = threading.get_ident()
    with _OWNERS_LOCK:
        for n, i in enumerate(plan.dict_ids):
            owner = _OWNERS.get(i)
            if owner is None:
                _OWNERS[i] = (me, 1)
            elif owner[0] == me:
                _OWNERS[i] = (me, owner[1] + 1)
            else:
                _release_ids(plan.dict_ids[:n])
                raise ModuleInUseError(
                    f"call: {type(module).__name__} is in use by a call in another thread "
                    f"(thread {owner[0]}); a module holds one set of tensors at a time, so "
                    "threads that step through the same module must each use their own copy "
                    "(copy.deepcopy(module)) or take turns"
                )


def _release_ids(ids: list[int]) -> None:
    for i in ids:
        owner = _OWNERS[i]
        if owner[1] == 1:
            del _OWNERS[i]
        else:
            _OWNERS[i] = (owner[0], owner[1] - 1)


def release(plan: Plan) -> None:
    """Undo one :func:`acquire` of ``plan`` by this thread."""
    with _OWNERS_LOCK:
        _release_ids(plan.dict_ids)


def swap(plan: Plan, td: TensorDictBase, leaves: list[torch.Tensor] | None = None) -> list[Any]:
    """Put ``td``'s leaves into their slots; return what the slots held (for :func:`restore`).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from tensordict import TensorDict
        >>> lin = nn.Linear(1, 1)
        >>> td = TensorDict({"bias": torch.zeros(1)}, [])
        >>> p = plan_for(lin, td)
        >>> old = swap(p, td)
        >>> lin.bias
        tensor([0.])
        >>> restore(p, old, td)
    """
    values = tree.leaves(td) if leaves is None else leaves
    olds: list[Any] = []
    for d, key, i in plan.entries:
        olds.append(d[key])
        d[key] = values[i]
    return olds


def restore(
    plan: Plan,
    olds: list[Any],
    td: TensorDictBase,
    leaves: list[torch.Tensor] | None = None,
) -> None:
    """Put ``olds`` back; a tensor the module put in a slot meanwhile is written into ``td``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from tensordict import TensorDict
        >>> bn = nn.BatchNorm1d(1)
        >>> td = TensorDict({"running_mean": torch.zeros(1)}, [])
        >>> p = plan_for(bn, td)
        >>> old = swap(p, td)
        >>> bn.running_mean = torch.ones(1)  # the module replaces the buffer
        >>> restore(p, old, td)
        >>> td["running_mean"], bn.running_mean
        (tensor([1.]), tensor([0.]))
    """
    values = tree.leaves(td) if leaves is None else leaves
    replaced: dict[int, Any] = {}
    for (d, key, i), old in zip(plan.entries, olds, strict=True):
        current = d.get(key)
        if current is not values[i] and i not in replaced:
            replaced[i] = current
        d[key] = old
    if replaced:
        _write_back(td, plan.paths, replaced)


def _write_back(td: TensorDictBase, paths: list[KeyPath], replaced: dict[int, Any]) -> None:
    for i, current in replaced.items():
        if not isinstance(current, torch.Tensor):
            raise TypeError(
                f"call: the module set {tree.format_path(paths[i])!r} to "
                f"{type(current).__name__} during the call; expected a tensor"
            )
        path = paths[i]
        value = current.detach() if isinstance(current, nn.Parameter) else current
        with td.unlock_():
            td.set(path, value, inplace=False)


def module_tensors(module: nn.Module) -> Iterator[tuple[KeyPath, torch.Tensor]]:
    """Canonical ``(path, tensor)`` of every parameter and buffer (duplicates removed).

    Example:
        >>> from torch import nn
        >>> [p for p, _ in module_tensors(nn.BatchNorm1d(1))][:3]
        [('weight',), ('bias',), ('running_mean',)]
    """
    layout = layout_of(module)
    for path, p in layout.params:
        yield path, p
    for path, b, _ in layout.buffers:
        yield path, b
