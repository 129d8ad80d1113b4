"""A pool of persistent worker processes sharing one gloo process group, for tests.

Multi-process tests are slow to set up (each process imports torch and joins a
process group), so :class:`WorkerPool` starts ``world_size`` processes once and
then runs many small tasks on them. Hypothesis stays in the parent process: a
test draws an example in the parent and calls :meth:`WorkerPool.run` with it, so
shrinking, the example database and the test's deadline all work as usual.

Tasks are module-level functions (they are pickled by reference). Every rank
receives the same ``fn, args, kwargs`` and calls ``fn(*args, **kwargs)``;
:func:`rank` and :func:`world_size` (or ``torch.distributed``) say which rank is
running. Results come back pickled by value, so return plain tensors (e.g.
``dtensor.full_tensor()`` or ``.to_local()``), not DTensors.

Failure handling: an exception on any rank is re-raised in the parent with its
original type where it can be unpickled, the remote traceback attached as
``__cause__`` and a note naming the rank. If some ranks fail while others do not
answer within ``grace_s`` (e.g. they wait in a collective for the failed rank),
or a task exceeds its timeout, or a worker dies, the pool kills all workers and
restarts them on the next :meth:`WorkerPool.run`, so one failing test does not
hang or break the tests after it. Closing the pool (or leaving the ``with``
block, or interpreter exit) shuts every worker down; workers also exit on their
own when the parent process disappears.

Example:
    >>> from purestep.testing.workers import WorkerPool, rank
    >>> with WorkerPool(2) as pool:  # doctest: +SKIP
    ...     pool.run(rank)
    [0, 1]
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import sys
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import TCPStore  # type: ignore[attr-defined]

__all__ = ["RemoteTraceback", "WorkerError", "WorkerPool", "rank", "world_size"]

_POLL_S = 0.05


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised in a worker (set as ``__cause__``).

    Example:
        >>> str(RemoteTraceback("rank 1:\\nTraceback ..."))
        'rank 1:\\nTraceback ...'
    """


class WorkerError(RuntimeError):
    """A worker failed in a way that cannot be re-raised as its own exception.

    Raised for worker deaths, timeouts, failed start-up and exceptions that
    cannot be pickled. ``rank`` names the first rank at fault (or ``None``).

    Example:
        >>> WorkerError("rank 0 died", rank=0).rank
        0
    """

    def __init__(self, message: str, *, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


def rank() -> int:
    """This process's rank in the default process group (0 without one).

    Example:
        >>> rank()
        0
    """
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The default process group's size (1 without one).

    Example:
        >>> world_size()
        1
    """
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """Temporarily set environment variables (inherited by processes started inside)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _worker_main(
    rank_: int,
    world_size_: int,
    port: int,
    pg_timeout_s: float,
    backend: str,
    parent_pid: int,
    tasks: Any,
    results: Any,
) -> None:
    """Entry point of one worker: join the process group, then serve tasks until ``None``."""
    torch.set_num_threads(1)
    try:
        store = TCPStore(
            "127.0.0.1",
            port,
            world_size_ + 1,
            is_master=False,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        dist.init_process_group(
            backend,
            store=store,
            rank=rank_,
            world_size=world_size_,
            timeout=timedelta(seconds=pg_timeout_s),
        )
    except BaseException:
        results.put((rank_, -1, False, pickle.dumps(None), traceback.format_exc()))
        return
    results.put((rank_, -1, True, pickle.dumps(None), ""))
    try:
        while True:
            try:
                task = tasks.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent_pid:  # orphaned: the parent is gone
                    return
                continue
            if task is None:
                return
            task_id, fn, args, kwargs = task
            try:
                value = fn(*args, **kwargs)
                payload = pickle.dumps(value)
            except BaseException as e:
                tb = traceback.format_exc()
                try:
                    exc_bytes = pickle.dumps(e)
                    pickle.loads(exc_bytes)  # must also rebuild on the other side
                except Exception:
                    exc_bytes = pickle.dumps(None)
                results.put((rank_, task_id, False, exc_bytes, tb))
            else:
                results.put((rank_, task_id, True, payload, ""))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        # Flush our answers, then skip interpreter finalisation: tearing down torch's native
        # state takes seconds and nothing in a worker needs it.
        with contextlib.suppress(Exception):
            results.close()
            results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _free_port_store(world_size_: int, timeout_s: float) -> tuple[TCPStore, int]:
    """A TCPStore server in this process on a free port picked by the OS (no port race)."""
    store = TCPStore(
        "127.0.0.1",
        0,
        world_size_ + 1,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return store, store.port


def _shutdown(procs: list[Any], task_queues: list[Any], join_s: float) -> None:
    """Ask workers to exit, then terminate and kill whatever is left."""
    for q in task_queues:
        with contextlib.suppress(Exception):
            q.put(None)
    deadline = time.monotonic() + join_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
    for q in task_queues:
        with contextlib.suppress(Exception):
            q.cancel_join_thread()
            q.close()


class WorkerPool:
    """``world_size`` persistent processes in one gloo process group, running tasks on every rank.

    Invariants: every rank runs every task, in submission order, one task at a
    time; a task's results come back as a list indexed by rank; after
    :meth:`close` no worker process is alive.

    Args:
        world_size: number of ranks (processes).
        task_timeout_s: default wall-clock limit of one :meth:`run`.
        pg_timeout_s: the process group's collective timeout (a rank stuck in a
            collective raises after this long).
        start_timeout_s: limit for starting the workers and joining the group.
        grace_s: after one rank fails, how long to wait for the others before
            restarting the pool.
        backend: the process group backend (``"gloo"`` for CPU).

    Example:
        >>> import torch, torch.distributed as dist
        >>> def total(x):  # in real use: a module-level function, so that it pickles
        ...     t = torch.tensor(x); dist.all_reduce(t); return int(t)
        >>> with WorkerPool(2) as pool:  # doctest: +SKIP
        ...     pool.run(total, 3)
        [6, 6]
    """

    def __init__(
        self,
        world_size: int = 2,
        *,
        task_timeout_s: float = 120.0,
        pg_timeout_s: float = 60.0,
        start_timeout_s: float = 120.0,
        grace_s: float = 5.0,
        backend: str = "gloo",
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.task_timeout_s = task_timeout_s
        self.pg_timeout_s = pg_timeout_s
        self.start_timeout_s = start_timeout_s
        self.grace_s = grace_s
        self.backend = backend
        self._ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self._store: TCPStore | None = None
        self._next_id = 0
        self._finalizer: weakref.finalize[Any, Any] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        """Process ids of the running workers (empty when stopped).

        Example:
            >>> WorkerPool(2).pids
            []
        """
        return [p.pid for p in self._procs if p.pid is not None]

    def start(self) -> WorkerPool:
        """Start the workers and wait until every rank has joined the process group.

        Example:
            >>> pool = WorkerPool(2).start()  # doctest: +SKIP
            >>> pool.close()  # doctest: +SKIP
        """
        if self._procs:
            return self
        self._store, port = _free_port_store(self.world_size, self.start_timeout_s)
        self._results = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(self.world_size)]
        with _env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"):
            for r in range(self.world_size):
                p = self._ctx.Process(
                    target=_worker_main,
                    args=(
                        r,
                        self.world_size,
                        port,
                        self.pg_timeout_s,
                        self.backend,
                        os.getpid(),
                        self._tasks[r],
                        self._results,
                    ),
                    daemon=True,
                    name=f"purestep-worker-{r}",
                )
                p.start()
                self._procs.append(p)
        self._finalizer = weakref.finalize(self, _shutdown, self._procs, self._tasks, 5.0)
        try:
            self._collect(-1, self.start_timeout_s, "starting the workers")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Shut every worker down (graceful exit, then terminate/kill); idempotent.

        Example:
            >>> WorkerPool(2).close()
        """
        if self._finalizer is not None:
            self._finalizer()  # runs _shutdown once
            self._finalizer = None
        self._procs = []
        self._tasks = []
        if self._results is not None:
            with contextlib.suppress(Exception):
                self._results.cancel_join_thread()
                self._results.close()
        self._results = None
        self._store = None

    def __enter__(self) -> WorkerPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- tasks -------------------------------------------------------------------------------

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results indexed by rank.

        ``fn`` must be picklable by reference (a module-level function) and its
        arguments and result picklable by value. Raises the lowest failing
        rank's exception (with the remote traceback as ``__cause__``), or
        :class:`WorkerError` for deaths and timeouts.

        Example:
            >>> with WorkerPool(2) as pool:  # doctest: +SKIP
            ...     pool.run(world_size)
            [2, 2]
        """
        self.start()
        task_id = self._next_id
        self._next_id += 1
        for q in self._tasks:
            q.put((task_id, fn, args, kwargs))
        name = getattr(fn, "__qualname__", repr(fn))
        return self._collect(
            task_id, self.task_timeout_s if timeout_s is None else timeout_s, f"task {name}"
        )

    def _collect(self, task_id: int, timeout_s: float, what: str) -> list[Any]:
        """Gather one answer per rank for ``task_id``; on any failure restart-on-next-use."""
        answers: dict[int, tuple[bool, bytes, str]] = {}
        deadline = time.monotonic() + timeout_s
        failed_at: float | None = None
        while len(answers) < self.world_size:
            now = time.monotonic()
            if failed_at is not None and now > failed_at + self.grace_s:
                break
            if now > deadline:
                missing = sorted(set(range(self.world_size)) - set(answers))
                if failed_at is None:
                    self.close()
                    raise WorkerError(
                        f"{what} timed out after {timeout_s:.0f}s; no answer from ranks {missing}",
                        rank=missing[0] if missing else None,
                    )
                break
            try:
                r, tid, ok, payload, tb = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                dead = [(i, p.exitcode) for i, p in enumerate(self._procs) if not p.is_alive()]
                dead = [(i, code) for i, code in dead if i not in answers]
                if dead:
                    self.close()
                    i, code = dead[0]
                    raise WorkerError(
                        f"worker rank {i} died (exit code {code}) during {what}", rank=i
                    ) from None
                continue
            if tid != task_id:
                continue  # a stale answer of an earlier, abandoned task
            answers[r] = (ok, payload, tb)
            if not ok and failed_at is None:
                failed_at = time.monotonic()
        if len(answers) < self.world_size:
            self.close()  # the others are probably stuck in a collective
        failures = sorted(r for r, (ok, _, _) in answers.items() if not ok)
        if failures:
            r = failures[0]
            _, exc_bytes, tb = answers[r]
            if task_id == -1:
                self.close()
                raise WorkerError(f"rank {r} failed to start:\n{tb}", rank=r)
            exc = pickle.loads(exc_bytes)
            cause = RemoteTraceback(f"rank {r} of {self.world_size}:\n{tb}")
            if not isinstance(exc, BaseException):
                raise WorkerError(f"rank {r} raised during {what}:\n{tb}", rank=r) from cause
            exc.add_note(f"(raised on worker rank {r} of {self.world_size} during {what})")
            raise exc from cause
        return [pickle.loads(answers[r][1]) for r in range(self.world_size)]
