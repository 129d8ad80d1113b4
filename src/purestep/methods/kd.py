"""Trajectory distillation (knowledge distillation, "ODE init") into a few-step student.

A frozen teacher runs a many-step Euler ODE from noise; the states it passes
at the student's timesteps are recorded together with its final ``x0``. The
student learns to map each recorded state ``x_t`` directly to that ``x0``:
``loss = 0.5 * mse(x_t - t * v_student(x_t, t), x0_teacher)``.

At inference the student samples with
:func:`~purestep.methods.flow.renoise_sample` along ``[*student_steps, 0.0]``
(predict ``x0``, re-noise with fresh noise): the re-noised states have the
marginals of the teacher's ODE states it was trained on, whereas deterministic
Euler steps would feed it states off the teacher's trajectories.

Trajectories are generated once by :func:`generate_trajectories` and cached
on disk in chunks; an interrupted generation resumes where it stopped and
gives the same files, bitwise, as an uninterrupted one. :func:`load_trajectories`
reads the cache as one TensorDict of training rows and :func:`batches` yields
shuffled batches from it.

Cache layout (``cache_dir``)::

    meta.json            # the generation settings; a resume must match them
    chunk_000000.pt      # {"x_t": [n, S, ...], "x0": [n, ...], "sample": [n], "cond": {...}}
    chunk_000001.pt      # ... one file per chunk of ``chunk_size`` samples

``S`` is the number of student steps. Each file is written to a temporary
name and renamed, so a file that exists is complete. The cache code lives in
``_kd_cache`` (re-exported here).

Example:
    >>> import tempfile
    >>> import torch
    >>> from torch import nn
    >>> from purestep import optim, rng
    >>> from purestep.methods import kd
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.lin = nn.Linear(3, 2)
    ...     def forward(self, x, t):
    ...         return self.lin(torch.cat([x, t[:, None]], dim=1))
    >>> teacher, student = Net(), Net()
    >>> d = tempfile.mkdtemp()
    >>> _ = kd.generate_trajectories(teacher, d, num_samples=8, sample_shape=(2,), chunk_size=4,
    ...                              student_steps=(1.0, 0.5), teacher_steps=8, key=rng.key(0))
    >>> data = kd.load_trajectories(d)
    >>> data.batch_size, data["x_t"].shape
    (torch.Size([16]), torch.Size([16, 2]))
    >>> opt = optim.adam(lr=1e-3)
    >>> step, state = kd.make_step(student, opt), kd.init_state(student, opt, seed=0)
    >>> state, metrics = step(state, next(kd.batches(data, 8, key=rng.key(1))))
"""

from __future__ import annotations

import attrs
import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from purestep import state as _state
from purestep import tree
from purestep.methods import _validators as _v
from purestep.methods import flow
from purestep.methods._common import build_step
from purestep.methods._kd_cache import (
    batches,
    generate_trajectories,
    load_trajectories,
    teacher_schedule,
)
from purestep.optim import Transform
from purestep.step import EMAStep, LossFn, TrainStep

__all__ = [
    "KDConfig",
    "batches",
    "generate_trajectories",
    "init_state",
    "load_trajectories",
    "loss_fn",
    "make_step",
    "teacher_schedule",
]


@attrs.frozen(kw_only=True)
class KDConfig:
    """Batch keys and model settings of trajectory distillation.

    Attributes:
        x_t_key: batch key of the recorded teacher states ``[B, ...]``.
        t_key: batch key of their timesteps ``[B]``.
        x0_key: batch key of the teacher's final samples ``[B, ...]``.
        cond_keys: batch keys passed to the student as keyword arguments.
        t_scale: the student receives ``t * t_scale``.
        role: the trainable role's name.

    Example:
        >>> KDConfig().x_t_key
        'x_t'
    """

    x_t_key: str = attrs.field(default="x_t", validator=_v.name)
    t_key: str = attrs.field(default="t", validator=_v.name)
    x0_key: str = attrs.field(default="x0", validator=_v.name)
    cond_keys: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_v.keys)
    t_scale: float = attrs.field(default=1.0, validator=_v.positive)
    role: str = attrs.field(default="student", validator=_v.name)


def loss_fn(model: nn.Module, config: KDConfig | None = None) -> LossFn:
    """``0.5 * mse(x_t - t * model(x_t, t, **cond), x0)`` over a batch of recorded states.

    Example:
        >>> lin = nn.Linear(2, 2)
        >>> callable(loss_fn(lin))
        True
    """
    cfg = config or KDConfig()

    def loss(
        params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        del key  # deterministic regression: no draws
        missing = [k for k in (cfg.x_t_key, cfg.t_key, cfg.x0_key) if k not in batch.keys()]
        if missing:
            raise KeyError(f"kd: batch has no {missing} (keys: {sorted(batch.keys())})")
        x_t, t, x0 = batch.get(cfg.x_t_key), batch.get(cfg.t_key), batch.get(cfg.x0_key)
        if t.dim() != 1 or t.shape[0] != x_t.shape[0]:
            raise ValueError(
                f"kd: batch[{cfg.t_key!r}] must have shape [B] = [{x_t.shape[0]}], "
                f"got {tuple(t.shape)}"
            )
        cond = flow.batch_cond(batch, cfg.cond_keys)
        v = flow.predict_velocity(model, params.get(cfg.role), x_t, t, cond, t_scale=cfg.t_scale)
        value = 0.5 * flow.mse(flow.x0_from_velocity(x_t, t, v), x0)
        return value, {}

    return loss


def make_step(
    model: nn.Module,
    optimizer: Transform,
    config: KDConfig | None = None,
    *,
    accumulate: int = 1,
    donate: bool = False,
    ema: float | None = None,
    ema_start_step: int = 0,
    skip_nonfinite: bool = False,
) -> TrainStep | EMAStep:
    """The trajectory-distillation step ``step(state, batch) -> (state, metrics)``.

    Args:
        model: the student's module.
        optimizer: its optimizer.
        config: batch keys and model settings (default :class:`KDConfig`).
        accumulate: number of microbatches per step (same result for any value).
        donate: reuse the input state's buffers.
        ema: keep an EMA of the student's params with this decay.
        ema_start_step: the EMA starts averaging at this step (a copy of the params before).
        skip_nonfinite: skip steps with a non-finite loss or gradient.

    Example:
        >>> from purestep import optim
        >>> type(make_step(nn.Linear(2, 2), optim.sgd(lr=0.1))).__name__
        'TrainStep'
    """
    cfg = config or KDConfig()
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
    model: nn.Module | TensorDictBase, optimizer: Transform, *, seed: int, role: str = "student"
) -> TensorDict:
    """The initial state with ``params[role]`` copied from ``model`` (e.g. the teacher's weights).

    Example:
        >>> from purestep import optim
        >>> sorted(init_state(nn.Linear(2, 2), optim.sgd(lr=0.1), seed=0)["params"].keys())
        ['student']
    """
    params = tree.clone(model.detach()) if isinstance(model, TensorDictBase) else model
    return _state.init_state({role: params}, {role: optimizer}, seed=seed)
