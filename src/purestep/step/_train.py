"""``apply_gradients`` and ``train_step``: one optimizer step over the explicit state."""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import torch
from tensordict import TensorDict, TensorDictBase

from purestep import rng, tree
from purestep._keys import BUFFERS, OPT_STATE, PARAMS, RNG, STEP
from purestep.errors import PurestepError, RoleError, with_prefix
from purestep.optim import Transform, current_lr
from purestep.step._batch import Batch, prepare_batch
from purestep.step._bound import is_bound, reduce_bound_metrics
from purestep.step._counters import add_skip_counters, all_finite, next_step, set_skip, skip_update
from purestep.step._donation import check_live, fresh_top, is_donated, mark_donated
from purestep.step._grad import GradFn
from purestep.step._validate import check_state, diagnose, remember

__all__ = ["Step", "TrainStep", "apply_gradients", "train_step"]


class Step(Protocol):
    """A step function ``step(state, batch) -> (state, metrics)``.

    Steps built by purestep also have ``prepare(state) -> state``, which adds the
    keys the step keeps in state (EMA copies, skip counters) so that the state's
    structure is fixed from step 0 (checkpoints load into it).
    """

    def __call__(self, state: TensorDictBase, batch: Batch) -> tuple[TensorDict, TensorDict]: ...

    def prepare(self, state: TensorDictBase) -> TensorDict: ...


def _check_bound_donation(state: TensorDictBase, roles: Sequence[str], donate: bool) -> None:
    if donate:
        return
    for role in roles:
        if is_bound(state.get((PARAMS, role))):
            raise ValueError(
                f"role {role!r} is bound to a module (FSDP); its params are the module's own "
                "parameters and are updated in place: build the step with donate=True"
            )


def _role_names(roles: object, who: str) -> list[str]:
    if isinstance(roles, str) or not isinstance(roles, Iterable):
        raise TypeError(
            f"{who}: roles must be a list of role names, got {roles!r}"
            + (f"; use [{roles!r}]" if isinstance(roles, str) else "")
        )
    return list(roles)


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
        grads: ``{role: tree}`` shaped like ``state["params", role]`` (or a
            subset of its leaves: a param without a gradient is not touched).
        optimizers: ``{role: Transform}``.
        roles: roles to update (default: every role in ``grads``).
        donate: update params and optimizer state in their own buffers (fused
            kernels); ``state`` is then invalid (using it again raises
            :class:`~purestep.errors.DonatedStateError`). With ``False``
            nothing is mutated.

    ``state["step"]`` is not changed here (see :func:`train_step`). The state
    is checked first (:class:`~purestep.errors.StateError` names the key path
    where it does not fit the optimizers), unknown roles raise
    :class:`~purestep.errors.RoleError`; nothing is changed before.

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
    if not isinstance(grads, TensorDictBase):
        raise TypeError(
            f"apply_gradients: grads is a {type(grads).__name__}; expected a TensorDict "
            "{role: tree} as value_and_grad returns"
        )
    if not isinstance(optimizers, Mapping):
        raise TypeError(
            f"apply_gradients: optimizers is a {type(optimizers).__name__}; expected a mapping "
            "{role: Transform}, e.g. {'student': optim.adamw(1e-3)}"
        )
    grad_roles = [str(r) for r in grads.keys()]
    roles = grad_roles if roles is None else _role_names(roles, "apply_gradients")
    for role in roles:
        if role not in optimizers:
            raise RoleError(
                f"apply_gradients: no optimizer for role {role!r} (optimizers: "
                f"{sorted(optimizers)})",
                role=role,
            )
        if role not in grad_roles:
            raise RoleError(
                f"apply_gradients: no grads for role {role!r} (grads has roles {grad_roles})",
                role=role,
            )
    if isinstance(state, TensorDictBase):
        check_live(state, "apply_gradients")
        have = state.get(PARAMS) if PARAMS in state.keys() else None
        if isinstance(have, TensorDictBase):
            for role in roles:
                if role not in have.keys():
                    raise RoleError(
                        f"apply_gradients: grads for role {role!r}, but the state has no "
                        f"params.{role} (roles with params: {list(have.keys())})",
                        role=role,
                    )
    check_state(
        state,
        {r: optimizers[r] for r in roles},
        who="apply_gradients",
        counters=False,
        donate=donate,
    )
    _check_bound_donation(state, roles, donate)
    out = _apply(state, grads, optimizers, roles, donate)
    remember(out, {r: optimizers[r] for r in roles}, donated=donate)
    return out


def _apply(
    state: TensorDictBase,
    grads: TensorDictBase,
    optimizers: Mapping[str, Transform],
    roles: Sequence[str],
    donate: bool,
) -> TensorDict:
    """:func:`apply_gradients` on a checked state; a donated input is marked as such."""
    out = fresh_top(state) if donate else state.copy()
    done = 0
    try:
        for role in roles:
            params = state.get((PARAMS, role))
            opt_state = state.get((OPT_STATE, role))
            try:
                new_params, new_opt = optimizers[role].step(
                    grads.get(role), opt_state, params, donate=donate
                )
            except PurestepError as e:
                raise with_prefix(e, f"role {role!r}: ") from e
            except Exception as e:
                # a state edited in place after it was checked: say which key is wrong
                found = diagnose(state, {role: optimizers[role]}, who="apply_gradients")
                if found is not None:
                    raise found from e
                if isinstance(e, ValueError | TypeError):
                    raise with_prefix(e, f"role {role!r}: ") from e
                raise
            if new_params is not params:
                out.set((PARAMS, role), new_params)
            if new_opt is not opt_state:
                out.set((OPT_STATE, role), new_opt)
            done += 1
    except BaseException:
        # a failure before the first role's update leaves the state as it was (kernels
        # check their inputs before writing); after it, a donated state is half-updated
        if donate and done:
            mark_donated(state, "an apply_gradients call that failed part-way")
        raise
    if donate:
        mark_donated(state, "apply_gradients(donate=True)")
    return out


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
        """Check ``state`` against the optimizers; add skip counters when skipping is on.

        Raises :class:`~purestep.errors.StateError` naming the key path where
        the state does not fit (see :func:`purestep.step.check_state`) and
        :class:`~purestep.errors.DonatedStateError` for a state donated before.
        """
        check_state(state, self.optimizers, who="train_step", counters=True, donate=self.donate)
        return add_skip_counters(state) if self.skip_nonfinite else state

    def __call__(self, state: TensorDictBase, batch: Batch) -> tuple[TensorDict, TensorDict]:
        # the grad-norm metric and clip_by_global_norm share one norm of the same grads
        with tree.norm_memo():
            return self._step(state, batch)

    def _step(self, state: TensorDictBase, batch: Batch) -> tuple[TensorDict, TensorDict]:
        entry = state
        state = self.prepare(state)
        batch = prepare_batch(batch)
        step = int(state.get(STEP))
        key = rng.fold_in(state.get(RNG), state.get(STEP))
        roles = self.due_roles(step)
        _check_bound_donation(state, roles, self.donate)
        params = state.get(PARAMS)
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
        try:
            grads, metrics = self.grad_fn(params, batch, key, roles=roles, **extra)
        except Exception as e:
            # a state edited in place after it was checked: say which key is wrong
            found = diagnose(state, self.optimizers, who="train_step")
            if found is not None:
                raise found from e
            raise
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
            finite = all_finite(metrics, norms)
            if not bool(finite):
                return self._skipped(entry, state, metrics, step)
        try:
            if written:
                state = _with_written_params(state, written, self.donate)
            out = _apply(state, grads, self.optimizers, updated, self.donate)
        except BaseException:
            if self.donate and (written or is_donated(state)):
                mark_donated(entry, f"a donated train_step that failed part-way at step {step}")
            raise
        if self.donate:
            what = f"a donated train_step at step {step}"
            mark_donated(entry, what)
            if state is not entry:
                mark_donated(state, what)
        if new_buffers is not None:
            out.set(BUFFERS, new_buffers)
        next_step(state, out, self.donate)
        if self.skip_nonfinite:
            set_skip(out, state, consecutive=0, total_inc=0, donate=self.donate)
            metrics.set("skipped", torch.zeros((), dtype=torch.bool))
        for role in updated:
            lr = current_lr(out.get((OPT_STATE, role)))
            if lr is not None:
                metrics.set((role, "lr"), lr)
            if role in norms:
                metrics.set((role, "grad_norm"), norms[role])
        remember(out, self.optimizers, donated=self.donate)  # updated: new; others: copies
        return out, metrics

    def _skipped(
        self, entry: TensorDictBase, state: TensorDictBase, metrics: TensorDict, step: int
    ) -> tuple[TensorDict, TensorDict]:
        if not self.donate:
            out = skip_update(state, metrics, donate=False, max_consecutive=self.max_consecutive)
        else:
            # a donated step returns a new top-level node (its input is marked donated)
            out = skip_update(
                fresh_top(state), metrics, donate=True, max_consecutive=self.max_consecutive
            )
            what = f"a donated train_step at step {step} (skipped)"
            mark_donated(entry, what)
            if state is not entry:
                mark_donated(state, what)
        remember(out[0], self.optimizers, donated=self.donate)
        return out


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
    if BUFFERS not in state.keys():
        return None
    buffers = state.get(BUFFERS)
    out = {}
    for role in buffers.keys():
        role_bufs = buffers.get(role)
        # a bound role's buffers are the module's own, updated in place by its forward
        out[role] = role_bufs if is_bound(state.get((PARAMS, role))) else tree.clone(role_bufs)
    return tree.plain_td(out)


def _split_written(
    work: TensorDictBase | None, state: TensorDictBase
) -> tuple[TensorDict | None, dict[str, TensorDict]]:
    """The new buffers, and the params the forward wrote in place, from the working copy."""
    if work is None:
        return None, {}
    has_buffers = BUFFERS in state.keys()
    old = state.get(BUFFERS) if has_buffers else None
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
                state.get((PARAMS, role, *path)).copy_(leaf)
        return state
    out = state.copy()
    params = out.get(PARAMS).copy()
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
    out.set(PARAMS, params)
    return out


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
            must match a bare imperative loop. Under :func:`purestep.skip_nonfinite`
            the norms are computed for the finiteness check anyway, and logged.

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
    if not callable(grad_fn):
        raise TypeError(
            f"train_step: grad_fn is a {type(grad_fn).__name__}, not callable; pass "
            "value_and_grad(loss_fn) (optionally wrapped in accumulate)"
        )
    if not isinstance(optimizers, Mapping):
        raise TypeError(
            f"train_step: optimizers is a {type(optimizers).__name__}; expected a mapping "
            "{role: Transform}, e.g. {'student': optim.adamw(1e-3)}"
        )
    if not optimizers:
        raise ValueError(
            "train_step: optimizers is empty, so the step would update nothing while "
            "state['step'] advances; pass {role: Transform} for the roles to train"
        )
    for role, opt in optimizers.items():
        if not isinstance(opt, Transform):
            raise TypeError(f"optimizers[{role!r}] is {type(opt).__name__}, not a Transform")
    if every is not None and not isinstance(every, Mapping):
        raise TypeError(
            f"train_step: every is a {type(every).__name__}; expected a mapping {{role: N}}"
        )
    every = dict(every or {})
    for role, n in every.items():
        if role not in optimizers:
            raise RoleError(
                f"train_step: every[{role!r}] given, but there is no optimizer for it "
                f"(optimizers: {sorted(optimizers)})",
                role=role,
            )
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(
                f"train_step: every[{role!r}] must be an int N >= 1 (update on steps that are "
                f"multiples of N), got {n!r}"
            )
        if n < 1:
            raise ValueError(f"train_step: every[{role!r}] must be a positive int, got {n!r}")
    for name, flag in (("donate", donate), ("grad_norm", grad_norm)):
        if not isinstance(flag, bool):
            raise TypeError(f"train_step: {name} must be a bool, got {flag!r}")
    return TrainStep(
        grad_fn=grad_fn,
        optimizers=dict(optimizers),
        every=every,
        donate=donate,
        grad_norm=grad_norm,
    )
