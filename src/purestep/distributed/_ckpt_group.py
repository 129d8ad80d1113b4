"""Process-group helpers of :mod:`purestep.distributed.checkpoint`.

Checkpoint collectives run on a dedicated gloo group (created on first use), so
an async save's background thread never competes with training collectives.
The group uses the default group's timeout (and follows later changes of it),
not torch's 30-minute default for new groups, so a rank stuck elsewhere ends a
checkpoint collective as soon as it would end a training one. Without a
default process group every helper acts for one process.

Errors are *agreed*: :func:`_raise_agreed` sends every rank's problem to all
ranks and raises the lowest rank's on each, so all ranks fail together with
the same :class:`CheckpointError` class, message and attributes (its cause
too, when it pickles) instead of some ranks hanging in the next collective.
"""

from __future__ import annotations

import pickle
import threading
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from purestep.distributed._ckpt_errors import ERROR_TYPES, CheckpointError
from purestep.distributed.timeouts import get_timeout, set_timeout

_NO_DIST_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized"

_group_lock = threading.Lock()
_group_cache: tuple[Any, Any] | None = None  # (default group, checkpoint group)


def _group() -> Any:
    """The dedicated gloo group for checkpoint collectives, or ``None`` without a default group."""
    global _group_cache
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    timeout = get_timeout(world)
    with _group_lock:
        if _group_cache is None or _group_cache[0] is not world:
            _group_cache = (world, dist.new_group(backend="gloo", timeout=timeout))
        group = _group_cache[1]
    if timeout is not None and get_timeout(group) != timeout:
        set_timeout(timeout, group)
    return group


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


def _portable(problem: CheckpointError) -> tuple[str, str, dict[str, Any], bytes | None]:
    """What another rank needs to re-create ``problem``: class name, message, attributes, cause."""
    cause = problem.__cause__
    blob = None
    if cause is not None:
        try:
            blob = pickle.dumps(cause)
            pickle.loads(blob)
        except Exception:
            blob = pickle.dumps(RuntimeError(f"{type(cause).__name__}: {cause}"))
    return type(problem).__name__, str(problem), problem.details(), blob


def _rebuild(found: tuple[str, str, dict[str, Any], bytes | None], rank: int) -> CheckpointError:
    name, msg, details, blob = found
    err = ERROR_TYPES.get(name, CheckpointError)(f"(on rank {rank}) {msg}", **details)
    if blob is not None:
        err.__cause__ = pickle.loads(blob)
    return err


def _raise_agreed(group: Any, problem: CheckpointError | None, what: str = "checkpoint") -> None:
    """Raise the lowest rank's problem on every rank (so all fail together instead of hanging).

    One collective with a process group; without one, just raises ``problem``.
    If the collective itself fails (a peer died or timed out), raises
    :class:`CheckpointError` with that failure as its cause (and this rank's
    own problem, if any, in the message).
    """
    if group is None:
        if problem is not None:
            raise problem
        return
    local = None if problem is None else _portable(problem)
    try:
        gathered = _gather(group, local)
    except Exception as e:
        own = "" if problem is None else f" (this rank had failed: {problem})"
        raise CheckpointError(
            f"{what}: a collective with the other ranks failed{own}: {e}",
            **({} if problem is None else problem.details()),
        ) from e
    for r, found in enumerate(gathered):
        if found is not None:
            if r == _rank(group) and problem is not None:
                raise problem
            raise _rebuild(found, r)


def from_dcp(
    e: CheckpointException, path: Path, cls: type[CheckpointError], doing: str
) -> BaseException:
    """The lowest rank's failure inside DCP's ``CheckpointException`` (a ``BaseException``)
    as a :class:`CheckpointError` (``cls`` unless it already is one) with the failure chained.

    A ``KeyboardInterrupt`` or ``SystemExit`` that DCP wrapped is returned as is.
    """
    failures = e.failures
    if not failures:
        return cls(f"{doing} checkpoint {path} failed: {e}", path=path)
    rank = min(failures)
    exc = failures[rank][0]
    distributed = dist.is_available() and dist.is_initialized()
    own = [r for r, (x, _) in failures.items() if not isinstance(x, Exception)]
    me = dist.get_rank() if distributed else 0
    if me in own:  # this rank was interrupted: that wins over any other rank's failure
        return failures[me][0]
    where = f" (on rank {rank})" if distributed else ""
    if not isinstance(exc, Exception):
        err = cls(f"{doing} checkpoint {path} was interrupted{where}: {exc!r}", path=path)
        err.__cause__ = exc
        return err
    if isinstance(exc, CheckpointError):
        if where and not str(exc).startswith("(on rank"):
            out = type(exc)(f"{where.strip()} {exc}", **exc.details())
            out.__cause__ = exc.__cause__
            return out
        return exc
    err = cls(f"{doing} checkpoint {path} failed{where}: {type(exc).__name__}: {exc}", path=path)
    err.__cause__ = exc
    return err


def _quiet_no_dist() -> None:
    """Silence DCP's 'assuming a single process' warning: purestep decides that explicitly."""
    for f in warnings.filters:
        if f[0] == "ignore" and f[1] is not None and f[1].pattern == _NO_DIST_WARNING:
            return
    warnings.filterwarnings("ignore", message=_NO_DIST_WARNING, category=UserWarning)
