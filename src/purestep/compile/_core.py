"""The pure function that a compiled step traces: flat leaves in, flat leaves out.

:func:`core_fn` builds, for one variant, ``core(*leaves) -> list[Tensor]`` that
rebuilds the TensorDicts from the leaves, runs the step's own ``grad_fn``
(``value_and_grad``, ``accumulate``, the user's loss, ``call``, ``rng``: the
eager code, unchanged) on a working copy of the buffers as ``train_step``
does, takes the grad norms and the finiteness check, runs each due role's
optimizer through its plan (``_kernels``) and the EMA lerps, and returns the
new leaves. While it is traced it records in an :class:`OutSpec` where each
result went: a graph output, or an input updated in place (donated buffers,
which the graph must not return). The orchestration mirrors
``TrainStep._step`` and ``EMAStep``; the tests hold the two to the same bits.

``phase`` splits a step that skips non-finite updates in two graphs: ``"grads"``
(grads, norms, metrics, the finite flag) and ``"apply"`` (optimizers and EMA),
with the host reading the flag in between as the eager step does. Without
skipping, ``"all"`` is the whole step in one graph.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal

import attrs
import torch
from tensordict import TensorDict, TensorDictBase

from purestep import tree
from purestep._keys import BUFFERS, EMA, EMA_BUFFERS, PARAMS
from purestep.compile._kernels import Plan
from purestep.compile._plan import Layout, Parts
from purestep.step import all_finite, recording_modules

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
        buffers: ``{role: skeleton}`` of the buffers after the forward.
        written: ``{role: [param index]}``: params the forward wrote in place
            (their new values are the ``("written", role)`` results).
    """

    updated: list[str] = attrs.field(factory=list)
    sources: dict[Hashable, list[tuple[str, int]]] = attrs.field(factory=dict)
    metrics: Skeleton | None = None
    normed: list[str] = attrs.field(factory=list)
    grads: dict[str, Skeleton] = attrs.field(factory=dict)
    replaced: dict[str, list[tuple[int, tuple[str, ...]]]] = attrs.field(factory=dict)
    buffers: dict[str, Skeleton] = attrs.field(factory=dict)
    written: dict[str, list[int]] = attrs.field(factory=dict)


def _same_paths(a: TensorDictBase, b: TensorDictBase | None) -> bool:
    return b is not None and tree.paths(a) == tree.paths(b)


def _average(
    e: list[torch.Tensor], p: list[torch.Tensor], w: float, copy: bool, donate: bool
) -> list[torch.Tensor]:
    """:meth:`EMAStep._average` on leaf lists: lerp floating leaves, copy the others."""
    avg = [i for i, t in enumerate(p) if t.is_floating_point()] if not copy else []
    cp = [i for i in range(len(p)) if i not in set(avg)] if len(avg) != len(p) else []
    if donate:
        if cp:
            tree.copy_([e[i] for i in cp], [p[i] for i in cp])
        if avg:
            torch._foreach_lerp_([e[i] for i in avg], [p[i] for i in avg], w)
        return e
    new = list(e)
    for i in cp:
        new[i] = p[i].clone()
    if avg:
        for i, t in zip(
            avg, torch._foreach_lerp([e[i] for i in avg], [p[i] for i in avg], w), strict=True
        ):
            new[i] = t
    return new


def _ema(
    parts: Parts,
    ema_copy: Sequence[Sequence[str]],
    new_params: dict[str, list[torch.Tensor]],
    emas: dict[str, list[torch.Tensor]],
    new_bufs: dict[str, list[torch.Tensor]],
    ema_bufs: dict[str, list[torch.Tensor]],
    donate: bool,
) -> None:
    """Apply each EMA layer in order, as :class:`~purestep.EMAStep` does (``emas`` updated)."""
    for layer, modes in zip(parts.emas, ema_copy, strict=True):
        w = 1.0 - layer.decay
        for role, mode in zip(layer.roles, modes, strict=True):
            if mode == "skip":  # the role did not update at this step: nor does its EMA
                continue
            copy = mode == "copy"
            emas[role] = _average(emas[role], new_params[role], w, copy, donate)
            if getattr(layer, "buffers", False):
                ema_bufs[role] = _average(ema_bufs[role], new_bufs[role], w, copy, donate)


def _split_written(
    work: TensorDictBase, groups: dict[Hashable, Any]
) -> dict[str, tuple[TensorDictBase | None, dict[int, torch.Tensor]]]:
    """Per role of the working buffers: the new buffers and ``{param index: value}`` the forward wrote.

    As ``train_step``: a role whose working copy has more leaves than its
    buffers holds, under their paths, the new values of params its forward
    wrote in place.
    """
    out: dict[str, tuple[TensorDictBase | None, dict[int, torch.Tensor]]] = {}
    for role in work.keys():
        role_work = work.get(role)
        old = groups.get((BUFFERS, role))
        n_buf = old.count if old is not None else 0
        if len(tree.leaves(role_work)) == n_buf:
            out[role] = (role_work, {})
            continue
        buf_paths = set(tree.paths(old.tree)) if old is not None and n_buf else set()
        param_index = {p: i for i, p in enumerate(tree.paths(groups[PARAMS, role].tree))}
        bufs: list[tuple[tree.KeyPath, torch.Tensor]] = []
        written: dict[int, torch.Tensor] = {}
        for path, leaf in zip(tree.paths(role_work), tree.leaves(role_work), strict=True):
            if path in buf_paths:
                bufs.append((path, leaf))
            else:
                written[param_index[path]] = leaf
        out[role] = (tree.unflatten(bufs) if bufs else None, written)
    return out


def _write(
    params: list[torch.Tensor], written: dict[int, torch.Tensor], in_place: bool
) -> list[torch.Tensor]:
    """The params with the forward's written values (in their buffers when donated)."""
    if in_place:
        for i, t in written.items():
            params[i].copy_(t)
        return params
    return [written.get(i, t) for i, t in enumerate(params)]


def takes(fn: Any, name: str) -> bool:
    """Whether ``fn`` accepts the keyword argument ``name`` (as ``train_step`` asks its grad_fn).

    Example:
        >>> takes(lambda a, *, buffers=None: a, "buffers"), takes(lambda a: a, "donate")
        (True, False)
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    ps = sig.parameters.values()
    return any(p.kind is p.VAR_KEYWORD for p in ps) or any(
        p.name == name and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) for p in ps
    )


def core_fn(
    parts: Parts,
    lay: Layout,
    *,
    roles: Sequence[str],
    ema_copy: Sequence[Sequence[str]],
    plans: dict[str, Plan],
    flags: dict[str, Hashable],
    phase: Phase,
    spec: OutSpec,
    subset: Callable[[str, Any], Plan],
) -> Callable[..., list[torch.Tensor]]:
    """``core(*leaves) -> outputs`` for one variant; tracing it fills ``spec``.

    Args:
        parts: the step taken apart.
        lay: the call's input layout (groups and their trees).
        roles: the due roles.
        ema_copy: per EMA layer and role: ``"avg"``, ``"copy"`` (before its
            ``start_step``) or ``"skip"`` (the role did not update: ``with_ema(on_update=)``).
        plans: ``{role: Plan}`` for the due roles (see ``_kernels``).
        flags: ``{role: flags}`` the plans are specialised on.
        phase: ``"all"``, ``"grads"`` or ``"apply"`` (see the module docstring).
        spec: filled while tracing.
        subset: ``subset(role, grads_tree)``: the plan for a role whose grads
            cover a subset of its params (the transform's own step).
    """
    train = parts.train
    donate = train.donate
    groups = lay.groups
    batch_skel = Skeleton.of(groups["batch"].tree)  # type: ignore[arg-type]
    param_roles = [name[1] for name in groups if isinstance(name, tuple) and name[0] == PARAMS]
    buffer_roles = [name[1] for name in groups if isinstance(name, tuple) and name[0] == BUFFERS]

    def core(*flat: torch.Tensor) -> list[torch.Tensor]:
        # as the eager step, clipping reuses the metric's norm; a module recorder of the
        # caller (testing.assert_pure) must not snapshot the fake tensors of the trace
        with tree.norm_memo(), recording_modules():
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

        p_lists = {r: groups[PARAMS, r].slice(flat) for r in param_roles}
        grad_trees: dict[str, Any] = {}
        new_bufs: dict[str, list[torch.Tensor]] = {
            r: groups[BUFFERS, r].slice(flat) for r in buffer_roles
        }
        if phase == "apply":
            grads = {r: groups["grads", r].slice(flat) for r in roles if ("grads", r) in groups}
            updated = [r for r in roles if r in grads]
            for r in updated:
                grad_trees[r] = groups["grads", r].tree
            for name, g in groups.items():  # the forward's buffers, from the first graph
                if isinstance(name, tuple) and name[0] == "new_buffers":
                    new_bufs[name[1]] = g.slice(flat)
        else:
            params = tree.plain_td(
                {r: tree.rebuild(groups[PARAMS, r].tree, p_lists[r]) for r in param_roles}  # type: ignore[arg-type]
            )
            b_leaves = groups["batch"].slice(flat)
            lead = [b_leaves[0].shape[0]] if b_leaves else []
            batch = batch_skel.build(b_leaves, lead)
            key = flat[groups["key"].start]
            extra: dict[str, Any] = {}
            work: TensorDict | None = None
            if takes(train.grad_fn, "buffers"):
                work = tree.plain_td(  # the forward's working copy of the buffers
                    {
                        r: tree.rebuild(groups[BUFFERS, r].tree, [t.clone() for t in new_bufs[r]])  # type: ignore[arg-type]
                        for r in buffer_roles
                    }
                )
                extra["buffers"] = work
            elif buffer_roles:
                raise TypeError(
                    f"train_step: the state has buffers for roles {buffer_roles}, but grad_fn "
                    "does not accept buffers=; build it with purestep.value_and_grad (and "
                    "accumulate), or give a custom grad_fn the keyword arguments buffers= and donate="
                )
            if donate and takes(train.grad_fn, "donate"):
                extra["donate"] = True
            g_td, metrics = train.grad_fn(params, batch, key, roles=list(roles), **extra)
            if work is not None:
                for r, (bufs, written) in _split_written(work, groups).items():
                    if bufs is not None:
                        spec.buffers[r] = Skeleton.of(bufs)
                        new_bufs[r] = tree.leaves(bufs)
                        emit((BUFFERS, r), new_bufs[r])
                    if written:
                        spec.written[r] = sorted(written)
                        emit(("written", r), [written[i] for i in spec.written[r]])
                        p_lists[r] = _write(p_lists[r], written, donate and phase == "all")
            updated = [r for r in roles if r in g_td.keys()]
            grads = {r: tree.leaves(g_td.get(r)) for r in updated}
            grad_trees.update({r: g_td.get(r) for r in updated})
            spec.metrics = Skeleton.of(metrics)
            emit("metrics", tree.leaves(metrics))
            norms: dict[str, torch.Tensor] = {}
            if train.grad_norm or train.skip_nonfinite:
                norms = {r: tree.global_norm(grads[r]) for r in updated}
            spec.normed = list(norms)
            for r, n in norms.items():
                emit(("norm", r), [n])
            if phase == "grads":
                emit("finite", [all_finite(metrics, norms)])
                for r in updated:
                    spec.grads[r] = Skeleton.of(g_td.get(r))
                    emit(("grads", r), grads[r])
        spec.updated = updated
        if phase == "grads":
            return outs
        new_params = dict(p_lists)
        for r in updated:
            scalars = groups["scalars", r].slice(flat)
            plan = plans[r]
            like = grad_trees.get(r)
            if like is not None and not _same_paths(like, groups[PARAMS, r].tree):
                # grads for a subset of the params (some got none): the transform's own
                # step projects its state onto them, as in eager
                plan = subset(r, like)
            p, o = plan.apply(
                p_lists[r], grads[r], groups["opt", r].slice(flat), scalars, flags[r], donate
            )
            new_params[r] = p
            emit((PARAMS, r), p)
            emit(("opt", r), o)
        for r in spec.written:
            if r not in updated:  # written by the forward but not updated: still new values
                emit((PARAMS, r), new_params[r])
        emas = {r: groups[EMA, r].slice(flat) for r in parts.ema_roles}
        ema_bufs = {r: groups[EMA_BUFFERS, r].slice(flat) for r in parts.ema_buffer_roles}
        _ema(parts, ema_copy, new_params, emas, new_bufs, ema_bufs, donate)
        for r, e in emas.items():
            emit((EMA, r), e)
        for r, e in ema_bufs.items():
            emit((EMA_BUFFERS, r), e)
        return outs

    return core
