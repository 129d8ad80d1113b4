"""``run``'s guard against a stuck rank: a collective timeout and a clear error when it fires."""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterator

import torch.distributed as dist

from purestep.distributed import timeouts

__all__ = ["CollectiveTimeoutError", "guard_collectives"]


class CollectiveTimeoutError(RuntimeError):
    """A collective waited longer than its timeout: another rank is stuck (or far slower).

    Raised by :func:`purestep.loop.run` on each rank whose collective timed out,
    with torch's error as ``__cause__``; the job cannot continue (the other
    ranks are not where this one is). Find the stuck rank from its own log.

    Example:
        >>> isinstance(CollectiveTimeoutError("rank 0 waited"), RuntimeError)
        True
    """


def _seconds(t: datetime.timedelta | None) -> str:
    return "unknown" if t is None else f"{t.total_seconds():g} s"


@contextlib.contextmanager
def guard_collectives(
    timeout: float | datetime.timedelta | None, where: Callable[[], str]
) -> Iterator[None]:
    """Within the block, the default group's collectives time out after ``timeout``.

    ``None`` keeps the group's own timeout (``init_process_group(timeout=...)``).
    A timed-out collective inside the block is re-raised as
    :class:`CollectiveTimeoutError` naming ``where()`` (the step). The old
    timeout is restored on exit. Without a process group this does nothing.
    """
    if not (dist.is_available() and dist.is_initialized()):
        yield
        return
    old = timeouts.get_timeout()
    if timeout is not None:
        timeouts.set_timeout(timeout)
    try:
        yield
    except Exception as e:
        if not timeouts.is_timeout(e):
            raise
        raise CollectiveTimeoutError(
            f"run: rank {dist.get_rank()} of {dist.get_world_size()} waited longer than the "
            f"collective timeout ({_seconds(timeouts.get_timeout())}) for the other ranks "
            f"{where()}: another rank is stuck (or far slower). Stopping; the newest complete "
            f"checkpoint is intact. ({type(e).__name__}: {e})"
        ) from e
    finally:
        if timeout is not None and old is not None:
            with contextlib.suppress(Exception):
                timeouts.set_timeout(old)
