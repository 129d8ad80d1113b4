"""Samplers: the Euler ODE sampler, the re-noising few-step sampler, and guided sampling."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
from tensordict import TensorDictBase
from torch import nn

from purestep import rng
from purestep.methods._flow_math import interpolate, noise_like
from purestep.methods._flow_models import Cond, guided_velocity

__all__ = ["VelocityFn", "euler_sample", "renoise_sample", "sample"]

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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
        >>> from purestep.methods.flow import timestep_schedule
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
