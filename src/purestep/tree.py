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

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase

from purestep import _compat
from purestep._norms import global_norm, norm_memo

__all__ = [
    "KeyPath",
    "assert_same_structure",
    "clone",
    "copy_",
    "first_leaf",
    "format_path",
    "global_norm",
    "group_by_device_dtype",
    "keyed_leaves",
    "leaves",
    "local",
    "map_with_leaves",
    "merge",
    "norm_memo",
    "paths",
    "plain_td",
    "rebuild",
    "select",
    "unflatten",
    "zeros_like",
]

KeyPath = tuple[str, ...]


def _as_path(key: str | tuple[str, ...]) -> KeyPath:
    return (key,) if isinstance(key, str) else tuple(key)


# Fast walkers. ``TensorDict.keys/values(include_nested=True)`` cost ~1 µs per
# leaf, which on a 150-leaf model is several percent of a fused optimizer step.
# For plain nested ``TensorDict`` trees (the state's layout) we walk the
# underlying dicts directly (~0.2 µs per leaf), in the same depth-first
# insertion order; any other node type (lazy stacks, non-tensor data, ...)
# falls back to the generic TensorDict API.


def _collect_leaves(td: TensorDict, out: list[torch.Tensor]) -> bool:
    for v in td._tensordict.values():
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif type(v) is not TensorDict or not _collect_leaves(v, out):
            return False
    return True


def _collect_items(
    td: TensorDict, prefix: KeyPath, keys: list[KeyPath], vals: list[torch.Tensor]
) -> bool:
    for k, v in td._tensordict.items():
        if isinstance(v, torch.Tensor):
            keys.append((*prefix, k))
            vals.append(v)
        elif type(v) is not TensorDict or not _collect_items(v, (*prefix, k), keys, vals):
            return False
    return True


def _flatten(td: TensorDictBase) -> tuple[list[KeyPath], list[torch.Tensor]] | None:
    """``(paths, leaves)`` by the fast walk, or None when ``td`` needs the generic API."""
    if type(td) is not _compat.PLAIN_TD:
        return None
    keys: list[KeyPath] = []
    vals: list[torch.Tensor] = []
    return (keys, vals) if _collect_items(td, (), keys, vals) else None


_GENERIC_KEY = object()  # marks structure keys built from paths (no plain signature collides)


def _collect_signature(td: TensorDict, out: list[torch.Tensor]) -> tuple[Any, ...] | None:
    sig: list[Any] = []
    for k, v in td._tensordict.items():
        if isinstance(v, torch.Tensor):
            out.append(v)
            sig.append(k)
        elif type(v) is TensorDict:
            sub = _collect_signature(v, out)
            if sub is None:
                return None
            sig.append((k, sub))
        else:
            return None
    return tuple(sig)


def keyed_leaves(td: TensorDictBase) -> tuple[Hashable, list[torch.Tensor]]:
    """``(structure, leaves)`` in one walk: a hashable key of the tree's key layout, and :func:`leaves`.

    Two trees have equal structure keys exactly when they have the same key
    paths in the same order (shapes are not part of it), so a plan computed
    from :func:`paths` can be cached under it without building the paths.

    Example:
        >>> from tensordict import TensorDict
        >>> a = TensorDict({"m": {"w": torch.ones(1)}, "b": torch.zeros(2)}, [])
        >>> key, ls = keyed_leaves(a)
        >>> key == keyed_leaves(a.clone())[0], len(ls)
        (True, 2)
    """
    if type(td) is _compat.PLAIN_TD:
        out: list[torch.Tensor] = []
        sig = _collect_signature(td, out)
        if sig is not None:
            return sig, out
    return (_GENERIC_KEY, tuple(paths(td))), leaves(td)


def _same_structure(a: TensorDict, b: TensorDict, check_shapes: bool) -> bool:
    """True when plain TensorDicts ``a`` and ``b`` have the same keys (in order) and shapes."""
    da, db = a._tensordict, b._tensordict
    if list(da) != list(db):
        return False
    for k, va in da.items():
        vb = db[k]
        if isinstance(va, torch.Tensor):
            if not isinstance(vb, torch.Tensor) or (check_shapes and va.shape != vb.shape):
                return False
        elif (
            type(va) is not TensorDict
            or type(vb) is not TensorDict
            or not _same_structure(va, vb, check_shapes)
        ):
            return False
    return True


def paths(td: TensorDictBase) -> list[KeyPath]:
    """Key paths of every leaf, in leaf-list order.

    Example:
        >>> from tensordict import TensorDict
        >>> paths(TensorDict({"a": {"b": torch.ones(1)}}, []))
        [('a', 'b')]
    """
    flat = _flatten(td)
    if flat is not None:
        return flat[0]
    return [_as_path(k) for k in td.keys(include_nested=True, leaves_only=True)]


def leaves(td: TensorDictBase) -> list[torch.Tensor]:
    """All leaf tensors, in the canonical depth-first order (no copies).

    Example:
        >>> from tensordict import TensorDict
        >>> leaves(TensorDict({"a": torch.ones(1), "b": torch.zeros(2)}, []))[1]
        tensor([0., 0.])
    """
    if type(td) is _compat.PLAIN_TD:
        out: list[torch.Tensor] = []
        if _collect_leaves(td, out):
            return out
    return [cast(torch.Tensor, v) for v in td.values(include_nested=True, leaves_only=True)]


def first_leaf(td: TensorDictBase) -> torch.Tensor | None:
    """The first leaf in :func:`leaves` order, or ``None`` for a tree without leaves.

    Example:
        >>> from tensordict import TensorDict
        >>> first_leaf(TensorDict({"a": {"b": torch.ones(1)}, "c": torch.zeros(1)}, []))
        tensor([1.])
    """
    if type(td) is _compat.PLAIN_TD:
        ok, found = _first_plain(td)
        if ok:
            return found
    first = next(iter(td.values(include_nested=True, leaves_only=True)), None)
    return first if isinstance(first, torch.Tensor) else None


def _first_plain(td: TensorDict) -> tuple[bool, torch.Tensor | None]:
    """``(True, first leaf or None)`` for a plain tree; ``(False, None)`` if a node needs the API."""
    for v in td._tensordict.values():
        if isinstance(v, torch.Tensor):
            return True, v
        if type(v) is not TensorDict:
            return False, None
        ok, found = _first_plain(v)
        if not ok or found is not None:
            return ok, found
    return True, None


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
    new: list[torch.Tensor] = new_leaves if isinstance(new_leaves, list) else list(new_leaves)
    it = iter(new)

    def take(_: torch.Tensor) -> torch.Tensor:
        try:
            return next(it)
        except StopIteration:
            raise ValueError(
                f"rebuild: fewer leaves ({len(new)}) than the template tree has"
            ) from None

    out = _map_plain(like, take, []) if type(like) is _compat.PLAIN_TD else None
    if out is None:  # generic TensorDict API (any node type, batch dims, devices)
        it = iter(new)
        out = like.apply(take)
        assert out is not None
    if next(it, None) is not None:
        used = len(leaves(like))
        raise ValueError(
            f"rebuild: more leaves than the template tree has ({len(new)} given, {used} used)"
        )
    return out


_NO_DIMS = torch.Size([])


def plain_td(items: dict[str, Any], batch_size: torch.Size = _NO_DIMS) -> TensorDict:
    """``TensorDict(items, batch_size)`` without the constructor's per-entry checks.

    For values the caller knows are valid: tensors whose leading dims match
    ``batch_size``, and TensorDict nodes with that batch size and no device
    (trees this library built). Nested plain dicts are not converted. Skipping
    the checks matters because every step builds several trees.

    Example:
        >>> plain_td({"w": torch.ones(2)})["w"]
        tensor([1., 1.])
    """
    td: TensorDict = _compat.new_td(items, batch_size=batch_size, nested=False)
    return td


def map_with_leaves(
    td: TensorDictBase, fn: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[TensorDict, list[torch.Tensor]]:
    """``rebuild(td, [fn(t) for t in leaves(td)])`` and that list, in one walk.

    Example:
        >>> from tensordict import TensorDict
        >>> new, ls = map_with_leaves(TensorDict({"a": torch.ones(2)}, []), torch.zeros_like)
        >>> new["a"] is ls[0], ls[0]
        (True, tensor([0., 0.]))
    """
    out: list[torch.Tensor] = []
    built = _map_plain(td, fn, out) if type(td) is _compat.PLAIN_TD else None
    if built is None:
        out = [fn(t) for t in leaves(td)]
        built = rebuild(td, out)
    return built, out


def _map_plain(
    like: TensorDict, fn: Callable[[torch.Tensor], torch.Tensor], out: list[torch.Tensor]
) -> TensorDict | None:
    """``like.apply(fn)`` for plain TensorDicts without batch dims or device, without its overhead.

    Builds the nodes directly (as ``apply`` does after its checks, which are no-ops
    for ``batch_size=[]`` and ``device=None``) and appends each new leaf to ``out``.
    Returns None, having built nothing visible, when some node needs the generic API.
    """
    if like._device is not None or like._batch_size:
        return None
    src: dict[str, Any] = {}
    for k, v in like._tensordict.items():
        if isinstance(v, torch.Tensor):
            new = src[k] = fn(v)
            out.append(new)
        elif type(v) is TensorDict:
            sub = _map_plain(v, fn, out)
            if sub is None:
                return None
            src[k] = sub
        else:
            return None
    return plain_td(src, like._batch_size)


def merge(
    a: TensorDictBase, b: TensorDictBase, *, what: str = "trees", keep_a: bool = False
) -> TensorDict:
    """The union of two trees with disjoint leaf paths (``a``'s order first); no copies.

    Raises ``ValueError`` naming the path where both have a leaf (unless
    ``keep_a``: then ``a``'s leaf wins), or where one has a leaf and the other
    a subtree.

    Example:
        >>> from tensordict import TensorDict
        >>> p = TensorDict({"bn": {"weight": torch.ones(1)}}, [])
        >>> b = TensorDict({"bn": {"running_mean": torch.zeros(1)}}, [])
        >>> paths(merge(p, b))
        [('bn', 'weight'), ('bn', 'running_mean')]
    """

    def node(td: TensorDictBase) -> dict[str, Any]:
        return dict(td._tensordict) if type(td) is _compat.PLAIN_TD else dict(td.items())

    def rec(x: TensorDictBase, y: TensorDictBase, prefix: KeyPath) -> TensorDict:
        out = node(x)
        for k, v in node(y).items():
            mine = out.get(k)
            if mine is None:
                out[k] = v
            elif isinstance(mine, TensorDictBase) and isinstance(v, TensorDictBase):
                out[k] = rec(mine, v, (*prefix, k))
            elif keep_a and isinstance(mine, torch.Tensor) and isinstance(v, torch.Tensor):
                continue
            else:
                raise ValueError(f"{what}: both trees have {format_path((*prefix, k))!r}")
        return plain_td(out)

    return rec(a, b, ())


def select(like: TensorDictBase, values: Sequence[torch.Tensor | None]) -> TensorDict:
    """A tree with ``like``'s paths where ``values`` (in :func:`leaves` order) is not None.

    Subtrees left without leaves are dropped.

    Example:
        >>> from tensordict import TensorDict
        >>> td = TensorDict({"a": torch.ones(1), "b": {"c": torch.ones(1)}}, [])
        >>> paths(select(td, [torch.zeros(1), None]))
        [('a',)]
    """
    if all(v is not None for v in values):
        return rebuild(like, cast(list[torch.Tensor], values))
    ps = paths(like)
    if len(ps) != len(values):
        raise ValueError(f"select: {len(values)} values for a tree of {len(ps)} leaves")
    return unflatten([(p, v) for p, v in zip(ps, values, strict=True) if v is not None])


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
    return cast(TensorDict, td.clone())


def zeros_like(td: TensorDictBase) -> TensorDict:
    """Zeros with ``td``'s structure, shapes, dtypes and devices.

    Example:
        >>> from tensordict import TensorDict
        >>> zeros_like(TensorDict({"x": torch.ones(2)}, []))["x"]
        tensor([0., 0.])
    """
    return cast(TensorDict, td.apply(torch.zeros_like))


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
    _compat.foreach_copy_([local(t) for t in dst], [local(t) for t in src])


def group_by_device_dtype(
    tensors: Sequence[torch.Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Indices of ``tensors`` grouped by (device, dtype), for fused kernels that need one of each.

    Example:
        >>> g = group_by_device_dtype([torch.ones(1), torch.ones(1, dtype=torch.float64)])
        >>> sorted(len(v) for v in g.values())
        [1, 1]
    """
    if not tensors:
        return {}
    device, dtype = tensors[0].device, tensors[0].dtype
    if all(t.dtype is dtype and t.device == device for t in tensors):
        return {(device, dtype): list(range(len(tensors)))}  # the common case, one group
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return groups


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
    if (
        type(expected) is _compat.PLAIN_TD
        and type(actual) is _compat.PLAIN_TD
        and _same_structure(expected, actual, check_shapes)
    ):
        return
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
