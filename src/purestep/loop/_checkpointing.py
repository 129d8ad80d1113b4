"""Checkpoints of the loop: where to resume from, loading the state and the data position, saving."""

from __future__ import annotations

import os
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase

from purestep._keys import PARAMS, STEP
from purestep.distributed import checkpoint as ckpt
from purestep.loop._data import DataStream, decode_state
from purestep.step import is_bound

__all__ = [
    "LOOP_KEY",
    "pending_metrics",
    "probe_writable",
    "rank",
    "restore",
    "restore_any",
    "resume_sources",
    "save",
]

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


def _step(path: Path) -> int:
    step = ckpt.read_metadata(path).get("step")
    return step if isinstance(step, int) else -1


def _warn(message: str) -> None:
    if rank() == 0:
        warnings.warn(message, stacklevel=4)


def resume_sources(resume: Any, root: Path | None) -> list[Path]:
    """The checkpoints to try, in order (empty: start from scratch); see ``run``'s ``resume``.

    ``"latest"``: every complete checkpoint in ``root``, newest first, after a
    warning naming each damaged one (it is skipped). A path: just it, unless
    ``root`` holds newer checkpoints (resuming there would replace them and
    their log records): then ``ValueError``.
    """
    if resume is None:
        found = ckpt.latest(root) if root is not None else None
        if found is not None:
            raise ValueError(
                f"run: checkpoint_dir {str(root)!r} already holds checkpoints (newest: "
                f"{found.name}) and resume=None; pass resume='latest' to continue that run, "
                "or use a fresh directory"
            )
        return []
    if resume == "latest":
        if root is None:
            return []
        bad = ckpt.damaged(root)
        intact = ckpt.checkpoints(root)
        if bad:
            _warn(
                "run: resume='latest' skips damaged or incomplete checkpoints: "
                + "; ".join(f"{p.name} ({why})" for p, why in bad)
            )
            if not intact:
                raise ckpt.CheckpointCorruptError(
                    f"run: resume='latest': no intact checkpoint in {str(root)!r}, only damaged "
                    f"ones ({', '.join(p.name for p, _ in bad)}); move them away to start afresh",
                    path=root,
                )
        return intact[::-1]
    if not isinstance(resume, (str, os.PathLike)):
        raise TypeError(f"run: resume must be 'latest', None or a path, got {resume!r}")
    path = Path(resume)
    try:
        at = _step(path)
    except ckpt.CheckpointError as e:
        raise type(e)(f"run: resume={str(resume)!r} is not a checkpoint: {e}", **e.details()) from e
    if root is not None:
        newer = [
            p for p in ckpt.checkpoints(root) if _step(p) > at and p.absolute() != path.absolute()
        ]
        newer += [p for p, _ in ckpt.damaged(root) if _named_after(p, at)]
        if newer:
            raise ValueError(
                f"run: resume={str(resume)!r} is at step {at}, but checkpoint_dir {str(root)!r} "
                f"holds later checkpoints ({', '.join(sorted(p.name for p in newer))}); resuming "
                "there would replace them and drop their metric records. To branch from step "
                f"{at}, pass a new checkpoint_dir (resume may point into this one); to continue "
                "the run, pass resume='latest'"
            )
    return [path]


def _named_after(p: Path, step: int) -> bool:
    """Whether ``p`` is named like a loop checkpoint of a step after ``step``."""
    name = p.name
    return name.startswith("step_") and name[5:].isdigit() and int(name[5:]) > step


def restore_any(
    sources: list[Path], state: TensorDictBase, stream: DataStream
) -> tuple[TensorDictBase, Path]:
    """:func:`restore` from the first of ``sources`` that loads; a damaged one is skipped (warned).

    Only ``resume='latest'`` passes several sources; the last one's error is raised.
    """
    for i, path in enumerate(sources):
        try:
            return restore(path, state, stream), path
        except ckpt.CheckpointCorruptError as e:
            if i == len(sources) - 1:
                raise
            _warn(f"run: resume='latest' skips damaged checkpoint {path.name}: {e}")
    raise AssertionError("restore_any needs at least one source")  # pragma: no cover


def _has_bound_params(state: TensorDictBase) -> bool:
    params = state.get(PARAMS, None)
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
    except ckpt.CheckpointMismatchError as e:
        raise ckpt.CheckpointMismatchError(
            f"run: cannot resume from {path}: {e}", **e.details()
        ) from e
    if has_loop:
        consumed = int(loaded.get((LOOP_KEY, "batches_consumed")))
        loaded = loaded.exclude(LOOP_KEY)
    else:  # a checkpoint saved outside the loop: assume one batch per step
        consumed = int(loaded.get(STEP))
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
                    stacklevel=4,
                )
        elif stream.stateful:
            warnings.warn(
                f"checkpoint {path} holds no data loader state; restoring the position of the "
                "stateful data by skipping batches instead",
                stacklevel=4,
            )
        epoch = int(vals.get((LOOP_KEY, "epoch")))
        stream.restore(consumed, epoch, int(vals.get((LOOP_KEY, "position"))), data_state)
    else:
        if has_loop:
            warnings.warn(
                f"checkpoint {path} was saved on world size {md.get('world_size')}, not "
                f"{_world()}: its per-rank data positions do not apply; skipping {consumed} "
                "batches from the start of data instead",
                stacklevel=4,
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
    pending_metrics: dict[str, list[str]] | None = None,
) -> Path:
    """Save ``state`` plus the data position at ``step_dir(root, step)``; prune to ``keep_last``.

    With ``async_`` the save is staged and written in the background (see
    :func:`purestep.checkpoint.save`); the prune then counts only complete
    checkpoints, so ``keep_last + 1`` may exist until the next save. A damaged
    checkpoint already at that path (one that ``resume='latest'`` skipped) is
    renamed to ``<name>.damaged-<token>`` first and kept; the save never
    replaces an existing checkpoint (another job writing the same directory
    makes it fail with :class:`purestep.checkpoint.CheckpointExistsError`).
    ``pending_metrics`` (a preemption's metrics since the last log point, see
    :meth:`MetricBuffer.pending`) go into the metadata, for :func:`pending_metrics`.
    """
    full = state.copy()
    full.set(LOOP_KEY, TensorDict({"batches_consumed": _scalar(stream.consumed)}, []))
    path = ckpt.step_dir(root, step)
    if rank() == 0:
        _set_damaged_aside(path)
    ckpt.save(
        full,
        path,
        async_=async_,
        per_rank=TensorDict({LOOP_KEY: stream.per_rank()}, []),
        metadata={
            "loop": {"batches_consumed": stream.consumed}
            | ({"pending_metrics": pending_metrics} if pending_metrics else {})
        },
    )
    if rank() == 0:
        ckpt.prune(root, keep_last)
    return path


def pending_metrics(path: Path) -> dict[str, Any]:
    """The metrics a preempted run had not logged when it saved ``path`` (``{}`` if none)."""
    loop_md = ckpt.read_metadata(path).get("metadata", {}).get(LOOP_KEY, {})
    found = loop_md.get("pending_metrics", {}) if isinstance(loop_md, dict) else {}
    if not isinstance(found, dict):
        raise ckpt.CheckpointFormatError(
            f"checkpoint {path}: metadata.loop.pending_metrics is not a mapping: {found!r}"
        )
    return found


def _set_damaged_aside(path: Path) -> None:
    """Rename a damaged purestep checkpoint at ``path`` to ``<name>.damaged-<token>`` (kept)."""
    if not os.path.lexists(path):
        return
    why = dict(ckpt.damaged(path.parent)).get(path)
    if why is None and ckpt.is_complete(path):
        try:  # rare: a checkpoint at a step being saved again, as after resume skipped it
            ckpt.verify(path)
        except ckpt.CheckpointCorruptError as e:
            why = str(e)
    if why is None:
        return  # intact, or not purestep's: save refuses it, naming it
    aside = path.with_name(f"{path.name}.damaged-{uuid.uuid4().hex[:12]}")
    os.rename(path, aside)
    warnings.warn(
        f"run: renamed the damaged checkpoint {path.name} to {aside.name} (kept) to save a new "
        f"{path.name}; it was damaged: {why}",
        stacklevel=4,
    )
