"""``apply_gradients`` and ``train_step``: one optimizer step over the explicit state."""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

import attrs
import torch
from tensordict import TensorDict, TensorDictBase

from purestep import rng, tree
from purestep.optim import Transform, current_lr
from purestep.step._batch import Batch, prepare_batch
from purestep.step._bound import is_bound, reduce_bound_metrics
from purestep.step._grad import GradFn

__all__ = ["Step", "TrainStep", "apply_gradients", "train_step"]


class Step(Protocol):
    """A step function ``step(state, batch) -> (state, metrics)``.

    Steps built by purestep also have ``prepare(state) -> state``, which adds the
    keys the step keeps in state (EMA copies, skip counters) so that the state's
    structure is fixed from step 0 (checkpoints load into it).
    """

    def __call__(self, state: TensorDictBase, batch: Batch) -> tuple[TensorDict, TensorDict]: ...

    def prepare(self, state: TensorDictBase) -> TensorDict: ...


class NonFiniteError(FloatingPointError):
    """Raised by :func:`purestep.skip_nonfinite` after too many consecutive skipped steps."""


def _check_bound_donation(state: TensorDictBase, roles: Sequence[str], donate: bool) -> None:
    if donate:
        return
    for role in roles:
        if is_bound(state.get(("params", role))):
            raise ValueError(
                f"role {role!r} is bound to a module (FSDP); its params are the module's own "
                "parameters and are updated in place: build the step with donate=True"
            )


def apply_gradients(
    state: TensorDictBase,
    grads: TensorDictBase,
    optimizers: Mapping[str, Transform],
    *,
    roles: Sequence[str] | None = None,
    donate: bool = False,
) -> TensorDict:
    """Apply each role's optimizer to its grads; returns the new state.

    Args:
        state: the training state.
        grads: ``{role: tree}`` shaped like ``state["params", role]``.
        optimizers: ``{role: Transform}``.
        roles: roles to update (default: every role in ``grads``).
        donate: update params and optimizer state in their own buffers (fused
            kernels); ``state`` is then invalid. With ``False`` nothing is mutated.

    ``state["step"]`` is not changed here (see :func:`train_step`).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from purestep import init_state, optim
        >>> opt = {"student": optim.sgd(lr=0.1)}
        >>> s = init_state({"student": nn.Linear(1, 1)}, opt, seed=0)
        >>> g = s["params"].apply(torch.ones_like)
        >>> s2 = apply_gradients(s, g, opt)
        >>> bool((s2["params", "student", "bias"] == s["params", "student", "bias"] - 0.1).all())
        True
    """
    roles = list(grads.keys()) if roles is None else list(roles)
    _check_bound_donation(state, roles, donate)
    out = state if donate else state.copy()
    for role in roles:
        if role not in optimizers:
            raise KeyError(f"no optimizer for role {role!r} (optimizers: {sorted(optimizers)})")
        if role not in grads.keys():
            raise KeyError(f"no grads for role {role!r} (grads has roles {list(grads.keys())})")
        params = state.get(("params", role))
        opt_state = state.get(("opt_state", role))
        try:
            new_params, new_opt = optimizers[role].step(
                grads.get(role), opt_state, params, donate=donate
            )
        except ValueError as e:
            raise ValueError(f"role {role!r}: {e}") from e
        if new_params is not params:
            out.set(("params", role), new_params)
        if new_opt is not opt_state:
            out.set(("opt_state", role), new_opt)
    return out


def _next_step(state: TensorDictBase, out: TensorDictBase, donate: bool) -> None:
    if donate:
        out.get("step").add_(1)
    else:
        out.set("step", state.get("step") + 1)


@attrs.frozen
class TrainStep:
    """The step built by :func:`train_step` (see there). Immutable; call it."""

    grad_fn: GradFn
    optimizers: Mapping[str, Transform]
    every: Mapping[str, int] = attrs.field(factory=dict)
    donate: bool = False
    skip_nonfinite: bool = False
    max_consecutive: int | None = None
    grad_norm: bool = True

    def due_roles(self, step: int) -> list[str]:
        """Roles updated at ``step``: those with ``step % every[role] == 0``."""
        return [r for r in self.optimizers if step % self.every.get(r, 1) == 0]

    def prepare(self, state: TensorDictBase) -> TensorDict:
        """Check ``state`` against the optimizers; add skip counters when skipping is on."""
        for role in self.optimizers:
            if role not in state.get("params").keys():
                raise KeyError(
                    f"train_step: optimizer for role {role!r}, but state has no params for it"
                )
            if role not in state.get("opt_state").keys():
                raise KeyError(
                    f"train_step: state has no opt_state for role {role!r}; build the state "
                    "with init_state(..., optimizers=...) using the same optimizers"
                )
        return add_skip_counters(state) if self.skip_nonfinite else state

    def __call__(self, state: TensorDictBase, batch: Batch) -> tuple[TensorDict, TensorDict]:
        # the grad-norm metric and clip_by_global_norm share one norm of the same grads
        with tree.norm_memo():
            return self._step(state, batch)

    def _step(self, state: TensorDictBase, batch: Batch) -> tuple[TensorDict, TensorDict]:
        state = self.prepare(state)
        batch = prepare_batch(batch)
        step = int(state.get("step"))
        key = rng.fold_in(state.get("rng"), state.get("step"))
        roles = self.due_roles(step)
        _check_bound_donation(state, roles, self.donate)
        params = state.get("params")
        work = _working_buffers(state)
        extra: dict[str, Any] = {}
        if _takes(self.grad_fn, "buffers"):
            extra["buffers"] = work if work is not None else tree.plain_td({})
        elif work is not None:
            raise TypeError(
                f"train_step: the state has buffers for roles {list(work.keys())}, but grad_fn "
                "does not accept buffers=; build it with purestep.value_and_grad (and "
                "accumulate), or give a custom grad_fn the keyword arguments buffers= and donate="
            )
        if self.donate and _takes(self.grad_fn, "donate"):
            extra["donate"] = True
        grads, metrics = self.grad_fn(params, batch, key, roles=roles, **extra)
        # bound (FSDP) roles: per-rank metrics -> data-parallel mean (one collective)
        metrics = reduce_bound_metrics(params, metrics)
        new_buffers, written = _split_written(extra.get("buffers"), state)
        updated = [r for r in roles if r in grads.keys()]
        norms = (
            {r: tree.global_norm(tree.leaves(grads.get(r))) for r in updated}
            if self.grad_norm or self.skip_nonfinite
            else {}
        )
        if self.skip_nonfinite:
            finite = _all_finite(metrics, norms)
            if not bool(finite):
                return self._skipped(state, metrics, step)
        if written:
            state = _with_written_params(state, written, self.donate)
        out = apply_gradients(state, grads, self.optimizers, roles=updated, donate=self.donate)
        if new_buffers is not None:
            out.set("buffers", new_buffers)
        _next_step(state, out, self.donate)
        if self.skip_nonfinite:
            set_skip(out, state, consecutive=0, total_inc=0, donate=self.donate)
            metrics.set("skipped", torch.zeros((), dtype=torch.bool))
        for role in updated:
            lr = current_lr(out.get(("opt_state", role)))
            if lr is not None:
                metrics.set((role, "lr"), lr)
            if role in norms:
                metrics.set((role, "grad_norm"), norms[role])
        return out, metrics

    def _skipped(
        self, state: TensorDictBase, metrics: TensorDict, step: int
    ) -> tuple[TensorDict, TensorDict]:
        return skip_update(state, metrics, donate=self.donate, max_consecutive=self.max_consecutive)


def _takes(fn: Any, name: str) -> bool:
    """Whether ``fn`` accepts the keyword argument ``name`` (cached per function object)."""
    try:
        cache = _TAKES.get(fn)
    except TypeError:  # not weak-referenceable
        cache = None
    if cache is None:
        try:
            sig = inspect.signature(fn)
            names = {
                p.name
                for p in sig.parameters.values()
                if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
            }
            var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        except (TypeError, ValueError):
            names, var_kw = set(), False
        cache = (frozenset(names), var_kw)
        with contextlib.suppress(TypeError):
            _TAKES[fn] = cache
    return cache[1] or name in cache[0]


_TAKES: weakref.WeakKeyDictionary[Any, tuple[frozenset[str], bool]] = weakref.WeakKeyDictionary()


def _working_buffers(state: TensorDictBase) -> TensorDict | None:
    """A copy of ``state["buffers"]`` for the forward to update (None without buffers).

    Always a copy, donated or not: a step that is skipped (non-finite) leaves
    the buffers as they were.
    """
    if "buffers" not in state.keys():
        return None
    buffers = state.get("buffers")
    out = {}
    for role in buffers.keys():
        role_bufs = buffers.get(role)
        # a bound role's buffers are the module's own, updated in place by its forward
        out[role] = role_bufs if is_bound(state.get(("params", role))) else tree.clone(role_bufs)
    return tree.plain_td(out)


def _split_written(
    work: TensorDictBase | None, state: TensorDictBase
) -> tuple[TensorDict | None, dict[str, TensorDict]]:
    """The new buffers, and the params the forward wrote in place, from the working copy."""
    if work is None:
        return None, {}
    has_buffers = "buffers" in state.keys()
    old = state.get("buffers") if has_buffers else None
    written: dict[str, TensorDict] = {}
    out: dict[str, Any] = {}
    for role in work.keys():
        role_work = work.get(role)
        n_buf = len(tree.leaves(old.get(role))) if old is not None and role in old.keys() else 0
        if len(tree.leaves(role_work)) == n_buf:
            out[role] = role_work
            continue
        buf_paths = set(tree.paths(old.get(role))) if old is not None and n_buf else set()
        bufs: list[tuple[tree.KeyPath, torch.Tensor]] = []
        params: list[tuple[tree.KeyPath, torch.Tensor]] = []
        for path, leaf in zip(tree.paths(role_work), tree.leaves(role_work), strict=True):
            (bufs if path in buf_paths else params).append((path, leaf))
        if bufs:
            out[role] = tree.unflatten(bufs)
        written[role] = tree.unflatten(params)
    return (tree.plain_td(out) if has_buffers else None), written


def _with_written_params(
    state: TensorDictBase, written: dict[str, TensorDict], donate: bool
) -> TensorDictBase:
    """``state`` whose params hold the values the forward wrote (the imperative loop's weights)."""
    if donate:
        for role, td in written.items():
            for path, leaf in zip(tree.paths(td), tree.leaves(td), strict=True):
                state.get(("params", role, *path)).copy_(leaf)
        return state
    out = state.copy()
    params = out.get("params").copy()
    for role, td in written.items():
        like = params.get(role)
        new = dict(zip(tree.paths(td), tree.leaves(td), strict=True))
        params.set(
            role,
            tree.rebuild(
                like,
                [new.get(p, t) for p, t in zip(tree.paths(like), tree.leaves(like), strict=True)],
            ),
        )
    out.set("params", params)
    return out


def _all_finite(metrics: TensorDictBase, norms: Mapping[str, torch.Tensor]) -> torch.Tensor:
    checks = [torch.isfinite(n).all() for n in norms.values()]
    for path, leaf in zip(tree.paths(metrics), tree.leaves(metrics), strict=True):
        if path[-1] == "loss" and leaf.is_floating_point():
            checks.append(
                torch.isfinite(leaf).all().to(checks[0].device if checks else leaf.device)
            )
    if not checks:
        return torch.ones((), dtype=torch.bool)
    return torch.stack([c.cpu() for c in checks]).all()


def skip_update(
    state: TensorDictBase,
    metrics: TensorDict,
    *,
    donate: bool,
    max_consecutive: int | None,
) -> tuple[TensorDict, TensorDict]:
    """The result of a step whose update is discarded: only ``step`` and the skip counters move.

    The shared ending of every ``skip_nonfinite`` path (a train step's, a wrapper's, a
    compiled step's): counts the skip, raises :class:`NonFiniteError` past
    ``max_consecutive`` consecutive skips, and sets the ``skipped`` metric.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> s = add_skip_counters(TensorDict({"step": torch.tensor(4)}, []))
        >>> out, m = skip_update(s, TensorDict({}, []), donate=False, max_consecutive=None)
        >>> int(out["step"]), int(out["skip", "total"]), bool(m["skipped"])
        (5, 1, True)
    """
    consecutive = int(state.get(("skip", "consecutive"))) + 1
    if max_consecutive is not None and consecutive > max_consecutive:
        raise NonFiniteError(
            f"{consecutive} consecutive steps with a non-finite loss or gradient "
            f"(max_consecutive={max_consecutive}), last at step {int(state.get('step'))}"
        )
    out = cast(TensorDict, state) if donate else state.copy()
    _next_step(state, out, donate)
    set_skip(out, state, consecutive=consecutive, total_inc=1, donate=donate)
    metrics.set("skipped", torch.ones((), dtype=torch.bool))
    return out, metrics


def add_skip_counters(state: TensorDictBase) -> TensorDict:
    """``state`` with ``state["skip", "total" | "consecutive"]`` (int64 zeros) where missing.

    Example:
        >>> from tensordict import TensorDict
        >>> sorted(add_skip_counters(TensorDict({}, []))["skip"].keys())
        ['consecutive', 'total']
    """
    if "skip" in state.keys():
        return cast(TensorDict, state)
    out = state.copy()
    zero = torch.zeros((), dtype=torch.int64)
    out.set("skip", TensorDict({"total": zero, "consecutive": zero.clone()}, []))
    return out


def set_skip(
    out: TensorDictBase, state: TensorDictBase, *, consecutive: int, total_inc: int, donate: bool
) -> None:
    """Write the skip counters of ``out`` from ``state``'s (in place when ``donate``).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> s = add_skip_counters(TensorDict({}, []))
        >>> set_skip(s, s, consecutive=0, total_inc=0, donate=True)
        >>> int(s["skip", "consecutive"])
        0
    """
    total = state.get(("skip", "total"))
    if donate:
        out.get(("skip", "consecutive")).fill_(consecutive)
        total.add_(total_inc)
    else:
        out.set(("skip", "consecutive"), torch.tensor(consecutive, dtype=torch.int64))
        out.set(("skip", "total"), total + total_inc)


def train_step(
    grad_fn: GradFn,
    optimizers: Mapping[str, Transform],
    *,
    every: Mapping[str, int] | None = None,
    donate: bool = False,
    grad_norm: bool = True,
) -> TrainStep:
    """Build ``step(state, batch) -> (state, metrics)`` from a grad function and optimizers.

    Each call:

    1. converts ``batch`` to a TensorDict ``[B]`` and assigns ``batch["index"] =
       arange(B)`` when absent (before any split);
    2. derives the step key ``rng.fold_in(state["rng"], state["step"])``;
    3. picks the roles due at this step (``step % every[role] == 0``; default every
       step) and calls ``grad_fn(params, batch, key, roles=due)`` (a loss can ask
       :func:`purestep.live_roles` and skip the others' work);
    4. applies each due role's optimizer: its own ``count``, and so its schedule,
       advances only when it updates. A schedule therefore counts the role's
       own updates, not the method's steps: with ``every={"student": 3}``,
       ``cosine_decay(lr, 1500)`` ends after 1500 student updates (step 4500);
       :func:`purestep.optim.schedules.in_steps` sizes it in method steps;
    5. increments ``step``; metrics gain ``(role, "lr")`` and ``(role, "grad_norm")``
       (global L2 norm before any clipping) for each updated role.

    With bound (FSDP) roles the step must donate, and the loss function's
    metrics (per-rank means) are averaged over the data-parallel ranks before
    the finiteness check, so every rank logs, and skips, alike.

    Args:
        grad_fn: from :func:`purestep.value_and_grad`, maybe wrapped in
            :func:`purestep.accumulate`.
        optimizers: ``{role: Transform}``.
        every: ``{role: N}``: update ``role`` only on steps that are multiples of N.
        donate: reuse the input state's buffers (fused in-place kernels); the input
            state is then invalid. ``False`` never mutates an input. Equal results.
        grad_norm: log ``(role, "grad_norm")``. It costs one read of all grads
            (``benchmarks/step.py`` measures it); turn it off when the step
            must match a bare imperative loop.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from purestep import call, init_state, optim, value_and_grad
        >>> net = nn.Linear(2, 1)
        >>> def loss_fn(params, batch, key):
        ...     pred = call(net, params["student"], batch["x"])
        ...     return ((pred - batch["y"]) ** 2).mean(), {}
        >>> opt = {"student": optim.adamw(lr=1e-2)}
        >>> step = train_step(value_and_grad(loss_fn), opt)
        >>> state = init_state({"student": net}, opt, seed=0)
        >>> batch = {"x": torch.ones(4, 2), "y": torch.zeros(4, 1)}
        >>> state, metrics = step(state, batch)
        >>> int(state["step"])
        1
    """
    every = dict(every or {})
    for role, n in every.items():
        if role not in optimizers:
            raise KeyError(f"train_step: every[{role!r}] given, but there is no optimizer for it")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"train_step: every[{role!r}] must be a positive int, got {n!r}")
    for role, opt in optimizers.items():
        if not isinstance(opt, Transform):
            raise TypeError(f"optimizers[{role!r}] is {type(opt).__name__}, not a Transform")
    return TrainStep(
        grad_fn=grad_fn,
        optimizers=dict(optimizers),
        every=every,
        donate=donate,
        grad_norm=grad_norm,
    )
