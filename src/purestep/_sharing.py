"""Which leaves share memory? A donated step must not update one buffer twice.

:func:`shared_memory` finds pairs of leaves whose memory overlaps (and leaves
that overlap themselves: expanded tensors); :func:`sharing_message` is the
error both ``init_state`` and the step-entry check (``step._validate``) raise
for them. A base module (torch and ``tree`` only), so ``state``, which sits
below ``step``, can use it.

Example:
    >>> import torch
    >>> w = torch.zeros(4)
    >>> shared_memory([(("a",), w), (("b",), w[1:])])
    [(('a',), ('b',))]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from purestep import tree

__all__ = ["shared_memory", "sharing_message"]

KeyPath = tuple[str, ...]
_MAX_LISTED = 6


def _fmt(path: Sequence[str]) -> str:
    return tree.format_path(tuple(path))


def sharing_message(who: str, shared: Sequence[tuple[KeyPath, KeyPath]]) -> str:
    """The message for leaves that share memory (see :func:`shared_memory`).

    Example:
        >>> sharing_message("init_state", [(("params", "a", "w"), ("params", "b", "w"))])[:54]
        'init_state: params.a.w shares memory with params.b.w, '
    """
    parts = [
        f"{_fmt(x)} overlaps itself (an expanded tensor, stride 0)"
        if x == y
        else f"{_fmt(x)} shares memory with {_fmt(y)}"
        for x, y in shared[:_MAX_LISTED]
    ]
    return (
        f"{who}: {'; '.join(parts)}, so a donated step would update that memory twice. Give "
        "each role (and each leaf) its own tensors: init_state copies modules and keeps one "
        "leaf per tied parameter; pass a TensorDict as .clone() when another role (or "
        "another key) uses the same tensors"
    )


_EXACT_OVERLAP_LIMIT = 1 << 24  # elements; larger gapped tensors whose spans meet count as sharing


def _span(t: torch.Tensor) -> tuple[tuple[str, int | None], int, int] | None:
    """``(device, first byte, end byte)`` of the memory ``t`` can reach, or None (empty, meta)."""
    if type(t) is not torch.Tensor:
        t = tree.local(t)
    n = t.numel()
    if n == 0 or t.is_meta:
        return None
    try:
        start = int(t.data_ptr())
    except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
        return None
    if t.is_contiguous():
        reach = n - 1
    else:
        reach = sum(int(k - 1) * int(s) for k, s in zip(t.shape, t.stride(), strict=True))
    device = t.device
    return (device.type, device.index), start, start + (reach + 1) * int(t.element_size())


def _self_overlapping(t: torch.Tensor) -> bool:
    """A stride of 0 over a dimension of size > 1 (an expanded tensor)."""
    return not t.is_contiguous() and any(
        s == 0 and n > 1 for n, s in zip(t.shape, t.stride(), strict=True)
    )


def _dense(t: torch.Tensor) -> bool:
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _byte_offsets(t: torch.Tensor) -> torch.Tensor:
    """The first byte of every element of ``t`` (int64, CPU), relative to its storage."""
    off = torch.zeros((), dtype=torch.int64)
    for n, s in zip(t.shape, t.stride(), strict=True):
        off = off.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * s
    out: torch.Tensor = (off.reshape(-1) + int(t.storage_offset())) * int(t.element_size())
    return out


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors whose memory spans meet share an element."""
    a, b = tree.local(a), tree.local(b)
    if _dense(a) and _dense(b):
        return True  # a dense tensor covers every byte of its span
    if a.numel() > _EXACT_OVERLAP_LIMIT or b.numel() > _EXACT_OVERLAP_LIMIT:
        return True
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return True  # different storages over the same bytes: give up, say shared
    return bool(torch.isin(_byte_offsets(a), _byte_offsets(b)).any())


def shared_memory(items: Iterable[tuple[KeyPath, torch.Tensor]]) -> list[tuple[KeyPath, KeyPath]]:
    """Pairs of leaves that share memory, and leaves that overlap themselves.

    A leaf whose elements overlap each other (an expanded tensor: a stride of
    0 over a dimension of size > 1) is reported as ``(path, path)``. Empty and
    ``meta`` tensors share nothing; views of one buffer that do not overlap
    (disjoint slices) do not count. An in-place update of such leaves (a
    donated step) would write the same memory twice.

    Example:
        >>> w = torch.zeros(4)
        >>> shared_memory([(("a",), w), (("b",), w[2:]), (("c",), w.clone())])
        [(('a',), ('b',))]
        >>> shared_memory([(("a",), w[:2]), (("b",), w[2:])])
        []
        >>> shared_memory([(("e",), torch.zeros(1).expand(3))])
        [(('e',), ('e',))]
    """
    listed = list(items)
    found: list[tuple[KeyPath, KeyPath]] = []
    spans: list[tuple[tuple[str, int | None], int, int, int]] = []
    for i, (path, t) in enumerate(listed):
        span = _span(t)
        if span is None:
            continue
        if _self_overlapping(t):
            found.append((path, path))
        spans.append((*span, i))
    spans.sort(key=lambda s: (s[0][0], -1 if s[0][1] is None else s[0][1], s[1], s[2], s[3]))
    for j, (dev, _start, end, i) in enumerate(spans):
        for dev2, start2, _end2, i2 in spans[j + 1 :]:
            if dev2 != dev or start2 >= end:
                break
            if _overlap(listed[i][1], listed[i2][1]):
                first, second = sorted((i, i2))
                found.append((listed[first][0], listed[second][0]))
    return found
