"""Process-group helpers of :mod:`purestep.distributed.checkpoint`.

Checkpoint collectives run on a dedicated gloo group (created on first use), so
an async save's background thread never competes with training collectives.
Without a default process group every helper acts for one process.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch.distributed as dist

_NO_DIST_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized"

_group_lock = threading.Lock()
_group_cache: tuple[Any, Any] | None = None  # (default group, checkpoint group)


def _group() -> Any:
    """The dedicated gloo group for checkpoint collectives, or ``None`` without a default group."""
    global _group_cache
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    with _group_lock:
        if _group_cache is None or _group_cache[0] is not world:
            _group_cache = (world, dist.new_group(backend="gloo"))
        return _group_cache[1]


def _rank(group: Any) -> int:
    return 0 if group is None else dist.get_rank()


def _world(group: Any) -> int:
    return 1 if group is None else dist.get_world_size()


def _gather(group: Any, value: Any) -> list[Any]:
    """``value`` from every rank, in rank order (``[value]`` without a group)."""
    if group is None:
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


_ERRORS: dict[str, type[Exception]] = {
    "FileExistsError": FileExistsError,
    "FileNotFoundError": FileNotFoundError,
    "RuntimeError": RuntimeError,
    "ValueError": ValueError,
}


def _raise_agreed(group: Any, problem: Exception | None) -> None:
    """Raise the lowest rank's problem on every rank (so all fail together instead of hanging).

    One collective with a process group; without one, just raises ``problem``.
    """
    if group is None:
        if problem is not None:
            raise problem
        return
    local = None if problem is None else (type(problem).__name__, str(problem))
    for r, found in enumerate(_gather(group, local)):
        if found is not None:
            if r == _rank(group) and problem is not None:
                raise problem
            name, msg = found
            raise _ERRORS.get(name, RuntimeError)(f"(on rank {r}) {msg}")


def _quiet_no_dist() -> None:
    """Silence DCP's 'assuming a single process' warning: purestep decides that explicitly."""
    for f in warnings.filters:
        if f[0] == "ignore" and f[1] is not None and f[1].pattern == _NO_DIST_WARNING:
            return
    warnings.filterwarnings("ignore", message=_NO_DIST_WARNING, category=UserWarning)
