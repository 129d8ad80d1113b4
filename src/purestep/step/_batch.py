"""Batch handling at the step boundary: convert to a TensorDict, assign sample ids."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from purestep import tree

__all__ = ["Batch", "as_batch", "batch_size", "prepare_batch", "with_index"]

Batch = TensorDictBase | Mapping[str, Any]


def as_batch(batch: Batch) -> TensorDictBase:
    """A TensorDict with ``batch_size=[B]``, from a TensorDict or a dict of tensors.

    A dict (or a TensorDict without batch dims) gets ``B`` from its leaves' leading
    dimension, which must agree.

    Raises:
        TypeError: ``batch`` is neither a TensorDict nor a mapping.
        ValueError: leaves disagree on the leading dimension (names the keys).

    Example:
        >>> import torch
        >>> as_batch({"x": torch.zeros(4, 2)}).batch_size
        torch.Size([4])
    """
    if isinstance(batch, TensorDictBase):
        td = batch
    elif isinstance(batch, Mapping):
        td = TensorDict(dict(batch), batch_size=[])
    else:
        raise TypeError(
            f"batch is {type(batch).__name__}; expected a TensorDict or a dict of tensors"
        )
    if td.batch_dims >= 1:
        return td
    sizes: dict[int, list[str]] = {}
    for path, leaf in zip(tree.paths(td), tree.leaves(td), strict=True):
        if leaf.ndim == 0:
            raise ValueError(
                f"batch key {tree.format_path(path)!r} is a 0-dim tensor; every batch "
                "entry needs a leading batch dimension"
            )
        sizes.setdefault(int(leaf.shape[0]), []).append(tree.format_path(path))
    if not sizes:
        raise ValueError("batch is empty: it has no tensors")
    if len(sizes) > 1:
        detail = "; ".join(f"{n}: {', '.join(keys)}" for n, keys in sorted(sizes.items()))
        raise ValueError(f"batch entries disagree on the leading (batch) dimension: {detail}")
    (b,) = sizes
    out = td.copy() if td is batch else td
    out.batch_size = torch.Size([b])
    return out


def batch_size(batch: TensorDictBase) -> int:
    """The leading batch dimension ``B``.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> batch_size(TensorDict({"x": torch.zeros(3)}, [3]))
        3
    """
    if batch.batch_dims < 1:
        raise ValueError("batch has no batch dimension; build it with batch_size=[B]")
    return int(batch.batch_size[0])


def with_index(batch: TensorDictBase) -> TensorDictBase:
    """``batch`` with ``"index" = arange(B)`` (int64) added when absent; the input is not modified.

    ``index`` holds global sample ids: per-sample randomness is drawn from
    ``rng.fold_in(key, index[i])``, so it does not depend on how the batch is cut.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> with_index(TensorDict({"x": torch.zeros(3)}, [3]))["index"]
        tensor([0, 1, 2])
    """
    if "index" in batch.keys():
        idx = batch.get("index")
        if idx.dtype != torch.int64 or idx.ndim != 1:
            raise ValueError(
                f"batch['index'] must be a 1-D int64 tensor of sample ids; got dtype "
                f"{idx.dtype} and shape {tuple(idx.shape)}"
            )
        return batch
    out = batch.copy()
    device = next(iter(tree.leaves(batch)), torch.empty(0)).device
    out.set("index", torch.arange(batch_size(batch), dtype=torch.int64, device=device))
    return out


def prepare_batch(batch: Batch) -> TensorDictBase:
    """``with_index(as_batch(batch))``, with a direct path for a flat dict of tensors.

    A plain ``dict`` of tensors of at least one dimension that agree on ``B``
    and on device (the usual data-loader output) becomes its TensorDict, index
    included, in one construction; anything else takes the general path (and
    its checks and errors).

    Example:
        >>> import torch
        >>> prepare_batch({"x": torch.zeros(3, 2)})["index"]
        tensor([0, 1, 2])
    """
    if type(batch) is dict and batch and "index" not in batch:
        values = list(batch.values())
        first = values[0]
        if type(first) is torch.Tensor and first.ndim >= 1:
            b, device = first.shape[0], first.device
            if all(
                type(v) is torch.Tensor and v.ndim >= 1 and v.shape[0] == b and v.device == device
                for v in values
            ) and all(type(k) is str for k in batch):
                items = dict(batch)
                items["index"] = torch.arange(b, dtype=torch.int64, device=device)
                return tree.plain_td(items, torch.Size([b]))
    return with_index(as_batch(batch))
