"""Preemption: SIGTERM / SIGINT set a flag that the loop checks between steps."""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["StopSignal"]

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


_group_cache: tuple[Any, Any] | None = None  # (default group, its gloo control group)


def _control_group() -> Any:
    """A gloo group for the per-step flag (``None``: the default group is gloo already)."""
    global _group_cache
    world = dist.group.WORLD
    if _group_cache is None or _group_cache[0] is not world:
        gloo = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        _group_cache = (world, gloo)
    return _group_cache[1]


class StopSignal:
    """Context manager catching the first SIGTERM or SIGINT (Ctrl-C) as a request to stop.

    The first signal only records its number; the loop finishes the current step,
    saves and stops. The first signal also re-arms both signals to act at once:
    a second SIGINT raises ``KeyboardInterrupt`` wherever the program is, a second
    SIGTERM terminates the process (the default action). The previous handlers are
    restored on exit. Outside the main thread no handler can be installed and the
    context does nothing.

    With a process group of several ranks, :meth:`poll` agrees on the flag across
    ranks (a MAX all-reduce of one integer on a gloo group, once per step), so
    every rank stops after the same step even if the signal reached them at
    different times.
    """

    def __init__(self) -> None:
        self.signum = 0
        self._old: dict[int, Any] = {}
        self._group: Any = None
        self._distributed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if self.signum == 0:
            self.signum = signum
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for s in _SIGNALS:
                self._old[s] = signal.getsignal(s)
                signal.signal(s, self._handle)
        self._distributed = (
            dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        )
        if self._distributed:
            self._group = _control_group()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for s, old in self._old.items():
            signal.signal(s, old if old is not None else signal.SIG_DFL)
        self._old = {}

    def poll(self) -> int:
        """The signal to stop for (0: none), the same on every rank."""
        if not self._distributed:
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return int(flag.item())
