"""Guarded checkpoint-record internals: DCP's chunk narrowing, non-zip ``torch.save`` records
and DCP's CPU loaders (used by ``distributed/_storage``).

Example:
    >>> import torch
    >>> from purestep._compat._records import narrow_tensor_by_index
    >>> narrow_tensor_by_index(torch.arange(6.0).reshape(2, 3), (1, 1), (1, 2))
    tensor([[4., 5.]])
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from purestep._compat._probe import _choose


def _narrow_public(
    tensor: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]
) -> torch.Tensor:
    """``tensor[o0:o0+s0, o1:o1+s1, ...]`` as a chain of ``Tensor.narrow`` (a view)."""
    for d, (o, s) in enumerate(zip(offsets, sizes, strict=True)):
        if o != 0 or s != tensor.size(d):
            tensor = tensor.narrow(d, o, s)
    return tensor


def _private_narrow() -> Callable[..., torch.Tensor]:
    from torch.distributed._shard._utils import narrow_tensor_by_index as fn

    return fn


def _probe_narrow() -> bool:
    t = torch.arange(24.0).reshape(4, 6)
    for offsets, sizes in (((1, 2), (2, 3)), ((0, 0), (4, 6)), ((3, 5), (1, 1))):
        got, want = _private_narrow()(t, offsets, sizes), _narrow_public(t, offsets, sizes)
        if not torch.equal(got, want) or got.data_ptr() != want.data_ptr():
            return False
    return True


narrow_tensor_by_index: Callable[[torch.Tensor, Sequence[int], Sequence[int]], torch.Tensor] = (
    _choose(
        "torch.distributed._shard._utils.narrow_tensor_by_index",
        _probe_narrow,
        _private_narrow,
        _narrow_public,
    )
)
"""The chunk ``offsets``/``sizes`` of ``tensor`` as a view (as DCP's own reader narrows)."""


def _save_non_zip(tensor: torch.Tensor, stream: Any, zip_: bool) -> None:
    torch.save(tensor, stream, _use_new_zipfile_serialization=zip_)


def _save_public(tensor: torch.Tensor, stream: Any, zip_: bool) -> None:
    torch.save(tensor, stream)  # always a zip record


def _probe_non_zip() -> bool:
    t = torch.arange(5, dtype=torch.float32)
    buf = io.BytesIO()
    _save_non_zip(t, buf, False)
    raw = buf.getvalue()
    if zipfile.is_zipfile(io.BytesIO(raw)):
        return False
    tail = (5).to_bytes(8, "little") + t.numpy().tobytes()
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    return raw.endswith(tail) and torch.equal(back, t)


NON_ZIP_RECORDS: bool = _choose(
    "torch.save(_use_new_zipfile_serialization=False)", _probe_non_zip, lambda: True, False
)
"""Whether checkpoint records may use ``torch.save``'s non-zip format (see ``distributed/_storage``)."""

save_record: Callable[[torch.Tensor, Any, bool], None] = (
    _save_non_zip if NON_ZIP_RECORDS else _save_public
)
"""``save_record(tensor, stream, zip_)``: ``torch.save`` a record, non-zip unless ``zip_``
(always zip when :data:`NON_ZIP_RECORDS` is False)."""


class _PublicCpuLoader:
    """DCP's serial CPU loader, in public calls: each item resolved, detached, on the CPU, in order.

    A view of a larger storage is copied so only its own bytes are written (as DCP does).
    """

    def __init__(self, resolve: Callable[[Any], Any]) -> None:
        self.resolve = resolve
        self.items: list[Any] = []

    def add(self, size: int, obj: Any) -> None:
        self.items.append(obj)

    def start_loading(self) -> None:
        pass

    def values(self) -> Iterator[tuple[torch.Tensor, Any]]:
        for obj in self.items:
            t = self.resolve(obj).detach().cpu()
            if t.untyped_storage().size() != t.nbytes:
                t = t.clone()
            yield t, obj


def _private_cpu_loader(resolve: Callable[[Any], Any], copy_ahead: int) -> Any:
    from torch.distributed.checkpoint import filesystem as fs

    if torch.cuda.is_available() and copy_ahead > 0:
        return fs._OverlappingCpuLoader(resolve, inflight_threshhold=copy_ahead)
    return fs._SerialCpuLoader(resolve)


def _probe_cpu_loader() -> bool:
    import inspect

    from torch.distributed.checkpoint import filesystem as fs

    if "inflight_threshhold" not in inspect.signature(fs._OverlappingCpuLoader).parameters:
        return False
    items = [torch.arange(6.0)[1:4], torch.ones(2, dtype=torch.bfloat16)]
    loader = _private_cpu_loader(items.__getitem__, 0)
    for i, t in enumerate(items):
        loader.add(t.nbytes, i)
    loader.start_loading()
    out = list(loader.values())
    return [o for _, o in out] == [0, 1] and all(
        torch.equal(t, items[o])
        and t.device.type == "cpu"
        and t.untyped_storage().size() == t.nbytes
        for t, o in out
    )


cpu_loader: Callable[[Callable[[Any], Any], int], Any] = _choose(
    "torch.distributed.checkpoint.filesystem._SerialCpuLoader/_OverlappingCpuLoader",
    _probe_cpu_loader,
    lambda: _private_cpu_loader,
    lambda resolve, copy_ahead: _PublicCpuLoader(resolve),
)
"""``cpu_loader(resolve, copy_ahead)``: DCP's loader of a save plan's tensors to the CPU
(``add(size, item)``, ``start_loading()``, ``values()`` -> ``(cpu tensor, item)`` in order);
the public fallback loads serially (no copy-ahead overlap on a GPU)."""
