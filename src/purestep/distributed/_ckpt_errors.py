"""The exceptions of :mod:`purestep.distributed.checkpoint` (see ``docs/errors.md``).

Every failure of ``save``, ``load``, ``load_per_rank`` and ``verify`` raises a
:class:`CheckpointError` (an ``Exception``), on every rank together; the root
cause (an ``OSError`` such as ``ENOSPC``, a collective's error) is chained as
``__cause__``. Subclasses say what kind of failure it was; several also derive
from the builtin exception that names the same situation (``FileExistsError``,
``FileNotFoundError``, ``ValueError``), so code written against those still works.

Each error carries the checkpoint ``path`` and, where one is at fault, the data
``file`` and the ``key`` (the state's dotted key path). They pickle with these
attributes, so an error raised on one rank is re-raised as is on the others.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointReadError",
    "CheckpointStateError",
    "CheckpointWriteError",
]


class CheckpointError(Exception):
    """Base class of every checkpoint failure; the root cause is chained as ``__cause__``.

    Attributes:
        path: the checkpoint directory concerned (``None`` when not known).
        file: the file at fault inside it, relative to ``path`` (or ``None``).
        key: the state key at fault, dotted (``params.student.fc.weight``), or ``None``.

    Example:
        >>> e = CheckpointError("boom", path="/ckpt/step_00000001")
        >>> isinstance(e, Exception), str(e.path)
        (True, '/ckpt/step_00000001')
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | Path | None = None,
        file: str | None = None,
        key: str | None = None,
    ) -> None:
        super().__init__(message)
        self.path = None if path is None else Path(path)
        self.file = file
        self.key = key

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def details(self) -> dict[str, Any]:
        """The attributes as keyword arguments (to re-create the error with another message).

        Example:
            >>> CheckpointError("x", file="f").details()
            {'path': None, 'file': 'f', 'key': None}
        """
        return {"path": self.path, "file": self.file, "key": self.key}


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """There is no checkpoint at the path: no such directory, or no ``metadata.json`` in it.

    Example:
        >>> issubclass(CheckpointNotFoundError, FileNotFoundError)
        True
    """


class CheckpointExistsError(CheckpointError, FileExistsError):
    """``save`` would replace something: the target exists (``overwrite=False``), another
    writer published there first, or the target is not a purestep checkpoint.

    Example:
        >>> issubclass(CheckpointExistsError, FileExistsError)
        True
    """


class CheckpointFormatError(CheckpointError, ValueError):
    """The directory holds a ``metadata.json`` that is not purestep's, or of a format version
    this purestep cannot read.

    Example:
        >>> issubclass(CheckpointFormatError, ValueError)
        True
    """


class CheckpointCorruptError(CheckpointError):
    """The checkpoint's bytes are not what was written: a record fails its checksum, a data
    file is missing, truncated or longer than recorded, or ``metadata.json`` fails its own
    checksum. Nothing was loaded into the caller's state.

    Example:
        >>> CheckpointCorruptError("bad", file="__0_0.distcp", key="w").key
        'w'
    """


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint is intact but does not fit the ``like`` state: missing, unexpected,
    mis-shaped or mis-typed keys (all listed), or per-rank values of another world size.

    Example:
        >>> issubclass(CheckpointMismatchError, ValueError)
        True
    """


class CheckpointStateError(CheckpointError, ValueError):
    """The state (or ``metadata``) cannot be checkpointed as given: keys containing ``.``,
    reserved keys, non-tensor leaves, unsupported tensors, metadata that is not JSON.
    Raised before anything is written.

    Example:
        >>> issubclass(CheckpointStateError, ValueError)
        True
    """


class CheckpointWriteError(CheckpointError):
    """Writing or publishing the checkpoint failed (``__cause__`` holds the ``OSError``,
    e.g. ``ENOSPC``, or the failed collective). Its scratch directory was removed and the
    checkpoints that existed before are unchanged.

    Example:
        >>> CheckpointWriteError("disk full").file is None
        True
    """


class CheckpointReadError(CheckpointError):
    """Reading the checkpoint failed for a reason other than damage to its bytes (an
    ``OSError`` such as ``EIO`` or ``EACCES`` in ``__cause__``, or a failed collective).

    Example:
        >>> issubclass(CheckpointReadError, CheckpointError)
        True
    """


ERROR_TYPES: dict[str, type[CheckpointError]] = {
    cls.__name__: cls
    for cls in (
        CheckpointError,
        CheckpointNotFoundError,
        CheckpointExistsError,
        CheckpointFormatError,
        CheckpointCorruptError,
        CheckpointMismatchError,
        CheckpointStateError,
        CheckpointWriteError,
        CheckpointReadError,
    )
}
"""Every checkpoint error class by name (to re-create an error sent from another rank)."""
