"""Supervised flow matching (fine-tuning): one trainable role, ``student``.

For each sample: a timestep ``t`` and noise ``eps`` are drawn per sample
(:class:`~purestep.methods.flow.Purpose` ``TIMESTEP`` and ``NOISE`` with
``index=batch["index"]``), ``x_t = (1 - t) x0 + t eps``, and the model's
velocity ``v = model(x_t, t, **cond)`` is regressed onto ``eps - x0``
(``MSE``), or, with ``precondition_outputs=True``, its implied clean sample
``x_t - t v`` onto ``x0``.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from purestep import optim
    >>> from purestep.methods import finetune
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.lin = nn.Linear(3, 2)
    ...     def forward(self, x, t):
    ...         return self.lin(torch.cat([x, t[:, None]], dim=1))
    >>> net, opt = Net(), optim.adamw(lr=1e-3)
    >>> step = finetune.make_step(net, opt)
    >>> state = finetune.init_state(net, opt, seed=0)
    >>> state, metrics = step(state, {"x0": torch.ones(8, 2)})
    >>> int(state["step"])
    1
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from purestep import state as _state
from purestep import tree
from purestep.methods import _validators as _v
from purestep.methods import flow
from purestep.methods._common import build_step
from purestep.methods.flow import Purpose, TimestepDist
from purestep.optim import Transform
from purestep.step import EMAStep, LossFn, TrainStep

__all__ = ["FinetuneConfig", "build_step", "init_state", "loss_fn", "make_step"]


@attrs.frozen(kw_only=True)
class FinetuneConfig:
    """Hyperparameters of supervised flow matching.

    Attributes:
        precondition_outputs: regress the implied clean sample ``x_t - t v``
            onto ``x0`` instead of ``v`` onto ``eps - x0``.
        timesteps: the training timestep distribution.
        x0_key: the batch key of the clean data ``[B, ...]``.
        cond_keys: batch keys passed to the model as keyword arguments.
        cond_dropout: per-sample probability of replacing the condition by
            ``null_cond`` (trains the unconditional branch for CFG).
        null_cond: ``{key: null value}`` for every key in ``cond_keys``; needed
            when ``cond_dropout > 0``.
        t_scale: the model receives ``t * t_scale``.
        role: the trainable role's name.

    Example:
        >>> FinetuneConfig(cond_keys=("label",), cond_dropout=0.1, null_cond={"label": 10}).role
        'student'
    """

    precondition_outputs: bool = attrs.field(
        default=False, validator=attrs.validators.instance_of(bool)
    )
    timesteps: TimestepDist = attrs.field(
        factory=TimestepDist, validator=attrs.validators.instance_of(TimestepDist)
    )
    x0_key: str = attrs.field(default="x0", validator=_v.name)
    cond_keys: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_v.keys)
    cond_dropout: float = attrs.field(default=0.0, validator=_v.unit)
    null_cond: Mapping[str, Any] | None = attrs.field(default=None)
    t_scale: float = attrs.field(default=1.0, validator=_v.positive)
    role: str = attrs.field(default="student", validator=_v.name)

    def __attrs_post_init__(self) -> None:
        if self.cond_dropout > 0:
            if not self.cond_keys:
                raise ValueError("FinetuneConfig.cond_dropout > 0 needs cond_keys")
            missing = [k for k in self.cond_keys if k not in (self.null_cond or {})]
            if missing:
                raise ValueError(
                    f"FinetuneConfig.null_cond must give a null value for cond_keys {missing} "
                    "when cond_dropout > 0"
                )


def loss_fn(model: nn.Module, config: FinetuneConfig | None = None) -> LossFn:
    """The flow-matching loss ``loss_fn(params, batch, key) -> (loss, metrics)`` for ``model``.

    ``params[config.role]`` are the model's params; ``batch[config.x0_key]`` the
    clean data. Metrics: ``loss`` (added by :func:`purestep.value_and_grad`) and
    ``(role, "t_mean")``.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from purestep import rng
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = nn.Parameter(torch.zeros(2))
        ...     def forward(self, x, t):
        ...         return x * self.w
        >>> net = Net()
        >>> params = TensorDict({"student": {"w": torch.zeros(2)}}, [])
        >>> loss, m = loss_fn(net)(params, TensorDict({"x0": torch.zeros(4, 2)}, [4]), rng.key(0))
        >>> loss > 0
        tensor(True)
    """
    cfg = config or FinetuneConfig()

    def loss(
        params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        if cfg.x0_key not in batch.keys():
            raise KeyError(f"finetune: batch has no {cfg.x0_key!r} (keys: {sorted(batch.keys())})")
        x0 = batch.get(cfg.x0_key)
        idx = flow.batch_index(batch)
        b = x0.shape[0]
        t = cfg.timesteps.sample(
            flow.purpose_key(key, Purpose.TIMESTEP), b, index=idx, device=x0.device, dtype=x0.dtype
        )
        eps = flow.noise_like(flow.purpose_key(key, Purpose.NOISE), x0, idx)
        x_t = flow.interpolate(x0, eps, t)
        cond = flow.batch_cond(batch, cfg.cond_keys)
        if cfg.cond_dropout > 0:
            assert cfg.null_cond is not None
            cond = flow.condition_dropout(
                flow.purpose_key(key, Purpose.COND_DROP),
                cond,
                cfg.null_cond,
                cfg.cond_dropout,
                index=idx,
            )
        v = flow.predict_velocity(model, params.get(cfg.role), x_t, t, cond, t_scale=cfg.t_scale)
        if cfg.precondition_outputs:
            value = flow.mse(flow.x0_from_velocity(x_t, t, v), x0)
        else:
            value = flow.mse(v, flow.velocity_target(x0, eps))
        return value, {cfg.role: {"t_mean": t.detach().mean()}}

    return loss


def make_step(
    model: nn.Module,
    optimizer: Transform,
    config: FinetuneConfig | None = None,
    *,
    accumulate: int = 1,
    donate: bool = False,
    ema: float | None = None,
    ema_start_step: int = 0,
    skip_nonfinite: bool = False,
) -> TrainStep | EMAStep:
    """The fine-tuning step ``step(state, batch) -> (state, metrics)``.

    Args:
        model: ``forward(x_t, t, **cond) -> velocity``.
        optimizer: the role's optimizer (a :class:`purestep.optim.Transform`).
        config: hyperparameters (default :class:`FinetuneConfig`).
        accumulate: number of microbatches per step (same result for any value).
        donate: reuse the input state's buffers (the input state is then invalid).
        ema: keep an EMA of the role's params with this decay in ``state["ema"]``.
        ema_start_step: the EMA starts averaging at this step (a copy of the params before).
        skip_nonfinite: skip steps with a non-finite loss or gradient.

    Example:
        >>> from purestep import optim
        >>> make_step(nn.Linear(2, 2), optim.sgd(lr=0.1), ema=0.99).roles
        ('student',)
    """
    cfg = config or FinetuneConfig()
    return build_step(
        loss_fn(model, cfg),
        {cfg.role: optimizer},
        accumulate=accumulate,
        donate=donate,
        ema=ema,
        ema_start_step=ema_start_step,
        skip_nonfinite=skip_nonfinite,
    )


def init_state(
    model: nn.Module | TensorDictBase,
    optimizer: Transform,
    *,
    seed: int,
    role: str = "student",
) -> TensorDict:
    """The initial state: ``params[role]`` copied from ``model``, its optimizer state, key and step.

    Example:
        >>> from purestep import optim
        >>> sorted(init_state(nn.Linear(2, 2), optim.sgd(lr=0.1), seed=0)["params"].keys())
        ['student']
    """
    params = tree.clone(model.detach()) if isinstance(model, TensorDictBase) else model
    return _state.init_state({role: params}, {role: optimizer}, seed=seed)
