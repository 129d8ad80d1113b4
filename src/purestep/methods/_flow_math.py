"""Rectified-flow maths: interpolation, targets, conversions, timesteps (see :mod:`.flow`)."""

from __future__ import annotations

import enum
import math
from typing import Literal

import attrs
import torch

from purestep import rng
from purestep.methods import _validators as _v

__all__ = [
    "Purpose",
    "TimeLike",
    "TimestepDist",
    "eps_from_velocity",
    "eps_from_x0",
    "interpolate",
    "mse",
    "noise_like",
    "purpose_key",
    "sample_timesteps",
    "shift_timesteps",
    "timestep_schedule",
    "velocity_from_x0",
    "velocity_target",
    "x0_from_velocity",
]

TimeLike = torch.Tensor | float


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
    shift: float = attrs.field(default=1.0, validator=_v.positive)
    mean: float = attrs.field(default=0.0, validator=_v.finite)
    std: float = attrs.field(default=1.0, validator=_v.positive)
    low: float = attrs.field(default=0.0, validator=_v.unit)
    high: float = attrs.field(default=1.0, validator=_v.unit)

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
