"""The DiffusionNFT objective: :class:`NFTConfig` and the inner updates' loss (see :mod:`.nft`)."""

from __future__ import annotations

from typing import Any

import attrs
import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from purestep.methods import _validators as _v
from purestep.methods import flow
from purestep.methods._nft_advantages import optimality_weight
from purestep.methods._nft_rollouts import cond_of
from purestep.step import LossFn

__all__ = ["NFTConfig", "loss_fn"]


@attrs.frozen(kw_only=True)
class NFTConfig:
    """Hyperparameters of the NFT objective (the maths is in the module docstring).

    Attributes:
        beta: strength of the implicit policies ``v+- = v_old +- beta (v - v_old)``.
        adv_clip: ``c``: advantages are clipped to ``[-c, c]`` and mapped to
            ``rho in [0, 1]``.
        kl_weight: weight of ``mean_d (v - v_ref)^2``; ``0`` skips the
            reference's forward pass (and the ``kl`` metric).
        timesteps: the training timestep distribution of the forward process.
        weight_eps: lower clip of the adaptive weights ``w+-``.
        cond_keys: prompt entries passed to the model as keyword arguments.
        t_scale: the model receives ``t * t_scale``.

    Example:
        >>> NFTConfig(beta=0.5).adv_clip
        5.0
    """

    beta: float = attrs.field(default=1.0, validator=_v.positive)
    adv_clip: float = attrs.field(default=5.0, validator=_v.positive)
    kl_weight: float = attrs.field(default=1e-4, validator=_v.non_negative)
    timesteps: flow.TimestepDist = attrs.field(
        factory=flow.TimestepDist, validator=attrs.validators.instance_of(flow.TimestepDist)
    )
    weight_eps: float = attrs.field(default=1e-5, validator=_v.positive)
    cond_keys: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_v.keys)
    t_scale: float = attrs.field(default=1.0, validator=_v.positive)


def loss_fn(
    student_model: nn.Module,
    reference_model: nn.Module | None,
    reference_params: TensorDictBase | None,
    config: NFTConfig,
) -> LossFn:
    """Build the NFT loss ``loss_fn(params, batch, key) -> (loss, metrics)`` for inner updates.

    ``params`` holds ``"student"`` (differentiated) and ``"old"`` (no gradient),
    both run through ``student_model``; the frozen reference runs
    ``reference_model`` (default ``student_model``) with ``reference_params``.
    ``batch`` holds ``"x0"`` (rollouts ``[B, ...]``), ``"adv"`` (advantages
    ``[B]``), ``"index"`` (sample ids) and ``"prompt"`` (a TensorDict ``[B]``
    with the ``config.cond_keys``; optional when there are none). Sample ``i``
    draws its timestep from ``fold_in(key, Purpose.TIMESTEP, index[i])`` and its
    forward noise from ``fold_in(key, Purpose.NOISE, index[i])``, so
    accumulation splits see the same draws.

    Metrics, under ``"student"``: ``policy_loss``, ``rho`` (mean optimality
    weight) and, when ``kl_weight > 0``, ``kl`` (``mean (v - v_ref)^2``).

    Args:
        student_model: the module of the student and old policies.
        reference_model: the reference's module (``None``: ``student_model``).
        reference_params: the frozen reference's params; may be ``None`` when
            ``config.kl_weight == 0``.
        config: :class:`NFTConfig`.

    Example:
        >>> import purestep as ps
        >>> from purestep import rng
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = nn.Linear(2, 1)
        ...     def forward(self, x, t):
        ...         return self.lin(torch.cat([x, t[:, None]], dim=1))
        >>> net = Net()
        >>> p = ps.params_of("student", net)
        >>> f = loss_fn(net, None, p, NFTConfig())
        >>> batch = TensorDict({"x0": torch.ones(4, 1), "adv": torch.zeros(4),
        ...                     "index": torch.arange(4)}, [4])
        >>> loss, m = f(TensorDict({"student": p, "old": p}, []), batch, rng.key(0))
        >>> sorted(m["student"])
        ['kl', 'policy_loss', 'rho']
    """
    if not isinstance(config, NFTConfig):
        raise TypeError(f"nft.loss_fn: config must be an NFTConfig, got {type(config).__name__}")
    if reference_params is None and config.kl_weight > 0:
        raise ValueError(
            f"nft.loss_fn: kl_weight={config.kl_weight} needs reference_params "
            "(the frozen reference's params), or set NFTConfig(kl_weight=0)"
        )
    ref_model = student_model if reference_model is None else reference_model
    beta, clip, eps_w, ts = config.beta, config.adv_clip, config.weight_eps, config.t_scale

    def loss(
        params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        for name in ("x0", "adv", "index"):
            if name not in batch:
                raise KeyError(f"nft loss: batch has no {name!r} (keys: {sorted(batch.keys())})")
        x0, adv, index = batch.get("x0"), batch.get("adv"), batch.get("index")
        b = x0.shape[0]
        if adv.shape != (b,):
            raise ValueError(
                f"nft loss: batch['adv'] must have shape ({b},), got {tuple(adv.shape)}"
            )
        prompt = batch.get("prompt") if "prompt" in batch else TensorDict({}, [b])
        cond = cond_of(prompt, config.cond_keys)
        t = config.timesteps.sample(
            flow.purpose_key(key, flow.Purpose.TIMESTEP),
            b,
            index=index,
            device=x0.device,
            dtype=x0.dtype,
        )
        eps = flow.noise_like(flow.purpose_key(key, flow.Purpose.NOISE), x0, index)
        x_t = flow.interpolate(x0, eps, t)
        v = flow.predict_velocity(student_model, params.get("student"), x_t, t, cond, t_scale=ts)
        with torch.no_grad():
            v_old = flow.predict_velocity(
                student_model, params.get("old"), x_t, t, cond, t_scale=ts
            )
        v_pos = beta * v + (1.0 - beta) * v_old
        v_neg = (1.0 + beta) * v_old - beta * v
        dims = tuple(range(1, x0.ndim))
        err_pos = flow.x0_from_velocity(x_t, t, v_pos) - x0
        err_neg = flow.x0_from_velocity(x_t, t, v_neg) - x0
        with torch.no_grad():
            w_pos = err_pos.abs().mean(dim=dims).clamp_min(eps_w)
            w_neg = err_neg.abs().mean(dim=dims).clamp_min(eps_w)
        rho = optimality_weight(adv.to(x0.dtype), clip)
        pos = err_pos.square().mean(dim=dims) / w_pos
        neg = err_neg.square().mean(dim=dims) / w_neg
        policy = ((rho * pos + (1.0 - rho) * neg) / beta).mean()
        student_metrics = {"policy_loss": policy.detach(), "rho": rho.mean().detach()}
        metrics = {"student": student_metrics}
        loss = policy
        if config.kl_weight > 0:
            assert reference_params is not None
            with torch.no_grad():
                v_ref = flow.predict_velocity(ref_model, reference_params, x_t, t, cond, t_scale=ts)
            kl = (v - v_ref).square().mean(dim=dims).mean()
            student_metrics["kl"] = kl.detach()
            loss = loss + config.kl_weight * kl
        return loss, metrics

    return loss
