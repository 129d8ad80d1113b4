"""The write half of :func:`purestep.distributed.checkpoint.save`: DCP write, metadata, publish.

:func:`write` runs on every rank (synchronously, or on the async writer
thread): DCP writes each rank's records into the scratch directory, then rank 0
writes ``metadata.json`` (sealed with its own checksum) and publishes the
directory under its name with a no-replace rename. Every failure becomes a
:class:`CheckpointError` agreed by all ranks, and the scratch directory is
removed whatever the exception (``BaseException`` too).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from purestep._version import __version__
from purestep.distributed import _ckpt_fs
from purestep.distributed._ckpt_errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointWriteError,
)
from purestep.distributed._ckpt_group import (
    _quiet_no_dist,
    _raise_agreed,
    _rank,
    _world,
    from_dcp,
)
from purestep.distributed._ckpt_integrity import seal
from purestep.distributed._ckpt_paths import (
    _FORMAT,
    _FORMAT_VERSION,
    _OLD,
    _RANK_KEY,
    METADATA_FILE,
    _remove,
    problem,
)
from purestep.distributed._ckpt_state import dtype_name
from purestep.distributed._storage import RecordWriter

__all__ = ["discard", "target_error", "write", "write_metadata"]


def discard(tmp: Path) -> None:
    """Remove a save's scratch directory (data first, marker last); ignore it being gone.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp()) / "c.tmp-1"; d.mkdir(); discard(d); d.exists()
        False
    """
    _ckpt_fs.remove_tree(tmp, last=(METADATA_FILE, _ckpt_fs.MARKER))


def target_error(path: Path, overwrite: bool) -> CheckpointExistsError | None:
    """Why ``save`` must not write to ``path`` (``None`` if it may).

    Example:
        >>> target_error(Path("/nonexistent/c"), False) is None
        True
    """
    if not os.path.lexists(path):
        return None
    why = problem(path)
    if why is not None:
        return CheckpointExistsError(
            f"{path} exists and is not a complete purestep checkpoint ({why}); remove it or "
            "save elsewhere (save never replaces it)",
            path=path,
        )
    if not overwrite:
        return CheckpointExistsError(
            f"checkpoint already exists at {path}; pass overwrite=True to replace it", path=path
        )
    return None


def write_metadata(
    tmp: Path,
    dcp_md: Any,
    integrity: Mapping[str, Any],
    world_size: int,
    step: int | None,
    user: Mapping[str, Any] | None,
) -> None:
    """Write ``tmp/metadata.json`` (sealed with its own checksum) and fsync it and ``tmp``."""
    keys: dict[str, dict[str, Any]] = {}
    per_rank: dict[str, dict[str, dict[str, Any]]] = {}
    for fqn, item in dcp_md.state_dict_metadata.items():
        desc = {"shape": list(item.size), "dtype": dtype_name(item.properties.dtype)}
        m = _RANK_KEY.match(fqn)
        if m:
            per_rank.setdefault(m.group(1), {})[m.group(2)] = desc
        else:
            keys[fqn] = desc
    md = seal(
        {
            "format": _FORMAT,
            "format_version": _FORMAT_VERSION,
            "step": step,
            "world_size": world_size,
            "purestep_version": __version__,
            "torch_version": torch.__version__,
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "keys": keys,
            "per_rank_keys": dict(sorted(per_rank.items(), key=lambda kv: int(kv[0]))),
            "metadata": dict(user or {}),
            "integrity": dict(integrity),
            "complete": True,
        }
    )
    with open(tmp / METADATA_FILE, "wb") as fh:
        fh.write(md)
        fh.flush()
        os.fsync(fh.fileno())
    _ckpt_fs.fsync_dir(tmp, strict=True)


def _publish(tmp: Path, path: Path, token: str, overwrite: bool) -> None:
    """Rename the finished scratch dir into place, never over anything but a checkpoint we may replace."""
    old = None
    if overwrite and os.path.lexists(path):
        found = target_error(path, overwrite=True)  # appeared since save() checked?
        if found is not None:
            raise found
        old = path.with_name(f"{path.name}{_OLD}{token}")
        try:
            os.rename(path, old)
        except FileNotFoundError:
            old = None
    try:
        _ckpt_fs.rename_noreplace(tmp, path)
    except FileExistsError as e:
        raise CheckpointExistsError(
            f"checkpoint {path} was published by another writer while this save was running; "
            "this save was discarded (a save never replaces a checkpoint it did not check)",
            path=path,
        ) from e
    except BaseException:
        if old is not None:  # put the replaced checkpoint back
            _ckpt_fs.rename_noreplace(old, path)
        raise
    try:
        _ckpt_fs.fsync_dir(path.parent, strict=True)
    except OSError:  # not durably published: take it back (the caller discards the scratch dir)
        _ckpt_fs.rename_noreplace(path, tmp)
        if old is not None:
            _ckpt_fs.rename_noreplace(old, path)
        raise
    if old is not None:
        _remove(old)


def write(
    flat: dict[str, torch.Tensor],
    tmp: Path,
    path: Path,
    token: str,
    group: Any,
    step: int | None,
    user: Mapping[str, Any] | None,
    overwrite: bool,
) -> Path:
    """DCP-write ``flat`` to ``tmp``; rank 0 adds metadata and publishes; all ranks agree."""
    rank0 = _rank(group) == 0
    try:
        failure: CheckpointError | None = None
        try:
            _quiet_no_dist()
            writer = RecordWriter(tmp)
            dcp_md = dcp_save(
                flat, storage_writer=writer, process_group=group, no_dist=group is None
            )
            if rank0:
                write_metadata(tmp, dcp_md, writer.integrity, _world(group), step, user)
                _publish(tmp, path, token, overwrite)
        except CheckpointException as e:
            found = from_dcp(e, path, CheckpointWriteError, "saving")
            if not isinstance(found, CheckpointError):
                raise found from e
            failure = found
        except CheckpointError as e:
            failure = e
        except Exception as e:
            failure = CheckpointWriteError(
                f"saving checkpoint {path} failed: {type(e).__name__}: {e}", path=path
            )
            failure.__cause__ = e
        _raise_agreed(group, failure, f"saving checkpoint {path}")
    except BaseException:
        if rank0:
            discard(tmp)
        raise
    return path
