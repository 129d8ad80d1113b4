"""Atomic, resharding, optionally asynchronous checkpoints of a TensorDict state, on DCP.

A checkpoint is a directory written by :mod:`torch.distributed.checkpoint`
(DCP) plus a ``metadata.json``. Keys are the state's nested keys joined with
``.`` (``params.student.fc.weight``), so no key may itself contain a ``.``.

Atomicity: :func:`save` writes into a sibling scratch directory
``<name>.tmp-<token>``; only after every rank has finished writing does rank 0
write ``metadata.json`` (with ``"complete": true``), fsync it, and rename the
scratch directory to ``<name>``. A crash or SIGKILL at any moment therefore
leaves either the old set of checkpoints or the old set plus the new one, never
a directory that :func:`is_complete` accepts but that cannot be loaded.
:func:`latest` and :func:`prune` only consider complete checkpoints.

Resharding: DTensor leaves (e.g. FSDP2-sharded params) are saved with their
global shapes; :func:`load` into a ``like`` state on a different world size
(or into plain tensors in a single process) reshards.

Distributed use: with an initialized default process group every rank must call
:func:`save`, :func:`load` and :func:`load_per_rank` (they are collectives; the
checkpoint directory must be on a filesystem all ranks share). Their
collectives run on a dedicated gloo group, created on first use, so an async
save's background thread never competes with training collectives. Without a
process group everything runs in one process (DCP's "assuming the intent is
to save in a single process" warning is filtered: that is the intent).

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

Overwriting (``overwrite=True``) moves the old checkpoint to
``<name>.old-<token>``, renames the new one into place, then deletes the old
one; if a crash falls between the two renames, :func:`latest` still finds the
old copy under its ``.old-`` name.

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

import contextlib
import datetime
import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, overload

import torch
from tensordict import TensorDictBase
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from purestep import tree
from purestep.distributed._ckpt_async import (
    SaveHandle,
    _stage,
    release_staging_buffers,
    submit,
    wait_pending,
)
from purestep.distributed._ckpt_group import (
    _gather,
    _group,
    _quiet_no_dist,
    _raise_agreed,
    _rank,
    _world,
)
from purestep.distributed._ckpt_paths import (
    _FORMAT,
    _FORMAT_VERSION,
    _OLD,
    _RANK_KEY,
    _RANK_PREFIX,
    _TMP,
    METADATA_FILE,
    _remove,
    checkpoints,
    is_complete,
    latest,
    prune,
    read_metadata,
    step_dir,
)
from purestep.distributed._storage import RAW_TAIL, RecordReader, RecordWriter

__all__ = [
    "METADATA_FILE",
    "SaveHandle",
    "checkpoints",
    "is_complete",
    "latest",
    "load",
    "load_per_rank",
    "prune",
    "read_metadata",
    "release_staging_buffers",
    "save",
    "step_dir",
    "wait_pending",
]


# -- flattening ----------------------------------------------------------------------------


def _flatten(td: TensorDictBase, what: str, prefix: str = "") -> dict[str, torch.Tensor]:
    """``{"a.b.c": tensor}`` in leaf order; errors name every bad key at once."""
    out: dict[str, torch.Tensor] = {}
    dotted: list[str] = []
    reserved: list[str] = []
    not_tensor: list[str] = []
    for key, value in td.items(include_nested=True, leaves_only=True):
        parts = (key,) if isinstance(key, str) else tuple(key)
        name = ".".join(parts)
        if any("." in part for part in parts):
            dotted.append(repr(parts))
        elif not prefix and parts[0].startswith(_RANK_PREFIX):
            reserved.append(name)
        elif not isinstance(value, torch.Tensor):
            not_tensor.append(f"{name} ({type(value).__name__})")
        else:
            out[prefix + name] = value
    problems = []
    if dotted:
        problems.append(
            "keys containing '.' (checkpoints join nested keys with '.', so these would not "
            "round-trip; nest them instead): " + ", ".join(dotted)
        )
    if reserved:
        problems.append(
            f"top-level keys starting with {_RANK_PREFIX!r} are reserved for per_rank values: "
            + ", ".join(reserved)
        )
    if not_tensor:
        problems.append("non-tensor leaves: " + ", ".join(not_tensor))
    if problems:
        raise ValueError(f"cannot checkpoint {what}: " + "; ".join(problems))
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe(flat: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    return {k: {"shape": list(v.shape), "dtype": _dtype_name(v.dtype)} for k, v in flat.items()}


def _mismatch_message(
    path: Path, expected: Mapping[str, Any], found: Mapping[str, dict[str, Any]], what: str
) -> str | None:
    """One message listing every missing, unexpected and mis-shaped key, or ``None``."""
    missing = [k for k in found if k not in expected]
    unexpected = [k for k in expected if k not in found]
    wrong = []
    for k, f in found.items():
        e = expected.get(k)
        if e is not None and (list(e["shape"]) != f["shape"] or e["dtype"] != f["dtype"]):
            wrong.append(
                f"{k}: checkpoint has {tuple(e['shape'])} {e['dtype']}, "
                f"like has {tuple(f['shape'])} {f['dtype']}"
            )
    if not (missing or unexpected or wrong):
        return None
    lines = [f"checkpoint {path} does not match `like` ({what}):"]
    if missing:
        lines.append("  missing from the checkpoint (in like only): " + ", ".join(missing))
    if unexpected:
        lines.append("  unexpected in the checkpoint (not in like): " + ", ".join(unexpected))
    if wrong:
        lines.append("  mismatched shape or dtype: " + "; ".join(wrong))
    return "\n".join(lines)


# -- save ----------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _target_error(path: Path, overwrite: bool) -> str | None:
    if not path.exists():
        return None
    if not is_complete(path):
        return (
            f"{path} exists and is not a complete purestep checkpoint; remove it or save elsewhere"
        )
    if not overwrite:
        return f"checkpoint already exists at {path}; pass overwrite=True to replace it"
    return None


def _write_metadata(
    tmp: Path, dcp_md: Any, world_size: int, step: int | None, user: Mapping[str, Any] | None
) -> None:
    import purestep

    keys: dict[str, dict[str, Any]] = {}
    per_rank: dict[str, dict[str, dict[str, Any]]] = {}
    for fqn, item in dcp_md.state_dict_metadata.items():
        desc = {"shape": list(item.size), "dtype": _dtype_name(item.properties.dtype)}
        m = _RANK_KEY.match(fqn)
        if m:
            per_rank.setdefault(m.group(1), {})[m.group(2)] = desc
        else:
            keys[fqn] = desc
    md = {
        "format": _FORMAT,
        "format_version": _FORMAT_VERSION,
        "records": RAW_TAIL,
        "step": step,
        "world_size": world_size,
        "purestep_version": purestep.__version__,
        "torch_version": torch.__version__,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "keys": keys,
        "per_rank_keys": dict(sorted(per_rank.items(), key=lambda kv: int(kv[0]))),
        "metadata": dict(user or {}),
        "complete": True,
    }
    f = tmp / METADATA_FILE
    with open(f, "w") as fh:
        json.dump(md, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(tmp)


def _publish(tmp: Path, path: Path, token: str) -> None:
    """Rename the finished scratch dir into place (moving an old checkpoint aside first)."""
    old = None
    if path.exists():
        old = path.with_name(f"{path.name}{_OLD}{token}")
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    if old is not None:
        _remove(old)


def _write(
    flat: dict[str, torch.Tensor],
    tmp: Path,
    path: Path,
    token: str,
    group: Any,
    step: int | None,
    user: Mapping[str, Any] | None,
) -> Path:
    """DCP-write ``flat`` to ``tmp``; rank 0 adds metadata and renames; all ranks agree."""
    rank0 = _rank(group) == 0
    problem: Exception | None = None
    try:
        _quiet_no_dist()
        dcp_md = dcp_save(
            flat,
            storage_writer=RecordWriter(tmp),
            process_group=group,
            no_dist=group is None,
        )
        if rank0:
            _write_metadata(tmp, dcp_md, _world(group), step, user)
            _publish(tmp, path, token)
    except Exception as e:
        problem = e
    try:
        _raise_agreed(group, problem)
    except Exception:
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _step_of(state: TensorDictBase) -> int | None:
    s = state.get("step", None)
    if isinstance(s, torch.Tensor) and s.numel() == 1 and not s.dtype.is_floating_point:
        return int(s.item())
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
    """Save ``state`` atomically as a DCP checkpoint directory at ``path``.

    With a process group, every rank must call this with the same ``path``
    and key structure (a collective). ``state`` is never modified.

    Args:
        state: the tensors to save; nested keys are joined with ``.``.
        path: the checkpoint directory to create (parents are created).
        async_: stage the tensors into CPU buffers, return a :class:`SaveHandle`
            and write in a background thread. The state may be modified as
            soon as this returns.
        metadata: extra JSON-serialisable values stored under ``"metadata"``
            in ``metadata.json`` (rank 0's are written).
        per_rank: this rank's own tensors (different on each rank), restored
            with :func:`load_per_rank`.
        overwrite: replace an existing complete checkpoint at ``path``
            (otherwise :class:`FileExistsError`).

    Returns:
        ``None`` for a synchronous save (the checkpoint is complete on return);
        a :class:`SaveHandle` for an async one.

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
    problem: Exception | None = None
    flat: dict[str, torch.Tensor] = {}
    try:
        flat = _flatten(state, "state")
        if per_rank is not None:
            flat.update(_flatten(per_rank, "per_rank", prefix=f"{_RANK_PREFIX}{rank}__."))
        if metadata is not None:
            json.dumps(dict(metadata))
    except ValueError as e:
        problem = e
    except TypeError as e:
        problem = ValueError(f"metadata is not JSON-serialisable: {e}")
    if problem is None and rank == 0:
        msg = _target_error(target, overwrite)
        problem = None if msg is None else FileExistsError(msg)
    _raise_agreed(group, problem)
    # rank 0 names the scratch directory; every rank writes its part into the same one
    token = _gather(group, uuid.uuid4().hex[:12])[0]
    tmp = target.with_name(f"{target.name}{_TMP}{token}")
    tmp.mkdir(parents=True, exist_ok=True)
    step = _step_of(state)
    meta = dict(metadata) if metadata is not None else None
    if not async_:
        _write(flat, tmp, target, token, group, step, meta)
        return None

    staged = _stage(flat)
    scratch = (tmp, target.with_name(f"{target.name}{_OLD}{token}"))
    return submit(_write, (staged, tmp, target, token, group, step, meta), target, scratch)


# -- load ----------------------------------------------------------------------------------


def _load_flat(
    group: Any,
    path: Path,
    flat_like: dict[str, torch.Tensor],
    donate: bool,
    md: Mapping[str, Any],
) -> dict[str, torch.Tensor]:
    dst = flat_like if donate else {k: torch.empty_like(v) for k, v in flat_like.items()}
    if dst:
        _quiet_no_dist()
        with torch.no_grad():
            dcp_load(
                dst,
                storage_reader=RecordReader(path, raw_tail=md.get("records") == RAW_TAIL),
                process_group=group,
                no_dist=group is None,
            )
    return dst


def load(
    path: str | os.PathLike[str], *, like: TensorDictBase, donate: bool = False
) -> TensorDictBase:
    """Load the checkpoint at ``path`` into a state shaped like ``like``.

    ``like`` gives the keys, global shapes, dtypes, devices and shardings
    (DTensor placements) to load into; the checkpoint may have been saved on a
    different world size (it is resharded). Missing, unexpected and
    mis-shaped (or mis-typed) keys are all listed in one ``ValueError``;
    per-rank values are ignored (see :func:`load_per_rank`). With a process
    group, every rank raises together.

    Args:
        path: a complete checkpoint directory.
        like: a template state (e.g. the freshly initialised one).
        donate: load in place into ``like``'s own tensors and return ``like``.
            Needed when the state's params alias module parameters (an FSDP
            bound state), which must keep their identity. Without it ``like``
            is not modified and the result has fresh tensors
            (``torch.empty_like`` of each leaf, so the same placements).

    Example:
        >>> import tempfile, torch
        >>> from tensordict import TensorDict
        >>> state = TensorDict({"w": torch.arange(3.0)}, [])
        >>> d = tempfile.mkdtemp() + "/ckpt"
        >>> save(state, d)
        >>> load(d, like=state.apply(torch.zeros_like))["w"]
        tensor([0., 1., 2.])
    """
    wait_pending()
    p = Path(path)
    group = _group()
    problem: Exception | None = None
    flat_like: dict[str, torch.Tensor] = {}
    md: dict[str, Any] = {}
    try:
        md = read_metadata(p)
        flat_like = _flatten(like, "like")
        msg = _mismatch_message(p, md["keys"], _describe(flat_like), "state")
        problem = None if msg is None else ValueError(msg)
    except (OSError, ValueError) as e:
        problem = e
    _raise_agreed(group, problem)
    dst = _load_flat(group, p, flat_like, donate, md)
    if donate:
        return like
    return tree.rebuild(like, list(dst.values()))


def load_per_rank(
    path: str | os.PathLike[str],
    *,
    like: TensorDictBase,
    donate: bool = False,
) -> TensorDictBase:
    """Load this rank's ``per_rank`` values saved by :func:`save`.

    Per-rank values do not reshard: the checkpoint must have been saved with
    the current world size, or ``ValueError`` is raised on every rank (a
    caller can catch it and fall back, e.g. restart its data order).
    ``donate`` as in :func:`load`.

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
    problem: Exception | None = None
    flat_like: dict[str, torch.Tensor] = {}
    md: dict[str, Any] = {}
    try:
        md = read_metadata(p)
        flat_like = _flatten(like, "like")
        if md.get("world_size") != world:
            problem = ValueError(
                f"checkpoint {p} holds per-rank values of world size {md.get('world_size')}; "
                f"they cannot be loaded on world size {world}"
            )
        else:
            expected = md.get("per_rank_keys", {}).get(str(rank), {})
            what = f"per-rank values of rank {rank}"
            msg = _mismatch_message(p, expected, _describe(flat_like), what)
            problem = None if msg is None else ValueError(msg)
    except (OSError, ValueError) as e:
        problem = e
    _raise_agreed(group, problem)
    dst = _load_flat(group, p, {prefix + k: v for k, v in flat_like.items()}, donate, md)
    if donate:
        return like
    return tree.rebuild(like, list(dst.values()))
