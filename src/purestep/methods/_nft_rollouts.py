"""DiffusionNFT's rollouts: ``group_size`` Euler samples per prompt with the old policy."""

from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from purestep import rng, tree
from purestep.methods import flow
from purestep.step import Batch, as_batch, with_index

__all__ = ["RewardFn", "cond_of", "prompts_of", "sample"]

RewardFn = Callable[[torch.Tensor, TensorDictBase], torch.Tensor]
"""``reward_fn(x0 [N, ...], prompts TensorDict [N]) -> rewards [N]``; must be pure."""


def prompts_of(batch: Batch) -> TensorDictBase:
    if isinstance(batch, TensorDictBase) and batch.batch_dims >= 1:
        return with_index(batch)
    return with_index(as_batch(batch))


def cond_of(prompts: TensorDictBase, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    missing = [k for k in keys if k not in prompts]
    if missing:
        raise KeyError(
            f"nft: prompts have no conditioning key(s) {missing} "
            f"(prompt keys: {sorted(prompts.keys())})"
        )
    return {k: prompts.get(k) for k in keys}


def sample(
    model: nn.Module,
    params: TensorDictBase,
    prompts: Batch,
    key: torch.Tensor,
    *,
    group_size: int,
    steps: int,
    sample_shape: tuple[int, ...],
    shift: float = 1.0,
    cond_keys: tuple[str, ...] = (),
    t_scale: float = 1.0,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> TensorDict:
    """Generate ``group_size`` samples per prompt with ``params`` (Euler ODE, no gradient).

    Prompt ``p`` (global id ``j = prompts["index"][p]``, default ``p``) gets
    samples ``i = j * group_size + g``; sample ``i`` starts from
    ``rng.normal(key, ..., index=i)``, so a sample does not depend on which other
    prompts share the batch. The model is called as ``model(x_t, t * t_scale,
    **cond)`` with ``t`` of shape ``[N]`` and ``cond`` the prompt entries named in
    ``cond_keys``, repeated per sample.

    Args:
        model: the flow model (``forward(x_t, t, **cond) -> velocity``).
        params: the params to sample with (e.g. ``state["params", "old"]``).
        prompts: a TensorDict ``[P]`` (it may have no entries) or a dict of tensors.
        key: a 0-dim int64 key.
        group_size: ``G`` samples per prompt.
        steps: Euler steps (``flow.timestep_schedule(steps, shift=shift)``).
        sample_shape: shape of one sample (without the batch dim).
        shift: timestep shift of the sampling schedule.
        cond_keys: prompt entries passed to the model.
        t_scale: the model receives ``t * t_scale``.
        dtype: sample dtype (default: the dtype of ``params``' first leaf).
        device: sample device (default: the device of ``params``' first leaf).

    Returns:
        A TensorDict ``[P * G]``, prompt-major, with ``"x0"`` (the samples),
        ``"prompt"`` (every prompt entry but ``"index"``, repeated), ``"group"``
        (prompt position ``p``, int64) and ``"index"`` (sample id ``i``, int64).

    Example:
        >>> class Zero(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = nn.Parameter(torch.zeros(()))
        ...     def forward(self, x, t):
        ...         return x * self.w
        >>> out = sample(Zero(), TensorDict({"w": torch.zeros(())}, []), TensorDict({}, [2]),
        ...              rng.key(0), group_size=3, steps=2, sample_shape=(2,))
        >>> out["x0"].shape, out["group"].tolist()
        (torch.Size([6, 2]), [0, 0, 0, 1, 1, 1])
    """
    if group_size < 1 or steps < 1:
        raise ValueError(f"sample: group_size and steps must be >= 1, got {group_size}, {steps}")
    td = prompts_of(prompts)
    p = int(td.batch_size[0])
    first = tree.leaves(params)[0]
    dt = first.dtype if dtype is None else dtype
    dev = first.device if device is None else torch.device(device)
    prompt_ids = td.get("index")  # ids and positions on the prompts' device: no host sync
    rank = torch.arange(p * group_size, dtype=torch.int64, device=prompt_ids.device)
    pos = rank.div(group_size, rounding_mode="floor")  # p, repeated group_size times
    ids = prompt_ids[pos] * group_size + rank.remainder_(group_size)
    repeated = td.exclude("index")[pos].to(dev)  # the model's conditions, where it runs
    noise = rng.normal(key, (p * group_size, *sample_shape), dtype=dt, device=dev, index=ids)
    x0 = flow.sample(
        model,
        params,
        noise,
        flow.timestep_schedule(steps, shift=shift),
        cond=cond_of(repeated, cond_keys),
        t_scale=t_scale,
    )
    assert isinstance(x0, torch.Tensor)
    return TensorDict(
        {"x0": x0, "prompt": repeated, "group": pos.to(dev), "index": ids.to(dev)},
        batch_size=[p * group_size],
    )
