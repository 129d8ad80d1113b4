"""Distributed checkpoint properties on gloo, world size 2 (one WorkerPool for the module).

Hypothesis draws examples in this (parent) process; each example runs tasks on
both ranks through the pool. Task functions are module-level so they pickle.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, TensorDictBase

from purestep.distributed import checkpoint as ckpt
from purestep.testing.workers import WorkerPool

pytestmark = pytest.mark.distributed

WORLD = 2


# -- helpers shared by the parent and the workers ------------------------------------------


def _mlp(sizes: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.nn.Sequential:
    """An MLP whose weights come from ``seed`` (no global RNG: built on meta, filled explicitly)."""
    layers: list[torch.nn.Module] = []
    for i in range(len(sizes) - 1):
        layers += [torch.nn.Linear(sizes[i], sizes[i + 1], device="meta", dtype=dtype)]
        layers += [torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers[:-1]).to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def _sharded(sizes: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _mlp(sizes, dtype, seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _state(params: TensorDictBase, seed: int, step: int) -> TensorDict:
    return TensorDict(
        {
            "params": {"student": params},
            "opt_state": {"student": {"count": torch.tensor(step, dtype=torch.int64)}},
            "rng": torch.tensor(seed * 7919 - 2**40, dtype=torch.int64),
            "step": torch.tensor(step, dtype=torch.int64),
        },
        batch_size=[],
    )


def _full(td: TensorDictBase) -> dict[str, torch.Tensor]:
    """Plain full tensors keyed by dotted path (gathers DTensors: a collective)."""
    out = {}
    for key, v in td.items(include_nested=True, leaves_only=True):
        name = key if isinstance(key, str) else ".".join(key)
        full = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[name] = full.detach().clone()
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same keys, dtypes, shapes and bits."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and torch.equal(_bits(a[k]), _bits(b[k]))
        for k in a
    )


# -- tasks (run on every rank) -------------------------------------------------------------


def task_save(
    path: str, sizes: tuple[int, ...], dtype: torch.dtype, seed: int, step: int, async_: bool
) -> dict[str, torch.Tensor]:
    """Save a sharded state (+ a per-rank value); with async_, overwrite it right after save."""
    model = _sharded(sizes, dtype, seed)
    state = _state(TensorDict.from_module(model), seed, step)
    expected = _full(state)
    per_rank = TensorDict({"data": {"pos": torch.tensor(1000 + dist.get_rank())}}, [])
    handle = ckpt.save(state, path, async_=async_, per_rank=per_rank)
    if handle is not None:
        with torch.no_grad():  # a donated in-place update racing with the background write
            for p in model.parameters():
                p.to_local().fill_(float("nan"))
            state["step"].add_(1)
            state["rng"].fill_(0)
        handle.wait()
    dist.barrier()
    return expected


def task_async_save_during_collectives(path: str, seed: int) -> dict[str, torch.Tensor]:
    """Async-save, then run training-like collectives on the default group while it writes."""
    model = _sharded((6, 5, 3), torch.float32, seed)
    state = _state(TensorDict.from_module(model), seed, 11)
    expected = _full(state)
    handle = ckpt.save(state, path, async_=True)
    with torch.no_grad():
        for _ in range(20):  # in-place updates and all-reduces while the save is in flight
            for p in model.parameters():
                local = p.to_local()  # shard shapes differ by rank: reduce a scalar
                total = local.sum().reshape(1)
                dist.all_reduce(total)
                local.add_(total)
    handle.wait()
    return expected


def task_load(
    path: str,
    sizes: tuple[int, ...],
    dtype: torch.dtype,
    seed: int,
    donate: bool,
    per_rank: bool = True,
) -> dict[str, Any]:
    """Load into a sharded ``like`` built from another seed; report results and purity."""
    model = _sharded(sizes, dtype, seed)
    like = _state(TensorDict.from_module(model), seed, 0)
    before = _full(like)
    params_before = list(model.parameters())
    out = ckpt.load(path, like=like, donate=donate)
    placements_kept = all(
        o.placements == v.placements
        for o, v in zip(
            out["params"].values(True, True), like["params"].values(True, True), strict=True
        )
    )
    pr_like = TensorDict({"data": {"pos": torch.tensor(-1)}}, [])
    pos = ckpt.load_per_rank(path, like=pr_like)["data", "pos"] if per_rank else None
    return {
        "loaded": _full(out),
        "like_unchanged": _same(before, _full(like)),
        "same_param_objects": all(
            a is b for a, b in zip(params_before, model.parameters(), strict=True)
        ),
        "module_sees_load": _same(
            _full(TensorDict.from_module(model)), _full(out["params", "student"])
        ),
        "placements_kept": placements_kept,
        "pos": None if pos is None else int(pos),
        "out_is_like": out is like,
    }


def task_load_mismatch(path: str, sizes: tuple[int, ...], dtype: torch.dtype) -> None:
    model = _sharded(sizes, dtype, 0)
    ckpt.load(path, like=_state(TensorDict.from_module(model), 0, 0))


def task_latest(root: str) -> str | None:
    found = ckpt.latest(root)
    return None if found is None else found.name


# -- fixtures and tests --------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool() -> Any:
    with WorkerPool(WORLD, task_timeout_s=120, pg_timeout_s=60) as p:
        yield p


sizes_st = st.lists(st.integers(1, 7), min_size=2, max_size=4).map(tuple)
dtype_st = st.sampled_from([torch.float32, torch.bfloat16, torch.float64])


def _parent_like(sizes: tuple[int, ...], dtype: torch.dtype) -> TensorDict:
    return _state(TensorDict.from_module(_mlp(sizes, dtype, 12345)), 0, 0)


@settings(max_examples=6, deadline=None)
@given(sizes=sizes_st, dtype=dtype_st, seed=st.integers(0, 2**16), async_=st.booleans())
def test_sharded_save_round_trips_on_same_and_one_rank(
    pool: WorkerPool,
    tmp_path_factory: pytest.TempPathFactory,
    sizes: tuple[int, ...],
    dtype: torch.dtype,
    seed: int,
    async_: bool,
) -> None:
    """A world-size-2 FSDP2 save loads bitwise on 2 ranks (sharded) and on 1 (plain tensors).

    With async_, the state is overwritten in place right after save returns;
    the checkpoint still holds the values at the time of the call.
    """
    path = str(tmp_path_factory.mktemp("ckpt") / "step_00000003")
    saved = pool.run(task_save, path, sizes, dtype, seed, 3, async_)
    assert _same(saved[0], saved[1])
    expected = saved[0]

    results = pool.run(task_load, path, sizes, dtype, seed + 1, False)
    for r, res in enumerate(results):
        assert _same(res["loaded"], expected), f"rank {r} loaded different values"
        assert res["like_unchanged"], f"rank {r}: load modified `like`"
        assert res["placements_kept"]
        assert res["pos"] == 1000 + r
        assert not res["out_is_like"]

    # 2 -> 1: no process group here, plain tensors.
    out = ckpt.load(path, like=_parent_like(sizes, dtype))
    assert _same(_full(out), expected)
    # ... and with stock DCP's own reader (the checkpoint is an ordinary DCP checkpoint)
    stock = {k: torch.zeros_like(v) for k, v in expected.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(stock, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    assert _same(stock, expected)
    md = ckpt.read_metadata(path)
    assert md["world_size"] == WORLD
    assert md["per_rank_keys"] == {
        str(r): {"data.pos": {"shape": [], "dtype": "int64"}} for r in range(WORLD)
    }


def test_async_save_overlaps_training_collectives_and_keeps_the_snapshot(
    pool: WorkerPool, tmp_path: Path
) -> None:
    """An async save on 2 ranks completes while the ranks run collectives and update in place;
    it holds the values of the call, loads bitwise on 1 rank and on 2 ranks."""
    path = tmp_path / "c"
    saved = pool.run(task_async_save_during_collectives, str(path), 5)
    assert _same(saved[0], saved[1])
    assert ckpt.is_complete(path)
    assert _same(_full(ckpt.load(path, like=_parent_like((6, 5, 3), torch.float32))), saved[0])
    for res in pool.run(task_load, str(path), (6, 5, 3), torch.float32, 6, False, False):
        assert _same(res["loaded"], saved[0])


def test_donated_load_writes_into_the_fsdp_parameters(pool: WorkerPool, tmp_path: Path) -> None:
    """load(donate=True) fills the module's own sharded parameters in place and returns like."""
    sizes, dtype = (5, 3, 2), torch.float32
    path = str(tmp_path / "c")
    expected = pool.run(task_save, path, sizes, dtype, 1, 9, False)[0]
    for res in pool.run(task_load, path, sizes, dtype, 2, True):
        assert res["out_is_like"]
        assert res["same_param_objects"]
        assert res["module_sees_load"]
        assert _same(res["loaded"], expected)


def _save_in_parent(path: Path, sizes: tuple[int, ...], dtype: torch.dtype, seed: int) -> Any:
    state = _state(TensorDict.from_module(_mlp(sizes, dtype, seed)), seed, 4)
    ckpt.save(state, path)
    return _full(state)


@settings(max_examples=4, deadline=None)
@given(sizes=sizes_st, dtype=dtype_st, seed=st.integers(0, 2**16))
def test_single_process_save_loads_sharded_on_two_ranks(
    pool: WorkerPool,
    tmp_path_factory: pytest.TempPathFactory,
    sizes: tuple[int, ...],
    dtype: torch.dtype,
    seed: int,
) -> None:
    """1 -> 2 resharding: a plain-tensor save loads bitwise into FSDP2-sharded params."""
    path = tmp_path_factory.mktemp("ckpt") / "c"
    expected = _save_in_parent(path, sizes, dtype, seed)
    for res in pool.run(task_load_single_saved, str(path), sizes, dtype, seed + 1):
        assert _same(res, expected)


def task_load_single_saved(
    path: str, sizes: tuple[int, ...], dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor]:
    model = _sharded(sizes, dtype, seed)
    out = ckpt.load(path, like=_state(TensorDict.from_module(model), seed, 0))
    return _full(out)


def test_per_rank_values_refuse_a_different_world_size(pool: WorkerPool, tmp_path: Path) -> None:
    """Per-rank values saved on 2 ranks cannot be loaded on 1 (and vice versa): clear error."""
    path2 = tmp_path / "two"
    pool.run(task_save, str(path2), (3, 2), torch.float32, 0, 1, False)
    with pytest.raises(ValueError, match="world size 2"):
        ckpt.load_per_rank(path2, like=TensorDict({"data": {"pos": torch.tensor(0)}}, []))
    path1 = tmp_path / "one"
    ckpt.save(
        _parent_like((3, 2), torch.float32),
        path1,
        per_rank=TensorDict({"data": {"pos": torch.tensor(5)}}, []),
    )
    with pytest.raises(ValueError, match="world size 1"):
        pool.run(task_load, str(path1), (3, 2), torch.float32, 0, False)
    # the pool is still usable: every rank raised together, none hung
    assert pool.run(task_latest, str(tmp_path)) == ["two", "two"]


def test_mismatched_like_raises_on_every_rank_without_hanging(
    pool: WorkerPool, tmp_path: Path
) -> None:
    """A `like` with other shapes fails on all ranks with one message listing the bad keys."""
    path = tmp_path / "c"
    pool.run(task_save, str(path), (4, 3), torch.float32, 0, 1, False)
    pids = pool.pids
    with pytest.raises(ValueError, match=r"mismatched shape or dtype: params\.student\.0\.weight"):
        pool.run(task_load_mismatch, str(path), (4, 5), torch.float32)
    assert pool.pids == pids  # no restart was needed


def task_load_damaged(path: str, sizes: tuple[int, ...], donate: bool) -> dict[str, Any]:
    """Load a damaged checkpoint into a sharded ``like``; report the error and whether ``like``
    (the live state, when donated) is unchanged."""
    model = _sharded(sizes, torch.float32, 3)
    like = _state(TensorDict.from_module(model), 3, 0)
    before = _full(like)
    err = None
    try:
        ckpt.load(path, like=like, donate=donate)
    except ckpt.CheckpointError as e:
        err = (type(e).__name__, str(e), e.file)
    return {"error": err, "unchanged": _same(before, _full(like))}


def task_save_failing_on_rank_1(root: str) -> dict[str, Any]:
    """Save twice; the second save's data-file fsync fails with ENOSPC on rank 1 only."""
    import errno

    model = _sharded((4, 3), torch.float32, 0)
    state = _state(TensorDict.from_module(model), 0, 1)
    ckpt.save(state, os.path.join(root, "a"))
    real = os.fsync

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if dist.get_rank() == 1:
        os.fsync = full  # type: ignore[assignment]
    try:
        ckpt.save(state, os.path.join(root, "b"))
    except ckpt.CheckpointError as e:
        cause = e.__cause__
        return {
            "error": type(e).__name__,
            "message": str(e),
            "errno": getattr(cause, "errno", None),
            "latest": ckpt.latest(root).name,  # type: ignore[union-attr]
        }
    finally:
        os.fsync = real  # type: ignore[assignment]
    return {"error": None}


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_sharded_checkpoint_fails_on_every_rank_and_never_tears_the_live_state(
    pool: WorkerPool, tmp_path: Path, damage: str
) -> None:
    """A bit flip (or truncation) in rank 1's data file: loading on 2 ranks raises
    CheckpointCorruptError on both (naming the file), plain and donated; the donated FSDP
    parameters keep their values on both ranks."""
    path = tmp_path / "c"
    pool.run(task_save, str(path), (6, 5, 3), torch.float32, 1, 2, False)
    f = path / "__1_0.distcp"
    if damage == "flip":  # the last data byte of a parameter shard in rank 1's file
        records = ckpt.read_metadata(path)["integrity"]["records"]
        (rec,) = [
            r for r in records if r["file"] == f.name and r["key"] == "params.student.0.weight"
        ]
        data = bytearray(f.read_bytes())
        data[rec["offset"] + rec["length"] - 1] ^= 0x40
        f.write_bytes(bytes(data))
    else:
        os.truncate(f, f.stat().st_size // 2)
    for donate in (False, True):
        results = pool.run(task_load_damaged, str(path), (6, 5, 3), donate)
        for r, res in enumerate(results):
            assert res["error"] is not None, f"rank {r} loaded a damaged checkpoint"
            name, message, file = res["error"]
            assert name == "CheckpointCorruptError" and file == "__1_0.distcp", (r, message)
            assert res["unchanged"], f"rank {r}: the live state changed (donate={donate})"


def test_a_save_failing_on_one_rank_fails_on_every_rank_and_leaves_no_scratch(
    pool: WorkerPool, tmp_path: Path
) -> None:
    """ENOSPC on rank 1 only: both ranks raise CheckpointWriteError with the OSError (errno
    ENOSPC) as cause, the scratch directory is gone and the previous checkpoint is latest."""
    results = pool.run(task_save_failing_on_rank_1, str(tmp_path))
    for r, res in enumerate(results):
        assert res["error"] == "CheckpointWriteError", (r, res)
        assert res["errno"] == 28, (r, res)
        assert "(on rank 1)" in res["message"] and "No space left" in res["message"], (r, res)
        assert res["latest"] == "a"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_pool_reports_per_rank_results_and_errors_and_leaves_no_process_behind(
    pool: WorkerPool,
) -> None:
    """Results come back in rank order; a rank's exception is re-raised naming the rank;
    closing the pool leaves none of its processes alive (it restarts if used again).

    Runs last in this module because it closes the shared pool.
    """
    assert pool.run(task_rank_times, 3) == [0, 3]
    with pytest.raises(ZeroDivisionError) as info:
        pool.run(task_divide, 1)
    assert "rank 1 of 2" in str(info.value.__notes__)
    assert "task_divide" in str(info.value.__cause__)  # the remote traceback
    pids = pool.pids
    assert pool.run(task_rank_times, 2) == [0, 2]  # still healthy: every rank answered
    assert pool.pids == pids
    pool.close()
    assert pool.pids == []
    for pid in pids:
        assert not _alive(pid), f"worker {pid} still alive"


def task_divide(x: int) -> float:
    return x / (dist.get_rank() - 1)  # rank 1 divides by zero


def task_rank_times(x: int) -> int:
    return dist.get_rank() * x


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) does not count as alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def task_load_per_rank_damaged(path: str) -> dict[str, Any]:
    """load_per_rank of this rank's value; report the error it raised, if any."""
    like = TensorDict({"data": {"pos": torch.tensor(-1)}}, [])
    try:
        ckpt.load_per_rank(path, like=like)
    except ckpt.CheckpointError as e:
        return {"error": type(e).__name__, "key": e.key}
    return {"error": None, "key": None}


def test_a_damaged_per_rank_value_fails_load_per_rank_on_every_rank(
    pool: WorkerPool, tmp_path: Path
) -> None:
    """A flipped byte in rank 1's per-rank value fails load_per_rank on both ranks, naming that
    key (rank 0's own value is intact, but its read is a collective and the ranks fail
    together)."""
    path = tmp_path / "c"
    pool.run(task_save, str(path), (4, 3), torch.float32, 0, 1, False)
    records = ckpt.read_metadata(path)["integrity"]["records"]
    (rec,) = [r for r in records if r["key"] == "__rank_1__.data.pos"]
    f = path / rec["file"]
    data = bytearray(f.read_bytes())
    data[rec["offset"] + rec["length"] - 1] ^= 0x40
    f.write_bytes(bytes(data))
    results = pool.run(task_load_per_rank_damaged, str(path))
    assert results == [{"error": "CheckpointCorruptError", "key": "__rank_1__.data.pos"}] * 2
