"""Checkpoint directories: names, ``metadata.json``, completeness, ``latest`` and ``prune``.

A directory is a complete checkpoint when its ``metadata.json`` parses, has
purestep's format and the ``"complete": true`` marker, and its name is not a
scratch name (``*.tmp-*`` of a save in progress, ``*.old-*`` of a replaced
checkpoint, ``*.del-*`` of one being deleted).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

from purestep.distributed._ckpt_async import _busy_scratch

METADATA_FILE = "metadata.json"
"""Name of the file that marks a directory as a complete purestep checkpoint."""

_FORMAT = "purestep.checkpoint"
_FORMAT_VERSION = 1
_TMP = ".tmp-"
_OLD = ".old-"
_DEL = ".del-"
_RANK_PREFIX = "__rank_"
_RANK_KEY = re.compile(r"^__rank_(\d+)__\.(.+)$")


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    """The conventional checkpoint directory for ``step``: ``root/step_00000100``.

    Zero-padded so that names sort like steps.

    Example:
        >>> step_dir("/ckpt", 100).as_posix()
        '/ckpt/step_00000100'
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return Path(root) / f"step_{step:08d}"


def _is_scratch(name: str) -> bool:
    return _TMP in name or _OLD in name or _DEL in name


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed ``metadata.json`` of the complete checkpoint at ``path``.

    Raises:
        FileNotFoundError: ``path`` has no ``metadata.json`` (not a checkpoint,
            or one whose save never finished).
        ValueError: the file is not a complete purestep checkpoint's metadata.

    Example:
        >>> import tempfile
        >>> try:
        ...     read_metadata(tempfile.mkdtemp())
        ... except FileNotFoundError as e:
        ...     print(str(e).split(":")[0])
        not a purestep checkpoint
    """
    p = Path(path)
    f = p / METADATA_FILE
    if not f.is_file():
        raise FileNotFoundError(f"not a purestep checkpoint: {p} (no {METADATA_FILE})")
    try:
        md = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"not a purestep checkpoint: {p} (unreadable {METADATA_FILE}: {e})") from e
    if not isinstance(md, dict) or md.get("format") != _FORMAT:
        raise ValueError(f"not a purestep checkpoint: {p} ({METADATA_FILE} has no purestep format)")
    if md.get("complete") is not True:
        raise ValueError(f"incomplete purestep checkpoint: {p} ({METADATA_FILE} lacks the marker)")
    return md


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a finished checkpoint (valid metadata, not a scratch name).

    Example:
        >>> import tempfile
        >>> is_complete(tempfile.mkdtemp())
        False
    """
    p = Path(path)
    if _is_scratch(p.name) or not p.is_dir():
        return False
    try:
        read_metadata(p)
    except (OSError, ValueError):
        return False
    return True


def _candidates(root: Path) -> list[tuple[int, str, Path]]:
    """Complete checkpoints under ``root`` as ``(step, name, path)``, oldest first.

    Also accepts ``<name>.old-<token>`` when ``<name>`` is gone: an overwriting
    save killed between its two renames leaves the replaced checkpoint there.
    """
    if not root.is_dir():
        return []
    out: list[tuple[int, str, Path]] = []
    for p in root.iterdir():
        name = p.name
        if _OLD in name and _TMP not in name and _DEL not in name:
            base = name.split(_OLD)[0]
            if (root / base).exists():
                continue
            name = base
        elif _is_scratch(name):
            continue
        try:
            md = read_metadata(p)
        except (OSError, ValueError):
            continue
        step = md.get("step")
        out.append((step if isinstance(step, int) else -1, name, p))
    out.sort(key=lambda c: (c[0], c[1]))
    return out


def checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """All complete checkpoints directly under ``root``, oldest first (by step, then name).

    Example:
        >>> import tempfile
        >>> checkpoints(tempfile.mkdtemp())
        []
    """
    return [p for _, _, p in _candidates(Path(root))]


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint directly under ``root`` (highest step, ties by name).

    Scratch directories of unfinished saves and directories without a valid
    ``metadata.json`` are ignored. ``None`` if there is none (or no ``root``).

    Example:
        >>> import tempfile
        >>> latest(tempfile.mkdtemp()) is None
        True
    """
    cands = _candidates(Path(root))
    return cands[-1][2] if cands else None


def prune(root: str | os.PathLike[str], keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints, and stale scratch dirs.

    A scratch directory (``*.tmp-*``, ``*.old-*``, ``*.del-*``) is stale unless it belongs to
    a save that is still in flight in *this* process (an async save not yet
    finished); so do not run two jobs that save into the same ``root``.
    Directories that are neither checkpoints nor scratch are left alone; a
    checkpoint is renamed to a scratch name before it is deleted, so an
    interrupted prune never leaves a half-deleted directory that looks
    complete. Safe
    to call from every rank (losing a race to delete is ignored), but calling
    it from one rank is enough. Returns the removed paths.

    Example:
        >>> import tempfile
        >>> prune(tempfile.mkdtemp(), keep_last=2)
        []
    """
    if keep_last < 0:
        raise ValueError(f"keep_last must be >= 0, got {keep_last}")
    r = Path(root)
    cands = _candidates(r)
    keep = {p for _, _, p in cands[max(0, len(cands) - keep_last) :]} if keep_last else set()
    busy = _busy_scratch()
    doomed = [p for _, _, p in cands if p not in keep]
    if r.is_dir():
        doomed += [
            p
            for p in r.iterdir()
            if _is_scratch(p.name)
            and p not in keep
            and p.absolute() not in busy
            and p not in doomed
        ]
    removed = []
    for p in sorted(doomed):
        if _remove(p):
            removed.append(p)
    return removed


def _remove(p: Path) -> bool:
    """Delete a directory so that no moment of the deletion looks like a complete checkpoint.

    A checkpoint is first renamed to a scratch name (atomic), then deleted.
    Returns whether this call removed it (``False`` if someone else did).
    """
    target = p
    if not _is_scratch(p.name) or _OLD in p.name:
        target = p.with_name(f"{p.name}{_DEL}{uuid.uuid4().hex[:12]}")
        try:
            os.rename(p, target)
        except FileNotFoundError:
            return False
    shutil.rmtree(target, ignore_errors=True)
    return not p.exists()
