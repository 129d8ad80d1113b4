"""Flat leaf lists over nested TensorDicts: the hot-path view of a tree.

A training state is a nested :class:`tensordict.TensorDict`. Walking it leaf by
leaf through TensorDict's API costs several microseconds per leaf; the
optimizers, accumulation and EMA instead work on *flat leaf lists* and hand
them to ``torch._foreach_*`` / fused kernels in one call.

Order: every function here lists leaves in the same depth-first insertion
order as ``td.values(include_nested=True, leaves_only=True)``, so two trees
with the same key structure give aligned lists.

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from purestep import tree
    >>> td = TensorDict({"a": {"w": torch.ones(2)}, "b": torch.zeros(3)}, [])
    >>> tree.paths(td)
    [('a', 'w'), ('b',)]
    >>> [t.shape for t in tree.leaves(td)]
    [torch.Size([2]), torch.Size([3])]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

__all__ = [
    "KeyPath",
    "assert_same_structure",
    "clone",
    "copy_",
    "format_path",
    "global_norm",
    "group_by_device_dtype",
    "leaves",
    "local",
    "paths",
    "rebuild",
    "unflatten",
    "zeros_like",
]

KeyPath = tuple[str, ...]


def _as_path(key: str | tuple[str, ...]) -> KeyPath:
    return (key,) if isinstance(key, str) else tuple(key)


def paths(td: TensorDictBase) -> list[KeyPath]:
    """Key paths of every leaf, in leaf-list order.

    Example:
        >>> from tensordict import TensorDict
        >>> paths(TensorDict({"a": {"b": torch.ones(1)}}, []))
        [('a', 'b')]
    """
    return [_as_path(k) for k in td.keys(include_nested=True, leaves_only=True)]


def leaves(td: TensorDictBase) -> list[torch.Tensor]:
    """All leaf tensors, in the canonical depth-first order (no copies).

    Example:
        >>> from tensordict import TensorDict
        >>> leaves(TensorDict({"a": torch.ones(1), "b": torch.zeros(2)}, []))[1]
        tensor([0., 0.])
    """
    return list(td.values(include_nested=True, leaves_only=True))


def format_path(path: str | Sequence[str]) -> str:
    """Render a key path for error messages: ``('student', 'fc', 'weight')`` -> ``student.fc.weight``.

    Example:
        >>> format_path(("student", "fc", "weight"))
        'student.fc.weight'
    """
    return path if isinstance(path, str) else ".".join(path)


def rebuild(like: TensorDictBase, new_leaves: Iterable[torch.Tensor]) -> TensorDict:
    """A new TensorDict with ``like``'s structure and ``new_leaves`` as its leaves.

    ``new_leaves`` must be in :func:`leaves` order. ``like`` is not modified.

    Example:
        >>> from tensordict import TensorDict
        >>> td = TensorDict({"a": torch.ones(2)}, [])
        >>> rebuild(td, [torch.zeros(2)])["a"]
        tensor([0., 0.])
    """
    it = iter(new_leaves)
    out = like.apply(lambda _: next(it))
    assert out is not None
    sentinel = object()
    if next(it, sentinel) is not sentinel:
        raise ValueError("rebuild: more leaves than the template tree has")
    return out  # type: ignore[no-any-return]


def unflatten(items: Sequence[tuple[KeyPath, torch.Tensor]]) -> TensorDict:
    """Build a nested TensorDict (batch_size ``[]``) from ``(path, tensor)`` pairs.

    Example:
        >>> unflatten([(("a", "b"), torch.ones(1))])["a", "b"]
        tensor([1.])
    """
    out = TensorDict({}, batch_size=[])
    for path, value in items:
        out.set(path if len(path) > 1 else path[0], value)
    return out


def clone(td: TensorDictBase) -> TensorDict:
    """A deep copy of every leaf (fresh buffers), same structure.

    Example:
        >>> from tensordict import TensorDict
        >>> a = TensorDict({"x": torch.ones(1)}, [])
        >>> clone(a)["x"] is a["x"]
        False
    """
    return td.clone()  # type: ignore[no-any-return]


def zeros_like(td: TensorDictBase) -> TensorDict:
    """Zeros with ``td``'s structure, shapes, dtypes and devices.

    Example:
        >>> from tensordict import TensorDict
        >>> zeros_like(TensorDict({"x": torch.ones(2)}, []))["x"]
        tensor([0., 0.])
    """
    return td.apply(torch.zeros_like)  # type: ignore[no-any-return]


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, or the tensor itself.

    Fused and ``_foreach_*`` kernels have no DTensor rules for several ops, so
    in-place updates go through the local shards.

    Example:
        >>> t = torch.ones(2)
        >>> local(t) is t
        True
    """
    to_local: Callable[[], torch.Tensor] | None = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def copy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """In-place ``dst[i].copy_(src[i])`` for all i, through local shards for DTensors.

    Example:
        >>> a, b = [torch.zeros(2)], [torch.ones(2)]
        >>> copy_(a, b); a[0]
        tensor([1., 1.])
    """
    if not dst:
        return
    torch._foreach_copy_([local(t) for t in dst], [local(t) for t in src])


def group_by_device_dtype(
    tensors: Sequence[torch.Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Indices of ``tensors`` grouped by (device, dtype), for fused kernels that need one of each.

    Example:
        >>> g = group_by_device_dtype([torch.ones(1), torch.ones(1, dtype=torch.float64)])
        >>> sorted(len(v) for v in g.values())
        [1, 1]
    """
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return groups


def global_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all ``tensors`` taken together, as a float32 0-dim tensor.

    DTensor leaves (e.g. FSDP2-sharded grads) contribute their *global* norm:
    per-shard squared norms are reduced across the mesh, so every rank gets the
    same value. Stays on device (no host sync).

    Example:
        >>> global_norm([torch.tensor([3.0]), torch.tensor([4.0])])
        tensor(5.)
    """
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    plain: list[torch.Tensor] = []
    dist_sq: list[torch.Tensor] = []
    for t in tensors:
        if hasattr(t, "full_tensor"):
            n = torch.linalg.vector_norm(t, dtype=torch.float32)
            full: Callable[[], torch.Tensor] = getattr(n, "full_tensor")  # noqa: B009
            dist_sq.append(full() ** 2)
        else:
            plain.append(t)
    parts: list[torch.Tensor] = []
    by_dev: dict[torch.device, list[torch.Tensor]] = {}
    for t in plain:
        by_dev.setdefault(t.device, []).append(t)
    device = tensors[0].device if not dist_sq else dist_sq[0].device
    for dev_tensors in by_dev.values():
        norms = torch._foreach_norm(dev_tensors, 2, dtype=torch.float32)
        parts.append(torch.linalg.vector_norm(torch.stack(norms)).to(device) ** 2)
    parts.extend(d.to(device) for d in dist_sq)
    return torch.stack(parts).sum().sqrt()


def assert_same_structure(
    expected: TensorDictBase,
    actual: TensorDictBase,
    *,
    what: str = "grads",
    like: str = "params",
    check_shapes: bool = True,
) -> None:
    """Raise ``ValueError`` naming the key path(s) and shapes where two trees differ.

    Example:
        >>> from tensordict import TensorDict
        >>> a = TensorDict({"w": torch.ones(2)}, [])
        >>> assert_same_structure(a, a.clone())
    """
    ep, ap = paths(expected), paths(actual)
    if ep != ap:
        missing = sorted(set(ep) - set(ap))
        extra = sorted(set(ap) - set(ep))
        parts = []
        if missing:
            parts.append("missing " + ", ".join(format_path(p) for p in missing))
        if extra:
            parts.append("unexpected " + ", ".join(format_path(p) for p in extra))
        if not parts:
            parts.append("same keys in a different order")
        raise ValueError(f"{what} keys differ from {like}: " + "; ".join(parts))
    if check_shapes:
        for p, e, a in zip(ep, leaves(expected), leaves(actual), strict=True):
            if e.shape != a.shape:
                raise ValueError(
                    f"{what} at {format_path(p)} has shape {tuple(a.shape)}, "
                    f"but {like} has shape {tuple(e.shape)}"
                )


def map_leaves(fn: Callable[..., Any], *tds: TensorDictBase) -> TensorDict:
    """Apply ``fn`` leafwise over trees of the same structure (thin ``TensorDict.apply``).

    Example:
        >>> from tensordict import TensorDict
        >>> a = TensorDict({"w": torch.ones(2)}, [])
        >>> map_leaves(torch.add, a, a)["w"]
        tensor([2., 2.])
    """
    return tds[0].apply(fn, *tds[1:])  # type: ignore[no-any-return]
