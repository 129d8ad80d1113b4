"""Filesystem steps of checkpoints: no-replace rename, directory fsync, the marker, safe removal.

* :func:`rename_noreplace` publishes a finished scratch directory atomically
  and fails if anything exists at the target, even when another process
  publishes there at the same moment: Linux ``renameat2(RENAME_NOREPLACE)``.
  Where that is unavailable (another OS, a filesystem without the flag) it
  falls back to checking first and then ``rename``, which still fails onto a
  non-empty directory (every checkpoint is one); only an *empty* directory
  created in the instant between the check and the rename could be replaced.
* :data:`MARKER` is written into every scratch directory a save creates (and
  stays in the checkpoint), so :func:`purestep.checkpoint.prune` recognises
  the directories purestep made and never touches others.
* :func:`remove_tree` deletes a directory's data files before its
  ``metadata.json`` and marker, so a removal interrupted at any point leaves a
  directory that is still recognisable as purestep's (or empty).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

__all__ = [
    "MARKER",
    "fsync_dir",
    "marker_token",
    "remove_tree",
    "rename_noreplace",
    "write_marker",
]

MARKER = ".purestep"
"""File in every directory a purestep save creates: ``{"format": ..., "token": <scratch token>}``."""

_MARKER_FORMAT = "purestep.checkpoint"
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def fsync_dir(path: Path, *, strict: bool = False) -> None:
    """fsync a directory (its entries: renames, new files).

    Filesystems that cannot fsync a directory (``EINVAL``, ``ENOTSUP``) are
    ignored; other errors (``EIO``) are raised when ``strict``.

    Example:
        >>> import tempfile
        >>> fsync_dir(Path(tempfile.mkdtemp()), strict=True)
    """
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        if strict and e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EISDIR):
            raise


@functools.cache
def _renameat2() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst`` atomically; ``FileExistsError`` if ``dst`` exists.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp()); (d / "a").mkdir(); (d / "b").mkdir()
        >>> (d / "b" / "f").write_text("x") and None
        >>> try:
        ...     rename_noreplace(d / "a", d / "b")
        ... except FileExistsError:
        ...     print("refused")
        refused
        >>> rename_noreplace(d / "a", d / "c"); sorted(p.name for p in d.iterdir())
        ['b', 'c']
    """
    fn = _renameat2()
    if fn is not None:
        if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            if err == errno.ENOTEMPTY:
                err = errno.EEXIST
            raise OSError(err, os.strerror(err), str(src), None, str(dst))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    try:
        os.rename(src, dst)
    except OSError as e:
        if e.errno == errno.ENOTEMPTY:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst)) from e
        raise


def write_marker(directory: Path, token: str) -> None:
    """Write :data:`MARKER` (naming the save's ``token``) into ``directory``.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp()); write_marker(d, "abc"); marker_token(d)
        'abc'
    """
    data = json.dumps({"format": _MARKER_FORMAT, "token": token})
    with open(directory / MARKER, "w") as f:
        f.write(data)


def marker_token(directory: Path) -> str | None:
    """The token in ``directory``'s :data:`MARKER`, or ``None`` if there is no readable one.

    Example:
        >>> import tempfile
        >>> marker_token(Path(tempfile.mkdtemp())) is None
        True
    """
    try:
        md = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if isinstance(md, dict) and md.get("format") == _MARKER_FORMAT:
        token = md.get("token")
        return token if isinstance(token, str) else None
    return None


def remove_tree(directory: Path, last: tuple[str, ...]) -> None:
    """Delete ``directory``: every entry but those named in ``last`` first, then those, then it.

    Errors are ignored (a concurrent remover may win); check the result with ``exists()``.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp()) / "c"; d.mkdir(); (d / "x").write_text("1") and None
        >>> remove_tree(d, last=("metadata.json",)); d.exists()
        False
    """
    if not isinstance(directory, (str, os.PathLike)):
        # os.scandir(None) lists the *working directory*, which would then be deleted.
        raise TypeError(f"remove_tree: directory must be a path, got {type(directory).__name__}")
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    later = []
    for e in entries:
        if e.name in last:
            later.append(e.path)
        elif e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(e.path)
    for p in later:
        with contextlib.suppress(OSError):
            os.unlink(p)
    with contextlib.suppress(OSError):
        os.rmdir(directory)
