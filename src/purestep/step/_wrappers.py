"""Step wrappers with the step signature: ``with_ema`` and ``skip_nonfinite``.

Both take any :class:`~purestep.step.Step` (``step(state, batch) -> (state, metrics)``
with ``prepare(state)``), so they compose with each other in any order, with
compiled steps and with a user's own wrappers. On steps built by
:func:`~purestep.train_step`, ``skip_nonfinite`` is fused into the step (the check
runs before the optimizer, so it also works with ``donate=True``); on other steps it
discards a non-finite result and returns the input state advanced by one step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import overload

import attrs
import torch
from tensordict import TensorDict, TensorDictBase

from purestep import _compat as _ops  # attrs 26.1's __repr__ reads a global _compat
from purestep import tree
from purestep._keys import BUFFERS, EMA, EMA_BUFFERS, PARAMS, STEP
from purestep.errors import StateError
from purestep.step._batch import Batch
from purestep.step._counters import add_skip_counters, set_skip, skip_update
from purestep.step._donation import check_live, mark_donated
from purestep.step._train import Step, TrainStep
from purestep.step._validate import check_pair, remember_pair

__all__ = ["EMAStep", "SkipNonFinite", "skip_nonfinite", "with_ema"]


def _check_decay(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"with_ema: {attribute.name} must be in [0, 1], got {value}")


@attrs.frozen
class EMAStep:
    """The step built by :func:`with_ema` (see there)."""

    inner: Step
    decay: float = attrs.field(validator=_check_decay)
    roles: tuple[str, ...]
    start_step: int = 0
    buffers: bool = False
    on_update: bool | None = None

    def period(self, role: str) -> int:
        """``N`` when ``role``'s EMA moves only on its own updates (every ``N`` steps), else 1.

        Example:
            >>> from purestep import optim, train_step, value_and_grad
            >>> gf = value_and_grad(lambda p, b, k: (p["m", "w"].sum(), {}))
            >>> with_ema(train_step(gf, {"m": optim.sgd(0.1)}, every={"m": 3}), 0.9, ["m"]).period("m")
            3
        """
        every = _every_of(self.inner).get(role, 1)
        on_update = self.on_update if self.on_update is not None else every > 1
        return every if on_update else 1

    @property
    def donate(self) -> bool:
        """Whether the wrapped step donates its input state."""
        return _donates(self.inner)

    def prepare(self, state: TensorDictBase) -> TensorDict:
        """Add ``state["ema", role]`` (a copy of the role's params) where missing."""
        state = _prepare(self.inner, state)
        keys = state.keys(include_nested=True)
        missing = [r for r in self.roles if (EMA, r) not in keys]
        missing_buf = [r for r in self.roles if self.buffers and (EMA_BUFFERS, r) not in keys]
        for role in self.roles:
            if role not in state.get(PARAMS).keys():
                raise StateError(
                    f"with_ema: role {role!r} has no params in state (roles with params: "
                    f"{list(state.get(PARAMS).keys())})",
                    path=(PARAMS, role),
                )
            if self.buffers and (BUFFERS, role) not in keys:
                raise StateError(
                    f"with_ema(buffers=True): role {role!r} has no buffers in state "
                    "(its module has no persistent buffers)",
                    path=(BUFFERS, role),
                )
        if not missing and not missing_buf:
            return state
        out = state.copy()
        for role in missing:
            out.set((EMA, role), tree.clone(state.get((PARAMS, role))))
        for role in missing_buf:
            out.set((EMA_BUFFERS, role), tree.clone(state.get((BUFFERS, role))))
        return out

    def __call__(self, state: TensorDictBase, batch: Batch) -> tuple[TensorDict, TensorDict]:
        if isinstance(state, TensorDictBase):
            check_live(state, "with_ema")
        entry = state
        state = self.prepare(state)
        self._check(state)
        step = int(state.get(STEP))
        new_state, metrics = self.inner(state, batch)
        if self.donate:
            mark_donated(entry, f"a donated with_ema step at step {step}")
        if "skipped" in metrics.keys() and bool(metrics.get("skipped")):
            return new_state, metrics
        if not self.donate and not isinstance(self.inner, _OWN_STEPS):
            new_state = new_state.copy()  # a foreign step's output may share nodes with its input
        copy = step < self.start_step
        for role in self.roles:
            if step % self.period(role):
                continue  # the role did not update at this step: nor does its EMA
            self._average(new_state, (PARAMS, role), (EMA, role), copy)
            if self.buffers:
                self._average(new_state, (BUFFERS, role), (EMA_BUFFERS, role), copy)
        self._check(new_state, remember_only=True)
        return new_state, metrics

    def _check(self, state: TensorDictBase, *, remember_only: bool = False) -> None:
        """The EMA trees match what they average (once per structure, see ``check_pair``)."""
        pairs = [(PARAMS, EMA)] + ([(BUFFERS, EMA_BUFFERS)] if self.buffers else [])
        for role in self.roles:
            for src, dst in pairs:
                a, b = state.get((src, role)), state.get((dst, role))
                if remember_only:
                    remember_pair(a, b, dst)
                else:
                    check_pair(a, b, (src, role), (dst, role), who="with_ema", tag=dst)

    def _average(
        self, state: TensorDictBase, src: tuple[str, str], dst: tuple[str, str], copy: bool
    ) -> None:
        """``state[dst] = lerp(state[dst], state[src], 1 - decay)`` (a copy before start_step).

        Leaves that are not floating point (``num_batches_tracked``) are copied.
        """
        p = tree.leaves(state.get(src))
        ema_td = state.get(dst)
        e = tree.leaves(ema_td)
        avg = [i for i, t in enumerate(p) if t.is_floating_point()] if not copy else []
        cp = [i for i in range(len(p)) if i not in set(avg)] if len(avg) != len(p) else []
        if self.donate:
            if cp:
                tree.copy_([e[i] for i in cp], [p[i] for i in cp])
            if avg:
                _ops.foreach_lerp_(
                    [tree.local(e[i]) for i in avg],
                    [tree.local(p[i]) for i in avg],
                    1.0 - self.decay,
                )
            return
        new = list(e)
        for i in cp:
            new[i] = p[i].clone()
        if avg:
            lerped = _ops.foreach_lerp([e[i] for i in avg], [p[i] for i in avg], 1.0 - self.decay)
            for i, t in zip(avg, lerped, strict=True):
                new[i] = t
        state.set(dst, tree.rebuild(ema_td, new))


def _donates(step: object) -> bool:
    """Whether ``step`` or any step it wraps (through ``inner``) donates its input."""
    for _ in range(64):
        if getattr(step, "donate", False) is True:
            return True
        step = getattr(step, "inner", None)
        if step is None:
            break
    return False


def _prepare(step: object, state: TensorDictBase) -> TensorDict:
    prepare = getattr(step, "prepare", None)
    return prepare(state) if callable(prepare) else state


def _check_step(step: object, who: str) -> None:
    if not callable(step) or isinstance(step, type):
        raise TypeError(
            f"{who} wraps a step function step(state, batch) -> (state, metrics) (a "
            f"purestep.step.Step); got {type(step).__name__}"
        )


def _finite(metrics: TensorDictBase) -> bool:
    """Whether every floating ``loss`` / ``grad_norm`` metric is finite (one host sync)."""
    checks = [
        torch.isfinite(leaf).all().cpu()
        for path, leaf in zip(tree.paths(metrics), tree.leaves(metrics), strict=True)
        if path[-1] in ("loss", "grad_norm") and leaf.is_floating_point()
    ]
    return bool(torch.stack(checks).all()) if checks else True


@attrs.frozen
class SkipNonFinite:
    """:func:`skip_nonfinite` around a step that is not a :class:`TrainStep` (see there)."""

    inner: Step
    max_consecutive: int | None = None

    @property
    def donate(self) -> bool:
        """Always ``False``: the input must survive a discarded step."""
        return False

    def prepare(self, state: TensorDictBase) -> TensorDict:
        """Add the skip counters ``state["skip", "total" | "consecutive"]`` where missing."""
        return add_skip_counters(_prepare(self.inner, state))

    def __call__(self, state: TensorDictBase, batch: Batch) -> tuple[TensorDict, TensorDict]:
        state = self.prepare(state)
        new_state, metrics = self.inner(state, batch)
        if _finite(metrics):
            out = new_state.copy()
            set_skip(out, state, consecutive=0, total_inc=0, donate=False)
            metrics.set("skipped", torch.zeros((), dtype=torch.bool))
            return out, metrics
        return skip_update(state, metrics, donate=False, max_consecutive=self.max_consecutive)


_OWN_STEPS = (TrainStep, EMAStep, SkipNonFinite)


def _every_of(step: object) -> Mapping[str, int]:
    """The ``every`` of the :class:`TrainStep` inside ``step`` (through wrappers' ``inner``)."""
    for _ in range(64):
        every = getattr(step, "every", None)
        if isinstance(every, Mapping):
            return every
        step = getattr(step, "inner", None)
        if step is None:
            break
    return {}


def with_ema(
    step: Step,
    decay: float,
    roles: Sequence[str],
    *,
    start_step: int = 0,
    buffers: bool = False,
    on_update: bool | None = None,
) -> EMAStep:
    """Keep an exponential moving average of ``roles``' params in ``state["ema", role]``.

    After each step at index ``s`` (the input ``state["step"]``):
    ``ema = ema + (1 - decay) * (params - ema)`` (``lerp`` on the leaf lists) when
    ``s >= start_step``; before ``start_step`` the EMA is a copy of the params, so
    it starts from the params at ``start_step``. A step skipped by
    :func:`skip_nonfinite` leaves the EMA unchanged. Donation follows the
    wrapped step.

    With ``buffers=True`` the roles' buffers (``state["buffers", role]``, e.g.
    BatchNorm statistics) are averaged the same way into
    ``state["ema_buffers", role]`` (integer buffers such as
    ``num_batches_tracked`` are copied), so ``purestep.variables(state, role,
    ema=True)`` evaluates the EMA model with EMA statistics. Without it the EMA
    params are used with the live buffers.

    Cadence. With ``on_update=True`` a role's EMA moves only at the steps where
    the role itself updates (``train_step(every={role: N})``: steps that are
    multiples of N), so ``decay`` is per update of the role. That is the
    default (``on_update=None``) for roles with ``every > 1``: averaging on the
    other steps too would lerp towards unchanged params N times, an effective
    decay of ``decay ** N`` per update. ``on_update=False`` averages after
    every step. ``start_step`` counts the method's steps (``state["step"]``)
    in either case.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from purestep import call, init_state, optim, train_step, value_and_grad
        >>> net = nn.Linear(1, 1)
        >>> loss = lambda p, b, k: (call(net, p["student"], b["x"]) ** 2).mean()
        >>> opt = {"student": optim.sgd(lr=0.1)}
        >>> step = with_ema(train_step(value_and_grad(lambda p, b, k: (loss(p, b, k), {})), opt),
        ...                 0.99, ["student"])
        >>> state = step.prepare(init_state({"student": net}, opt, seed=0))
        >>> state, _ = step(state, {"x": torch.ones(2, 1)})
        >>> sorted(state["ema"].keys())
        ['student']
    """
    if isinstance(roles, str):
        raise TypeError(f"with_ema: roles must be a list of role names; use [{roles!r}]")
    if not roles:
        raise ValueError("with_ema: roles is empty")
    if start_step < 0:
        raise ValueError(f"with_ema: start_step must be >= 0, got {start_step}")
    _check_step(step, "with_ema")
    return EMAStep(
        inner=step,
        decay=float(decay),
        roles=tuple(roles),
        start_step=start_step,
        buffers=buffers,
        on_update=on_update,
    )


@overload
def skip_nonfinite(step: TrainStep, *, max_consecutive: int | None = None) -> TrainStep: ...
@overload
def skip_nonfinite(step: EMAStep, *, max_consecutive: int | None = None) -> EMAStep: ...
@overload
def skip_nonfinite(
    step: TrainStep | EMAStep, *, max_consecutive: int | None = None
) -> TrainStep | EMAStep: ...
@overload
def skip_nonfinite(step: Step, *, max_consecutive: int | None = None) -> Step: ...
def skip_nonfinite(step: Step, *, max_consecutive: int | None = None) -> Step:
    """Skip updates whose loss or gradient is not finite, as if they never happened.

    A skipped step leaves params, opt_state (so optimizer counts and schedules)
    and EMA exactly unchanged, advances ``state["step"]`` (so the next step gets a
    fresh key), and counts skips in ``state["skip", "total"]`` and
    ``state["skip", "consecutive"]``. Metrics gain a boolean ``"skipped"``. More
    than ``max_consecutive`` consecutive skips raise :class:`NonFiniteError`
    naming the count. Checking finiteness costs one host sync per step.

    Works on any step, in any order with :func:`with_ema`
    (``skip_nonfinite(with_ema(s))`` == ``with_ema(skip_nonfinite(s))``) and user
    wrappers. On a :func:`train_step` step the check is fused into it, before the
    optimizer (so donation works); any other step must not donate (its result is
    discarded and the input state returned, advanced one step, when a floating
    ``loss`` or ``grad_norm`` metric is not finite: :class:`SkipNonFinite`).

    Example:
        >>> from purestep import optim, train_step, value_and_grad
        >>> s = skip_nonfinite(train_step(value_and_grad(lambda p, b, k: (p["m", "w"].sum(), {})),
        ...                               {"m": optim.sgd(lr=0.1)}), max_consecutive=3)
        >>> s.max_consecutive
        3
    """
    if max_consecutive is not None and (
        isinstance(max_consecutive, bool) or not isinstance(max_consecutive, int)
    ):
        raise TypeError(f"skip_nonfinite: max_consecutive must be an int, got {max_consecutive!r}")
    if max_consecutive is not None and max_consecutive < 0:
        raise ValueError(f"skip_nonfinite: max_consecutive must be >= 0, got {max_consecutive}")
    if isinstance(step, EMAStep):
        return attrs.evolve(step, inner=skip_nonfinite(step.inner, max_consecutive=max_consecutive))
    if isinstance(step, TrainStep):
        return attrs.evolve(step, skip_nonfinite=True, max_consecutive=max_consecutive)
    if isinstance(step, SkipNonFinite):
        return attrs.evolve(step, max_consecutive=max_consecutive)
    _check_step(step, "skip_nonfinite")
    if _donates(step):
        raise ValueError(
            f"skip_nonfinite: {type(step).__name__} donates its input state, so its input is "
            "already overwritten when its metrics show a non-finite loss; build it with "
            "donate=False (train_step steps fuse the check and may donate)"
        )
    return SkipNonFinite(inner=step, max_consecutive=max_consecutive)
