"""DMD2's optional losses: the paired-noise regression loss and the GAN head on the critic's features.

* **Regression** (DMD's ``L_reg``): the batch carries pairs ``(noise,
  teacher's ODE output from that noise)``, generated once by the teacher
  (e.g. :func:`purestep.methods.kd.generate_trajectories` with
  ``student_steps=(1.0,)``). The student's one-step prediction from the noise
  (``x0 = z - v(z, 1)``) regresses onto the teacher's output:
  ``regression_weight * mse(x0, x0_teacher)`` (MSE; DMD used LPIPS on images).
* **GAN** (DMD2's classification branch): a small head (its own role,
  ``gan_head``) reads the critic's features at ``GANConfig.feature_layer``
  (a submodule path of the critic's module, captured by a forward hook) of
  noised real data and noised student samples. The critic and the head learn
  to tell them apart (``softplus(-D(real)) + softplus(D(fake))``, weighted by
  ``critic_weight``); the student gets the non-saturating generator loss
  ``student_weight * softplus(-D(fake))`` through frozen copies of both.

Example:
    >>> GANConfig(feature_layer="blocks.2").student_weight
    0.001
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from tensordict import TensorDictBase
from torch import nn

from purestep.methods import _validators as _v
from purestep.methods import flow
from purestep.methods.flow import TimestepDist
from purestep.step import call

__all__ = ["GAN_NOISE", "GAN_TIMESTEP", "GANConfig", "discriminate", "gan_losses", "regression"]

GAN_TIMESTEP = int.from_bytes(b"gantime", "big")
"""Purpose of the GAN branch's timesteps (real and fake samples share them per sample)."""
GAN_NOISE = int.from_bytes(b"gannois", "big")
"""Purpose of the GAN branch's forward noise."""


@attrs.frozen(kw_only=True)
class GANConfig:
    """The GAN head on the critic's features (DMD2's classification branch).

    Attributes:
        feature_layer: path of the submodule of the critic's module whose
            output is the feature map (e.g. ``"transformer_blocks.1"``); a tuple
            output's first element is used.
        student_weight: weight of the generator loss in the student's loss.
        critic_weight: weight of the discriminator loss in the critic's (and
            the head's) loss.
        timesteps: where real and fake samples are noised before the critic
            reads them.

    Example:
        >>> GANConfig(feature_layer="net.1", critic_weight=0.1).critic_weight
        0.1
    """

    feature_layer: str = attrs.field(validator=_v.name)
    student_weight: float = attrs.field(default=1e-3, validator=_v.non_negative)
    critic_weight: float = attrs.field(default=1e-2, validator=_v.non_negative)
    timesteps: TimestepDist = attrs.field(
        factory=lambda: TimestepDist(low=0.02, high=0.98),
        validator=attrs.validators.instance_of(TimestepDist),
    )


@contextlib.contextmanager
def _capture(module: nn.Module, layer: str) -> Iterator[list[torch.Tensor]]:
    try:
        sub = module.get_submodule(layer)
    except AttributeError as e:
        raise KeyError(
            f"dmd2: GANConfig.feature_layer {layer!r} is not a submodule of "
            f"{type(module).__name__} ({e})"
        ) from e
    out: list[torch.Tensor] = []

    def hook(_m: nn.Module, _args: Any, output: Any) -> None:
        out.append(output[0] if isinstance(output, tuple | list) else output)

    handle = sub.register_forward_hook(hook)
    try:
        yield out
    finally:
        handle.remove()


def discriminate(
    critic: nn.Module,
    critic_params: TensorDictBase,
    head: nn.Module,
    head_params: TensorDictBase,
    x_t: torch.Tensor,
    t: torch.Tensor,
    cond: Mapping[str, torch.Tensor],
    *,
    layer: str,
    t_scale: float,
) -> torch.Tensor:
    """Logits ``[B]``: ``head(features)`` of the critic's layer ``layer`` on ``(x_t, t)``.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.body = nn.Linear(3, 4)
        ...         self.out = nn.Linear(4, 2)
        ...     def forward(self, x, t):
        ...         return self.out(self.body(torch.cat([x, t[:, None]], 1)))
        >>> net, head = Net(), nn.Linear(4, 1)
        >>> p, hp = TensorDict.from_module(net), TensorDict.from_module(head)
        >>> discriminate(net, p, head, hp, torch.zeros(5, 2), torch.ones(5), {},
        ...              layer="body", t_scale=1.0).shape
        torch.Size([5])
    """
    with _capture(critic, layer) as feats:
        flow.predict_velocity(critic, critic_params, x_t, t, cond, t_scale=t_scale)
    if not feats:
        raise RuntimeError(f"dmd2: the critic's layer {layer!r} did not run in its forward")
    logits = call(head, head_params, feats[-1])
    if not isinstance(logits, torch.Tensor) or logits.shape[0] != x_t.shape[0]:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(
            f"dmd2: the GAN head must return logits with a leading batch dim {x_t.shape[0]}, "
            f"got {got}"
        )
    return logits.reshape(x_t.shape[0], -1).mean(dim=1)


def gan_losses(
    gan: GANConfig,
    critic: nn.Module,
    head: nn.Module,
    params: TensorDictBase,
    x0_student: torch.Tensor,
    x0_real: torch.Tensor,
    cond: Mapping[str, torch.Tensor],
    key: torch.Tensor,
    index: torch.Tensor,
    *,
    student_live: bool,
    critic_live: bool,
    t_scale: float,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The GAN terms: ``({"student"?, "critic"?, "gan_head"?: loss}, metrics)`` for the live roles.

    Real data and student samples are noised to the same per-sample timestep
    (``GAN_TIMESTEP``) with the same noise (``GAN_NOISE``). Metrics:
    ``("gan_head", "real_logit")`` / ``("gan_head", "fake_logit")`` (mean
    logits) on critic steps, ``("student", "gan_loss")`` on student steps.
    """
    b, dev, dt = x0_real.shape[0], x0_real.device, x0_real.dtype
    t = gan.timesteps.sample(
        flow.purpose_key(key, GAN_TIMESTEP), b, index=index, device=dev, dtype=dt
    )
    eps = flow.noise_like(flow.purpose_key(key, GAN_NOISE), x0_real, index)
    kw: dict[str, Any] = {"layer": gan.feature_layer, "t_scale": t_scale}
    losses: dict[str, torch.Tensor] = {}
    metrics: dict[str, dict[str, torch.Tensor]] = {}
    if critic_live:
        c_p, h_p = params.get("critic"), params.get("gan_head")
        real = discriminate(
            critic, c_p, head, h_p, flow.interpolate(x0_real, eps, t), t, cond, **kw
        )
        x_fake = flow.interpolate(x0_student.detach(), eps, t)
        fake = discriminate(critic, c_p, head, h_p, x_fake, t, cond, **kw)
        d_loss = F.softplus(-real).mean() + F.softplus(fake).mean()
        losses["critic"] = gan.critic_weight * d_loss
        losses["gan_head"] = gan.critic_weight * d_loss
        metrics["gan_head"] = {
            "real_logit": real.detach().mean(),
            "fake_logit": fake.detach().mean(),
        }
    if student_live:
        c_p, h_p = params.get("critic").detach(), params.get("gan_head").detach()
        fake = discriminate(
            critic, c_p, head, h_p, flow.interpolate(x0_student, eps, t), t, cond, **kw
        )
        g_loss = F.softplus(-fake).mean()
        losses["student"] = gan.student_weight * g_loss
        metrics["student"] = {"gan_loss": g_loss.detach()}
    return losses, metrics  # type: ignore[return-value]


def regression(
    model: nn.Module,
    params: TensorDictBase,
    batch: TensorDictBase,
    keys: tuple[str, str],
    cond: Mapping[str, torch.Tensor],
    *,
    t_scale: float,
) -> torch.Tensor:
    """``mse(z - v(z, 1), x0_teacher)`` over the batch's paired ``(noise, teacher output)``.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> class Zero(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = nn.Parameter(torch.zeros(()))
        ...     def forward(self, x, t):
        ...         return x * self.w
        >>> b = TensorDict({"z": torch.ones(2, 2), "y": torch.ones(2, 2)}, [2])
        >>> regression(Zero(), TensorDict({"w": torch.zeros(())}, []), b, ("z", "y"), {},
        ...            t_scale=1.0)
        tensor(0.)
    """
    missing = [k for k in keys if k not in batch.keys()]
    if missing:
        raise KeyError(
            f"dmd2: regression_weight > 0 needs the paired keys {list(keys)} in the batch; "
            f"missing {missing} (batch keys: {sorted(batch.keys())})"
        )
    z, target = batch.get(keys[0]), batch.get(keys[1])
    if z.shape != target.shape:
        raise ValueError(
            f"dmd2: batch[{keys[0]!r}] has shape {tuple(z.shape)} but batch[{keys[1]!r}] "
            f"{tuple(target.shape)}"
        )
    t = torch.ones(z.shape[0], dtype=z.dtype, device=z.device)
    v = flow.predict_velocity(model, params, z, t, cond, t_scale=t_scale)
    return flow.mse(flow.x0_from_velocity(z, t, v), target)
