"""Whole-file atomic writes: readers see the old file or the new one, never half of one.

The one helper the loop's metric sinks and the kd trajectory cache share (checkpoints
have their own, directory-level protocol in ``distributed/_ckpt_fs``): write to a
scratch file beside the target, flush and fsync it, ``os.replace`` it over the target,
and fsync the directory; on any failure the scratch file is removed and the target is
untouched.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> p = Path(tempfile.mkdtemp()) / "a.txt"
    >>> write_text(p, "hello")
    >>> p.read_text()
    'hello'
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["remove_scratch", "replace_with", "torch_save", "write_text"]


_SCRATCH = ".tmp-"


def remove_scratch(directory: str | os.PathLike[str]) -> list[Path]:
    """Delete the scratch files writers killed mid-write left in ``directory``; the removed paths.

    Only names this module's writers use (``.<name>.tmp-<pid>``) are touched.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> d = Path(tempfile.mkdtemp())
        >>> _ = (d / ".a.pt.tmp-123").write_bytes(b"half")
        >>> [p.name for p in remove_scratch(d)]
        ['.a.pt.tmp-123']
    """
    removed = []
    for p in sorted(Path(directory).glob(f".*{_SCRATCH}*")):
        if p.is_file() and p.name.rsplit(_SCRATCH, 1)[-1].isdigit():
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed.append(p)
    return removed


def replace_with(path: str | os.PathLike[str], write: Callable[[IO[bytes]], Any]) -> None:
    """Atomically replace ``path`` by what ``write(file)`` writes (fsynced file and directory).

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> p = Path(tempfile.mkdtemp()) / "b.bin"
        >>> replace_with(p, lambda fh: fh.write(b"xy"))
        >>> p.read_bytes()
        b'xy'
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}{_SCRATCH}{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    with contextlib.suppress(OSError):  # a filesystem that cannot fsync a directory
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Atomically replace ``path`` by ``text`` (UTF-8, newlines as given).

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> p = Path(tempfile.mkdtemp()) / "c.txt"
        >>> write_text(p, "a\\nb\\n")
        >>> p.read_text().splitlines()
        ['a', 'b']
    """
    replace_with(path, lambda fh: fh.write(text.encode()))


def torch_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """Atomically replace ``path`` by ``torch.save(obj)``.

    Example:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> p = Path(tempfile.mkdtemp()) / "t.pt"
        >>> torch_save({"w": torch.ones(1)}, p)
        >>> torch.load(p)["w"]
        tensor([1.])
    """
    import torch

    replace_with(path, lambda fh: torch.save(obj, fh))
