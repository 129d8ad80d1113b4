"""Checkpoints of the loop: where to resume from, loading the state and the data position, saving."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase

from purestep.distributed import checkpoint as ckpt
from purestep.loop._data import DataStream, decode_state
from purestep.step import is_bound

__all__ = ["LOOP_KEY", "probe_writable", "rank", "restore", "resume_source", "save"]

LOOP_KEY = "loop"
"""Top-level checkpoint key of the loop's own values (``loop.batches_consumed``)."""


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def probe_writable(root: Path, rank: int) -> None:
    """Create ``root`` and write and remove a probe file there, or raise ``OSError`` naming it."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".purestep-write-probe-{rank}-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise OSError(f"run: checkpoint_dir {str(root)!r} is not writable: {e}") from e


def resume_source(resume: Any, root: Path | None) -> Path | None:
    """The checkpoint to resume from (``None``: start from scratch); see ``run``'s ``resume``."""
    if resume is None:
        found = ckpt.latest(root) if root is not None else None
        if found is not None:
            raise ValueError(
                f"run: checkpoint_dir {str(root)!r} already holds checkpoints (newest: "
                f"{found.name}) and resume=None; pass resume='latest' to continue that run, "
                "or use a fresh directory"
            )
        return None
    if resume == "latest":
        return ckpt.latest(root) if root is not None else None
    if not isinstance(resume, (str, os.PathLike)):
        raise TypeError(f"run: resume must be 'latest', None or a path, got {resume!r}")
    path = Path(resume)
    try:
        ckpt.read_metadata(path)
    except (OSError, ValueError) as e:
        raise type(e)(f"run: resume={str(resume)!r} is not a checkpoint: {e}") from e
    return path


def _has_bound_params(state: TensorDictBase) -> bool:
    params = state.get("params", None)
    if not isinstance(params, TensorDictBase):
        return False
    roles = [params.get(r) for r in params.keys()]
    return any(isinstance(p, TensorDictBase) and is_bound(p) for p in roles)


def _scalar(x: int) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int64)


def restore(path: Path, state: TensorDictBase, stream: DataStream) -> TensorDictBase:
    """Load the state from ``path`` and move ``stream`` to the saved data position."""
    md = ckpt.read_metadata(path)
    has_loop = f"{LOOP_KEY}.batches_consumed" in md.get("keys", {})
    like = state.copy()
    if has_loop:
        like.set(LOOP_KEY, TensorDict({"batches_consumed": _scalar(0)}, []))
    try:
        loaded = ckpt.load(path, like=like, donate=_has_bound_params(state))
    except ValueError as e:
        raise ValueError(f"run: cannot resume from {path}: {e}") from e
    if has_loop:
        consumed = int(loaded.get((LOOP_KEY, "batches_consumed")))
        loaded = loaded.exclude(LOOP_KEY)
    else:  # a checkpoint saved outside the loop: assume one batch per step
        consumed = int(loaded.get("step"))
    saved = md.get("per_rank_keys", {}).get(str(rank()), {})
    if md.get("world_size") == _world() and f"{LOOP_KEY}.epoch" in saved:
        pos: dict[str, torch.Tensor] = {"epoch": _scalar(0), "position": _scalar(0)}
        if f"{LOOP_KEY}.data_state" in saved:
            shape = saved[f"{LOOP_KEY}.data_state"]["shape"]
            pos["data_state"] = torch.zeros(shape, dtype=torch.uint8)
        vals = ckpt.load_per_rank(path, like=TensorDict({LOOP_KEY: pos}, []))
        data_state = None
        if "data_state" in pos:
            if stream.stateful:
                data_state = decode_state(vals.get((LOOP_KEY, "data_state")))
            else:
                warnings.warn(
                    f"checkpoint {path} holds a data loader state, but data has no "
                    "load_state_dict(); restoring the position by skipping batches instead",
                    stacklevel=3,
                )
        elif stream.stateful:
            warnings.warn(
                f"checkpoint {path} holds no data loader state; restoring the position of the "
                "stateful data by skipping batches instead",
                stacklevel=3,
            )
        epoch = int(vals.get((LOOP_KEY, "epoch")))
        stream.restore(consumed, epoch, int(vals.get((LOOP_KEY, "position"))), data_state)
    else:
        if has_loop:
            warnings.warn(
                f"checkpoint {path} was saved on world size {md.get('world_size')}, not "
                f"{_world()}: its per-rank data positions do not apply; skipping {consumed} "
                "batches from the start of data instead",
                stacklevel=3,
            )
        stream.skip(consumed)
    return loaded


def save(
    root: Path,
    state: TensorDictBase,
    stream: DataStream,
    step: int,
    keep_last: int,
    *,
    async_: bool = False,
) -> Path:
    """Save ``state`` plus the data position at ``step_dir(root, step)``; prune to ``keep_last``.

    With ``async_`` the save is staged and written in the background (see
    :func:`purestep.checkpoint.save`); the prune then counts only complete
    checkpoints, so ``keep_last + 1`` may exist until the next save.
    """
    full = state.copy()
    full.set(LOOP_KEY, TensorDict({"batches_consumed": _scalar(stream.consumed)}, []))
    path = ckpt.step_dir(root, step)
    ckpt.save(
        full,
        path,
        async_=async_,
        per_rank=TensorDict({LOOP_KEY: stream.per_rank()}, []),
        metadata={"loop": {"batches_consumed": stream.consumed}},
        overwrite=True,
    )
    if rank() == 0:
        ckpt.prune(root, keep_last)
    return path
