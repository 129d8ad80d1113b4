"""Batch handling at the step boundary: convert to a TensorDict, assign sample ids."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from purestep import tree
from purestep.errors import BatchError

__all__ = ["Batch", "as_batch", "batch_size", "check_index", "prepare_batch", "with_index"]

Batch = TensorDictBase | Mapping[str, Any]


def as_batch(batch: Batch) -> TensorDictBase:
    """A TensorDict with ``batch_size=[B]``, from a TensorDict or a dict of tensors.

    A dict (or a TensorDict without batch dims) gets ``B`` from its leaves' leading
    dimension, which must agree.

    Raises:
        TypeError: ``batch`` is neither a TensorDict nor a mapping.
        BatchError: leaves disagree on the leading dimension (names the keys), a
            0-dim entry, no tensors, or no samples (``B = 0``).

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
        _check_not_empty(int(td.batch_size[0]))
        return td
    sizes: dict[int, list[str]] = {}
    for path, leaf in zip(tree.paths(td), tree.leaves(td), strict=True):
        if leaf.ndim == 0:
            raise BatchError(
                f"batch key {tree.format_path(path)!r} is a 0-dim tensor; every batch "
                "entry needs a leading batch dimension",
                key=tree.format_path(path),
            )
        sizes.setdefault(int(leaf.shape[0]), []).append(tree.format_path(path))
    if not sizes:
        raise BatchError("batch is empty: it has no tensors")
    if len(sizes) > 1:
        detail = "; ".join(f"{n}: {', '.join(keys)}" for n, keys in sorted(sizes.items()))
        raise BatchError(f"batch entries disagree on the leading (batch) dimension: {detail}")
    (b,) = sizes
    _check_not_empty(b)
    out = td.copy() if td is batch else td
    out.batch_size = torch.Size([b])
    return out


def _check_not_empty(b: int) -> None:
    if b == 0:
        raise BatchError(
            "batch has no samples (B=0): a step on it would average the loss over nothing "
            "(NaN) and still apply the optimizer; skip empty batches before the step (e.g. "
            "drop_last=True in the data loader, or `if len(batch['x']): step(...)`)"
        )


# index tensors known to hold distinct ids: id -> (weak reference, version when checked)
_DISTINCT: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}


def _known_distinct(idx: torch.Tensor) -> bool:
    entry = _DISTINCT.get(id(idx))
    return entry is not None and entry[0]() is idx and entry[1] == idx._version


def _remember_distinct(idx: torch.Tensor) -> None:
    key = id(idx)
    if len(_DISTINCT) >= 64:
        with contextlib.suppress(RuntimeError, StopIteration, KeyError):  # another thread
            del _DISTINCT[next(iter(_DISTINCT))]
    _DISTINCT[key] = (weakref.ref(idx, lambda _: _DISTINCT.pop(key, None)), idx._version)


def check_index(idx: object) -> torch.Tensor:
    """``batch["index"]`` checked: a 1-D int64 tensor of distinct sample ids.

    Per-sample randomness is drawn from ``rng.fold_in(key, index[i])``, so two
    samples with the same id would get the same noise. Checking costs a sort of
    ``B`` ids (and, on an accelerator, one host sync); an index this module
    assigned (``arange``) or already checked is not checked again.

    Raises:
        BatchError: another dtype or shape, or duplicate ids (named, with their
            positions).

    Example:
        >>> check_index(torch.tensor([3, 1, 3, 0]))
        Traceback (most recent call last):
        ...
        purestep.errors.BatchError: batch['index'] has duplicate sample ids: 3 at positions [0, 2]; ...
    """
    if not isinstance(idx, torch.Tensor) or idx.dtype != torch.int64 or idx.ndim != 1:
        got = (
            f"dtype {idx.dtype} and shape {tuple(idx.shape)}"
            if isinstance(idx, torch.Tensor)
            else f"a {type(idx).__name__}"
        )
        raise BatchError(
            f"batch['index'] must be a 1-D int64 tensor of sample ids; got {got}", key="index"
        )
    if _known_distinct(idx):
        return idx
    if type(idx) is not torch.Tensor or torch.compiler.is_compiling():
        return idx  # traced (purestep.compile, torch.compile): no values; checked on the host
    if idx.numel() > 1:
        values = torch.sort(idx).values
        same = values[1:] == values[:-1]
        if bool(same.any()):
            first = int(values[1:][same][0])
            where = (idx == first).nonzero().flatten().tolist()
            n_dup = int(same.sum())
            more = f" ({n_dup} repeated ids in all)" if n_dup > len(where) - 1 else ""
            raise BatchError(
                f"batch['index'] has duplicate sample ids: {first} at positions {where}{more}; "
                "per-sample noise is drawn from fold_in(key, index[i]), so these samples "
                "would get the same noise. Give every sample of a step its own id (e.g. its "
                "position in the stream of samples, not its dataset index when sampling with "
                "replacement), or leave 'index' out (it defaults to arange(B))",
                key="index",
            )
    _remember_distinct(idx)
    return idx


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
        check_index(batch.get("index"))
        return batch
    out = batch.copy()
    device = next(iter(tree.leaves(batch)), torch.empty(0)).device
    index = torch.arange(batch_size(batch), dtype=torch.int64, device=device)
    _remember_distinct(index)
    out.set("index", index)
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
                _check_not_empty(b)
                items = dict(batch)
                index = torch.arange(b, dtype=torch.int64, device=device)
                _remember_distinct(index)
                items["index"] = index
                return tree.plain_td(items, torch.Size([b]))
    return with_index(as_batch(batch))
