"""Alias of :mod:`purestep.distributed.checkpoint` (atomic, verified DCP checkpoints of a state).

``python -m purestep.checkpoint verify PATH [PATH ...]`` checks checkpoints
without a model (see :mod:`purestep.checkpoint.__main__`).

Example:
    >>> from purestep import checkpoint
    >>> checkpoint.step_dir("/ckpt", 5).name
    'step_00000005'
"""

from purestep.distributed.checkpoint import (
    METADATA_FILE,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointStateError,
    CheckpointWriteError,
    SaveHandle,
    checkpoints,
    damaged,
    is_complete,
    latest,
    load,
    load_per_rank,
    prune,
    read_metadata,
    release_staging_buffers,
    save,
    step_dir,
    verify,
    wait_pending,
)

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
