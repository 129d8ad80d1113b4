"""Data-parallel helpers: ranks, batch sharding with global sample ids, metric averaging, gather.

Each rank computes the mean loss of its slice of the global batch and FSDP
averages grads over ranks, which gives the global-batch mean when every rank
has the same number of samples. :func:`shard_batch` assigns the global sample
ids (``batch["index"]``) before slicing, so per-sample noise is the same as in
one process; :func:`reduce_metrics` averages per-rank metric means in one
collective. Public through :mod:`purestep.distributed.fsdp`.

Example:
    >>> from purestep.distributed import fsdp
    >>> fsdp.dp_rank(), fsdp.dp_size()  # no process group
    (0, 1)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase
from torch.distributed.device_mesh import DeviceMesh

from purestep import tree
from purestep.step import Batch, as_batch, batch_size, with_index

__all__ = ["Group", "dp_rank", "dp_size", "gather", "reduce_metrics", "shard_batch"]


Group = DeviceMesh | dist.ProcessGroup | None


def dp_rank(group: Group = None) -> int:
    """This process's data-parallel rank: its position in ``group`` (row-major for a 2-D mesh).

    ``group`` is a device mesh (all its dims are data parallel, as in HSDP), a
    process group, or None for the default group (0 without a process group).

    Example:
        >>> dp_rank()  # no process group
        0
    """
    if isinstance(group, DeviceMesh):
        coord = group.get_coordinate()
        if coord is None:
            raise ValueError("dp_rank: this rank is not part of the mesh")
        r = 0
        for c, n in zip(coord, group.shape, strict=True):
            r = r * n + c
        return r
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def dp_size(group: Group = None) -> int:
    """The number of data-parallel ranks in ``group`` (see :func:`dp_rank`).

    Example:
        >>> dp_size()  # no process group
        1
    """
    if isinstance(group, DeviceMesh):
        return group.size()
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def shard_batch(batch: Batch, group: Group = None) -> TensorDictBase:
    """This rank's contiguous slice of a global batch, with global sample ids in ``"index"``.

    ``batch["index"] = arange(B)`` is assigned first when absent (before the
    split), so per-sample randomness drawn with ``index`` is the same as in one
    process. Every rank must pass the same global batch.

    Args:
        batch: the global batch (a TensorDict ``[B]`` or a dict of tensors).
        group: the data-parallel mesh or process group (default: the default group).

    Raises:
        ValueError: ``B`` is not divisible by the number of data-parallel ranks
            (the per-rank means would then not average to the global mean).

    Example:
        >>> import torch
        >>> shard_batch({"x": torch.zeros(4, 2)})["index"]  # one process: the whole batch
        tensor([0, 1, 2, 3])
    """
    td = with_index(as_batch(batch))
    b, n, r = batch_size(td), dp_size(group), dp_rank(group)
    if b % n != 0:
        raise ValueError(
            f"shard_batch: global batch of {b} samples is not divisible by the {n} "
            "data-parallel ranks; every rank needs the same number of samples so that "
            "the mean over ranks of per-rank mean losses is the global mean"
        )
    per = b // n
    return td[r * per : (r + 1) * per]


def _reduce_device(group: Group) -> torch.device:
    if isinstance(group, DeviceMesh):
        return torch.device(group.device_type) if group.device_type == "cpu" else _accel()
    backend = str(dist.get_backend(group)).lower()
    return torch.device("cpu") if backend == "gloo" else _accel()


def _accel() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def reduce_metrics(metrics: TensorDictBase, group: Group = None) -> TensorDict:
    """Average floating-point metrics over the data-parallel ranks in one collective.

    Each rank's metrics are means over its own samples; with equal per-rank
    sample counts their average is the global-batch mean, i.e. what one process
    would log. Floating leaves of any shape are averaged (in float32, then cast
    back); other leaves (counts, flags) are returned as they are. Every rank
    must call this with the same keys. Without a process group (or with one
    rank) ``metrics`` is returned unchanged.

    ``train_step`` already does this for states with bound (FSDP) roles; call it
    for metrics of a ``grad_fn`` used directly.

    Args:
        metrics: a TensorDict of metrics (not modified).
        group: the data-parallel mesh (2-D: reduced over both dims) or process
            group; default: the default group.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> m = TensorDict({"loss": torch.tensor(2.0)}, [])
        >>> reduce_metrics(m)["loss"]  # one process: unchanged
        tensor(2.)
    """
    if dp_size(group) == 1:
        return metrics
    leaves = tree.leaves(metrics)
    idx = [i for i, t in enumerate(leaves) if t.is_floating_point()]
    if not idx:
        return metrics
    device = _reduce_device(group)
    flat = torch.cat([leaves[i].detach().reshape(-1).to(device, torch.float32) for i in idx])
    if isinstance(group, DeviceMesh):
        if group.size() == dist.get_world_size():
            dist.all_reduce(flat)  # the default group covers the mesh: one collective
        else:
            for d in range(group.ndim):
                dist.all_reduce(flat, group=group.get_group(d))
    else:
        dist.all_reduce(flat, group=group)
    flat.div_(dp_size(group))
    out = list(leaves)
    start = 0
    for i in idx:
        t = leaves[i]
        n = t.numel()
        out[i] = flat[start : start + n].reshape(t.shape).to(t.device, t.dtype)
        start += n
    return tree.rebuild(metrics, out)


def gather(params: TensorDictBase) -> TensorDict:
    """Full (unsharded) plain tensors of every leaf: DTensors are all-gathered, others copied.

    A collective when ``params`` has DTensor leaves: every rank must call it
    with the same keys (calling it on one rank only hangs or aborts the group).
    Use it for exporting weights or comparing with a single-process run.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> gather(TensorDict({"w": torch.ones(2)}, []))["w"]
        tensor([1., 1.])
    """
    out = []
    for t in tree.leaves(params):
        full: Callable[[], torch.Tensor] | None = getattr(t, "full_tensor", None)
        out.append(full().detach() if full is not None else t.detach().clone())
    return tree.rebuild(params, out)
