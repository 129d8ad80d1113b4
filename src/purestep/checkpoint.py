"""Alias of :mod:`purestep.distributed.checkpoint` (atomic DCP checkpoints of a state).

Example:
    >>> from purestep import checkpoint
    >>> checkpoint.step_dir("/ckpt", 5).name
    'step_00000005'
"""

from purestep.distributed.checkpoint import (
    METADATA_FILE,
    SaveHandle,
    checkpoints,
    is_complete,
    latest,
    load,
    load_per_rank,
    prune,
    read_metadata,
    release_staging_buffers,
    save,
    step_dir,
    wait_pending,
)

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
