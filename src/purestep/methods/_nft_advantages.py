"""DiffusionNFT's group-normalised advantages and optimality weights (see :mod:`.nft`)."""

from __future__ import annotations

import torch

__all__ = ["ADV_EPS", "advantages", "optimality_weight"]

ADV_EPS = 1e-4
"""The constant in ``(r - mean) / (std + ADV_EPS)``."""


def advantages(rewards: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    """Group-normalised advantages ``(r - mean) / (std + 1e-4)`` per prompt group.

    ``std`` is the population standard deviation (``ddof = 0``) of the group.

    Args:
        rewards: ``[P, G]`` (row ``p`` is prompt ``p``'s group), or ``[N]`` with
            ``group_size`` (consecutive runs of ``group_size`` form a group).
        group_size: ``G`` for 1-D ``rewards``; must divide ``N``.

    Returns:
        Advantages with ``rewards``' shape and dtype.

    Raises:
        ValueError: a shape that is neither ``[P, G]`` nor ``[N]`` with a
            dividing ``group_size``.

    Example:
        >>> advantages(torch.tensor([[1.0, 3.0], [2.0, 2.0]]))
        tensor([[-0.9999,  0.9999],
                [ 0.0000,  0.0000]])
    """
    if not isinstance(rewards, torch.Tensor) or not rewards.is_floating_point():
        raise TypeError(f"advantages: rewards must be a float tensor, got {rewards!r}")
    if rewards.ndim == 1:
        n = rewards.shape[0]
        if group_size is None or group_size < 1 or n % group_size:
            raise ValueError(
                f"advantages: 1-D rewards of length {n} need a group_size that divides it, "
                f"got group_size={group_size!r}"
            )
        return advantages(rewards.view(n // group_size, group_size)).view(n)
    if rewards.ndim != 2:
        raise ValueError(
            f"advantages: rewards must be [num_prompts, group_size] or [N], got shape "
            f"{tuple(rewards.shape)}"
        )
    if group_size is not None and group_size != rewards.shape[1]:
        raise ValueError(
            f"advantages: group_size={group_size} but rewards has shape {tuple(rewards.shape)}"
        )
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, correction=0, keepdim=True)
    return (rewards - mean) / (std + ADV_EPS)


def optimality_weight(adv: torch.Tensor, adv_clip: float) -> torch.Tensor:
    """``rho = clip(adv, -c, c) / (2c) + 1/2``, in ``[0, 1]``.

    Example:
        >>> optimality_weight(torch.tensor([-10.0, 0.0, 2.5]), 5.0)
        tensor([0.0000, 0.5000, 0.7500])
    """
    return adv.clamp(-adv_clip, adv_clip) / (2.0 * adv_clip) + 0.5
