"""The async half of :func:`purestep.distributed.checkpoint.save`: staging and the writer thread.

At most one save is in flight per process (:data:`_pending`). Staging copies
every tensor into CPU buffers kept for reuse by the next async save of the same
keys, so the caller may update the state in place as soon as ``save`` returns.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

_pending_lock = threading.Lock()
_pending: SaveHandle | None = None
_executor: concurrent.futures.ThreadPoolExecutor | None = None
_staging: dict[str, torch.Tensor] = {}


class SaveHandle:
    """The in-flight part of an async :func:`save`: write, ``metadata.json``, rename.

    Invariant: the state's tensors were copied (staged) before the handle was
    returned, so the caller may overwrite them; the checkpoint at :attr:`path`
    is complete once :meth:`wait` returns on any rank.

    Example:
        >>> import tempfile, torch
        >>> from tensordict import TensorDict
        >>> from purestep.checkpoint import save
        >>> h = save(TensorDict({"x": torch.ones(1)}, []), tempfile.mkdtemp() + "/c", async_=True)
        >>> h.wait().name
        'c'
    """

    def __init__(
        self,
        future: concurrent.futures.Future[Path],
        path: Path,
        *,
        scratch: tuple[Path, ...] = (),
    ) -> None:
        self._future = future
        self.path = path
        self._scratch = scratch

    def done(self) -> bool:
        """Whether the background save has finished (successfully or not).

        Example:
            >>> import tempfile, torch
            >>> from tensordict import TensorDict
            >>> from purestep.checkpoint import save
            >>> h = save(TensorDict({"x": torch.ones(1)}, []), tempfile.mkdtemp() + "/c", async_=True)
            >>> _ = h.wait(); h.done()
            True
        """
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Path:
        """Block until the checkpoint is complete; re-raise a failure of the save.

        Example:
            >>> import tempfile, torch
            >>> from tensordict import TensorDict
            >>> from purestep.checkpoint import save
            >>> h = save(TensorDict({"x": torch.ones(1)}, []), tempfile.mkdtemp() + "/c", async_=True)
            >>> h.wait().name
            'c'
        """
        global _pending
        try:
            return self._future.result(timeout)
        finally:
            if self._future.done():
                with _pending_lock:
                    if _pending is self:
                        _pending = None


def wait_pending() -> None:
    """Wait for the in-flight async save of this process, if any (re-raising its failure).

    Staging finishes before :func:`save` returns, so donated in-place updates
    need not call this; call it before exit, or before reading a checkpoint
    that may still be in flight.

    Example:
        >>> wait_pending()
    """
    with _pending_lock:
        handle = _pending
    if handle is not None:
        handle.wait()


def release_staging_buffers() -> None:
    """Free the CPU staging buffers that async saves keep for reuse (after waiting for them).

    Example:
        >>> release_staging_buffers()
    """
    wait_pending()
    _staging.clear()


def _busy_scratch() -> set[Path]:
    with _pending_lock:
        handle = _pending
    if handle is None or handle.done():
        return set()
    return set(handle._scratch)


def _stage(flat: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy every tensor (the local shard of a DTensor) into a reusable CPU buffer."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    for k, t in flat.items():
        src = t.to_local() if isinstance(t, DTensor) else t
        buf = _staging.get(k)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu")
            _staging[k] = buf
        with torch.no_grad():
            buf.copy_(src.detach())
        if isinstance(t, DTensor):
            out[k] = DTensor.from_local(
                buf, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
            )
        else:
            out[k] = buf
    for k in [k for k in _staging if k not in flat]:
        del _staging[k]
    return out


def submit(
    write: Callable[..., Path], args: tuple[Any, ...], target: Path, scratch: tuple[Path, ...]
) -> SaveHandle:
    """Run ``write(*args)`` on the checkpoint thread; it becomes this process's pending save."""
    global _pending, _executor
    if _executor is None:
        _executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="purestep-ckpt")
    handle = SaveHandle(_executor.submit(write, *args), target, scratch=scratch)
    with _pending_lock:
        _pending = handle
    return handle
