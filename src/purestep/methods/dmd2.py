"""Distribution-matching distillation (DMD2) of a flow teacher into a few-step student.

Roles:

* ``student`` (trainable): the few-step generator. It predicts clean samples
  ``x0 = x_t - t * v`` at the timesteps in ``config.student_steps``.
* ``teacher`` (frozen, *not* state): the real score, with classifier-free
  guidance ``config.guidance_scale``. Its params are constants captured by the
  loss function.
* ``critic`` (trainable): the fake score, usually initialised from the
  teacher's weights (:func:`init_state`) and trained by flow matching on the
  student's samples.
* ``gan_head`` (trainable, optional): DMD2's classification branch on the
  critic's features (``DMD2Config(gan=GANConfig(...))``, see
  :mod:`._dmd2_extras`); ``DMD2Config(regression_weight=...)`` adds DMD's
  paired regression loss to the student's.

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
    >>> import purestep as ps
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
    >>> teacher_params = ps.export.module_variables(teacher)  # the frozen teacher's weights
    >>> step = dmd2.make_step(student=student, teacher=teacher, teacher_params=teacher_params,
    ...                       optimizers=opts, config=cfg)
    >>> state = dmd2.init_state(student=student, critic=teacher, optimizers=opts, seed=0)
    >>> state, metrics = step(state, {"x0": torch.zeros(8, 2)})
    >>> sorted(metrics["student"].keys())
    ['dmd_g_abs', 'grad_norm', 'loss', 'lr', 'x0_sq']
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
from purestep.methods._dmd2_extras import GANConfig, gan_losses, regression
from purestep.methods.flow import Purpose, TimestepDist
from purestep.optim import Transform
from purestep.step import EMAStep, LossFn, TrainStep, live_roles

__all__ = ["DMD2Config", "GANConfig", "init_state", "loss_fn", "make_step", "student_sample"]

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
        regression_weight: weight of DMD's paired regression loss (``0``: off;
            see :mod:`._dmd2_extras`): the student's one-step prediction from
            ``batch[regression_keys[0]]`` (noise) regresses onto
            ``batch[regression_keys[1]]`` (the teacher's ODE output from it).
        regression_keys: the batch keys ``(noise, teacher output)``.
        gan: the GAN head on the critic's features (:class:`GANConfig`;
            ``None``: off). Adds the role ``gan_head`` (its module is
            ``make_step(gan_head=...)``, with an optimizer of its own).

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
    regression_weight: float = attrs.field(default=0.0, validator=_v.non_negative)
    regression_keys: tuple[str, str] = attrs.field(
        default=("reg_noise", "reg_x0"), converter=tuple, validator=_v.keys
    )
    gan: GANConfig | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(GANConfig))
    )

    @property
    def roles(self) -> tuple[str, ...]:
        """The trainable roles: ``("student", "critic")``, plus ``"gan_head"`` with ``gan``."""
        return (*_ROLES, "gan_head") if self.gan is not None else _ROLES

    def __attrs_post_init__(self) -> None:
        if self.regression_weight > 0 and self.student_steps[0] != 1.0:
            raise ValueError(
                "DMD2Config.regression_weight > 0 needs student_steps[0] == 1.0 (the regression "
                f"maps pure noise to the teacher's output), got {self.student_steps!r}"
            )
        if len(self.regression_keys) != 2:
            raise ValueError(
                f"DMD2Config.regression_keys must be (noise key, target key), got "
                f"{self.regression_keys!r}"
            )
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
    *,
    student: nn.Module,
    teacher: nn.Module,
    teacher_params: TensorDictBase,
    critic: nn.Module | None = None,
    gan_head: nn.Module | None = None,
    config: DMD2Config | None = None,
) -> LossFn:
    """The DMD2 loss ``loss_fn(params, batch, key) -> ({"student": ..., "critic": ...}, metrics)``.

    ``params`` holds the trainable roles (``student``, ``critic``, and
    ``gan_head`` with ``config.gan``). The teacher is frozen: it runs
    ``teacher`` with ``teacher_params`` (required: a module's own weights may
    be its untrained initial ones; see :mod:`purestep.export`). The critic runs
    on ``critic`` (default: the teacher's module, called with the critic's
    params). The student's work is skipped on steps where it is not live
    (:func:`purestep.live_roles`).

    Metrics: ``(role, "loss")`` (added by :func:`purestep.value_and_grad`),
    ``("student", "dmd_g_abs")`` (mean ``|g|``, on student steps),
    ``("student", "x0_sq")`` (mean square of the student's samples),
    ``("student", "regression")`` with ``regression_weight`` and the GAN
    metrics with ``gan``; all batch means, so they combine exactly under
    accumulation.

    Example:
        >>> from tensordict import TensorDict
        >>> lin = nn.Linear(2, 2)
        >>> f = loss_fn(student=lin, teacher=lin, teacher_params=TensorDict.from_module(lin))
        >>> callable(f)
        True
    """
    cfg = config or DMD2Config()
    if not isinstance(teacher_params, TensorDictBase):
        raise TypeError(
            "dmd2: teacher_params must be the frozen teacher's params as a TensorDict "
            "(e.g. purestep.variables(teacher_state, 'student', ema=True) after training it, or "
            f"purestep.export.module_variables(pretrained_module)); got {type(teacher_params).__name__}"
        )
    if (cfg.gan is None) != (gan_head is None):
        raise ValueError(
            "dmd2: DMD2Config.gan and the gan_head module go together (got "
            f"gan={cfg.gan!r}, gan_head={type(gan_head).__name__})"
        )
    critic_model = teacher if critic is None else critic
    t_params = teacher_params.detach()
    roles = cfg.roles

    def loss(
        params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        for role in roles:
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
            x0_s = student_sample(student, s_params, x_like, key, idx, cfg, cond, data=x_like)
        losses: dict[str, torch.Tensor] = {}
        s_metrics: dict[str, torch.Tensor] = {"x0_sq": x0_s.detach().square().mean()}
        metrics: dict[str, Any] = {"student": s_metrics}
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
                    teacher, t_params, x_t, t, cond, null, cfg.guidance_scale, t_scale=cfg.t_scale
                )
                v_fake = flow.predict_velocity(
                    critic_model, params.get("critic").detach(), x_t, t, cond, t_scale=cfg.t_scale
                )
                x0_real = flow.x0_from_velocity(x_t, t, v_real)
                x0_fake = flow.x0_from_velocity(x_t, t, v_fake)
                g = (x0_fake - x0_real) / _per_sample_mean_abs(x0_s.detach() - x0_real)
                g = torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0)
            losses["student"] = 0.5 * flow.mse(x0_s, (x0_s - g).detach())
            s_metrics["dmd_g_abs"] = g.abs().mean()
            if cfg.regression_weight > 0:
                reg = regression(
                    student, s_params, batch, cfg.regression_keys, cond, t_scale=cfg.t_scale
                )
                losses["student"] = losses["student"] + cfg.regression_weight * reg
                s_metrics["regression"] = reg.detach()
        if critic_live:
            x0_d = x0_s.detach()
            t_c = cfg.critic_timesteps.sample(
                flow.purpose_key(key, Purpose.CRITIC_TIMESTEP), b, index=idx, device=dev, dtype=dt
            )
            eps_c = flow.noise_like(flow.purpose_key(key, Purpose.CRITIC_NOISE), x_like, idx)
            x_t_c = flow.interpolate(x0_d, eps_c, t_c)
            v_c = flow.predict_velocity(
                critic_model, params.get("critic"), x_t_c, t_c, cond, t_scale=cfg.t_scale
            )
            losses["critic"] = flow.mse(v_c, flow.velocity_target(x0_d, eps_c))
        if cfg.gan is not None and gan_head is not None:
            g_losses, g_metrics = gan_losses(
                cfg.gan,
                critic_model,
                gan_head,
                params,
                x0_s,
                x_like,
                cond,
                key,
                idx,
                student_live=student_live,
                critic_live=critic_live,
                t_scale=cfg.t_scale,
            )
            for role, value in g_losses.items():
                losses[role] = losses[role] + value if role in losses else value
            for role, ms in g_metrics.items():
                metrics.setdefault(role, {}).update(ms)
        return losses, metrics

    return loss


def make_step(
    *,
    student: nn.Module,
    teacher: nn.Module,
    teacher_params: TensorDictBase,
    optimizers: Mapping[str, Transform],
    critic: nn.Module | None = None,
    gan_head: nn.Module | None = None,
    config: DMD2Config | None = None,
    accumulate: int = 1,
    donate: bool = False,
    ema: float | None = None,
    ema_start_step: int = 0,
    ema_on_update: bool | None = None,
    skip_nonfinite: bool = False,
) -> TrainStep | EMAStep:
    """The DMD2 step: the critic updates every step, the student every ``generator_update_interval``.

    Every argument is keyword-only (no positional ``None`` for a role).

    Cadence: the student's optimizer ``count`` advances once per *student
    update*, so a learning-rate schedule of the student counts its updates,
    not the method's steps: with ``generator_update_interval=3``,
    ``cosine_decay(lr, 1500)`` ends after 1500 student updates (4500 steps).
    Size it in method steps with ``optim.schedules.in_steps(cosine_decay(lr,
    4500), every=3)``. The student's EMA (``ema``) moves on the student's
    updates only (``ema_on_update``, default), so ``ema`` is a decay per
    student update.

    Args:
        student: the few-step generator's module.
        teacher: the frozen teacher's module.
        teacher_params: the frozen teacher's params (and buffers), required:
            ``purestep.variables(teacher_state, "student", ema=True)`` after
            training it with :mod:`~purestep.methods.finetune`, or
            ``purestep.export.module_variables(teacher)`` for a module loaded
            with pretrained weights. (The module's own weights are never
            used: after training they are still the initial ones.)
        optimizers: ``{"student": Transform, "critic": Transform}`` (and
            ``"gan_head"`` with ``config.gan``).
        critic: the critic's module (``None``: the teacher's module, called
            with the critic's params).
        gan_head: the GAN head's module (with ``config.gan``): critic features
            ``-> [B]`` logits.
        config: hyperparameters (default :class:`DMD2Config`).
        accumulate: number of microbatches per step (same result for any value).
        donate: reuse the input state's buffers.
        ema: keep an EMA of the student's params with this decay in ``state["ema"]``.
        ema_start_step: the EMA starts averaging at this method step (a copy
            of the params before it).
        ema_on_update: average on student updates only (``None``: yes when
            ``generator_update_interval > 1``); ``False``: after every step.
        skip_nonfinite: skip steps with a non-finite loss or gradient.

    Example:
        >>> from tensordict import TensorDict
        >>> from purestep import optim
        >>> lin = nn.Linear(2, 2)
        >>> opts = {"student": optim.sgd(lr=0.1), "critic": optim.sgd(lr=0.1)}
        >>> make_step(student=lin, teacher=lin, teacher_params=TensorDict.from_module(lin),
        ...           optimizers=opts, config=DMD2Config(generator_update_interval=3)).every
        {'student': 3}
    """
    cfg = config or DMD2Config()
    if set(optimizers) != set(cfg.roles):
        raise KeyError(
            f"dmd2.make_step: optimizers must have exactly the roles {list(cfg.roles)}, "
            f"got {sorted(optimizers)}"
        )
    return build_step(
        loss_fn(
            student=student,
            teacher=teacher,
            teacher_params=teacher_params,
            critic=critic,
            gan_head=gan_head,
            config=cfg,
        ),
        optimizers,
        accumulate=accumulate,
        donate=donate,
        every={"student": cfg.generator_update_interval},
        ema=ema,
        ema_roles=("student",),
        ema_start_step=ema_start_step,
        ema_on_update=ema_on_update,
        skip_nonfinite=skip_nonfinite,
    )


def init_state(
    *,
    student: nn.Module | TensorDictBase,
    critic: nn.Module | TensorDictBase,
    optimizers: Mapping[str, Transform],
    seed: int,
    gan_head: nn.Module | TensorDictBase | None = None,
) -> TensorDict:
    """The DMD2 state: ``student`` and ``critic`` (and ``gan_head``) params, optimizer states, key.

    Each role is copied from a module (its trainable params, and its
    persistent buffers into ``state["buffers", role]``) or from a TensorDict of
    trainable params. Both are explicit: to start the student and the critic
    from a trained teacher, load its weights into the module first
    (``purestep.export.load_params(teacher, teacher_vars)``) and pass it as
    both. The teacher itself is not state.

    Example:
        >>> from purestep import optim
        >>> lin = nn.Linear(2, 2)
        >>> opts = {"student": optim.sgd(lr=0.1), "critic": optim.sgd(lr=0.1)}
        >>> s = init_state(student=lin, critic=lin, optimizers=opts, seed=0)
        >>> torch.equal(s["params", "critic", "weight"], lin.weight.detach())
        True
    """
    sources: dict[str, nn.Module | TensorDictBase] = {"student": student, "critic": critic}
    if gan_head is not None:
        sources["gan_head"] = gan_head
    params = {
        role: tree.clone(src.detach()) if isinstance(src, TensorDictBase) else src
        for role, src in sources.items()
    }
    return _state.init_state(params, optimizers, seed=seed)
