"""The optimizer contract: :class:`Transform`, :func:`chain`, :func:`apply_updates`.

A transform is a pair of pure functions over TensorDicts, as in optax:

* ``init(params) -> state``: the transform's state, a TensorDict (may be empty).
* ``update(grads, state, params) -> (updates, state)``: new update directions
  (to be *added* to params) and the next state.

and one entry point that the training step uses:

* ``step(grads, state, params, *, donate=False) -> (params, state)``: the
  updated params and state. With ``donate=False`` no input is modified. With
  ``donate=True`` params, state buffers and grads may be overwritten in place
  (fused kernels, no parameter-sized temporaries); the inputs are then invalid.
  Both give equal results. Transforms without a dedicated step fall back to
  ``update`` followed by :func:`apply_updates`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import attrs
import torch
from tensordict import TensorDict, TensorDictBase

from purestep import _compat as _ops  # attrs 26.1's __repr__ reads a global _compat
from purestep import tree

__all__ = [
    "ScalarOrSchedule",
    "Schedule",
    "Transform",
    "apply_updates",
    "chain",
    "current_lr",
]


class Schedule(Protocol):
    """A pure function of an optimizer's own update count: ``count -> value``."""

    def __call__(self, count: int | torch.Tensor, /) -> float: ...


ScalarOrSchedule = float | Schedule | Callable[[int], float]


class UpdateFn(Protocol):
    def __call__(
        self,
        grads: TensorDictBase,
        state: TensorDictBase,
        params: TensorDictBase | None,
        *,
        donate: bool = False,  # pragma: no mutate (a Protocol stub, never run)
    ) -> tuple[TensorDict, TensorDict]: ...


class StepFn(Protocol):
    def __call__(
        self,
        grads: TensorDictBase,
        state: TensorDictBase,
        params: TensorDictBase,
        *,
        donate: bool = False,  # pragma: no mutate (a Protocol stub, never run)
    ) -> tuple[TensorDict, TensorDict]: ...


@attrs.frozen
class Transform:
    """A gradient transformation: ``init``, ``update`` and a (possibly fused) ``step``.

    Build transforms with the factories (:func:`purestep.optim.adamw`,
    :func:`purestep.optim.sgd`, :func:`chain`, ...), not by hand, unless you are
    writing a new one.

    Attributes:
        init_fn: ``params -> state``.
        update_fn: ``(grads, state, params, *, donate=False) -> (updates, state)``.
        step_fn: optional ``(grads, state, params, *, donate=False) -> (params, state)``
            that is faster than ``update`` + ``apply_updates`` (fused kernels).
        name: a short name for errors and reprs.
        hparams: the validated hyperparameters (an attrs instance), if any;
            for :func:`chain`, the tuple of chained transforms.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from purestep import optim
        >>> t = optim.sgd(lr=0.5)
        >>> p = TensorDict({"w": torch.ones(2)}, [])
        >>> g = TensorDict({"w": torch.ones(2)}, [])
        >>> new_p, s = t.step(g, t.init(p), p)
        >>> new_p["w"]
        tensor([0.5000, 0.5000])
    """

    init_fn: Callable[[TensorDictBase], TensorDict]
    update_fn: UpdateFn
    step_fn: StepFn | None = None
    name: str = "transform"
    hparams: Any = None

    def init(self, params: TensorDictBase) -> TensorDict:
        """The initial state for ``params`` (a TensorDict, empty for stateless transforms)."""
        return self.init_fn(params)

    def update(
        self,
        grads: TensorDictBase,
        state: TensorDictBase,
        params: TensorDictBase | None = None,
        *,
        donate: bool = False,
    ) -> tuple[TensorDict, TensorDict]:
        """Return ``(updates, new_state)``; pure unless ``donate=True``.

        With ``grads`` for a subset of ``params`` the updates cover that subset
        and the other parameters' state is unchanged (see :meth:`step`).
        """
        sub = _Subset.of(params, grads) if params is not None else None
        if sub is not None and params is not None:
            updates, new_s = self.update_fn(
                sub.grads, sub.project(state), sub.project(params), donate=donate
            )
            return updates, sub.merge(state, new_s)
        return self.update_fn(grads, state, params, donate=donate)

    def step(
        self,
        grads: TensorDictBase,
        state: TensorDictBase,
        params: TensorDictBase,
        *,
        donate: bool = False,
    ) -> tuple[TensorDict, TensorDict]:
        """Return ``(new_params, new_state)``; see the module docstring for ``donate``.

        ``grads`` may hold a subset of the params (those that received a
        gradient): the others, and their per-parameter state, are left exactly
        as they are, as ``torch.optim`` skips a parameter whose ``.grad`` is None.
        """
        sub = _Subset.of(params, grads)
        if sub is not None:
            new_p, new_s = self.step(
                sub.grads, sub.project(state), sub.project(params), donate=donate
            )
            return sub.merge(params, new_p), sub.merge(state, new_s)
        if self.step_fn is not None:
            return self.step_fn(grads, state, params, donate=donate)
        updates, new_state = self.update_fn(grads, state, params, donate=donate)
        return apply_updates(params, updates, donate=donate), new_state


class _Subset:
    """Grads for some of the params: project params and state onto them, merge results back.

    A state entry is per-parameter when it is a tree with exactly the params'
    paths (moments, step counts); such trees are projected onto the subset and
    merged back leaf by leaf, everything else (counts, learning rates) is
    replaced by the new value.
    """

    __slots__ = ("grads", "idx", "paths", "sub_paths")

    def __init__(self, paths: list[tree.KeyPath], idx: list[int], grads: TensorDictBase) -> None:
        self.paths = paths
        self.idx = idx
        self.sub_paths = [paths[i] for i in idx]
        self.grads = grads

    @staticmethod
    def of(params: TensorDictBase, grads: TensorDictBase) -> _Subset | None:
        """None when ``grads`` has exactly the params' structure; raise on unknown keys/shapes."""
        if (
            type(params) is _ops.PLAIN_TD
            and type(grads) is _ops.PLAIN_TD
            and tree._same_structure(params, grads, True)
        ):
            return None
        ps, gs = tree.paths(params), tree.paths(grads)
        if ps == gs:
            tree.assert_same_structure(params, grads)
            return None
        where = {p: i for i, p in enumerate(ps)}
        unknown = [p for p in gs if p not in where]
        if unknown:
            missing = sorted(set(ps) - set(gs))
            parts = (
                ["missing " + ", ".join(tree.format_path(p) for p in missing)] if missing else []
            )
            parts.append("unexpected " + ", ".join(tree.format_path(p) for p in unknown))
            raise ValueError("grads keys differ from params: " + "; ".join(parts))
        p_leaves = tree.leaves(params)
        by_path = dict(zip(gs, tree.leaves(grads), strict=True))
        for path, g in by_path.items():
            want = p_leaves[where[path]].shape
            if g.shape != want:
                raise ValueError(
                    f"grads at {tree.format_path(path)} has shape {tuple(g.shape)}, "
                    f"but params has shape {tuple(want)}"
                )
        idx = sorted(where[p] for p in gs)
        ordered = tree.unflatten([(ps[i], by_path[ps[i]]) for i in idx])
        return _Subset(ps, idx, ordered)

    def _is_per_param(self, td: TensorDictBase) -> bool:
        return tree.paths(td) == self.paths

    def project(self, td: TensorDictBase) -> TensorDict:
        """``td`` with every per-parameter tree cut down to the subset."""
        if self._is_per_param(td):
            ls = tree.leaves(td)
            return tree.unflatten(
                [(p, ls[i]) for p, i in zip(self.sub_paths, self.idx, strict=True)]
            )
        out: dict[str, Any] = {}
        for k in td.keys():
            v = td.get(k)
            out[k] = self.project(v) if isinstance(v, TensorDictBase) else v
        return TensorDict(out, batch_size=[])

    def merge(self, full: TensorDictBase, sub: TensorDictBase) -> TensorDict:
        """``full`` with the subset's new values from ``sub`` (the result of a projected call)."""
        if self._is_per_param(full):
            new = tree.leaves(full)
            for i, leaf in zip(self.idx, tree.leaves(sub), strict=True):
                new[i] = leaf
            return tree.rebuild(full, new)
        out: dict[str, Any] = {}
        for k in sub.keys():
            v = sub.get(k)
            old = full.get(k, None) if k in full.keys() else None
            out[k] = (
                self.merge(old, v)
                if isinstance(old, TensorDictBase) and isinstance(v, TensorDictBase)
                else v
            )
        return TensorDict(out, batch_size=[])


def apply_updates(
    params: TensorDictBase, updates: TensorDictBase, *, donate: bool = False
) -> TensorDict:
    """``params + updates`` leafwise, in each param's dtype.

    With ``donate=True`` params are updated in place (and returned).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> p = TensorDict({"w": torch.ones(2)}, [])
        >>> apply_updates(p, TensorDict({"w": torch.full((2,), 0.5)}, []))["w"]
        tensor([1.5000, 1.5000])
    """
    tree.assert_same_structure(params, updates, what="updates")
    p_leaves = tree.leaves(params)
    u_leaves = [
        u.to(p.dtype) if u.dtype != p.dtype else u
        for p, u in zip(p_leaves, tree.leaves(updates), strict=True)
    ]
    if donate:
        if p_leaves:
            _ops.foreach_add_([tree.local(p) for p in p_leaves], [tree.local(u) for u in u_leaves])
        return cast(TensorDict, params)
    return tree.rebuild(params, _ops.foreach_add(p_leaves, u_leaves) if p_leaves else [])


def _chain_init(transforms: tuple[Transform, ...]) -> Callable[[TensorDictBase], TensorDict]:
    def init(params: TensorDictBase) -> TensorDict:
        return TensorDict({str(i): t.init(params) for i, t in enumerate(transforms)}, batch_size=[])

    return init


def chain(*transforms: Transform) -> Transform:
    """Compose transforms left to right; state is ``{"0": state_0, "1": state_1, ...}``.

    The last transform's fused ``step`` is used when it has one, so
    ``chain(clip_by_global_norm(1.0), adamw(1e-3))`` still runs the fused AdamW.

    Example:
        >>> from purestep import optim
        >>> t = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(lr=1e-3))
        >>> t.name, len(t.hparams)
        ('chain(clip_by_global_norm, adamw)', 2)
    """
    if not transforms:
        raise ValueError("chain() needs at least one transform")
    for i, t in enumerate(transforms):
        if not isinstance(t, Transform):
            raise TypeError(f"chain: argument {i} is {type(t).__name__}, not a Transform")

    def update(
        grads: TensorDictBase,
        state: TensorDictBase,
        params: TensorDictBase | None,
        *,
        donate: bool = False,
    ) -> tuple[TensorDict, TensorDict]:
        new_state = {}
        for i, t in enumerate(transforms):
            grads, new_state[str(i)] = t.update(grads, state[str(i)], params, donate=donate)
        return cast(TensorDict, grads), TensorDict(new_state, batch_size=[])

    def step(
        grads: TensorDictBase,
        state: TensorDictBase,
        params: TensorDictBase,
        *,
        donate: bool = False,
    ) -> tuple[TensorDict, TensorDict]:
        new_state = {}
        *head, last = transforms
        for i, t in enumerate(head):
            grads, new_state[str(i)] = t.update(grads, state[str(i)], params, donate=donate)
        k = str(len(head))
        new_params, new_state[k] = last.step(grads, state[k], params, donate=donate)
        return new_params, TensorDict(new_state, batch_size=[])

    name = "chain(" + ", ".join(t.name for t in transforms) + ")"
    return Transform(
        init_fn=_chain_init(tuple(transforms)),
        update_fn=update,
        step_fn=step,
        name=name,
        hparams=tuple(transforms),  # the parts, for purestep.compile
    )


def current_lr(opt_state: TensorDictBase) -> torch.Tensor | None:
    """The learning rate used by the most recent update (0-dim CPU tensor), or None.

    Transforms that scale by a learning rate keep it in their state under the
    key ``"lr"``; in a chain the first one found (depth first) is returned.
    Before the first update it is the lr the first update will use.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from purestep import optim
        >>> t = optim.adamw(lr=optim.schedules.linear(1e-3, 0.0, 10))
        >>> float(optim.current_lr(t.init(TensorDict({"w": torch.ones(1)}, []))))
        0.001
    """
    for key in opt_state.keys():
        value = opt_state.get(key)
        if isinstance(value, TensorDictBase):
            found = current_lr(value)
            if found is not None:
                return found
        elif key == "lr" and isinstance(value, torch.Tensor):
            return value  # stops before walking moment trees (they follow "lr")
    return None
