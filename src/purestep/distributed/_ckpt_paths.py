"""Checkpoint directories: names, ``metadata.json``, completeness, ``latest``, ``damaged``, ``prune``.

A directory is a complete checkpoint when its name is not a scratch name
(``*.tmp-*`` of a save in progress, ``*.old-*`` of a replaced checkpoint,
``*.del-*`` of one being deleted), its ``metadata.json`` parses, matches its
own checksum, has purestep's format and version and the ``"complete": true``
marker, and every file it lists exists with its recorded size. This check
reads no tensor data (it is cheap enough for :func:`latest` to run on every
candidate); :func:`purestep.checkpoint.verify` and ``load`` check every byte.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

from purestep.distributed._ckpt_async import _busy_scratch
from purestep.distributed._ckpt_errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointReadError,
)
from purestep.distributed._ckpt_fs import MARKER, marker_token, remove_tree
from purestep.distributed._ckpt_integrity import file_problem, records, seal_problem

METADATA_FILE = "metadata.json"
"""Name of the file that marks a directory as a complete purestep checkpoint."""

_FORMAT = "purestep.checkpoint"
_FORMAT_VERSION = 2
_TMP = ".tmp-"
_OLD = ".old-"
_DEL = ".del-"
_DAMAGED = ".damaged-"
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


def _scratch_kind(name: str) -> str | None:
    for kind in (_TMP, _OLD, _DEL):
        if kind in name:
            return kind
    return None


def _is_scratch(name: str) -> bool:
    return _scratch_kind(name) is not None


def _corrupt(p: Path, why: str, file: str = METADATA_FILE) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"checkpoint {p} is damaged: {why}", path=p, file=file)


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed ``metadata.json`` of the checkpoint at ``path``, checked against its own checksum.

    Raises:
        CheckpointNotFoundError: no such directory, or no ``metadata.json`` in
            it (not a checkpoint, or one whose save never finished). Also a
            ``FileNotFoundError``.
        CheckpointFormatError: not purestep's metadata, or a format version
            this purestep does not read. Also a ``ValueError``.
        CheckpointCorruptError: ``metadata.json`` is not valid JSON, fails its
            checksum, or lacks the completion marker.
        CheckpointReadError: ``metadata.json`` cannot be read (an ``OSError``).

    Example:
        >>> import tempfile
        >>> try:
        ...     read_metadata(tempfile.mkdtemp())
        ... except CheckpointNotFoundError as e:
        ...     print(str(e).split(":")[0])
        not a purestep checkpoint
    """
    p = Path(path)
    f = p / METADATA_FILE
    if not p.is_dir():
        raise CheckpointNotFoundError(f"no checkpoint at {p} (no such directory)", path=p)
    if not f.is_file():
        raise CheckpointNotFoundError(
            f"not a purestep checkpoint: {p} (no {METADATA_FILE})", path=p, file=METADATA_FILE
        )
    try:
        data = f.read_bytes()
    except OSError as e:
        raise CheckpointReadError(
            f"checkpoint {p}: cannot read {METADATA_FILE}: {e}", path=p, file=METADATA_FILE
        ) from e
    unsealed = seal_problem(data)
    if unsealed is not None and unsealed != "it has no checksum":
        raise _corrupt(p, f"{METADATA_FILE}: {unsealed}")
    try:
        md = json.loads(data)
    except ValueError as e:  # includes UnicodeDecodeError
        raise _corrupt(p, f"{METADATA_FILE} is not valid JSON ({e})") from e
    if not isinstance(md, dict):
        raise _corrupt(p, f"{METADATA_FILE} does not hold an object")
    if unsealed is not None and "checksum" in md:  # a checksum, but not where purestep puts it
        raise _corrupt(p, f"{METADATA_FILE}: its content does not match its own checksum")
    if md.get("format") != _FORMAT:
        raise CheckpointFormatError(
            f"not a purestep checkpoint: {p} ({METADATA_FILE} has no purestep format)",
            path=p,
            file=METADATA_FILE,
        )
    version = md.get("format_version")
    if version != _FORMAT_VERSION:
        hint = (
            " (format 1, written before checksums: stock torch.distributed.checkpoint "
            "FileSystemReader still loads its tensors)"
            if version == 1
            else ""
        )
        raise CheckpointFormatError(
            f"checkpoint {p} has format version {version!r}; this purestep reads version "
            f"{_FORMAT_VERSION}{hint}",
            path=p,
            file=METADATA_FILE,
        )
    if unsealed is not None:
        raise _corrupt(p, f"{METADATA_FILE} has no checksum")
    if md.get("complete") is not True:
        raise _corrupt(p, f"{METADATA_FILE} lacks the completion marker")
    try:
        records(md)
        files = md["integrity"]["files"]
        if not isinstance(md["keys"], dict) or not isinstance(files, dict):
            raise TypeError("keys or integrity.files is not an object")
        for info in files.values():
            int(info["size"])
    except (KeyError, TypeError, ValueError) as e:
        raise _corrupt(p, f"{METADATA_FILE} is malformed ({type(e).__name__}: {e})") from e
    return md


def problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` is not a complete checkpoint (``None`` if it is); reads no tensor data.

    Example:
        >>> import tempfile
        >>> problem(tempfile.mkdtemp()).split(" (")[0].startswith("not a purestep checkpoint")
        True
    """
    p = Path(path)
    if _is_scratch(p.name):
        return f"{p} has a scratch name (a save or deletion in progress, or interrupted)"
    try:
        md = read_metadata(p)
    except CheckpointError as e:
        return str(e)
    found = file_problem(p, md)
    return None if found is None else f"checkpoint {p} is damaged: {found[1]}"


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a finished, undamaged-looking checkpoint (cheap: no tensor data read).

    Checks the name, ``metadata.json`` (parsed, against its own checksum) and
    that every data file it lists exists with its recorded size. Bit rot inside
    a data file is found only by reading it (``load``, :func:`purestep.checkpoint.verify`).

    Example:
        >>> import tempfile
        >>> is_complete(tempfile.mkdtemp())
        False
    """
    return problem(path) is None


def _candidates(root: Path) -> list[tuple[int, str, Path]]:
    """Complete checkpoints under ``root`` as ``(step, name, path)``, oldest first.

    Also accepts ``<name>.old-<token>`` when ``<name>`` is gone: an overwriting
    save killed between its two renames leaves the replaced checkpoint there.
    Skips ``<name>.damaged-<token>`` (set aside by ``purestep.loop`` after
    failing verification, though its sizes may look right).
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
        elif _is_scratch(name) or _DAMAGED in name:
            continue
        try:
            md = read_metadata(p)
        except CheckpointError:
            continue
        if file_problem(p, md) is not None:
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

    Scratch directories of unfinished saves, directories without a valid
    ``metadata.json`` and checkpoints with a missing or truncated data file are
    ignored (:func:`damaged` lists the last two). ``None`` if there is none
    (or no ``root``).

    Example:
        >>> import tempfile
        >>> latest(tempfile.mkdtemp()) is None
        True
    """
    cands = _candidates(Path(root))
    return cands[-1][2] if cands else None


def damaged(root: str | os.PathLike[str]) -> list[tuple[Path, str]]:
    """Directories under ``root`` that purestep wrote as checkpoints but that are not complete.

    A directory counts when it has a ``metadata.json`` or purestep's marker
    file and a non-scratch name (``*.damaged-*`` directories, set aside by
    ``purestep.loop``, are not listed again). Returns ``(path, reason)`` pairs
    sorted by name; the check is :func:`is_complete`'s (no tensor data read).

    Example:
        >>> import tempfile
        >>> damaged(tempfile.mkdtemp())
        []
    """
    r = Path(root)
    if not r.is_dir():
        return []
    out = []
    for p in sorted(r.iterdir()):
        if _is_scratch(p.name) or _DAMAGED in p.name or not p.is_dir():
            continue
        if not ((p / METADATA_FILE).exists() or (p / MARKER).exists()):
            continue
        why = problem(p)
        if why is not None:
            out.append((p, why))
    return out


def _purestep_metadata(p: Path) -> bool:
    try:
        md = json.loads((p / METADATA_FILE).read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(md, dict) and md.get("format") == _FORMAT


def _ours(p: Path, kind: str) -> bool:
    """Whether the scratch-named directory ``p`` was made by purestep (or is empty)."""
    if not p.is_dir() or p.is_symlink():
        return False
    try:
        if not any(os.scandir(p)):
            return True  # an empty directory holds nothing to lose
    except OSError:
        return False
    if kind == _TMP:
        if marker_token(p) == p.name.rsplit(_TMP, 1)[1]:
            return True
        # a save killed between creating its marker and writing the token into it leaves the
        # marker alone, empty or cut short: nothing else is in the directory, nothing to lose
        return _only_a_torn_marker(p)
    return _purestep_metadata(p) or marker_token(p) is not None


def _only_a_torn_marker(p: Path) -> bool:
    """Whether ``p`` holds nothing but an unreadable :data:`MARKER` (its write was interrupted)."""
    try:
        names = [e.name for e in os.scandir(p)]
    except OSError:
        return False
    return names == [MARKER] and (p / MARKER).is_file() and marker_token(p) is None


def prune(root: str | os.PathLike[str], keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints, and purestep's stale scratch.

    Only directories purestep created are removed: complete checkpoints
    (recognised by their ``metadata.json``) and scratch directories
    (``*.tmp-<token>`` holding purestep's marker file with that token, or
    nothing but a marker cut short by a save killed while writing it,
    ``*.old-*`` / ``*.del-*`` holding a purestep ``metadata.json`` or marker,
    or any empty one). A ``*.old-*`` checkpoint whose original name is gone is
    the only copy of that checkpoint and is kept. Damaged checkpoints
    (:func:`damaged`) and every other entry are left alone, whatever their names.

    A scratch directory is stale unless it belongs to a save still in flight
    in *this* process (an async save not yet finished); so do not run two jobs
    that save into the same ``root``. A checkpoint is renamed to a scratch
    name before it is deleted, and its ``metadata.json`` is deleted last, so an
    interrupted prune never leaves a half-deleted directory that looks
    complete or that a later prune would not recognise. Safe to call from
    every rank (losing a race to delete is ignored), but calling it from one
    rank is enough. Returns the removed paths.

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
        for p in r.iterdir():
            kind = _scratch_kind(p.name)
            if kind is None or p in keep or p in doomed or p.absolute() in busy:
                continue
            if kind == _OLD and not (r / p.name.split(_OLD)[0]).exists():
                continue  # the only copy of a checkpoint (or a damaged one): not stale
            if _ours(p, kind):
                doomed.append(p)
    removed = []
    for p in sorted(doomed):
        if _remove(p):
            removed.append(p)
    return removed


def _remove(p: Path) -> bool:
    """Delete a directory so that no moment of the deletion looks like a complete checkpoint.

    A checkpoint is first renamed to a scratch name (atomic), then deleted,
    data files first. Returns whether this call removed it (``False`` if
    someone else did).
    """
    target = p
    if not _is_scratch(p.name) or _OLD in p.name:
        target = p.with_name(f"{p.name}{_DEL}{uuid.uuid4().hex[:12]}")
        try:
            os.rename(p, target)
        except FileNotFoundError:
            return False
    remove_tree(target, last=(METADATA_FILE, MARKER))
    return not p.exists() and not target.exists()
