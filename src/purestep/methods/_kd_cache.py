"""The teacher-trajectory cache of trajectory distillation: atomic, resumable chunks on disk.

See :mod:`purestep.methods.kd` for the cache layout and the method.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from purestep import rng, tree
from purestep._atomic import remove_scratch, torch_save, write_text
from purestep.methods import flow
from purestep.methods.flow import Purpose

__all__ = ["batches", "generate_trajectories", "load_trajectories", "teacher_schedule"]

_META = "meta.json"
_VERSION = 1


def teacher_schedule(
    teacher_steps: int | Sequence[float], student_steps: Sequence[float], *, shift: float = 1.0
) -> list[float]:
    """The teacher's Euler timesteps: its own schedule merged with the student's steps.

    ``teacher_steps`` is a step count (``flow.timestep_schedule(n, shift=shift)``)
    or an explicit decreasing list from 1 to 0. Student steps not already in it
    are inserted, so the states at the student's steps are exact Euler states.

    Example:
        >>> teacher_schedule(4, [1.0, 0.6])
        [1.0, 0.75, 0.6, 0.5, 0.25, 0.0]
    """
    base = (
        flow.timestep_schedule(teacher_steps, shift=shift).tolist()
        if isinstance(teacher_steps, int)
        else [float(s) for s in teacher_steps]
    )
    if base[0] != 1.0 or base[-1] != 0.0:
        raise ValueError(f"kd: the teacher's steps must run from 1.0 to 0.0, got {base}")
    for s in student_steps:
        if not 0.0 < float(s) <= 1.0:
            raise ValueError(f"kd: student_steps must be in (0, 1], got {list(student_steps)}")
    merged = sorted({*base, *(float(s) for s in student_steps)}, reverse=True)
    out: list[float] = []
    for s in merged:
        if not out or out[-1] - s > 1e-9:
            out.append(s)
    return out


def _chunk_path(cache: Path, c: int) -> Path:
    return cache / f"chunk_{c:06d}.pt"


def _check_meta(cache: Path, meta: dict[str, Any]) -> None:
    path = cache / _META
    if path.exists():
        old = json.loads(path.read_text())
        diff = sorted(k for k in set(old) | set(meta) if old.get(k) != meta.get(k))
        if diff:
            details = "; ".join(
                f"{k}: cached {old.get(k)!r} vs requested {meta.get(k)!r}" for k in diff
            )
            raise ValueError(
                f"kd: cache {str(cache)!r} was generated with other settings ({details}); "
                "use another cache_dir or delete this one"
            )
    else:
        write_text(path, json.dumps(meta, indent=1, sort_keys=True))


def generate_trajectories(
    teacher: nn.Module,
    cache_dir: str | os.PathLike[str],
    *,
    num_samples: int,
    sample_shape: Sequence[int],
    student_steps: Sequence[float],
    key: torch.Tensor,
    teacher_steps: int | Sequence[float] = 32,
    shift: float = 1.0,
    chunk_size: int = 1024,
    teacher_params: TensorDictBase | None = None,
    cond: Mapping[str, torch.Tensor] | None = None,
    null_cond: Mapping[str, Any] | None = None,
    guidance_scale: float = 1.0,
    t_scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    progress: Callable[[int, int], None] | None = None,
    max_chunks: int | None = None,
) -> Path:
    """Generate (or finish generating) the teacher's trajectories into ``cache_dir``.

    Sample ``i`` starts from ``rng.normal(fold_in(key, Purpose.NOISE), ...,
    index=i)``, so its noise depends only on ``key`` and ``i``, and chunk ``c``
    (samples ``c * chunk_size ..``) is a deterministic function of the settings:
    chunks that exist are skipped, missing ones are generated, and the result
    equals an uninterrupted run bitwise. The teacher integrates
    :func:`teacher_schedule` with Euler steps and CFG ``guidance_scale``, without grad.

    Args:
        teacher: the teacher's module (frozen).
        cache_dir: the cache folder (created if missing).
        num_samples: number of trajectories ``N``.
        sample_shape: one sample's shape (without the batch dim).
        student_steps: the student's timesteps (decreasing, in ``(0, 1]``), whose
            states are recorded.
        key: the generation key (a 0-dim int64 key).
        teacher_steps: the teacher's step count or explicit steps.
        shift: timestep shift of the teacher's schedule (with a step count).
        chunk_size: samples per chunk file (part of the settings: a resume must
            use the same).
        teacher_params: the teacher's params (default: the module's own).
        cond: conditioning for every sample, ``{key: [N, ...]}``; stored in the cache.
        null_cond: null values for CFG (with ``cond`` and ``guidance_scale != 1``).
        guidance_scale: the teacher's classifier-free guidance scale.
        t_scale: the teacher receives ``t * t_scale``.
        dtype: dtype of the noise and the recorded states.
        device: where the teacher runs (results are stored on CPU).
        progress: called as ``progress(done_chunks, total_chunks)`` after each chunk.
        max_chunks: stop after generating this many new chunks (to spread the
            work over several calls; ``None``: all).

    Returns:
        The cache folder.

    Example:
        >>> import tempfile
        >>> class Net(nn.Module):
        ...     def forward(self, x, t):
        ...         return -x
        >>> p = generate_trajectories(Net(), tempfile.mkdtemp(), num_samples=4, sample_shape=(2,),
        ...                           student_steps=(1.0,), key=rng.key(0), chunk_size=2)
        >>> sorted(f.name for f in p.iterdir())
        ['chunk_000000.pt', 'chunk_000001.pt', 'meta.json']
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"kd: num_samples must be an int >= 1, got {num_samples!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"kd: chunk_size must be an int >= 1, got {chunk_size!r}")
    s_steps = [float(s) for s in student_steps]
    if not s_steps or any(b >= a for a, b in itertools.pairwise(s_steps)):
        raise ValueError(
            f"kd: student_steps must be non-empty and strictly decreasing, got {s_steps}"
        )
    schedule = teacher_schedule(teacher_steps, s_steps, shift=shift)
    record_at = [schedule.index(min(schedule, key=lambda v: abs(v - s))) for s in s_steps]
    cond = dict(cond or {})
    for k, v in cond.items():
        if v.shape[0] != num_samples:
            raise ValueError(
                f"kd: cond[{k!r}] has {v.shape[0]} rows but num_samples is {num_samples}"
            )
    dev = torch.device("cpu") if device is None else torch.device(device)
    meta = {
        "version": _VERSION,
        "num_samples": num_samples,
        "chunk_size": chunk_size,
        "sample_shape": [int(d) for d in sample_shape],
        "student_steps": s_steps,
        "schedule": schedule,
        "key": int(key),
        "guidance_scale": float(guidance_scale),
        "t_scale": float(t_scale),
        "dtype": str(dtype),
        "cond_keys": sorted(cond),
    }
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    _check_meta(cache, meta)
    remove_scratch(cache)  # chunks a killed run was writing: rewritten below
    t_params = teacher_params.detach() if teacher_params is not None else None
    noise_key = flow.purpose_key(key, Purpose.NOISE)
    n_chunks = math.ceil(num_samples / chunk_size)
    made = 0
    for c in range(n_chunks):
        path = _chunk_path(cache, c)
        if path.exists():
            if progress is not None:
                progress(c + 1, n_chunks)
            continue
        if max_chunks is not None and made >= max_chunks:
            break
        lo, hi = c * chunk_size, min(num_samples, (c + 1) * chunk_size)
        idx = torch.arange(lo, hi, dtype=torch.int64, device=dev)
        noise = rng.normal(noise_key, (hi - lo, *sample_shape), index=idx, dtype=dtype)
        c_cond = {k: v[lo:hi].to(dev) for k, v in cond.items()}
        null = (
            flow.null_condition(c_cond, null_cond)
            if c_cond and null_cond is not None and guidance_scale != 1.0
            else None
        )
        x0, traj = flow.sample(
            teacher,
            t_params,
            noise,
            schedule,
            cond=c_cond,
            null_cond=null,
            guidance_scale=guidance_scale,
            t_scale=t_scale,
            return_trajectory=True,
        )
        record = {
            "x_t": traj[record_at].transpose(0, 1).contiguous().cpu(),
            "x0": x0.contiguous().cpu(),
            "sample": idx.cpu(),
            "cond": {k: v.cpu() for k, v in c_cond.items()},
        }
        torch_save(record, path)
        made += 1
        if progress is not None:
            progress(c + 1, n_chunks)
    return cache


def load_trajectories(cache_dir: str | os.PathLike[str]) -> TensorDict:
    """The cached trajectories as training rows: a TensorDict ``[N * S]``.

    Row ``i * S + s`` is sample ``i``'s state at student step ``s``: keys
    ``x_t`` ``[.., *shape]``, ``t`` (float32), ``x0`` (the teacher's final
    sample), ``sample`` (the sample id) and the stored condition keys.

    Raises:
        FileNotFoundError: no ``meta.json`` or a missing chunk (names it: the
            generation was interrupted; call :func:`generate_trajectories` again).

    Example:
        >>> import tempfile
        >>> class Net(nn.Module):
        ...     def forward(self, x, t):
        ...         return -x
        >>> d = generate_trajectories(Net(), tempfile.mkdtemp(), num_samples=3, sample_shape=(2,),
        ...                           student_steps=(1.0, 0.5), key=rng.key(0))
        >>> load_trajectories(d)["t"].tolist()
        [1.0, 0.5, 1.0, 0.5, 1.0, 0.5]
    """
    cache = Path(cache_dir)
    meta_path = cache / _META
    if not meta_path.exists():
        raise FileNotFoundError(f"kd: no trajectory cache at {str(cache)!r} (missing {_META})")
    meta = json.loads(meta_path.read_text())
    n_chunks = math.ceil(meta["num_samples"] / meta["chunk_size"])
    parts = []
    for c in range(n_chunks):
        path = _chunk_path(cache, c)
        if not path.exists():
            raise FileNotFoundError(
                f"kd: trajectory cache {str(cache)!r} is incomplete: {path.name} of {n_chunks} "
                "chunks is missing; run generate_trajectories again to resume"
            )
        parts.append(torch.load(path, weights_only=True))
    steps = meta["student_steps"]
    n_steps = len(steps)
    x_t = torch.cat([p["x_t"] for p in parts])  # [N, S, ...]
    x0 = torch.cat([p["x0"] for p in parts])
    sample = torch.cat([p["sample"] for p in parts])
    n = x_t.shape[0]
    rows: dict[str, torch.Tensor] = {
        "x_t": x_t.reshape(n * n_steps, *x_t.shape[2:]),
        "t": torch.tensor(steps, dtype=torch.float32).repeat(n),
        "x0": x0.repeat_interleave(n_steps, dim=0),
        "sample": sample.repeat_interleave(n_steps),
    }
    for k in meta["cond_keys"]:
        rows[k] = torch.cat([p["cond"][k] for p in parts]).repeat_interleave(n_steps, dim=0)
    return TensorDict(rows, batch_size=[n * n_steps])


def batches(
    data: TensorDictBase,
    batch_size: int,
    *,
    key: torch.Tensor,
    drop_last: bool = True,
) -> Iterator[TensorDictBase]:
    """Shuffled batches of ``data``, epoch after epoch, forever.

    Epoch ``e`` visits the rows in the order ``rng.randperm(fold_in(key, e), N)``,
    so the sequence of batches is a pure function of ``key``. Each batch gets
    ``index``: its rows' global position in the epoch stream (unique ids, for
    methods that draw per-sample noise).

    Example:
        >>> from purestep import rng
        >>> d = TensorDict({"x": torch.arange(6.0)}, [6])
        >>> it = batches(d, 3, key=rng.key(0))
        >>> sorted(next(it)["x"].tolist() + next(it)["x"].tolist())  # one epoch: every row once
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    """
    n = int(data.batch_size[0])
    if not 1 <= batch_size <= n:
        raise ValueError(f"kd.batches: batch_size must be in [1, {n}], got {batch_size}")
    leaves = tree.leaves(data)
    dev = data.device or (leaves[0].device if leaves else None)  # order and ids live with the data
    epoch = 0
    while True:
        perm = rng.randperm(rng.fold_in(key, epoch), n, device=dev)
        stop = n - batch_size + 1 if drop_last else n
        for start in range(0, stop, batch_size):
            rows = perm[start : start + batch_size]
            out = data[rows]
            ids = torch.arange(start, start + rows.shape[0], dtype=torch.int64, device=dev)
            out.set("index", ids.add_(epoch * n))
            yield out
        epoch += 1
