"""Module layouts: every parameter and buffer slot of a module tree, under every path.

A **layout** lists every parameter and buffer *slot* of a module tree
(``module._parameters[key]`` / ``module._buffers[key]``), under every path that
reaches it: a tied parameter (GPT-2's ``lm_head.weight`` is
``transformer.wte.weight``) has several slots holding one object, a shared
submodule (ALBERT) one slot reached by several paths. The *canonical* path of an
object is the first one ``named_parameters()`` / ``named_buffers()`` give
(duplicates removed): the state's key. ``torch.compile`` wrappers
(``OptimizedModule``) are transparent: their ``_orig_mod`` adds no path
component, so keys are the same with and without compile.

Layouts are cached per module and re-validated on every use by comparing the
identities of every slot's object and every child module (one C-level pass), so
a module whose parameters are replaced or re-tied after the first call gets a
new layout rather than a stale one. This is a base module: ``state`` builds
state keys from it, ``step._swap`` swaps tensors into its slots.

Example:
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(1, 1))
    >>> net.add_module("again", net[0])  # a shared submodule
    >>> [p for p, _ in layout_of(net).params]
    [('0', 'weight'), ('0', 'bias')]
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Hashable
from itertools import chain
from typing import Any

import torch
from torch import nn

__all__ = ["KeyPath", "Layout", "layout_of", "unwrap"]

_ORIG_MOD = "_orig_mod"
KeyPath = tuple[str, ...]
_Slot = tuple[dict[str, Any], str]


def _is_compile_wrapper(module: nn.Module) -> bool:
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    return wrapper is not None and isinstance(module, wrapper)


def unwrap(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper compiles (repeatedly), or ``module`` itself.

    Example:
        >>> from torch import nn
        >>> lin = nn.Linear(1, 1)
        >>> unwrap(lin) is lin
        True
    """
    while _is_compile_wrapper(module):
        module = module._modules[_ORIG_MOD]  # type: ignore[assignment]
    return module


class Layout:
    """Every parameter and buffer slot of a module tree (see the module docstring).

    Attributes:
        slots: ``{path: [(slots dict, key), ...]}`` for every path (aliases
            included); the list holds every distinct slot of the object at that
            path, so swapping one path swaps all of its aliases.
        params: canonical ``(path, parameter)`` pairs in ``named_parameters()``
            order, duplicates removed (``None`` slots skipped).
        buffers: canonical ``(path, buffer, persistent)`` triples in
            ``named_buffers()`` order, duplicates removed.
        canonical: ``{path: canonical path of the object there}``.
    """

    __slots__ = ("_dicts", "_ids", "buffers", "canonical", "params", "plans", "slots")

    def __init__(self, root: nn.Module) -> None:
        self.slots: dict[KeyPath, list[_Slot]] = {}
        self.params: list[tuple[KeyPath, torch.Tensor]] = []
        self.buffers: list[tuple[KeyPath, torch.Tensor, bool]] = []
        self.canonical: dict[KeyPath, KeyPath] = {}
        self.plans: dict[Hashable, Any] = {}  # step._swap's Plan cache
        self._dicts: list[dict[str, Any]] = []
        first_path: dict[int, KeyPath] = {}
        obj_slots: dict[int, list[_Slot]] = {}
        path_obj: dict[KeyPath, int] = {}
        seen_modules: set[int] = set()

        def visit(mod: nn.Module, prefix: KeyPath, stack: tuple[int, ...]) -> None:
            if id(mod) in stack:  # a module containing itself: nothing new below
                return
            d = mod.__dict__
            first_visit = id(mod) not in seen_modules
            seen_modules.add(id(mod))
            params: dict[str, Any] = d["_parameters"]
            buffers: dict[str, Any] = d["_buffers"]
            children: dict[str, Any] = d["_modules"]
            if first_visit:
                self._dicts.extend((params, buffers, children))
            non_persistent: set[str] = d.get("_non_persistent_buffers_set", set())
            for kind, slots in (("param", params), ("buffer", buffers)):
                for key, obj in slots.items():
                    path = (*prefix, key)
                    if obj is None:
                        self.slots[path] = [(slots, key)]
                        continue
                    oid = id(obj)
                    path_obj[path] = oid
                    here = obj_slots.setdefault(oid, [])
                    if not any(s is slots and k == key for s, k in here):
                        here.append((slots, key))
                    if oid not in first_path:
                        first_path[oid] = path
                        if kind == "param":
                            self.params.append((path, obj))
                        else:
                            self.buffers.append((path, obj, key not in non_persistent))
            for name, child in children.items():
                if child is None:
                    continue
                transparent = name == _ORIG_MOD and _is_compile_wrapper(mod)
                visit(child, prefix if transparent else (*prefix, name), (*stack, id(mod)))

        visit(root, (), ())
        for path, oid in path_obj.items():
            self.slots[path] = obj_slots[oid]
            self.canonical[path] = first_path[oid]
        self._ids = self._snapshot()

    def _snapshot(self) -> tuple[int, ...]:
        return tuple(map(id, chain.from_iterable(map(dict.values, self._dicts))))

    def is_current(self) -> bool:
        """Whether every slot and child still holds the object it held when this was built."""
        return self._snapshot() == self._ids


_LAYOUTS: weakref.WeakKeyDictionary[nn.Module, Layout] = weakref.WeakKeyDictionary()


def layout_of(module: nn.Module) -> Layout:
    """The (cached, re-validated) :class:`Layout` of ``module`` (compile wrappers unwrapped).

    Example:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(1, 1))
        >>> net.add_module("again", net[0])  # a shared submodule
        >>> [p for p, _ in layout_of(net).params]
        [('0', 'weight'), ('0', 'bias')]
    """
    module = unwrap(module)
    layout = _LAYOUTS.get(module)
    if layout is None or not layout.is_current():
        layout = _LAYOUTS[module] = Layout(module)
    return layout
