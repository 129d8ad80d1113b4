"""Distribution-matching distillation (DMD2) of a flow teacher into a few-step student.

Roles:

* ``student`` (trainable): the few-step generator. It predicts clean samples
  ``x0 = x_t - t * v`` at the timesteps in ``config.student_steps``.
* ``teacher`` (frozen, *not* state): the real score, with classifier-free
  guidance ``config.guidance_scale``. Its params are constants captured by the
  loss function.
* ``critic`` (trainable): the fake score, initialised from the teacher's
  weights (:func:`init_state`) and trained by flow matching on the student's
  samples.

Each step (key ``k``, per-sample draws with ``index=batch["index"]``):

1. **Student rollout** (draws: ``Purpose.ROLLOUT_STEP``, ``ROLLOUT_NOISE``).
   A step ``j`` is drawn per sample from the student's step list.
   ``rollout="data"``: noise the batch's data to ``t_j`` and predict ``x0``.
   ``rollout="simulate"``: start from noise at ``t = 1``, run the student
   without grad down the step list (predict ``x0``, re-noise it with fresh
   noise to the next step, as :func:`~purestep.methods.flow.renoise_sample`
   does at inference) until ``t_j``, then predict ``x0`` (with grad on update
   steps).
2. **Student loss**, only on steps where the student is live
   (``every={"student": generator_update_interval}``; see
   :func:`purestep.live_roles`). The student's ``x0`` is noised to a score
   timestep ``t`` drawn from ``config.score_timesteps`` (``SCORE_TIMESTEP``,
   ``SCORE_NOISE``); without grad, ``x0_real`` is the teacher's (guided)
   prediction and ``x0_fake`` the critic's, and
   ``g = (x0_fake - x0_real) / mean|x0_student - x0_real|`` (mean per sample over
   non-batch dims; non-finite entries set to 0). The loss is
   ``0.5 * mse(x0_student, (x0_student - g).detach())``, whose gradient with
   respect to ``x0_student`` is ``g / numel``: it moves the student's samples
   from the fake towards the real score.
3. **Critic loss**, every step: flow matching on the detached student samples
   (``CRITIC_TIMESTEP``, ``CRITIC_NOISE`` from ``config.critic_timesteps``).

The loss returns ``{"student": ..., "critic": ...}`` (only live roles), so each
role is differentiated by its own loss and has its own optimizer (the critic
often uses ``betas=(0.0, 0.999)``).

Example:
    >>> import torch
    >>> from torch import nn
    >>> from purestep import optim
    >>> from purestep.methods import dmd2
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.lin = nn.Linear(3, 2)
    ...     def forward(self, x, t):
    ...         return self.lin(torch.cat([x, t[:, None]], dim=1))
    >>> student, teacher = Net(), Net()
    >>> opts = {"student": optim.adam(lr=1e-4), "critic": optim.adam(lr=1e-4, betas=(0.0, 0.999))}
    >>> cfg = dmd2.DMD2Config(generator_update_interval=2)
    >>> step = dmd2.make_step(student, teacher, None, opts, cfg)
    >>> state = dmd2.init_state(student, teacher, opts, seed=0)
    >>> state, metrics = step(state, {"x0": torch.zeros(8, 2)})
    >>> sorted(metrics.keys())[:2]
    ['critic', 'dmd_g_abs']
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any, Literal

import attrs
import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from purestep import rng, tree
from purestep import state as _state
from purestep.methods import _validators as _v
from purestep.methods import flow
from purestep.methods._common import build_step
from purestep.methods.flow import Purpose, TimestepDist
from purestep.optim import Transform
from purestep.step import EMAStep, LossFn, TrainStep, live_roles

__all__ = ["DMD2Config", "init_state", "loss_fn", "make_step", "student_sample"]

_ROLES = ("student", "critic")


def _student_steps(
    _: object, attribute: attrs.Attribute[tuple[float, ...]], value: tuple[float, ...]
) -> None:
    if not value:
        raise ValueError(f"DMD2Config.{attribute.name} must not be empty")
    for s in value:
        if not (isinstance(s, float) and math.isfinite(s) and 0.0 < s <= 1.0):
            raise ValueError(
                f"DMD2Config.{attribute.name} entries must be in (0, 1], got {value!r}"
            )
    if any(b >= a for a, b in itertools.pairwise(value)):
        raise ValueError(f"DMD2Config.{attribute.name} must be strictly decreasing, got {value!r}")


def _floats(value: Any) -> tuple[float, ...]:
    return tuple(float(v) for v in value)


@attrs.frozen(kw_only=True)
class DMD2Config:
    """Hyperparameters of DMD2.

    Attributes:
        student_steps: the timesteps (strictly decreasing, in ``(0, 1]``) at which
            the student predicts ``x0``; ``(1.0,)`` is a one-step generator. At
            inference sample with ``flow.sample(..., [*student_steps, 0.0],
            renoise_key=key)`` (:func:`~purestep.methods.flow.renoise_sample`).
        rollout: ``"simulate"`` (from noise, the student's own few-step
            trajectory; needs ``student_steps[0] == 1.0``) or ``"data"`` (noise
            the batch's data to a student timestep).
        guidance_scale: classifier-free guidance of the teacher (the real score).
        score_timesteps: timesteps at which the scores are compared; ``low`` and
            ``high`` are the min/max timestep ratios.
        critic_timesteps: timesteps of the critic's flow-matching loss.
        generator_update_interval: the student updates on steps that are
            multiples of this (the critic every step).
        x0_key: batch key of the data ``[B, ...]``; with ``rollout="simulate"``
            only its shape, dtype and device are used.
        cond_keys: batch keys passed to all three models as keyword arguments.
        null_cond: ``{key: null value}`` for the teacher's unconditional branch
            (needed when ``cond_keys`` is set and ``guidance_scale != 1``).
        t_scale: the models receive ``t * t_scale``.

    Example:
        >>> DMD2Config(student_steps=(1.0, 0.5), generator_update_interval=5).rollout
        'simulate'
    """

    student_steps: tuple[float, ...] = attrs.field(
        default=(1.0,), converter=_floats, validator=_student_steps
    )
    rollout: Literal["simulate", "data"] = attrs.field(
        default="simulate", validator=attrs.validators.in_(("simulate", "data"))
    )
    guidance_scale: float = attrs.field(default=1.0, validator=_v.finite)
    score_timesteps: TimestepDist = attrs.field(
        factory=lambda: TimestepDist(low=0.02, high=0.98),
        validator=attrs.validators.instance_of(TimestepDist),
    )
    critic_timesteps: TimestepDist = attrs.field(
        factory=TimestepDist, validator=attrs.validators.instance_of(TimestepDist)
    )
    generator_update_interval: int = attrs.field(default=5, validator=_v.positive_int)
    x0_key: str = attrs.field(default="x0", validator=_v.name)
    cond_keys: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_v.keys)
    null_cond: Mapping[str, Any] | None = attrs.field(default=None)
    t_scale: float = attrs.field(default=1.0, validator=_v.positive)

    def __attrs_post_init__(self) -> None:
        if self.rollout == "simulate" and self.student_steps[0] != 1.0:
            raise ValueError(
                f"DMD2Config.student_steps must start at 1.0 for rollout='simulate' "
                f"(the rollout starts from pure noise), got {self.student_steps!r}"
            )
        if self.cond_keys and self.guidance_scale != 1.0:
            missing = [k for k in self.cond_keys if k not in (self.null_cond or {})]
            if missing:
                raise ValueError(
                    f"DMD2Config.null_cond must give a null value for cond_keys {missing} "
                    f"when guidance_scale != 1 (got {self.guidance_scale})"
                )


def _per_sample_mean_abs(x: torch.Tensor) -> torch.Tensor:
    dims = tuple(range(1, x.dim()))
    return x.abs().mean(dim=dims, keepdim=True) if dims else x.abs()


def student_sample(
    model: nn.Module,
    params: TensorDictBase,
    x_like: torch.Tensor,
    key: torch.Tensor,
    index: torch.Tensor,
    config: DMD2Config,
    cond: Mapping[str, torch.Tensor] | None = None,
    *,
    data: torch.Tensor | None = None,
) -> torch.Tensor:
    """The student's rollout ``x0`` (step 1 of the module docstring), with grad if enabled.

    Only the final prediction is differentiable: the simulated prefix runs under
    ``torch.no_grad()``.

    Args:
        model: the student module.
        params: the student's params.
        x_like: a tensor with the samples' shape ``[B, ...]``, dtype and device.
        key: the step key (purposes are folded in here).
        index: int64 ``[B]`` sample ids.
        config: the DMD2 config (``student_steps``, ``rollout``, ``t_scale``).
        cond: conditioning kwargs for the student.
        data: the clean data for ``rollout="data"`` (default ``x_like``).

    Example:
        >>> class Zero(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = nn.Parameter(torch.zeros(()))
        ...     def forward(self, x, t):
        ...         return x * self.w
        >>> p = TensorDict({"w": torch.zeros(())}, [])
        >>> x0 = student_sample(Zero(), p, torch.zeros(4, 2), rng.key(0), torch.arange(4),
        ...                     DMD2Config())
        >>> x0.shape
        torch.Size([4, 2])
    """
    steps = config.student_steps
    n = len(steps)
    b = x_like.shape[0]
    dev, dt = x_like.device, x_like.dtype
    if n > 1:
        j = rng.randint(
            flow.purpose_key(key, Purpose.ROLLOUT_STEP), 0, n, (b,), index=index, device=dev
        )
    else:
        j = torch.zeros(b, dtype=torch.int64, device=dev)
    t_j = torch.full((b,), steps[0], dtype=dt, device=dev)  # steps[j], built on the device
    for i in range(1, n):  # (a host list copied to the GPU would synchronise it)
        t_j = torch.where(j == i, steps[i], t_j)
    roll_key = flow.purpose_key(key, Purpose.ROLLOUT_NOISE)
    eps = flow.noise_like(roll_key, x_like, index)
    if config.rollout == "data":
        x = flow.interpolate(x_like if data is None else data, eps, t_j)
    else:
        x = eps
        with torch.no_grad():
            for i in range(n - 1):  # as flow.renoise_sample(key=roll_key), stopped at step j
                t_i = torch.full((b,), steps[i], dtype=dt, device=dev)
                v = flow.predict_velocity(model, params, x, t_i, cond, t_scale=config.t_scale)
                x0 = flow.x0_from_velocity(x, t_i, v)
                fresh = flow.noise_like(rng.fold_in(roll_key, i + 1), x_like, index)
                x_next = flow.interpolate(x0, fresh, steps[i + 1])
                keep = (j <= i).reshape(b, *([1] * (x.dim() - 1)))
                x = torch.where(keep, x, x_next)
    v = flow.predict_velocity(model, params, x, t_j, cond, t_scale=config.t_scale)
    return flow.x0_from_velocity(x, t_j, v)


def loss_fn(
    student_model: nn.Module,
    teacher_model: nn.Module,
    critic_model: nn.Module | None = None,
    config: DMD2Config | None = None,
    *,
    teacher_params: TensorDictBase | None = None,
) -> LossFn:
    """The DMD2 loss ``loss_fn(params, batch, key) -> ({"student": ..., "critic": ...}, metrics)``.

    ``params`` holds the ``student`` and ``critic`` roles. The teacher is frozen:
    its params are ``teacher_params``, or a copy of ``teacher_model``'s taken
    now (pass ``TensorDict.from_module(teacher_model)`` to avoid the copy). The
    critic runs on ``critic_model`` (default: the teacher's module, called with
    the critic's params). The student's work is skipped on steps where it is not
    live (:func:`purestep.live_roles`).

    Metrics: ``(role, "loss")`` (added by :func:`purestep.value_and_grad`),
    ``dmd_g_abs`` (mean ``|g|``, on student steps) and ``x0_sq`` (mean square of
    the student's samples; batch means, so they combine exactly under accumulation).

    Example:
        >>> lin = nn.Linear(2, 2)
        >>> f = loss_fn(lin, lin, None, DMD2Config())
        >>> callable(f)
        True
    """
    cfg = config or DMD2Config()
    critic = teacher_model if critic_model is None else critic_model
    t_params = (
        flow.frozen_params(teacher_model) if teacher_params is None else teacher_params.detach()
    )

    def loss(
        params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        for role in _ROLES:
            if role not in params.keys():
                raise KeyError(
                    f"dmd2: params have no role {role!r} (roles: {sorted(params.keys())}); "
                    "build the state with dmd2.init_state"
                )
        if cfg.x0_key not in batch.keys():
            raise KeyError(f"dmd2: batch has no {cfg.x0_key!r} (keys: {sorted(batch.keys())})")
        live = live_roles()
        student_live = live is None or "student" in live
        critic_live = live is None or "critic" in live
        x_like = batch.get(cfg.x0_key)
        idx = flow.batch_index(batch)
        b, dev, dt = x_like.shape[0], x_like.device, x_like.dtype
        cond = flow.batch_cond(batch, cfg.cond_keys)
        s_params = params.get("student")
        with torch.set_grad_enabled(student_live and torch.is_grad_enabled()):
            x0_s = student_sample(student_model, s_params, x_like, key, idx, cfg, cond, data=x_like)
        losses: dict[str, torch.Tensor] = {}
        metrics: dict[str, torch.Tensor] = {"x0_sq": x0_s.detach().square().mean()}
        if student_live:
            t = cfg.score_timesteps.sample(
                flow.purpose_key(key, Purpose.SCORE_TIMESTEP), b, index=idx, device=dev, dtype=dt
            )
            eps = flow.noise_like(flow.purpose_key(key, Purpose.SCORE_NOISE), x_like, idx)
            with torch.no_grad():
                x_t = flow.interpolate(x0_s.detach(), eps, t)
                null = (
                    flow.null_condition(cond, cfg.null_cond)
                    if cond and cfg.null_cond is not None and cfg.guidance_scale != 1.0
                    else None
                )
                v_real = flow.guided_velocity(
                    teacher_model,
                    t_params,
                    x_t,
                    t,
                    cond,
                    null,
                    cfg.guidance_scale,
                    t_scale=cfg.t_scale,
                )
                v_fake = flow.predict_velocity(
                    critic, params.get("critic").detach(), x_t, t, cond, t_scale=cfg.t_scale
                )
                x0_real = flow.x0_from_velocity(x_t, t, v_real)
                x0_fake = flow.x0_from_velocity(x_t, t, v_fake)
                g = (x0_fake - x0_real) / _per_sample_mean_abs(x0_s.detach() - x0_real)
                g = torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0)
            losses["student"] = 0.5 * flow.mse(x0_s, (x0_s - g).detach())
            metrics["dmd_g_abs"] = g.abs().mean()
        if critic_live:
            x0_d = x0_s.detach()
            t_c = cfg.critic_timesteps.sample(
                flow.purpose_key(key, Purpose.CRITIC_TIMESTEP), b, index=idx, device=dev, dtype=dt
            )
            eps_c = flow.noise_like(flow.purpose_key(key, Purpose.CRITIC_NOISE), x_like, idx)
            x_t_c = flow.interpolate(x0_d, eps_c, t_c)
            v_c = flow.predict_velocity(
                critic, params.get("critic"), x_t_c, t_c, cond, t_scale=cfg.t_scale
            )
            losses["critic"] = flow.mse(v_c, flow.velocity_target(x0_d, eps_c))
        return losses, metrics

    return loss


def make_step(
    student_model: nn.Module,
    teacher_model: nn.Module,
    critic_model: nn.Module | None,
    optimizers: Mapping[str, Transform],
    config: DMD2Config | None = None,
    *,
    teacher_params: TensorDictBase | None = None,
    accumulate: int = 1,
    donate: bool = False,
    ema: float | None = None,
    skip_nonfinite: bool = False,
) -> TrainStep | EMAStep:
    """The DMD2 step: the critic updates every step, the student every ``generator_update_interval``.

    Args:
        student_model: the few-step generator's module.
        teacher_model: the frozen teacher's module.
        critic_model: the critic's module (``None``: the teacher's module, called
            with the critic's params).
        optimizers: ``{"student": Transform, "critic": Transform}``.
        config: hyperparameters (default :class:`DMD2Config`).
        teacher_params: the teacher's params (default: a copy of ``teacher_model``'s).
        accumulate: number of microbatches per step (same result for any value).
        donate: reuse the input state's buffers.
        ema: keep an EMA of the student's params with this decay in ``state["ema"]``.
        skip_nonfinite: skip steps with a non-finite loss or gradient.

    Example:
        >>> from purestep import optim
        >>> lin = nn.Linear(2, 2)
        >>> opts = {"student": optim.sgd(lr=0.1), "critic": optim.sgd(lr=0.1)}
        >>> make_step(lin, lin, None, opts, DMD2Config(generator_update_interval=3)).every
        {'student': 3}
    """
    cfg = config or DMD2Config()
    if set(optimizers) != set(_ROLES):
        raise KeyError(
            f"dmd2.make_step: optimizers must have exactly the roles {list(_ROLES)}, "
            f"got {sorted(optimizers)}"
        )
    return build_step(
        loss_fn(student_model, teacher_model, critic_model, cfg, teacher_params=teacher_params),
        optimizers,
        accumulate=accumulate,
        donate=donate,
        every={"student": cfg.generator_update_interval},
        ema=ema,
        ema_roles=("student",),
        skip_nonfinite=skip_nonfinite,
    )


def init_state(
    student: nn.Module | TensorDictBase,
    teacher: nn.Module | TensorDictBase,
    optimizers: Mapping[str, Transform],
    *,
    seed: int,
    critic: nn.Module | TensorDictBase | None = None,
) -> TensorDict:
    """The DMD2 state: ``student`` params, ``critic`` params (a copy of the teacher's by default).

    The student's (and an explicit critic's) trainable params are copied from a
    module (``requires_grad=True`` ones) or a TensorDict. Without ``critic`` the
    critic starts as a copy of *all* the teacher's params (a frozen teacher
    works). The teacher itself is not state. To start the student from the
    teacher too, pass the teacher (or a copy of its params) as ``student``.

    Example:
        >>> from purestep import optim
        >>> lin = nn.Linear(2, 2)
        >>> opts = {"student": optim.sgd(lr=0.1), "critic": optim.sgd(lr=0.1)}
        >>> s = init_state(lin, lin, opts, seed=0)
        >>> torch.equal(s["params", "critic", "weight"], lin.weight.detach())
        True
    """

    def copy(role: str, src: nn.Module | TensorDictBase, *, all_params: bool) -> TensorDictBase:
        if isinstance(src, nn.Module):
            return flow.frozen_params(src) if all_params else _state.params_of(role, src)
        return tree.clone(src.detach())

    critic_params = (
        copy("critic", teacher, all_params=True)
        if critic is None
        else copy("critic", critic, all_params=False)
    )
    return _state.init_state(
        {"student": copy("student", student, all_params=False), "critic": critic_params},
        optimizers,
        seed=seed,
    )
