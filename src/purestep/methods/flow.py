"""Rectified-flow maths shared by every method: interpolation, targets, timesteps, sampling.

Conventions (every method in :mod:`purestep.methods` follows them):

* ``t`` is in ``[0, 1]``: ``t = 0`` is data, ``t = 1`` is pure noise, and
  ``x_t = (1 - t) * x0 + t * eps``. The velocity is ``v = eps - x0``, so
  ``x0 = x_t - t * v`` and ``eps = x_t + (1 - t) * v``.
* A timestep tensor has shape ``[B]`` (or is 0-dim / a float) and broadcasts
  over the trailing dims of ``x`` (``t`` is viewed as ``[B, 1, ..., 1]``).
* A model is any ``nn.Module`` with ``forward(x_t, t, **cond) -> v`` that gets
  ``t`` as a float tensor ``[B]`` (times ``t_scale``, e.g. 1000 for models
  trained on integer-like timesteps).
* The Euler sampler integrates from ``t = 1`` down to ``0``:
  ``x_{t'} = x_t + (t' - t) * v(x_t, t)``.

Randomness. Every draw comes from :mod:`purestep.rng` with a key derived from
the step key by folding in a *purpose* constant (:class:`Purpose`), and with
``index=batch["index"]``, so each sample's noise and timestep depend only on its
global sample id: results do not depend on how a batch is cut.

Example:
    >>> import torch
    >>> from purestep import rng
    >>> from purestep.methods import flow
    >>> x0 = torch.zeros(4, 2)
    >>> eps = torch.ones(4, 2)
    >>> t = flow.sample_timesteps(rng.key(0), 4, index=torch.arange(4))
    >>> x_t = flow.interpolate(x0, eps, t)
    >>> torch.allclose(flow.x0_from_velocity(x_t, t, flow.velocity_target(x0, eps)), x0)
    True
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs
import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from purestep import rng, tree
from purestep.step import call

__all__ = [
    "Purpose",
    "TimestepDist",
    "VelocityFn",
    "batch_cond",
    "batch_index",
    "cfg",
    "condition_dropout",
    "eps_from_velocity",
    "eps_from_x0",
    "euler_sample",
    "frozen_params",
    "guided_velocity",
    "interpolate",
    "mse",
    "noise_like",
    "null_condition",
    "predict_velocity",
    "purpose_key",
    "renoise_sample",
    "sample",
    "sample_timesteps",
    "shift_timesteps",
    "timestep_schedule",
    "velocity_from_x0",
    "velocity_target",
    "x0_from_velocity",
]

TimeLike = torch.Tensor | float
VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Cond = Mapping[str, torch.Tensor]


class Purpose(enum.IntEnum):
    """Constants folded into a step key to derive the key of one kind of draw.

    ``rng.fold_in(step_key, Purpose.NOISE)`` is the key of the forward-process
    noise, and so on. Each value is the ASCII of its name read as a big-endian
    integer (``int.from_bytes(b"noise", "big")``), so they are distinct,
    stable and readable in a hex dump. Methods that need more purposes fold in
    further constants of their own the same way.
    """

    NOISE = int.from_bytes(b"noise", "big")
    TIMESTEP = int.from_bytes(b"timestep", "big")
    COND_DROP = int.from_bytes(b"conddrop", "big")
    ROLLOUT_NOISE = int.from_bytes(b"rollnois", "big")
    ROLLOUT_STEP = int.from_bytes(b"rollstep", "big")
    SCORE_NOISE = int.from_bytes(b"scornois", "big")
    SCORE_TIMESTEP = int.from_bytes(b"scortime", "big")
    CRITIC_NOISE = int.from_bytes(b"critnois", "big")
    CRITIC_TIMESTEP = int.from_bytes(b"crittime", "big")


def purpose_key(key: torch.Tensor, purpose: int) -> torch.Tensor:
    """The key of one purpose: ``rng.fold_in(key, purpose)``.

    Example:
        >>> from purestep import rng
        >>> k = purpose_key(rng.key(0), Purpose.NOISE)
        >>> torch.equal(k, rng.fold_in(rng.key(0), int(Purpose.NOISE)))
        True
    """
    return rng.fold_in(key, int(purpose))


# --------------------------------------------------------------------------- maths


def _bcast(t: TimeLike, x: torch.Tensor) -> torch.Tensor | float:
    """``t`` viewed as ``[B, 1, ..., 1]`` to broadcast over ``x`` (floats pass through)."""
    if not isinstance(t, torch.Tensor):
        return float(t)
    if t.dim() == 0:
        return t.to(x.dtype)
    if t.dim() != 1 or (x.dim() >= 1 and t.shape[0] not in (1, x.shape[0])):
        raise ValueError(
            f"timestep t must be 0-dim or of shape [B] with B = x.shape[0] = "
            f"{x.shape[0] if x.dim() else 'n/a'}; got shape {tuple(t.shape)}"
        )
    return t.to(x.dtype).reshape(t.shape[0], *([1] * (x.dim() - 1)))


def interpolate(x0: torch.Tensor, eps: torch.Tensor, t: TimeLike) -> torch.Tensor:
    """The forward process ``x_t = (1 - t) * x0 + t * eps``.

    Args:
        x0: clean data ``[B, ...]``.
        eps: noise of the same shape.
        t: a float, a 0-dim tensor or a ``[B]`` tensor in ``[0, 1]``.

    Example:
        >>> interpolate(torch.zeros(2, 3), torch.ones(2, 3), torch.tensor([0.0, 0.5]))[:, 0]
        tensor([0.0000, 0.5000])
    """
    if x0.shape != eps.shape:
        raise ValueError(f"interpolate: x0 has shape {tuple(x0.shape)}, eps {tuple(eps.shape)}")
    tb = _bcast(t, x0)
    return (1 - tb) * x0 + tb * eps  # exact at t = 0 and t = 1


def velocity_target(x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """The flow-matching target ``v = eps - x0`` (``d x_t / d t``).

    Example:
        >>> velocity_target(torch.zeros(1, 2), torch.ones(1, 2))
        tensor([[1., 1.]])
    """
    return eps - x0


def x0_from_velocity(x_t: torch.Tensor, t: TimeLike, v: torch.Tensor) -> torch.Tensor:
    """Clean data predicted from a velocity: ``x0 = x_t - t * v``.

    Example:
        >>> x0_from_velocity(torch.ones(1, 2), torch.tensor([1.0]), torch.ones(1, 2))
        tensor([[0., 0.]])
    """
    return x_t - _bcast(t, x_t) * v


def eps_from_velocity(x_t: torch.Tensor, t: TimeLike, v: torch.Tensor) -> torch.Tensor:
    """Noise predicted from a velocity: ``eps = x_t + (1 - t) * v``.

    Example:
        >>> eps_from_velocity(torch.zeros(1, 2), torch.tensor([0.0]), torch.ones(1, 2))
        tensor([[1., 1.]])
    """
    return x_t + (1 - _bcast(t, x_t)) * v


def _safe_t(t: TimeLike, x: torch.Tensor, min_t: float) -> torch.Tensor | float:
    tb = _bcast(t, x)
    if isinstance(tb, torch.Tensor):
        return tb.clamp_min(min_t)
    return max(tb, min_t)


def eps_from_x0(
    x_t: torch.Tensor, x0: torch.Tensor, t: TimeLike, *, min_t: float = 1e-4
) -> torch.Tensor:
    """Noise from a noisy sample and its clean data: ``eps = (x_t - (1 - t) * x0) / t``.

    ``eps`` is undetermined at ``t = 0`` (``x_t = x0``): ``t`` is clamped below at
    ``min_t`` in the division, so the result stays finite there.

    Example:
        >>> eps_from_x0(torch.full((1, 2), 0.5), torch.zeros(1, 2), torch.tensor([0.5]))
        tensor([[1., 1.]])
    """
    tb = _bcast(t, x_t)
    return (x_t - (1 - tb) * x0) / _safe_t(t, x_t, min_t)


def velocity_from_x0(
    x_t: torch.Tensor, x0: torch.Tensor, t: TimeLike, *, min_t: float = 1e-4
) -> torch.Tensor:
    """Velocity from a noisy sample and its clean data: ``v = (x_t - x0) / t`` (``t >= min_t``).

    Example:
        >>> velocity_from_x0(torch.ones(1, 2), torch.zeros(1, 2), torch.tensor([1.0]))
        tensor([[1., 1.]])
    """
    return (x_t - x0) / _safe_t(t, x_t, min_t)


def mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Mean squared error over all elements (so a per-sample mean, then a batch mean).

    Example:
        >>> mse(torch.zeros(2, 2), torch.ones(2, 2))
        tensor(1.)
    """
    return (a - b).square().mean()


def noise_like(key: torch.Tensor, x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """Standard normal noise shaped like ``x``; row ``i`` drawn from ``rng.fold_in(key, index[i])``.

    Example:
        >>> from purestep import rng
        >>> a = noise_like(rng.key(0), torch.zeros(3, 2), torch.arange(3))
        >>> torch.equal(a[1:], noise_like(rng.key(0), torch.zeros(2, 2), torch.arange(1, 3)))
        True
    """
    return rng.normal(key, tuple(x.shape), index=index, dtype=x.dtype, device=x.device)


# --------------------------------------------------------------------------- timesteps


def shift_timesteps(t: torch.Tensor, shift: float) -> torch.Tensor:
    """The usual timestep shift ``shift * t / (1 + (shift - 1) * t)``.

    Monotone increasing in ``t`` for ``shift > 0``, with ``0 -> 0`` and ``1 -> 1``;
    ``shift > 1`` moves timesteps towards noise.

    Example:
        >>> shift_timesteps(torch.tensor([0.0, 0.5, 1.0]), 3.0)
        tensor([0.0000, 0.7500, 1.0000])
    """
    if not (isinstance(shift, int | float) and math.isfinite(shift) and shift > 0):
        raise ValueError(f"shift_timesteps: shift must be a finite float > 0, got {shift!r}")
    if shift == 1.0:
        return t
    return (shift * t / (1 + (shift - 1) * t)).clamp(0.0, 1.0)  # rounding stays in [0, 1]


def sample_timesteps(
    key: torch.Tensor,
    batch_size: int,
    *,
    kind: Literal["uniform", "logit_normal"] = "uniform",
    shift: float = 1.0,
    mean: float = 0.0,
    std: float = 1.0,
    low: float = 0.0,
    high: float = 1.0,
    index: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Draw ``batch_size`` timesteps in ``[low, high]``, one per sample.

    ``u`` is uniform in ``[0, 1)`` (``kind="uniform"``) or ``sigmoid(N(mean,
    std))`` (``kind="logit_normal"``); then ``t = shift_timesteps(low + (high -
    low) * u, shift)`` (so ``low``/``high`` bound ``t`` before the shift, as the
    min/max timestep ratios of DMD2 do). With ``index`` (global sample ids)
    sample ``i`` draws from ``rng.fold_in(key, index[i])``: its timestep does not
    depend on which batch it is in.

    Args:
        key: a 0-dim int64 key (fold in :attr:`Purpose.TIMESTEP` first).
        batch_size: ``B``.
        kind: ``"uniform"`` or ``"logit_normal"``.
        shift: timestep shift (``1.0``: none).
        mean: logit-normal mean.
        std: logit-normal std.
        low: lower bound of ``t`` before the shift.
        high: upper bound of ``t`` before the shift.
        index: int64 ``[B]`` sample ids; without it the ``B`` values are one draw
            from ``key`` (so they depend on ``B``).
        device: where to draw; default ``index``'s device, else ``key``'s.
        dtype: result dtype.

    Example:
        >>> from purestep import rng
        >>> t = sample_timesteps(rng.key(0), 8, kind="logit_normal", index=torch.arange(8))
        >>> t.shape, bool(((t >= 0) & (t <= 1)).all())
        (torch.Size([8]), True)
    """
    if kind == "uniform":
        u = rng.uniform(key, (batch_size,), index=index, device=device, dtype=torch.float64)
    elif kind == "logit_normal":
        z = rng.normal(
            key, (batch_size,), mean=mean, std=std, index=index, device=device, dtype=torch.float64
        )
        u = torch.sigmoid(z)
    else:
        raise ValueError(
            f"sample_timesteps: kind must be 'uniform' or 'logit_normal', got {kind!r}"
        )
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(
            f"sample_timesteps: need 0 <= low <= high <= 1, got low={low}, high={high}"
        )
    t = low + (high - low) * u
    return shift_timesteps(t, shift).to(dtype)


def _unit(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (isinstance(value, int | float) and 0.0 <= value <= 1.0):
        raise ValueError(f"{attribute.name} must be a float in [0, 1], got {value!r}")


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a finite float > 0, got {value!r}")


def _finite(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value)):
        raise ValueError(f"{attribute.name} must be a finite float, got {value!r}")


@attrs.frozen
class TimestepDist:
    """A timestep distribution for training: the arguments of :func:`sample_timesteps`.

    Attributes:
        kind: ``"uniform"`` or ``"logit_normal"``.
        shift: timestep shift applied last (``1.0``: none).
        mean: logit-normal mean.
        std: logit-normal std (``> 0``).
        low: lower bound of ``t`` before the shift (a min timestep ratio).
        high: upper bound of ``t`` before the shift (a max timestep ratio).

    Example:
        >>> from purestep import rng
        >>> d = TimestepDist(low=0.02, high=0.98)
        >>> t = d.sample(rng.key(0), 4)
        >>> bool(((t >= 0.02) & (t <= 0.98)).all())
        True
    """

    kind: Literal["uniform", "logit_normal"] = attrs.field(
        default="uniform", validator=attrs.validators.in_(("uniform", "logit_normal"))
    )
    shift: float = attrs.field(default=1.0, validator=_positive)
    mean: float = attrs.field(default=0.0, validator=_finite)
    std: float = attrs.field(default=1.0, validator=_positive)
    low: float = attrs.field(default=0.0, validator=_unit)
    high: float = attrs.field(default=1.0, validator=_unit)

    def __attrs_post_init__(self) -> None:
        if self.low > self.high:
            raise ValueError(f"TimestepDist: low={self.low} must be <= high={self.high}")

    def sample(
        self,
        key: torch.Tensor,
        batch_size: int,
        *,
        index: torch.Tensor | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """Draw ``[batch_size]`` timesteps (see :func:`sample_timesteps`)."""
        return sample_timesteps(
            key,
            batch_size,
            kind=self.kind,
            shift=self.shift,
            mean=self.mean,
            std=self.std,
            low=self.low,
            high=self.high,
            index=index,
            device=device,
            dtype=dtype,
        )


def timestep_schedule(num_steps: int, *, shift: float = 1.0) -> torch.Tensor:
    """Sampling timesteps from ``1.0`` down to ``0.0``: ``num_steps + 1`` float64 values.

    Evenly spaced, then shifted with :func:`shift_timesteps` (endpoints stay fixed).

    Example:
        >>> timestep_schedule(4)
        tensor([1.0000, 0.7500, 0.5000, 0.2500, 0.0000], dtype=torch.float64)
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"timestep_schedule: num_steps must be an int >= 1, got {num_steps!r}")
    t = shift_timesteps(torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64), shift)
    t[0], t[-1] = 1.0, 0.0  # exact endpoints whatever the rounding of the shift
    return t


def _as_steps(steps: Sequence[float] | torch.Tensor, who: str) -> list[float]:
    vals = [float(s) for s in (steps.tolist() if isinstance(steps, torch.Tensor) else steps)]
    if len(vals) < 2:
        raise ValueError(f"{who}: steps needs at least 2 timesteps (start and end), got {vals}")
    for a, b in itertools.pairwise(vals):
        if not b < a:
            raise ValueError(f"{who}: steps must be strictly decreasing, got {vals}")
    if not (vals[-1] >= 0.0 and vals[0] <= 1.0):
        raise ValueError(f"{who}: steps must lie in [0, 1], got {vals}")
    return vals


def euler_sample(
    velocity_fn: VelocityFn,
    noise: torch.Tensor,
    steps: Sequence[float] | torch.Tensor,
    *,
    return_trajectory: bool = False,
    enable_grad: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Integrate ``dx/dt = v(x, t)`` with Euler steps along ``steps`` (decreasing, usually 1 -> 0).

    ``x_{t'} = x_t + (t' - t) * velocity_fn(x_t, t)`` where ``t`` is passed as a
    ``[B]`` tensor in ``noise``'s dtype. Runs under ``torch.no_grad()`` unless
    ``enable_grad=True``. Few-step students use the same sampler with a short
    step list (e.g. ``[1.0, 0.0]`` for one step).

    Args:
        velocity_fn: ``(x_t, t) -> v``.
        noise: the start ``x_{steps[0]}``, shape ``[B, ...]``.
        steps: strictly decreasing timesteps in ``[0, 1]`` (at least 2).
        return_trajectory: also return the states at every step, stacked as
            ``[len(steps), B, ...]`` (the first is ``noise``, the last the result).
        enable_grad: build an autograd graph through the sampler.

    Returns:
        ``x`` at ``steps[-1]``, or ``(x, trajectory)``.

    Example:
        >>> x = euler_sample(lambda x, t: torch.ones_like(x), torch.ones(2, 2), [1.0, 0.0])
        >>> x
        tensor([[0., 0.],
                [0., 0.]])
    """
    ts = _as_steps(steps, "euler_sample")
    b = noise.shape[0]
    traj: list[torch.Tensor] = [noise]
    with torch.set_grad_enabled(enable_grad):
        x = noise
        for t_cur, t_next in itertools.pairwise(ts):
            t = torch.full((b,), t_cur, dtype=noise.dtype, device=noise.device)
            v = velocity_fn(x, t)
            x = x + (t_next - t_cur) * v
            if return_trajectory:
                traj.append(x)
    if return_trajectory:
        return x, torch.stack(traj)
    return x


def renoise_sample(
    velocity_fn: VelocityFn,
    noise: torch.Tensor,
    steps: Sequence[float] | torch.Tensor,
    *,
    key: torch.Tensor,
    index: torch.Tensor | None = None,
    return_trajectory: bool = False,
    enable_grad: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The few-step sampler of distilled students: predict ``x0``, re-noise with fresh noise.

    At each ``t = steps[i]``: ``x0 = x_t - t * velocity_fn(x_t, t)``, then
    ``x_{t'} = (1 - t') * x0 + t' * eps_i`` with fresh noise ``eps_i`` drawn from
    ``rng.fold_in(key, i + 1)`` per sample (``index``, default ``arange(B)``).
    Unlike :func:`euler_sample`, the states ``x_{t'}`` follow the forward
    process's marginals when the ``x0`` predictions are right, which is what a
    student trained on data-noised or teacher-ODE states (DMD2, KD) expects. A
    single step ``[1.0, 0.0]`` equals one Euler step. No grad unless
    ``enable_grad=True``.

    Args:
        velocity_fn: ``(x_t, t) -> v``.
        noise: the start ``x_{steps[0]}``, shape ``[B, ...]``.
        steps: strictly decreasing timesteps in ``[0, 1]`` (at least 2).
        key: the key of the re-noising draws.
        index: int64 ``[B]`` sample ids.
        return_trajectory: also return the states ``[len(steps), B, ...]``.
        enable_grad: build an autograd graph through the sampler.

    Example:
        >>> from purestep import rng
        >>> target = torch.tensor([[2.0, -1.0]])
        >>> x0_to_v = lambda x, t: (x - target) / t[:, None]  # always predicts x0 = target
        >>> x = renoise_sample(x0_to_v, torch.zeros(3, 2), [1.0, 0.5, 0.0], key=rng.key(0))
        >>> torch.allclose(x, target.expand(3, 2))
        True
    """
    ts = _as_steps(steps, "renoise_sample")
    b = noise.shape[0]
    idx = torch.arange(b, dtype=torch.int64, device=noise.device) if index is None else index
    traj: list[torch.Tensor] = [noise]
    with torch.set_grad_enabled(enable_grad):
        x = noise
        for i, (t_cur, t_next) in enumerate(itertools.pairwise(ts)):
            t = torch.full((b,), t_cur, dtype=noise.dtype, device=noise.device)
            x0 = x - t_cur * velocity_fn(x, t)
            if t_next > 0.0:
                x = interpolate(x0, noise_like(rng.fold_in(key, i + 1), x0, idx), t_next)
            else:
                x = x0
            if return_trajectory:
                traj.append(x)
    if return_trajectory:
        return x, torch.stack(traj)
    return x


# --------------------------------------------------------------------------- models


def predict_velocity(
    model: nn.Module,
    params: TensorDictBase | None,
    x_t: torch.Tensor,
    t: torch.Tensor,
    cond: Cond | None = None,
    *,
    t_scale: float = 1.0,
) -> torch.Tensor:
    """``model(x_t, t * t_scale, **cond)`` with ``params`` (``None``: the module's own).

    Example:
        >>> class Zero(nn.Module):
        ...     def forward(self, x, t):
        ...         return torch.zeros_like(x)
        >>> predict_velocity(Zero(), None, torch.ones(2, 3), torch.ones(2)).shape
        torch.Size([2, 3])
    """
    tt = t * t_scale if t_scale != 1.0 else t
    kwargs = dict(cond or {})
    out = model(x_t, tt, **kwargs) if params is None else call(model, params, x_t, tt, **kwargs)
    if not isinstance(out, torch.Tensor) or out.shape != x_t.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"{type(model).__name__}.forward must return a velocity shaped like x_t "
            f"{tuple(x_t.shape)}; got {got}"
        )
    return out


def cfg(uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance: ``uncond + scale * (cond - uncond)``.

    ``scale = 1`` gives ``cond``; ``scale = 0`` gives ``uncond``.

    Example:
        >>> cfg(torch.zeros(1), torch.ones(1), 3.0)
        tensor([3.])
    """
    return uncond + scale * (cond - uncond)


def null_condition(cond: Cond, null: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The null condition for a batch: each ``cond[k]`` replaced by ``null[k]`` broadcast to it.

    Args:
        cond: ``{name: [B, ...] tensor}``.
        null: ``{name: value}``, a scalar or a tensor of one sample's shape, for
            every key of ``cond``.

    Example:
        >>> null_condition({"label": torch.tensor([3, 5])}, {"label": 10})
        {'label': tensor([10, 10])}
    """
    out: dict[str, torch.Tensor] = {}
    for k, v in cond.items():
        if k not in null:
            raise KeyError(
                f"null_condition: no null value for condition {k!r} (have {sorted(null)})"
            )
        value = null[k]
        if isinstance(value, torch.Tensor):
            n = value.to(dtype=v.dtype, device=v.device)
        else:  # a fill on the device: a host value copied to a GPU would synchronise it
            n = torch.full((), value, dtype=v.dtype, device=v.device)
        out[k] = n.expand_as(v).clone() if n.shape != v.shape else n.clone()
    return out


def guided_velocity(
    model: nn.Module,
    params: TensorDictBase | None,
    x_t: torch.Tensor,
    t: torch.Tensor,
    cond: Cond | None,
    null_cond: Cond | None,
    scale: float,
    *,
    t_scale: float = 1.0,
) -> torch.Tensor:
    """The classifier-free-guided velocity ``cfg(v(x_t, t, null_cond), v(x_t, t, cond), scale)``.

    Both branches run in one batched forward (inputs concatenated along dim 0).
    With no condition, no null condition or ``scale == 1`` it is one plain call.

    Example:
        >>> class Lin(nn.Module):
        ...     def forward(self, x, t, c):
        ...         return x * c[:, None]
        >>> v = guided_velocity(Lin(), None, torch.ones(2, 1), torch.ones(2),
        ...                     {"c": torch.ones(2)}, {"c": torch.zeros(2)}, 2.0)
        >>> v
        tensor([[2.],
                [2.]])
    """
    if not cond or null_cond is None or scale == 1.0:
        return predict_velocity(model, params, x_t, t, cond, t_scale=t_scale)
    if set(cond) != set(null_cond):
        raise KeyError(
            f"guided_velocity: cond has keys {sorted(cond)} but null_cond {sorted(null_cond)}"
        )
    b = x_t.shape[0]
    both = {k: torch.cat([null_cond[k], cond[k]]) for k in cond}
    v = predict_velocity(
        model, params, torch.cat([x_t, x_t]), torch.cat([t, t]), both, t_scale=t_scale
    )
    return cfg(v[:b], v[b:], scale)


def sample(
    model: nn.Module,
    params: TensorDictBase | None,
    noise: torch.Tensor,
    steps: Sequence[float] | torch.Tensor,
    *,
    cond: Cond | None = None,
    null_cond: Cond | None = None,
    guidance_scale: float = 1.0,
    t_scale: float = 1.0,
    return_trajectory: bool = False,
    renoise_key: torch.Tensor | None = None,
    index: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Generate from ``model``'s (guided) velocity along ``steps``, without grad.

    Uses :func:`euler_sample` (teachers, ODE sampling), or
    :func:`renoise_sample` with ``renoise_key`` (and ``index``) for few-step
    students trained by DMD2 or KD.

    Example:
        >>> class Drift(nn.Module):
        ...     def forward(self, x, t):
        ...         return torch.ones_like(x)
        >>> sample(Drift(), None, torch.ones(3, 2), timestep_schedule(4)).abs().max()
        tensor(0.)
    """

    def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return guided_velocity(
            model, params, x, t, cond, null_cond, guidance_scale, t_scale=t_scale
        )

    if renoise_key is not None:
        return renoise_sample(
            velocity,
            noise,
            steps,
            key=renoise_key,
            index=index,
            return_trajectory=return_trajectory,
        )
    return euler_sample(velocity, noise, steps, return_trajectory=return_trajectory)


def frozen_params(module: nn.Module) -> TensorDict:
    """A detached copy of *all* of ``module``'s parameters (trainable or not), nested by module path.

    Use it for frozen roles (a teacher) that the loss function captures, and to
    initialise a role from another (DMD2's critic from the teacher).

    Example:
        >>> sorted(frozen_params(nn.Linear(2, 2).requires_grad_(False)).keys())
        ['bias', 'weight']
    """
    items = [(tuple(n.split(".")), p.detach().clone()) for n, p in module.named_parameters()]
    if not items:
        raise ValueError(f"frozen_params: {type(module).__name__} has no parameters")
    return tree.unflatten(items)


def batch_index(batch: TensorDictBase) -> torch.Tensor:
    """``batch["index"]`` (global sample ids), or ``arange(B)`` on the batch's device when it has none.

    Example:
        >>> batch_index(TensorDict({"x": torch.zeros(3)}, [3]))
        tensor([0, 1, 2])
    """
    if "index" in batch.keys():
        idx: torch.Tensor = batch.get("index")
        return idx
    leaves = tree.leaves(batch)
    b = int(batch.batch_size[0]) if batch.batch_dims else leaves[0].shape[0]
    device = batch.device or (leaves[0].device if leaves else None)
    return torch.arange(b, dtype=torch.int64, device=device)  # on the batch's device


def batch_cond(batch: TensorDictBase, keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """The model's conditioning kwargs ``{k: batch[k]}`` for ``keys``, with a clear error if missing.

    Example:
        >>> batch_cond(TensorDict({"label": torch.tensor([1, 2])}, [2]), ["label"])
        {'label': tensor([1, 2])}
    """
    missing = [k for k in keys if k not in batch.keys()]
    if missing:
        raise KeyError(
            f"batch has no conditioning key(s) {missing} (batch keys: {sorted(batch.keys())})"
        )
    return {k: batch.get(k) for k in keys}


def condition_dropout(
    key: torch.Tensor,
    cond: Cond,
    null: Mapping[str, Any],
    p: float,
    *,
    index: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Replace each sample's condition by the null condition with probability ``p`` (per sample).

    Sample ``i`` is dropped when ``rng.bernoulli(fold_in(key, index[i]), p)``;
    all keys of one sample are dropped together. Trains the unconditional branch
    that :func:`cfg` needs.

    Example:
        >>> from purestep import rng
        >>> c = condition_dropout(rng.key(0), {"label": torch.tensor([3, 5])}, {"label": 10}, 1.0,
        ...                       index=torch.arange(2))
        >>> c["label"]
        tensor([10, 10])
    """
    if not cond or p == 0.0:
        return dict(cond)
    nulls = null_condition(cond, null)
    any_v = next(iter(cond.values()))
    b = any_v.shape[0]
    drop = rng.bernoulli(key, p, (b,), dtype=torch.bool, index=index, device=any_v.device)
    out: dict[str, torch.Tensor] = {}
    for k, v in cond.items():
        mask = drop.reshape(b, *([1] * (v.dim() - 1)))
        out[k] = torch.where(mask, nulls[k], v)
    return out
