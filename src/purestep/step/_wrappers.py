"""Step wrappers with the step signature: ``with_ema`` and ``skip_nonfinite``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
from tensordict import TensorDict, TensorDictBase

from purestep import _compat, tree
from purestep.step._batch import Batch
from purestep.step._train import TrainStep

__all__ = ["EMAStep", "skip_nonfinite", "with_ema"]


def _check_decay(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"with_ema: {attribute.name} must be in [0, 1], got {value}")


@attrs.frozen
class EMAStep:
    """The step built by :func:`with_ema` (see there)."""

    inner: TrainStep | EMAStep
    decay: float = attrs.field(validator=_check_decay)
    roles: tuple[str, ...]
    start_step: int = 0
    buffers: bool = False
    on_update: bool | None = None

    def _follows(self, role: str) -> int:
        """``N`` when ``role``'s EMA moves only on its own updates (every ``N`` steps), else 1."""
        every = _every_of(self.inner).get(role, 1)
        on_update = self.on_update if self.on_update is not None else every > 1
        return every if on_update else 1

    @property
    def donate(self) -> bool:
        """Whether the wrapped step donates its input state."""
        return self.inner.donate

    def prepare(self, state: TensorDictBase) -> TensorDict:
        """Add ``state["ema", role]`` (a copy of the role's params) where missing."""
        state = self.inner.prepare(state)
        keys = state.keys(include_nested=True)
        missing = [r for r in self.roles if ("ema", r) not in keys]
        missing_buf = [r for r in self.roles if self.buffers and ("ema_buffers", r) not in keys]
        for role in self.roles:
            if role not in state.get("params").keys():
                raise KeyError(f"with_ema: role {role!r} has no params in state")
            if self.buffers and ("buffers", role) not in keys:
                raise KeyError(
                    f"with_ema(buffers=True): role {role!r} has no buffers in state "
                    "(its module has no persistent buffers)"
                )
        if not missing and not missing_buf:
            return state
        out = state.copy()
        for role in missing:
            out.set(("ema", role), tree.clone(state.get(("params", role))))
        for role in missing_buf:
            out.set(("ema_buffers", role), tree.clone(state.get(("buffers", role))))
        return out

    def __call__(self, state: TensorDictBase, batch: Batch) -> tuple[TensorDict, TensorDict]:
        state = self.prepare(state)
        step = int(state.get("step"))
        new_state, metrics = self.inner(state, batch)
        if "skipped" in metrics.keys() and bool(metrics.get("skipped")):
            return new_state, metrics
        copy = step < self.start_step
        for role in self.roles:
            if step % self._follows(role):
                continue  # the role did not update at this step: nor does its EMA
            self._average(new_state, ("params", role), ("ema", role), copy)
            if self.buffers:
                self._average(new_state, ("buffers", role), ("ema_buffers", role), copy)
        return new_state, metrics

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
                _compat.foreach_lerp_(
                    [tree.local(e[i]) for i in avg],
                    [tree.local(p[i]) for i in avg],
                    1.0 - self.decay,
                )
            return
        new = list(e)
        for i in cp:
            new[i] = p[i].clone()
        if avg:
            lerped = _compat.foreach_lerp(
                [e[i] for i in avg], [p[i] for i in avg], 1.0 - self.decay
            )
            for i, t in zip(avg, lerped, strict=True):
                new[i] = t
        state.set(dst, tree.rebuild(ema_td, new))


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
    step: TrainStep | EMAStep,
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
    if not roles:
        raise ValueError("with_ema: roles is empty")
    if start_step < 0:
        raise ValueError(f"with_ema: start_step must be >= 0, got {start_step}")
    if not isinstance(step, (TrainStep, EMAStep)):
        raise TypeError(
            f"with_ema wraps steps built by train_step/with_ema/skip_nonfinite; got "
            f"{type(step).__name__}"
        )
    return EMAStep(
        inner=step,
        decay=float(decay),
        roles=tuple(roles),
        start_step=start_step,
        buffers=buffers,
        on_update=on_update,
    )


def skip_nonfinite(
    step: TrainStep | EMAStep, *, max_consecutive: int | None = None
) -> TrainStep | EMAStep:
    """Skip updates whose loss or gradient is not finite, as if they never happened.

    A skipped step leaves params, opt_state (so optimizer counts and schedules)
    and EMA exactly unchanged, advances ``state["step"]`` (so the next step gets a
    fresh key), and counts skips in ``state["skip", "total"]`` and
    ``state["skip", "consecutive"]``. Metrics gain a boolean ``"skipped"``. More
    than ``max_consecutive`` consecutive skips raise :class:`NonFiniteError`
    naming the count. Checking finiteness costs one host sync per step.

    Works on steps built by :func:`train_step`, in any order with
    :func:`with_ema` (``skip_nonfinite(with_ema(s))`` == ``with_ema(skip_nonfinite(s))``).

    Example:
        >>> from purestep import optim, train_step, value_and_grad
        >>> s = skip_nonfinite(train_step(value_and_grad(lambda p, b, k: (p["m", "w"].sum(), {})),
        ...                               {"m": optim.sgd(lr=0.1)}), max_consecutive=3)
        >>> s.max_consecutive
        3
    """
    if max_consecutive is not None and max_consecutive < 0:
        raise ValueError(f"skip_nonfinite: max_consecutive must be >= 0, got {max_consecutive}")
    if isinstance(step, EMAStep):
        return attrs.evolve(step, inner=skip_nonfinite(step.inner, max_consecutive=max_consecutive))
    if isinstance(step, TrainStep):
        return attrs.evolve(step, skip_nonfinite=True, max_consecutive=max_consecutive)
    raise TypeError(
        f"skip_nonfinite wraps steps built by train_step/with_ema; got {type(step).__name__}"
    )
