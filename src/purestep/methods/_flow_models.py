"""Calling a flow model: velocity prediction, classifier-free guidance, frozen params."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from purestep import tree
from purestep.step import call

__all__ = ["Cond", "cfg", "frozen_params", "guided_velocity", "null_condition", "predict_velocity"]

Cond = Mapping[str, torch.Tensor]


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
    adapted_scale = getattr(model, "timestep_scale", 1.0)
    if t_scale != 1.0 and adapted_scale != 1.0:
        raise ValueError(
            f"t_scale={t_scale} given for a model adapted with timestep_scale="
            f"{adapted_scale} (flow.adapt): the timesteps would be scaled "
            "twice; leave t_scale at 1 (the adapter carries the scale)"
        )
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
