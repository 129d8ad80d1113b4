"""Host-side decisions of a compiled step, made before the graph runs.

A compiled step splits each call into what the host decides from 0-dim CPU
values (no device sync) and what the graph computes from tensors:

* the host reads ``state["step"]``, picks the due roles (``every``) and whether
  each EMA has started, derives the step key, and lists the state's and the
  batch's leaves in a fixed order (the *layout*);
* the graph gets the leaves, computes grads, metrics and updates, and hands
  back new leaves;
* the host puts them back into TensorDicts and does the eager step's
  bookkeeping (``step + 1``, skip counters, ``lr`` / ``grad_norm`` metrics).

A *variant* is everything the graph is specialised on: the due roles, the EMA
phase, which part of the step it computes, and the leaves' structure, shapes,
dtypes, devices and strides. Each distinct variant is traced and compiled once.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import attrs
import torch
from tensordict import TensorDict, TensorDictBase

from purestep import tree
from purestep._keys import BUFFERS, EMA, EMA_BUFFERS, OPT_STATE, PARAMS
from purestep.step import EMAStep, TrainStep

__all__ = ["Group", "Guard", "Layout", "Parts", "decompose", "flatten", "layout_of"]


@attrs.frozen
class Parts:
    """A step built by purestep, taken apart: the train step and its EMA wrappers.

    Attributes:
        train: the innermost :class:`~purestep.TrainStep`.
        emas: the :class:`~purestep.EMAStep` layers, innermost first.
        outer: the step as given (its ``prepare`` adds the keys every layer keeps).
    """

    train: TrainStep
    emas: tuple[EMAStep, ...]
    outer: TrainStep | EMAStep

    @property
    def ema_roles(self) -> tuple[str, ...]:
        """Every role with an EMA, in first-seen order (innermost layer first)."""
        seen: dict[str, None] = {}
        for layer in self.emas:
            seen.update(dict.fromkeys(layer.roles))
        return tuple(seen)

    @property
    def ema_buffer_roles(self) -> tuple[str, ...]:
        """Every role with an EMA of its buffers (``with_ema(buffers=True)``)."""
        seen: dict[str, None] = {}
        for layer in self.emas:
            if getattr(layer, "buffers", False):
                seen.update(dict.fromkeys(layer.roles))
        return tuple(seen)


def decompose(step: Any) -> Parts:
    """Take apart a step built by :func:`~purestep.train_step` / ``with_ema`` / ``skip_nonfinite``.

    Raises:
        TypeError: ``step`` is not such a step (names its type).

    Example:
        >>> import purestep as ps
        >>> gf = ps.value_and_grad(lambda p, b, k: (p["m", "w"].sum(), {}))
        >>> s = ps.with_ema(ps.train_step(gf, {"m": ps.optim.sgd(0.1)}), 0.9, ["m"])
        >>> parts = decompose(s)
        >>> len(parts.emas), parts.ema_roles
        (1, ('m',))
    """
    emas: list[EMAStep] = []
    inner: Any = step
    while isinstance(inner, EMAStep):
        emas.append(inner)
        inner = inner.inner
    if not isinstance(inner, TrainStep):
        raise TypeError(
            "purestep.compile compiles steps built by train_step, with_ema and "
            f"skip_nonfinite (or a method's make_step); got {type(step).__name__}"
            + (f" wrapping {type(inner).__name__}" if inner is not step else "")
        )
    return Parts(train=inner, emas=tuple(reversed(emas)), outer=step)


@attrs.frozen
class Group:
    """A run of graph inputs that come from one tree (or one tensor).

    Attributes:
        name: ``("params", role)``, ``("opt", role)``, ``("ema", role)``, ``"key"``,
            ``"batch"``, ``("grads", role)``, ``("scalars", role)``.
        start: index of its first leaf in the flat input list.
        tree: the tree the leaves come from (``None`` for plain tensors).
        count: number of leaves.
        keys: the tree's key structure (see :func:`flatten`).
    """

    name: Hashable
    start: int
    tree: TensorDictBase | None
    count: int
    keys: tuple[Any, ...] = ()

    def slice(self, flat: Sequence[Any]) -> list[Any]:
        """This group's leaves out of ``flat``."""
        return list(flat[self.start : self.start + self.count])


def _walk(td: TensorDict, keys: list[Any], leaves: list[torch.Tensor]) -> bool:
    for k, v in td._tensordict.items():
        if isinstance(v, torch.Tensor):
            keys.append(k)
            leaves.append(v)
        elif type(v) is TensorDict and not v._batch_size and v._device is None:
            keys.append((k,))  # a node opens
            if not _walk(v, keys, leaves):
                return False
            keys.append(None)  # and closes
        else:
            return False
    return True


def flatten(td: TensorDictBase) -> tuple[tuple[Any, ...], list[torch.Tensor]]:
    """A tree's key structure and its leaves (in :func:`purestep.tree.leaves` order), in one walk.

    The structure is a flat tuple: a leaf's key, ``(key,)`` where a node opens
    and ``None`` where it closes; two trees have equal structures exactly when
    they have the same key paths in the same order.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> keys, leaves = flatten(TensorDict({"a": {"w": torch.ones(1)}, "b": torch.ones(2)}, []))
        >>> keys, len(leaves)
        ((('a',), 'w', None, 'b'), 2)
    """
    keys: list[Any] = []
    leaves: list[torch.Tensor] = []
    if (
        type(td) is TensorDict
        and not td._batch_size
        and td._device is None
        and _walk(td, keys, leaves)
    ):
        return tuple(keys), leaves
    return tuple(tree.paths(td)), tree.leaves(td)


@attrs.define
class Layout:
    """The flat graph inputs of one call and where each group of them starts.

    Attributes:
        groups: ``{name: Group}`` in input order.
        leaves: the flat input tensors.
    """

    groups: dict[Hashable, Group] = attrs.field(factory=dict)
    leaves: list[torch.Tensor] = attrs.field(factory=list)

    def add(self, name: Hashable, td: TensorDictBase | torch.Tensor) -> None:
        """Append ``td``'s leaves (or the one tensor) as group ``name``."""
        if isinstance(td, torch.Tensor):
            self.groups[name] = Group(name, len(self.leaves), None, 1)
            self.leaves.append(td)
            return
        keys, ls = flatten(td)
        self.groups[name] = Group(name, len(self.leaves), td, len(ls), keys)
        self.leaves.extend(ls)

    def add_list(
        self, name: Hashable, tensors: Sequence[torch.Tensor], like: TensorDictBase | None = None
    ) -> None:
        """Append ``tensors`` as group ``name`` (leaves of ``like``, if given)."""
        self.groups[name] = Group(name, len(self.leaves), like, len(tensors))
        self.leaves.extend(tensors)

    def structure(self) -> tuple[Any, ...]:
        """Every group's name and key structure: equal layouts trace to the same graph inputs."""
        return tuple((name, g.count, g.keys) for name, g in self.groups.items())


def layout_of(
    state: TensorDictBase,
    batch: TensorDictBase,
    key: torch.Tensor,
    roles: Sequence[str],
    ema_roles: Sequence[str],
    grads: dict[str, list[torch.Tensor]] | None = None,
    grads_like: dict[str, TensorDictBase] | None = None,
    *,
    ema_buffer_roles: Sequence[str] = (),
    new_buffers: dict[str, TensorDictBase] | None = None,
) -> Layout:
    """The graph inputs of a call: all params, the due roles' optimizer states, EMAs, key, batch.

    With ``grads`` (the second graph of a step that skips non-finite updates),
    each role's grads follow, shaped like ``grads_like[role]``, then the
    buffers the first graph's forward produced (``new_buffers``).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> s = TensorDict({"params": {"m": {"w": torch.ones(2)}}, "opt_state": {"m": {}}}, [])
        >>> b = TensorDict({"x": torch.ones(3)}, [3])
        >>> lay = layout_of(s, b, torch.tensor(0), ["m"], [])
        >>> [g for g in lay.groups], len(lay.leaves)
        ([('params', 'm'), ('opt', 'm'), 'key', 'batch'], 3)
    """
    lay = Layout()
    params = state.get(PARAMS)
    for role in params.keys():
        lay.add((PARAMS, role), params.get(role))
    if BUFFERS in state.keys():
        buffers = state.get(BUFFERS)
        for role in buffers.keys():
            lay.add((BUFFERS, role), buffers.get(role))
    for role in roles:
        lay.add(("opt", role), state.get((OPT_STATE, role)))
    for role in ema_roles:
        lay.add((EMA, role), state.get((EMA, role)))
    for role in ema_buffer_roles:
        lay.add((EMA_BUFFERS, role), state.get((EMA_BUFFERS, role)))
    lay.add("key", key)
    lay.add("batch", batch)
    if grads is not None:
        assert grads_like is not None
        for role, g in grads.items():
            lay.add_list(("grads", role), g, grads_like[role])
    for role, td in (new_buffers or {}).items():
        lay.add(("new_buffers", role), td)
    return lay


Meta = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]


def _meta(t: torch.Tensor) -> Meta:
    return (tuple(t.shape), t.stride(), t.dtype, t.device)


@attrs.define
class Guard:
    """Checks that a call's leaves have the shapes, strides, dtypes and devices a graph was traced with.

    Leaves that are the very tensors last checked (a donated state's buffers,
    step after step) are not looked at again (weak references: the guard keeps
    no tensor alive); the others are compared one by one. The batch's leading
    sizes are left to the graph's own shape guards when the batch is dynamic.

    Attributes:
        metas: per input, ``(shape, stride, dtype, device)``, or ``(dim, dtype,
            device)`` for a dynamic batch leaf.
        dynamic: indices of the dynamic batch leaves.
        seen: weak references to the inputs of the last call that passed.

    Example:
        >>> import torch
        >>> g = Guard.of([torch.ones(2)], dynamic=())
        >>> g.check([torch.zeros(2)]), g.check([torch.zeros(3)])
        (True, False)
    """

    metas: list[Any]
    dynamic: frozenset[int]
    seen: list[Any]

    @staticmethod
    def of(leaves: Sequence[torch.Tensor], dynamic: Sequence[int]) -> Guard:
        """The guard of a graph traced with ``leaves`` (``dynamic``: inputs with a symbolic batch dim)."""
        dyn = frozenset(dynamic)
        metas: list[Any] = [
            (t.dim(), t.dtype, t.device) if i in dyn else _meta(t) for i, t in enumerate(leaves)
        ]
        return Guard(metas, dyn, [_dead] * len(metas))

    def check(self, leaves: Sequence[torch.Tensor]) -> bool:
        """Whether ``leaves`` fit; remembers them when they do."""
        if len(leaves) != len(self.metas):
            return False
        seen, metas, dyn = self.seen, self.metas, self.dynamic
        fresh: list[int] = []
        for i, t in enumerate(leaves):
            if seen[i]() is t:
                continue
            m = (t.dim(), t.dtype, t.device) if i in dyn else _meta(t)
            if m != metas[i]:
                return False
            fresh.append(i)
        for i in fresh:
            seen[i] = weakref.ref(leaves[i])
        return True


def _dead() -> None:
    return None
