"""Rectified-flow maths shared by every method: interpolation, targets, timesteps, sampling.

Conventions (every method in :mod:`purestep.methods` follows them):

* ``t`` is in ``[0, 1]``: ``t = 0`` is data, ``t = 1`` is pure noise, and
  ``x_t = (1 - t) * x0 + t * eps``. The velocity is ``v = eps - x0``, so
  ``x0 = x_t - t * v`` and ``eps = x_t + (1 - t) * v``.
* A timestep tensor has shape ``[B]`` (or is 0-dim / a float) and broadcasts
  over the trailing dims of ``x`` (``t`` is viewed as ``[B, 1, ..., 1]``).
* A model is any ``nn.Module`` with ``forward(x_t, t, **cond) -> v`` that gets
  ``t`` as a float tensor ``[B]`` (times ``t_scale``, e.g. 1000 for models
  trained on integer-like timesteps). :func:`adapt` wraps a model with another
  signature (diffusers': ``timestep`` in ``[0, 1000]``, ``class_labels=``, an
  output object), carrying the scale so every sampler uses it.
* The Euler sampler integrates from ``t = 1`` down to ``0``:
  ``x_{t'} = x_t + (t' - t) * v(x_t, t)``.

Layout. This module is the public face; the code lives in private modules, one
concept each: ``_flow_math`` (interpolation, targets, conversions, timesteps),
``_flow_models`` (calling a model: velocity, CFG, frozen params),
``_flow_adapter`` (``adapt``: diffusers-style models to the flow contract),
``_flow_samplers`` (Euler, re-noising, guided sampling) and ``_flow_batch``
(sample ids, conditioning keys, condition dropout).

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

from purestep.methods._flow_adapter import FlowAdapter, adapt
from purestep.methods._flow_batch import (
    batch_cond,
    batch_index,
    condition_dropout,
)
from purestep.methods._flow_math import (
    Purpose,
    TimestepDist,
    eps_from_velocity,
    eps_from_x0,
    interpolate,
    mse,
    noise_like,
    purpose_key,
    sample_timesteps,
    shift_timesteps,
    timestep_schedule,
    velocity_from_x0,
    velocity_target,
    x0_from_velocity,
)
from purestep.methods._flow_models import (
    cfg,
    frozen_params,
    guided_velocity,
    null_condition,
    predict_velocity,
)
from purestep.methods._flow_samplers import (
    VelocityFn,
    euler_sample,
    renoise_sample,
    sample,
)

__all__ = [
    "FlowAdapter",
    "Purpose",
    "TimestepDist",
    "VelocityFn",
    "adapt",
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
