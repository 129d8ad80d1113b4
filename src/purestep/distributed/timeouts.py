"""Collective timeouts: read and set a process group's, and recognise a timed-out collective.

A rank that hangs (a stuck data loader, a deadlock) leaves the other ranks
waiting in their next collective until the group's timeout, which torch sets
to 30 minutes (10 for NCCL) unless ``init_process_group(timeout=...)`` says
otherwise. With gloo a collective that waits longer than the timeout raises
a ``RuntimeError`` ("Timed out waiting ... ms"); NCCL's watchdog aborts the
process. Set it when the group is created::

    torch.distributed.init_process_group("nccl", timeout=datetime.timedelta(seconds=300))

or later, for the default group, with :func:`set_timeout` (what
``purestep.loop.run(collective_timeout=...)`` does for the duration of a run).
Checkpoint collectives run on their own gloo group, which follows the default
group's timeout.

Example:
    >>> get_timeout() is None  # no process group in this process
    True
"""

from __future__ import annotations

import datetime
import re
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["get_timeout", "is_timeout", "set_timeout"]

_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)


def _default(group: Any) -> Any:
    if group is not None:
        return group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def get_timeout(group: Any = None) -> datetime.timedelta | None:
    """The collective timeout of ``group`` (default: the default group); ``None`` if unknown.

    Example:
        >>> get_timeout() is None
        True
    """
    g = _default(group)
    if g is None:
        return None
    for device in ("cpu", "cuda"):
        try:
            t = g._get_backend(torch.device(device)).options._timeout
        except Exception:
            continue
        if isinstance(t, datetime.timedelta):
            return t
    return None


def set_timeout(timeout: datetime.timedelta | float, group: Any = None) -> None:
    """Set the collective timeout of ``group`` (default: the default group); local, not a collective.

    ``timeout`` in seconds or as a ``timedelta``. Without a process group, does nothing.

    Raises:
        ValueError: ``timeout`` is not positive.
        RuntimeError: this torch cannot change a group's timeout (pass
            ``timeout=`` to ``init_process_group`` instead).

    Example:
        >>> set_timeout(30.0)  # no process group here: nothing to do
    """
    td = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
    if td.total_seconds() <= 0:
        raise ValueError(f"a collective timeout must be positive, got {timeout!r}")
    g = _default(group)
    if g is None:
        return
    from torch.distributed import distributed_c10d

    fn = getattr(distributed_c10d, "_set_pg_timeout", None)
    if fn is None:  # pragma: no cover - present in every supported torch
        raise RuntimeError(
            "this torch cannot change a process group's timeout; pass "
            "timeout=datetime.timedelta(...) to torch.distributed.init_process_group instead"
        )
    fn(td, g)


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a collective that timed out.

    Example:
        >>> is_timeout(RuntimeError("Timed out waiting 3000ms for recv operation to complete"))
        True
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (RuntimeError, TimeoutError)) and _TIMEOUT.search(str(e)):
            return True
        e = e.__cause__ or e.__context__
    return False
