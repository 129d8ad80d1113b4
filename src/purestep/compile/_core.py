"""The pure function that a compiled step traces: flat leaves in, flat leaves out.

:func:`core_fn` builds, for one variant, ``core(*leaves) -> list[Tensor]`` that
rebuilds the TensorDicts from the leaves, runs the step's own ``grad_fn``
(``value_and_grad``, ``accumulate``, the user's loss, ``call``, ``rng``: the
eager code, unchanged), takes the grad norms and the finiteness check, runs
each due role's optimizer through ``purestep::transform_step`` and the EMA
lerps, and returns the new leaves. While it is traced it records in an
:class:`OutSpec` where each result went: a graph output, or an input updated
in place (donated buffers, which the graph must not return).

``phase`` splits a step that skips non-finite updates in two graphs: ``"grads"``
(grads, norms, metrics, the finite flag) and ``"apply"`` (optimizers and EMA),
with the host reading the flag in between as the eager step does. Without
skipping, ``"all"`` is the whole step in one graph.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal

import attrs
import torch
from tensordict import TensorDict, TensorDictBase

from purestep import tree
from purestep.compile._kernels import Plan
from purestep.compile._plan import Layout, Parts

__all__ = ["OutSpec", "Phase", "Skeleton", "core_fn"]

Phase = Literal["all", "grads", "apply"]


@attrs.frozen
class Skeleton:
    """A TensorDict's key structure and batch dims, holding no tensors.

    Attributes:
        keys: ``(key, None)`` for a leaf, ``(key, Skeleton)`` for a node, in order.
        batch_dims: the node's number of batch dims.
    """

    keys: tuple[tuple[str, Skeleton | None], ...]
    batch_dims: int

    @staticmethod
    def of(td: TensorDictBase) -> Skeleton:
        """The skeleton of ``td`` (a plain nested TensorDict).

        Example:
            >>> from tensordict import TensorDict
            >>> Skeleton.of(TensorDict({"a": {"b": torch.ones(1)}}, [])).keys[0][0]
            'a'
        """
        keys: list[tuple[str, Skeleton | None]] = []
        for k, v in td.items():
            keys.append((str(k), Skeleton.of(v) if isinstance(v, TensorDictBase) else None))
        return Skeleton(tuple(keys), td.batch_dims)

    def build(self, leaves: Sequence[torch.Tensor], lead: Sequence[Any] = ()) -> TensorDict:
        """A TensorDict of this structure over ``leaves`` (in :func:`tree.leaves` order).

        ``lead`` gives the batch dims (sizes may be symbolic); nodes take as
        many of them as they have batch dims.

        Example:
            >>> from tensordict import TensorDict
            >>> sk = Skeleton.of(TensorDict({"x": torch.ones(3)}, [3]))
            >>> sk.build([torch.zeros(3)], [3])["x"]
            tensor([0., 0., 0.])
        """
        it = iter(leaves)
        return self._build(it, lead)

    def _build(self, it: Any, lead: Sequence[Any]) -> TensorDict:
        items: dict[str, Any] = {}
        for k, sub in self.keys:
            items[k] = next(it) if sub is None else sub._build(it, lead)
        return tree.plain_td(items, torch.Size(list(lead[: self.batch_dims])))


@attrs.define
class OutSpec:
    """Where the traced core put each result (filled while tracing).

    Attributes:
        updated: the due roles that got grads (their optimizers ran).
        sources: ``{name: [("in", i) | ("out", j), ...]}`` per result group:
            flat input ``i`` (updated in place) or graph output ``j``.
        metrics: the metrics' skeleton.
        normed: roles with a ``grad_norm`` (a ``("norm", role)`` result each).
        grads: ``{role: skeleton}`` of the grads (phase ``"grads"``).
        replaced: ``{role: [(leaf index, path)]}``: the optimizer-state leaves
            that are new tensors after the step (not updated in place).
    """

    updated: list[str] = attrs.field(factory=list)
    sources: dict[Hashable, list[tuple[str, int]]] = attrs.field(factory=dict)
    metrics: Skeleton | None = None
    normed: list[str] = attrs.field(factory=list)
    grads: dict[str, Skeleton] = attrs.field(factory=dict)
    replaced: dict[str, list[tuple[int, tuple[str, ...]]]] = attrs.field(factory=dict)


def _finite(metrics: TensorDictBase, norms: Sequence[torch.Tensor]) -> torch.Tensor:
    """True when every norm and every floating ``loss`` metric is finite (as the eager step)."""
    checks = [torch.isfinite(n).all() for n in norms]
    for path, leaf in zip(tree.paths(metrics), tree.leaves(metrics), strict=True):
        if path[-1] == "loss" and leaf.is_floating_point():
            checks.append(
                torch.isfinite(leaf).all().to(checks[0].device if checks else leaf.device)
            )
    if not checks:
        return torch.ones((), dtype=torch.bool)
    return torch.stack([c.cpu() for c in checks]).all()


def _ema(
    parts: Parts,
    ema_copy: Sequence[bool],
    new_params: dict[str, list[torch.Tensor]],
    emas: dict[str, list[torch.Tensor]],
    donate: bool,
) -> None:
    """Apply each EMA layer in order, as :class:`~purestep.EMAStep` does (``emas`` updated)."""
    for layer, copy in zip(parts.emas, ema_copy, strict=True):
        w = 1.0 - layer.decay
        for role in layer.roles:
            p, e = new_params[role], emas[role]
            if donate:
                if copy:
                    tree.copy_(e, p)
                else:
                    torch._foreach_lerp_(e, p, w)
            else:
                emas[role] = [t.clone() for t in p] if copy else list(torch._foreach_lerp(e, p, w))


def core_fn(
    parts: Parts,
    lay: Layout,
    *,
    roles: Sequence[str],
    ema_copy: Sequence[bool],
    plans: dict[str, Plan],
    flags: dict[str, Hashable],
    phase: Phase,
    spec: OutSpec,
) -> Callable[..., list[torch.Tensor]]:
    """``core(*leaves) -> outputs`` for one variant; tracing it fills ``spec``.

    Args:
        parts: the step taken apart.
        lay: the call's input layout (groups and their trees).
        roles: the due roles.
        ema_copy: per EMA layer, whether it copies (before its ``start_step``).
        plans: ``{role: Plan}`` for the due roles (see ``_kernels``).
        flags: ``{role: flags}`` the plans are specialised on.
        phase: ``"all"``, ``"grads"`` or ``"apply"`` (see the module docstring).
        spec: filled while tracing.
    """
    train = parts.train
    donate = train.donate
    groups = lay.groups
    batch_skel = Skeleton.of(groups["batch"].tree)  # type: ignore[arg-type]
    param_roles = [name[1] for name in groups if isinstance(name, tuple) and name[0] == "params"]

    def core(*flat: torch.Tensor) -> list[torch.Tensor]:
        with tree.norm_memo():  # as the eager step: clipping reuses the metric's norm
            return body(flat)

    def body(flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        inputs = {id(t): i for i, t in enumerate(flat)}
        outs: list[torch.Tensor] = []

        def emit(name: Hashable, tensors: Sequence[torch.Tensor]) -> None:
            src: list[tuple[str, int]] = []
            for t in tensors:
                i = inputs.get(id(t))
                if i is not None and flat[i] is t:
                    src.append(("in", i))
                else:
                    src.append(("out", len(outs)))
                    outs.append(t)
            spec.sources[name] = src

        p_lists = {r: groups["params", r].slice(flat) for r in param_roles}
        if phase == "apply":
            grads = {r: groups["grads", r].slice(flat) for r in roles if ("grads", r) in groups}
            updated = [r for r in roles if r in grads]
        else:
            params = tree.plain_td(
                {r: tree.rebuild(groups["params", r].tree, p_lists[r]) for r in param_roles}  # type: ignore[arg-type]
            )
            b_leaves = groups["batch"].slice(flat)
            lead = [b_leaves[0].shape[0]] if b_leaves else []
            batch = batch_skel.build(b_leaves, lead)
            key = flat[groups["key"].start]
            g_td, metrics = train.grad_fn(params, batch, key, roles=list(roles))
            updated = [r for r in roles if r in g_td.keys()]
            grads = {r: tree.leaves(g_td.get(r)) for r in updated}
            spec.metrics = Skeleton.of(metrics)
            emit("metrics", tree.leaves(metrics))
            norms: dict[str, torch.Tensor] = {}
            if train.grad_norm or train.skip_nonfinite:
                norms = {r: tree.global_norm(grads[r]) for r in updated}
            spec.normed = list(norms)
            for r, n in norms.items():
                emit(("norm", r), [n])
            if phase == "grads":
                emit("finite", [_finite(metrics, list(norms.values()))])
                for r in updated:
                    spec.grads[r] = Skeleton.of(g_td.get(r))
                    emit(("grads", r), grads[r])
        spec.updated = updated
        if phase == "grads":
            return outs
        new_params = dict(p_lists)
        for r in updated:
            scalars = groups["scalars", r].slice(flat)
            p, o = plans[r].apply(
                p_lists[r], grads[r], groups["opt", r].slice(flat), scalars, flags[r], donate
            )
            new_params[r] = p
            emit(("params", r), p)
            emit(("opt", r), o)
        emas = {r: groups["ema", r].slice(flat) for r in parts.ema_roles}
        _ema(parts, ema_copy, new_params, emas, donate)
        for r, e in emas.items():
            emit(("ema", r), e)
        return outs

    return core
