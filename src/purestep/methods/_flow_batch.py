"""Batch plumbing of the flow methods: sample ids, conditioning keys, condition dropout."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

from purestep import rng, tree
from purestep.methods._flow_models import Cond, null_condition

__all__ = ["batch_cond", "batch_index", "condition_dropout"]


def batch_index(batch: TensorDictBase) -> torch.Tensor:
    """``batch["index"]`` (global sample ids), or ``arange(B)`` on the batch's device when it has none.

    Example:
        >>> from tensordict import TensorDict
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
        >>> from tensordict import TensorDict
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
