"""Atomic, verified, resharding, optionally asynchronous checkpoints of a TensorDict state, on DCP.

A checkpoint is a directory written by :mod:`torch.distributed.checkpoint`
(DCP) plus a ``metadata.json``. Keys are the state's nested keys joined with
``.`` (``params.student.fc.weight``), so no key may itself contain a ``.``.
Every leaf must be a tensor (any dtype, bitwise round trip); a non-tensor leaf
fails the save instead of being dropped.

Integrity: every tensor record's bytes are hashed while they are written
(``xxh3_64``; ``benchmarks/checksum.py`` measures it against
``zlib.crc32``) and the checksums, each data file's size, the checksum of
DCP's ``.metadata`` and the algorithm's name go into ``metadata.json``,
which carries a checksum of its own. :func:`load` verifies every record it
reads (``verify=True``, the default), :func:`verify` (and ``python -m
purestep.checkpoint verify PATH``) checks a whole checkpoint without a model,
and :func:`is_complete` / :func:`latest` check, without reading tensor data,
that every data file exists with its recorded size. A mismatch raises
:class:`CheckpointCorruptError` naming the checkpoint, the file and the key.

Failures: every failure of :func:`save`, :func:`load`, :func:`load_per_rank`
and :func:`verify` raises a :class:`CheckpointError` (an ``Exception``; the
subclasses are listed in ``docs/errors.md``), with the root cause chained as
``__cause__`` (an ``OSError`` such as ``ENOSPC``), on every rank together.

Atomicity: :func:`save` writes into a sibling scratch directory
``<name>.tmp-<token>`` (marked as purestep's by a ``.purestep`` file); only
after every rank has finished writing does rank 0 write ``metadata.json``
(with ``"complete": true``), fsync it, and rename the scratch directory to
``<name>`` with a no-replace rename (``renameat2(RENAME_NOREPLACE)`` on
Linux), so a save never replaces what it did not check, even when another
process publishes the same name at the same moment. A crash or SIGKILL at any
moment therefore leaves either the old set of checkpoints or the old set plus
the new one, never a directory that :func:`is_complete` accepts but that
cannot be loaded. A save that fails removes its scratch directory, whatever
the exception. :func:`latest` and :func:`prune` only consider complete
checkpoints, and :func:`prune` deletes only directories purestep created.

Resharding: DTensor leaves (e.g. FSDP2-sharded params) are saved with their
global shapes; :func:`load` into a ``like`` state on a different world size
(or into plain tensors in a single process) reshards.

Distributed use: with an initialized default process group every rank must call
:func:`save`, :func:`load` and :func:`load_per_rank` (they are collectives; the
checkpoint directory must be on a filesystem all ranks share). Their
collectives run on a dedicated gloo group, created on first use with the
default group's timeout, so an async save's background thread never competes
with training collectives. Without a process group everything runs in one
process (DCP's "assuming the intent is to save in a single process" warning is
filtered: that is the intent). :func:`verify` is local (no collectives).

Per-rank values: DCP saves a plain (non-DTensor) tensor once, as replicated, so
values that differ by rank (a data loader's position, say) go in
``save(..., per_rank=td)`` and come back with :func:`load_per_rank`; they are
stored under ``__rank_<r>__.<key>`` and ignored by :func:`load`.

Async saves: ``save(..., async_=True)`` copies ("stages") every tensor into
CPU buffers before it returns, so the caller may immediately update the state
in place (donated steps); the write, ``metadata.json`` and the rename run on a
background thread (its collectives run on the checkpoint group, so no rank
needs to call anything for the save to complete). At most one save is in
flight per process: the next :func:`save`, :func:`load` or :func:`load_per_rank`
waits for it first, and re-raises its error if it failed. Call
:meth:`SaveHandle.wait` or :func:`wait_pending` on every rank before exit
(and before reading the checkpoint) to surface errors. The staging buffers
are kept and reused by the next async save of the same keys, which avoids
page faults; :func:`release_staging_buffers` frees them.

Overwriting (``overwrite=True``) replaces only a complete checkpoint: it moves
it to ``<name>.old-<token>``, renames the new one into place, then deletes the
old one; if a crash falls between the two renames, :func:`latest` still finds
the old copy under its ``.old-`` name.

Example:
    >>> import tempfile, torch
    >>> from tensordict import TensorDict
    >>> from purestep.distributed import checkpoint as ckpt
    >>> state = TensorDict({"params": {"w": torch.ones(2)}, "step": torch.tensor(3)}, [])
    >>> root = tempfile.mkdtemp()
    >>> _ = ckpt.save(state, ckpt.step_dir(root, 3))
    >>> ckpt.latest(root).name
    'step_00000003'
    >>> ckpt.load(ckpt.latest(root), like=state)["step"]
    tensor(3)
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, overload

import torch
from tensordict import TensorDictBase

from purestep import tree
from purestep.distributed import _ckpt_fs
from purestep.distributed._ckpt_async import (
    SaveHandle,
    _stage,
    release_staging_buffers,
    submit,
    wait_pending,
)
from purestep.distributed._ckpt_errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointStateError,
    CheckpointWriteError,
)
from purestep.distributed._ckpt_group import (
    _gather,
    _group,
    _raise_agreed,
    _rank,
    _world,
)
from purestep.distributed._ckpt_integrity import (
    ALGORITHM,
    file_problem,
    verify_records,
)
from purestep.distributed._ckpt_paths import (
    _OLD,
    _RANK_PREFIX,
    _TMP,
    METADATA_FILE,
    checkpoints,
    damaged,
    is_complete,
    latest,
    prune,
    read_metadata,
    step_dir,
)
from purestep.distributed._ckpt_read import cross_check, prepare
from purestep.distributed._ckpt_read import read as read_into
from purestep.distributed._ckpt_state import flatten, json_metadata, step_of
from purestep.distributed._ckpt_write import discard, target_error
from purestep.distributed._ckpt_write import write as _write

__all__ = [
    "METADATA_FILE",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointReadError",
    "CheckpointStateError",
    "CheckpointWriteError",
    "SaveHandle",
    "checkpoints",
    "damaged",
    "is_complete",
    "latest",
    "load",
    "load_per_rank",
    "prune",
    "read_metadata",
    "release_staging_buffers",
    "save",
    "step_dir",
    "verify",
    "wait_pending",
]


# -- save ----------------------------------------------------------------------------------


def _agreed_token(group: Any, target: Path) -> str:
    """Rank 0's random token for the scratch directory's name (every rank writes into it)."""
    try:
        return str(_gather(group, uuid.uuid4().hex[:12])[0])
    except Exception as e:
        raise CheckpointWriteError(
            f"saving checkpoint {target}: a collective with the other ranks failed: {e}",
            path=target,
        ) from e


def _make_scratch(tmp: Path, token: str, target: Path) -> CheckpointError | None:
    """Rank 0 creates the scratch directory with purestep's marker; the error, if any."""
    try:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        _ckpt_fs.write_marker(tmp, token)
    except OSError as e:
        discard(tmp)
        err = CheckpointWriteError(
            f"saving checkpoint {target}: cannot create its scratch directory {tmp}: {e}",
            path=target,
        )
        err.__cause__ = e
        return err
    return None


@overload
def save(
    state: TensorDictBase,
    path: str | os.PathLike[str],
    *,
    async_: Literal[False] = ...,
    metadata: Mapping[str, Any] | None = ...,
    per_rank: TensorDictBase | None = ...,
    overwrite: bool = ...,
) -> None: ...


@overload
def save(
    state: TensorDictBase,
    path: str | os.PathLike[str],
    *,
    async_: Literal[True],
    metadata: Mapping[str, Any] | None = ...,
    per_rank: TensorDictBase | None = ...,
    overwrite: bool = ...,
) -> SaveHandle: ...


@overload
def save(
    state: TensorDictBase,
    path: str | os.PathLike[str],
    *,
    async_: bool,
    metadata: Mapping[str, Any] | None = ...,
    per_rank: TensorDictBase | None = ...,
    overwrite: bool = ...,
) -> SaveHandle | None: ...


def save(
    state: TensorDictBase,
    path: str | os.PathLike[str],
    *,
    async_: bool = False,
    metadata: Mapping[str, Any] | None = None,
    per_rank: TensorDictBase | None = None,
    overwrite: bool = False,
) -> SaveHandle | None:
    """Save ``state`` atomically as a checksummed DCP checkpoint directory at ``path``.

    With a process group, every rank must call this with the same ``path``
    and key structure (a collective). ``state`` is never modified.

    Args:
        state: the tensors to save; nested keys are joined with ``.``. Every
            leaf must be a tensor (any dtype; DTensors are saved with their
            global shape).
        path: the checkpoint directory to create (parents are created).
        async_: stage the tensors into CPU buffers, return a :class:`SaveHandle`
            and write in a background thread. The state may be modified as
            soon as this returns.
        metadata: extra JSON-serialisable values stored under ``"metadata"``
            in ``metadata.json`` (rank 0's are written).
        per_rank: this rank's own tensors (different on each rank), restored
            with :func:`load_per_rank`.
        overwrite: replace an existing *complete* checkpoint at ``path``.
            Without it, a checkpoint at ``path`` (there already, or published
            by another writer while this save runs) fails the save and is
            never replaced. Anything at ``path`` that is not a complete
            checkpoint is never replaced.

    Returns:
        ``None`` for a synchronous save (the checkpoint is complete on return);
        a :class:`SaveHandle` for an async one.

    Raises:
        CheckpointStateError: the state or metadata cannot be saved (bad keys,
            non-tensor leaves, metadata not JSON); nothing was written.
        CheckpointExistsError: see ``overwrite``.
        CheckpointWriteError: writing failed (the ``OSError`` in ``__cause__``);
            the scratch directory was removed, earlier checkpoints are unchanged.

    Example:
        >>> import tempfile, torch
        >>> from tensordict import TensorDict
        >>> state = TensorDict({"w": torch.ones(2), "step": torch.tensor(7)}, [])
        >>> d = tempfile.mkdtemp() + "/ckpt"
        >>> save(state, d, metadata={"note": "hi"})
        >>> read_metadata(d)["step"], read_metadata(d)["metadata"]
        (7, {'note': 'hi'})
    """
    wait_pending()
    target = Path(path).absolute()
    group = _group()
    rank = _rank(group)
    problem: CheckpointError | None = None
    flat: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] | None = None
    try:
        flat = flatten(state, "state")
        if per_rank is not None:
            flat.update(flatten(per_rank, "per_rank", prefix=f"{_RANK_PREFIX}{rank}__."))
        meta = json_metadata(metadata)
        if rank == 0:
            problem = target_error(target, overwrite)
    except CheckpointError as e:
        problem = e
    _raise_agreed(group, problem, f"saving checkpoint {target}")
    # rank 0 names and creates the scratch directory; every rank writes its part into it
    token = _agreed_token(group, target)
    tmp = target.with_name(f"{target.name}{_TMP}{token}")
    made = _make_scratch(tmp, token, target) if rank == 0 else None
    try:
        _raise_agreed(group, made, f"saving checkpoint {target}")
        step = step_of(state)
        if not async_:
            _write(flat, tmp, target, token, group, step, meta, overwrite)
            return None
        staged: dict[str, torch.Tensor] = {}
        failure: CheckpointError | None = None
        try:
            staged = _stage(flat)
        except Exception as e:
            failure = CheckpointWriteError(
                f"saving checkpoint {target}: copying the state to CPU buffers failed: {e}",
                path=target,
            )
            failure.__cause__ = e
        _raise_agreed(group, failure, f"saving checkpoint {target}")
    except BaseException:
        if rank == 0:
            discard(tmp)
        raise
    scratch = (tmp, target.with_name(f"{target.name}{_OLD}{token}"))
    args = (staged, tmp, target, token, group, step, meta, overwrite)
    return submit(_write, args, target, scratch)


# -- load ----------------------------------------------------------------------------------


def _prefix(key: str | Sequence[str]) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, Sequence) and key and all(isinstance(k, str) for k in key):
        return ".".join(key)
    raise TypeError(f"load: keys entries must be dotted str or tuples of str, got {key!r}")


def _selected(
    saved: Mapping[str, Any], keys: Sequence[str | Sequence[str]] | None, p: Path
) -> dict[str, Any]:
    """The saved keys under the prefixes ``keys`` (all without); a prefix that selects nothing raises."""
    if keys is None:
        return dict(saved)
    prefixes = [_prefix(k) for k in keys]
    out = {k: v for k, v in saved.items() if any(k == q or k.startswith(q + ".") for q in prefixes)}
    empty = [q for q in prefixes if not any(k == q or k.startswith(q + ".") for k in saved)]
    if empty:
        tops = sorted({k.split(".")[0] for k in saved})
        raise CheckpointMismatchError(
            f"checkpoint {p} has no key {', '.join(map(repr, empty))} (nor any under it); its "
            f"top-level keys are {tops}",
            path=p,
            key=empty[0],
        )
    return out


def _template(selected: Mapping[str, Any]) -> TensorDictBase:
    """CPU tensors shaped and typed as the checkpoint's ``selected`` keys, nested."""
    items = []
    for k, info in selected.items():
        dtype = getattr(torch, str(info["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointFormatError(f"load: unknown dtype {info['dtype']!r} of key {k!r}")
        items.append((tuple(k.split(".")), torch.empty(list(info["shape"]), dtype=dtype)))
    return tree.unflatten(items)


def load(
    path: str | os.PathLike[str],
    *,
    like: TensorDictBase | None = None,
    keys: Sequence[str | Sequence[str]] | None = None,
    strict: bool = True,
    donate: bool = False,
    verify: bool = True,
) -> TensorDictBase:
    """Load the checkpoint at ``path`` (or a part of it) into a state shaped like ``like``, verified.

    ``like`` gives the keys, global shapes, dtypes, devices and shardings
    (DTensor placements) to load into; the checkpoint may have been saved on a
    different world size (it is resharded). Missing, unexpected and
    mis-shaped (or mis-typed) keys are all listed in one
    :class:`CheckpointMismatchError`; per-rank values are ignored (see
    :func:`load_per_rank`). With a process group, every rank raises together.

    Partial loads read only the records they need, each verified as in a full
    load: ``keys=["ema.student"]`` (dotted prefixes, or tuples such as
    ``("ema", "student")``) selects the subtrees under those keys, and
    ``like`` then describes just them; without ``like`` they come back as CPU
    tensors shaped and typed as saved (an export of EMA weights, say).
    ``strict=False`` loads ``like``'s keys and ignores the checkpoint's other
    keys (a key of ``like`` that the checkpoint lacks still raises).

    Args:
        path: a complete checkpoint directory.
        like: a template state (e.g. the freshly initialised one); optional
            with ``keys``.
        keys: load only the keys under these prefixes.
        strict: with ``False``, checkpoint keys that ``like`` lacks are not an
            error (they are not read).
        donate: load in place into ``like``'s own tensors and return ``like``.
            Needed when the state's params alias module parameters (an FSDP
            bound state), which must keep their identity. With ``verify``,
            every record this load needs is read and checked *before* the
            first byte is written into ``like`` (one extra read of those
            records), so a damaged checkpoint never tears the live state.
            Without ``donate``, ``like`` is never modified and the result has
            fresh tensors (``torch.empty_like`` of each leaf, so the same
            placements).
        verify: check ``.metadata`` and every record read against the
            checksums in ``metadata.json`` (default). ``verify=False`` skips
            the hashing (data file sizes and record lengths are still checked).

    Raises:
        CheckpointNotFoundError, CheckpointFormatError: ``path`` is not a
            checkpoint this purestep reads.
        CheckpointCorruptError: the checkpoint is damaged (names file and key);
            ``like`` is unchanged (with ``donate=True`` only when ``verify``).
        CheckpointMismatchError: the keys, shapes or dtypes differ from
            ``like``'s (or a ``keys`` prefix selects nothing).
        CheckpointReadError: an I/O error or failed collective (cause chained).

    Example:
        >>> import tempfile, torch
        >>> from tensordict import TensorDict
        >>> state = TensorDict({"w": torch.arange(3.0), "ema": {"w": torch.ones(3)}}, [])
        >>> d = tempfile.mkdtemp() + "/ckpt"
        >>> save(state, d)
        >>> load(d, like=state.apply(torch.zeros_like))["w"]
        tensor([0., 1., 2.])
        >>> load(d, keys=["ema"])["ema", "w"]
        tensor([1., 1., 1.])
    """
    wait_pending()
    p = Path(path)
    if like is None:
        if keys is None:
            raise TypeError(
                "load: pass like= (a template state), keys= (prefixes to load), or both"
            )
        if donate:
            raise ValueError("load: donate=True needs like= (the tensors to load into)")
        like = _template(_selected(read_metadata(p).get("keys", {}), keys, p))
    group = _group()
    flat_names = set(flatten(like, "like")) if not strict else set()

    def expected(md: Mapping[str, Any]) -> Any:
        saved = _selected(md["keys"], keys, p)
        if strict:
            return saved
        return {k: v for k, v in saved.items() if k in flat_names}

    md, flat_like, dcp_md = prepare(p, like, group, expected, "state", donate, verify)
    dst = read_into(group, p, flat_like, donate, md, verify, dcp_md)
    if donate:
        return like
    return tree.rebuild(like, list(dst.values()))


def load_per_rank(
    path: str | os.PathLike[str],
    *,
    like: TensorDictBase,
    donate: bool = False,
    verify: bool = True,
) -> TensorDictBase:
    """Load this rank's ``per_rank`` values saved by :func:`save`.

    Per-rank values do not reshard: the checkpoint must have been saved with
    the current world size, or :class:`CheckpointMismatchError` (a
    ``ValueError``) is raised on every rank (a caller can catch it and fall
    back, e.g. restart its data order). ``donate`` and ``verify`` as in :func:`load`.

    Example:
        >>> import tempfile, torch
        >>> from tensordict import TensorDict
        >>> d = tempfile.mkdtemp() + "/ckpt"
        >>> pos = TensorDict({"data_pos": torch.tensor(17)}, [])
        >>> save(TensorDict({"w": torch.ones(1)}, []), d, per_rank=pos)
        >>> load_per_rank(d, like=pos.apply(torch.zeros_like))["data_pos"]
        tensor(17)
    """
    wait_pending()
    p = Path(path)
    group = _group()
    rank, world = _rank(group), _world(group)
    prefix = f"{_RANK_PREFIX}{rank}__."

    def expected(md: Mapping[str, Any]) -> Any:
        if md.get("world_size") != world:
            raise CheckpointMismatchError(
                f"checkpoint {p} holds per-rank values of world size {md.get('world_size')}; "
                f"they cannot be loaded on world size {world}",
                path=p,
            )
        return md.get("per_rank_keys", {}).get(str(rank), {})

    md, flat_like, dcp_md = prepare(
        p, like, group, expected, f"per-rank values of rank {rank}", donate, verify, prefix
    )
    flat = {prefix + k: v for k, v in flat_like.items()}
    dst = read_into(group, p, flat, donate, md, verify, dcp_md)
    if donate:
        return like
    return tree.rebuild(like, list(dst.values()))


# -- verify --------------------------------------------------------------------------------


def verify(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Check every byte of the checkpoint at ``path`` against its checksums, without a model.

    Checks ``metadata.json`` (against its own checksum), that every data file
    exists with its recorded size, DCP's ``.metadata`` (size, checksum, and
    that it places every record where ``metadata.json`` does), and every
    record's checksum. Local: no collectives, so any one process may run it
    (``python -m purestep.checkpoint verify PATH`` does).

    Returns:
        A summary: ``{"path", "step", "algorithm", "files", "records", "bytes", "seconds"}``.

    Raises:
        CheckpointError: the first problem found (:class:`CheckpointCorruptError`
            names the file and key).

    Example:
        >>> import tempfile, torch
        >>> from tensordict import TensorDict
        >>> d = tempfile.mkdtemp() + "/ckpt"
        >>> save(TensorDict({"w": torch.ones(4)}, []), d)
        >>> s = verify(d); s["records"], s["algorithm"]
        (1, 'xxh3_64')
    """
    wait_pending()
    t0 = time.perf_counter()
    p = Path(path)
    md = read_metadata(p)
    found = file_problem(p, md)
    if found is not None:
        raise CheckpointCorruptError(
            f"checkpoint {p} is damaged: {found[1]}", path=p, file=found[0]
        )
    cross_check(p, md)
    nbytes = verify_records(p, md)
    return {
        "path": str(p),
        "step": md.get("step"),
        "algorithm": md["integrity"].get("algorithm", ALGORITHM),
        "files": len(md["integrity"]["files"]),
        "records": len(md["integrity"]["records"]),
        "bytes": nbytes,
        "seconds": time.perf_counter() - t0,
    }
