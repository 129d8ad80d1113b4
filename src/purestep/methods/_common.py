"""Plumbing shared by the methods' step builders."""

from __future__ import annotations

from collections.abc import Mapping

from purestep.optim import Transform
from purestep.step import (
    EMAStep,
    LossFn,
    TrainStep,
    train_step,
    value_and_grad,
    with_ema,
)
from purestep.step import accumulate as _accumulate
from purestep.step import skip_nonfinite as _skip_nonfinite

__all__ = ["build_step"]


def build_step(
    loss: LossFn,
    optimizers: Mapping[str, Transform],
    *,
    accumulate: int = 1,
    donate: bool = False,
    every: Mapping[str, int] | None = None,
    ema: float | None = None,
    ema_roles: tuple[str, ...] = (),
    ema_start_step: int = 0,
    ema_on_update: bool | None = None,
    skip_nonfinite: bool = False,
) -> TrainStep | EMAStep:
    """``train_step(accumulate(value_and_grad(loss), k), optimizers)`` with optional EMA and skipping.

    The shared plumbing of every method's ``make_step``. ``ema`` keeps an EMA of
    ``ema_roles`` (:func:`purestep.with_ema`) from ``ema_start_step`` on (a
    copy of the params before it); ``ema_on_update`` says whether a role's EMA
    moves only on the steps where the role updates (default: yes for roles
    updated every N > 1 steps, so the decay is per update of the role).

    Example:
        >>> import torch
        >>> from purestep import optim
        >>> s = build_step(lambda p, b, k: (p["m", "w"].sum(), {}), {"m": optim.sgd(lr=0.1)})
        >>> type(s).__name__
        'TrainStep'
    """
    grad_fn = value_and_grad(loss)
    if accumulate != 1:
        grad_fn = _accumulate(grad_fn, accumulate)
    step: TrainStep | EMAStep = train_step(grad_fn, optimizers, every=every, donate=donate)
    if ema is not None:
        step = with_ema(
            step,
            ema,
            ema_roles or tuple(optimizers),
            start_step=ema_start_step,
            on_update=ema_on_update,
        )
    elif ema_start_step or ema_on_update is not None:
        raise ValueError("ema_start_step and ema_on_update need ema= (an EMA decay)")
    if skip_nonfinite:
        step = _skip_nonfinite(step)
    return step
