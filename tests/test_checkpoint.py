"""Single-process checkpoint properties (no process group): round trip, errors, atomicity."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import purestep
from _checkpoint_states import DTYPES, _random_tensor, _same, _small, _train_state
from purestep import checkpoint as alias
from purestep.distributed import _ckpt_write
from purestep.distributed import checkpoint as ckpt

name_st = st.from_regex(r"[a-z][a-z0-9_]{0,5}", fullmatch=True)
leaf_st = st.tuples(st.lists(st.integers(0, 4), max_size=3).map(tuple), st.sampled_from(DTYPES))
tree_st = st.recursive(
    leaf_st, lambda inner: st.dictionaries(name_st, inner, min_size=1, max_size=3), max_leaves=8
).filter(lambda t: isinstance(t, dict))


def _build(spec: dict[str, Any], g: torch.Generator) -> dict[str, Any]:
    return {
        k: _build(v, g) if isinstance(v, dict) else _random_tensor(v[0], v[1], g)
        for k, v in spec.items()
    }


@settings(max_examples=25, deadline=None)
@given(
    spec=tree_st,
    seed=st.integers(0, 2**31),
    rng=st.integers(-(2**63), 2**63 - 1),
    step=st.integers(0, 2**40),
    async_=st.booleans(),
)
def test_save_load_round_trips_bitwise(
    tmp_path_factory: pytest.TempPathFactory,
    spec: dict[str, Any],
    seed: int,
    rng: int,
    step: int,
    async_: bool,
) -> None:
    """load(save(state)) == state bit for bit, for any nesting, dtype, shape, rng and step."""
    g = torch.Generator().manual_seed(seed)
    state = TensorDict(
        {"params": _build(spec, g), "rng": torch.tensor(rng), "step": torch.tensor(step)}, []
    )
    like = state.apply(torch.zeros_like)
    like_before = like.clone()
    path = tmp_path_factory.mktemp("c") / "ckpt"
    handle = ckpt.save(state, path, async_=async_)
    if handle is not None:
        assert handle.wait() == path.absolute()
    out = ckpt.load(path, like=like)
    assert _same(out, state)
    assert _same(like, like_before), "load modified `like` without donate=True"
    assert int(out["rng"]) == rng
    assert int(out["step"]) == step


def test_alias_module_exports_the_same_functions() -> None:
    """purestep.checkpoint is purestep.distributed.checkpoint under a shorter name."""
    for name in ckpt.__all__:
        assert getattr(alias, name) is getattr(ckpt, name)
    assert set(alias.__all__) == set(ckpt.__all__)


def test_nested_train_state_round_trips(tmp_path: Path) -> None:
    """A typical state (bf16/fp64 params, int64 count, fp64 lr, rng, step) loads bitwise."""
    state = _train_state(seed=1, step=17)
    ckpt.save(state, tmp_path / "c")
    out = ckpt.load(tmp_path / "c", like=_train_state(seed=2, step=0))
    assert _same(out, state)


def test_keys_containing_dots_are_rejected_by_name(tmp_path: Path) -> None:
    """A key with '.' would not round-trip through '.'-flattening: save names every such key."""
    state = TensorDict({"a.b": torch.ones(1), "c": {"d.e": torch.ones(1), "ok": torch.ones(1)}}, [])
    with pytest.raises(ValueError, match=r"'a\.b'.*'c', 'd\.e'") as info:
        ckpt.save(state, tmp_path / "c")
    assert "ok" not in str(info.value)
    assert not (tmp_path / "c").exists()
    assert list(tmp_path.iterdir()) == []  # nothing was created


def test_reserved_prefix_and_bad_metadata_are_rejected(tmp_path: Path) -> None:
    """Top-level keys named like per-rank storage and non-JSON metadata fail before writing."""
    with pytest.raises(ValueError, match="reserved"):
        ckpt.save(TensorDict({"__rank_0__": torch.ones(1)}, []), tmp_path / "a")
    with pytest.raises(ValueError, match="JSON"):
        ckpt.save(TensorDict({"x": torch.ones(1)}, []), tmp_path / "b", metadata={"f": object()})
    assert list(tmp_path.iterdir()) == []


def test_like_mismatch_lists_every_bad_key_in_one_message(tmp_path: Path) -> None:
    """Missing, unexpected, mis-shaped and mis-typed keys all appear in a single ValueError."""
    state = _train_state()
    ckpt.save(state, tmp_path / "c")
    like = _train_state()
    del like["params", "student", "head"]  # -> unexpected in checkpoint
    like["params", "student", "extra"] = torch.zeros(2)  # -> missing from checkpoint
    like["params", "student", "fc", "weight"] = torch.zeros(3, 4)  # -> wrong shape
    like["step"] = torch.tensor(0, dtype=torch.int32)  # -> wrong dtype
    with pytest.raises(ValueError, match="does not match `like`") as info:
        ckpt.load(tmp_path / "c", like=like)
    msg = str(info.value)
    assert "missing from the checkpoint (in like only): params.student.extra" in msg
    assert "unexpected in the checkpoint (not in like): params.student.head.weight" in msg
    assert "params.student.fc.weight: checkpoint has (4, 3) float32, like has (3, 4) float32" in msg
    assert "step: checkpoint has () int64, like has () int32" in msg


def test_loading_a_non_checkpoint_fails_clearly(tmp_path: Path) -> None:
    """Empty, missing, foreign, old-format and markerless directories are not checkpoints; each
    error is a CheckpointError subclass that also is the matching builtin exception."""
    like = _train_state()
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ckpt.CheckpointNotFoundError, match=r"not a purestep checkpoint: .*empty \(no metadata"
    ) as info:
        ckpt.load(tmp_path / "empty", like=like)
    assert isinstance(info.value, FileNotFoundError)
    assert info.value.path == tmp_path / "empty"
    with pytest.raises(ckpt.CheckpointNotFoundError, match="no such directory"):
        ckpt.load(tmp_path / "nowhere", like=like)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "metadata.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ckpt.CheckpointFormatError, match="not a purestep checkpoint"):
        ckpt.load(tmp_path / "foreign", like=like)
    (tmp_path / "v1").mkdir()
    v1 = {"format": "purestep.checkpoint", "format_version": 1, "complete": True}
    (tmp_path / "v1" / "metadata.json").write_text(json.dumps(v1))
    with pytest.raises(ckpt.CheckpointFormatError, match=r"format version 1.*before checksums"):
        ckpt.load(tmp_path / "v1", like=like)
    ckpt.save(_small(1), tmp_path / "half")
    md = json.loads((tmp_path / "half" / "metadata.json").read_text())
    del md["complete"]
    (tmp_path / "half" / "metadata.json").write_text(json.dumps(md))
    with pytest.raises(ckpt.CheckpointCorruptError, match="does not match its own checksum"):
        ckpt.load(tmp_path / "half", like=_small(0))
    for name in ["empty", "nowhere", "foreign", "v1", "half"]:
        assert not ckpt.is_complete(tmp_path / name)


def test_metadata_json_describes_the_checkpoint(tmp_path: Path) -> None:
    """metadata.json holds step, every key's shape and dtype, world size, version, user data."""
    state = _train_state(step=42)
    ckpt.save(state, tmp_path / "c", metadata={"run": "abc", "n": [1, 2]})
    md = json.loads((tmp_path / "c" / "metadata.json").read_text())
    assert md["complete"] is True
    assert md["step"] == 42
    assert md["world_size"] == 1
    assert md["purestep_version"] == purestep.__version__
    assert md["metadata"] == {"run": "abc", "n": [1, 2]}
    expected = {
        ".".join(k): {
            "shape": list(v.shape),
            "dtype": str(v.dtype).removeprefix("torch."),
        }
        for k, v in state.items(True, True)
        for k in [(k,) if isinstance(k, str) else k]
    }
    assert md["keys"] == expected
    assert ckpt.read_metadata(tmp_path / "c") == md


def test_step_dir_names_sort_like_steps(tmp_path: Path) -> None:
    """step_dir zero-pads, so lexical order of names equals numeric order of steps."""
    steps = [0, 7, 10, 99, 100, 12345678]
    names = [ckpt.step_dir(tmp_path, s).name for s in steps]
    assert sorted(names) == names
    with pytest.raises(ValueError, match="step must be >= 0"):
        ckpt.step_dir(tmp_path, -1)


def test_latest_is_highest_step_and_ignores_scratch_and_incomplete(tmp_path: Path) -> None:
    """latest() orders by the step in metadata (not by name) and skips unfinished directories."""
    assert ckpt.latest(tmp_path / "missing") is None
    assert ckpt.latest(tmp_path) is None
    ckpt.save(_small(5), tmp_path / "b")
    ckpt.save(_small(9), tmp_path / "a")  # later step, earlier name
    # an unfinished save: scratch dir with a complete-looking metadata.json
    ckpt.save(_small(50), tmp_path / "tmp-src")
    os.rename(tmp_path / "tmp-src", tmp_path / "z.tmp-deadbeef")
    (tmp_path / "step_99999999").mkdir()  # no metadata.json
    (tmp_path / "file").write_text("x")
    assert ckpt.latest(tmp_path) == tmp_path / "a"
    assert ckpt.checkpoints(tmp_path) == [tmp_path / "b", tmp_path / "a"]
    assert not ckpt.is_complete(tmp_path / "z.tmp-deadbeef")


def test_latest_falls_back_to_a_moved_aside_checkpoint(tmp_path: Path) -> None:
    """An overwrite killed between its two renames leaves `<name>.old-*`, still found by latest()."""
    ckpt.save(_small(3), tmp_path / "c")
    os.rename(tmp_path / "c", tmp_path / "c.old-1234")
    assert ckpt.latest(tmp_path) == tmp_path / "c.old-1234"
    assert _same(ckpt.load(ckpt.latest(tmp_path), like=_small(0)), _small(3))
    ckpt.save(_small(3), tmp_path / "c")  # once <name> exists again the old copy is scratch
    assert ckpt.checkpoints(tmp_path) == [tmp_path / "c"]
    assert ckpt.prune(tmp_path, keep_last=1) == [tmp_path / "c.old-1234"]


def test_prune_keeps_the_newest_and_removes_stale_scratch(tmp_path: Path) -> None:
    """prune keeps the newest keep_last checkpoints, removes older ones and stale scratch dirs."""
    for s in [1, 2, 3, 4]:
        ckpt.save(_small(s), ckpt.step_dir(tmp_path, s))
    (tmp_path / "step_00000005.tmp-abc").mkdir()
    (tmp_path / "notes").mkdir()
    removed = ckpt.prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == [
        "step_00000001",
        "step_00000002",
        "step_00000005.tmp-abc",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step_00000003", "step_00000004"]
    assert ckpt.prune(tmp_path, keep_last=0) == [
        tmp_path / "step_00000003",
        tmp_path / "step_00000004",
    ]
    with pytest.raises(ValueError, match="keep_last"):
        ckpt.prune(tmp_path, keep_last=-1)


def test_prune_with_fewer_checkpoints_than_keep_last_removes_none(tmp_path: Path) -> None:
    """keep_last larger than the number of checkpoints keeps them all."""
    for s in [1, 2]:
        ckpt.save(_small(s), ckpt.step_dir(tmp_path, s))
    assert ckpt.prune(tmp_path, keep_last=3) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000002"]


def test_prune_spares_the_scratch_dir_of_a_save_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An async save still writing in this process keeps its scratch dir through prune()."""
    gate = threading.Event()
    real_write = ckpt._write

    def slow_write(*args: Any) -> Path:
        gate.wait(30)
        return real_write(*args)

    monkeypatch.setattr(ckpt, "_write", slow_write)
    handle = ckpt.save(_small(1), tmp_path / "c", async_=True)
    try:
        scratch = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
        assert len(scratch) == 1
        assert not handle.done()
        assert ckpt.prune(tmp_path, keep_last=0) == []
        assert scratch[0].exists()
    finally:
        gate.set()
    handle.wait()
    assert ckpt.latest(tmp_path) == tmp_path / "c"
    assert not scratch[0].exists()


def test_existing_checkpoint_is_not_overwritten_unless_asked(tmp_path: Path) -> None:
    """save refuses an existing path; overwrite=True replaces a checkpoint, never other dirs."""
    ckpt.save(_small(1), tmp_path / "c")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        ckpt.save(_small(2), tmp_path / "c")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        ckpt.save(_small(2), tmp_path / "c", async_=True)
    assert _same(ckpt.load(tmp_path / "c", like=_small(0)), _small(1))
    ckpt.save(_small(2), tmp_path / "c", overwrite=True)
    assert _same(ckpt.load(tmp_path / "c", like=_small(0)), _small(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no scratch left behind
    (tmp_path / "data").mkdir()
    with pytest.raises(FileExistsError, match="not a complete purestep checkpoint"):
        ckpt.save(_small(2), tmp_path / "data", overwrite=True)


@pytest.mark.parametrize("async_", [False, True])
def test_a_failed_save_leaves_no_checkpoint_and_no_scratch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_: bool
) -> None:
    """An error while writing is raised (by save, or by wait for async) and cleans up."""
    ckpt.save(_small(1), tmp_path / "a")

    def broken(*args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device (simulated)")

    monkeypatch.setattr(_ckpt_write, "write_metadata", broken)

    def save_and_wait() -> None:
        handle = ckpt.save(_small(2), tmp_path / "b", async_=async_)
        if handle is not None:
            handle.wait()

    with pytest.raises(ckpt.CheckpointWriteError, match="No space left") as info:
        save_and_wait()
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno == errno.ENOSPC
    ckpt.wait_pending()  # the failure was consumed; nothing left pending
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    assert ckpt.latest(tmp_path) == tmp_path / "a"


def test_async_save_snapshots_the_state_at_call_time(tmp_path: Path) -> None:
    """Overwriting the state in place right after save(async_=True) returns does not leak in."""
    g = torch.Generator().manual_seed(0)
    state = TensorDict(
        {
            "w": torch.randn(4_000_000, generator=g),
            "v": torch.randn(1000, generator=g),
            "step": torch.tensor(1),
        },
        [],
    )
    expected = state.clone()
    handle = ckpt.save(state, tmp_path / "c", async_=True)
    state["w"].fill_(float("nan"))  # a donated in-place update, immediately
    state["v"].zero_()
    state["step"].add_(1)
    assert handle.wait() == (tmp_path / "c").absolute()
    assert handle.done()
    assert _same(ckpt.load(tmp_path / "c", like=state), expected)
    # the next save reuses the staging buffers; the earlier checkpoint is unaffected
    ckpt.save(state, tmp_path / "d", async_=True)
    ckpt.wait_pending()
    assert _same(ckpt.load(tmp_path / "d", like=state), state)
    assert _same(ckpt.load(tmp_path / "c", like=state), expected)
    ckpt.release_staging_buffers()


def test_donated_load_fills_like_in_place(tmp_path: Path) -> None:
    """load(donate=True) writes into like's own tensors (keeping their identity) and returns like."""
    g = torch.Generator().manual_seed(0)
    saved = TensorDict(
        {
            "params": {
                "weight": torch.randn(4, 3, generator=g),
                "bias": torch.randn(4, generator=g),
            },
            "step": torch.tensor(8),
        },
        [],
    )
    ckpt.save(saved, tmp_path / "c")
    model = torch.nn.Linear(3, 4)
    like = TensorDict({"params": TensorDict.from_module(model), "step": torch.tensor(0)}, [])
    weight, bias = model.weight, model.bias
    out = ckpt.load(tmp_path / "c", like=like, donate=True)
    assert out is like
    assert model.weight is weight
    assert model.bias is bias
    assert torch.equal(model.weight.detach(), saved["params", "weight"])
    assert _same(out.apply(torch.Tensor.detach), saved)


def test_per_rank_values_round_trip_in_one_process(tmp_path: Path) -> None:
    """per_rank values come back through load_per_rank and are invisible to load."""
    pos = TensorDict({"loader": {"pos": torch.tensor(123), "epoch": torch.tensor(2)}}, [])
    ckpt.save(_small(1), tmp_path / "c", per_rank=pos)
    assert _same(ckpt.load(tmp_path / "c", like=_small(0)), _small(1))
    assert _same(ckpt.load_per_rank(tmp_path / "c", like=pos.apply(torch.zeros_like)), pos)
    with pytest.raises(ValueError, match=r"missing from the checkpoint.*loader\.other"):
        ckpt.load_per_rank(
            tmp_path / "c",
            like=TensorDict(
                {
                    "loader": {
                        "pos": torch.tensor(0),
                        "epoch": torch.tensor(0),
                        "other": torch.tensor(0),
                    }
                },
                [],
            ),
        )


def test_per_rank_values_load_into_fresh_tensors_unless_donated(tmp_path: Path) -> None:
    """load_per_rank leaves like untouched and returns new tensors (donate=False is the
    default); donate=True fills like's own tensors and returns like."""
    pos = TensorDict({"loader": {"pos": torch.tensor(123)}}, [])
    ckpt.save(_small(1), tmp_path / "c", per_rank=pos)
    like = pos.apply(torch.zeros_like)
    out = ckpt.load_per_rank(tmp_path / "c", like=like)
    assert _same(out, pos) and out is not like
    assert int(like["loader", "pos"]) == 0 and out["loader", "pos"] is not like["loader", "pos"]
    kept = like["loader", "pos"]
    assert ckpt.load_per_rank(tmp_path / "c", like=like, donate=True) is like
    assert like["loader", "pos"] is kept and int(kept) == 123


def test_per_rank_values_of_another_world_size_are_refused_naming_both(tmp_path: Path) -> None:
    """Per-rank values saved on another world size (metadata.json says 2; this is 1) raise
    CheckpointMismatchError with both sizes and the checkpoint's path."""
    from purestep.distributed import _ckpt_integrity

    p = tmp_path / "c"
    pos = TensorDict({"pos": torch.tensor(3)}, [])
    ckpt.save(_small(1), p, per_rank=pos)
    md = json.loads((p / ckpt.METADATA_FILE).read_bytes())
    md["world_size"] = 2
    (p / ckpt.METADATA_FILE).write_bytes(_ckpt_integrity.seal(md))
    with pytest.raises(ckpt.CheckpointMismatchError) as e:
        ckpt.load_per_rank(p, like=pos.apply(torch.zeros_like))
    assert str(e.value) == (
        f"checkpoint {p} holds per-rank values of world size 2; "
        "they cannot be loaded on world size 1"
    )
    assert e.value.path == p
    assert _same(ckpt.load(p, like=_small(0)), _small(1))  # the state itself still loads


def test_load_per_rank_names_every_key_the_checkpoint_lacks_for_this_rank(tmp_path: Path) -> None:
    """Without per-rank values (or without per_rank_keys in metadata.json at all), or with
    other ones, load_per_rank raises one CheckpointMismatchError naming rank and keys."""
    from purestep.distributed import _ckpt_integrity

    like = TensorDict({"pos": torch.tensor(0), "n": {"e": torch.tensor(0)}}, [])
    bare, other = tmp_path / "bare", tmp_path / "other"
    ckpt.save(_small(1), bare)
    ckpt.save(_small(1), other, per_rank=TensorDict({"pos": torch.tensor(3)}, []))
    head = "does not match `like` (per-rank values of rank 0):\n  missing from the checkpoint"
    with pytest.raises(ckpt.CheckpointMismatchError) as e:
        ckpt.load_per_rank(other, like=like)
    assert str(e.value) == f"checkpoint {other} {head} (in like only): n.e"
    for drop_field in (False, True):
        if drop_field:
            md = json.loads((bare / ckpt.METADATA_FILE).read_bytes())
            del md["per_rank_keys"]
            (bare / ckpt.METADATA_FILE).write_bytes(_ckpt_integrity.seal(md))
        with pytest.raises(ckpt.CheckpointMismatchError) as e:
            ckpt.load_per_rank(bare, like=like)
        assert str(e.value) == f"checkpoint {bare} {head} (in like only): pos, n.e"


def test_every_save_writes_into_its_own_marked_scratch_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save writes into <name>.tmp-<12 hex digits>, marked with that token; two saves
    draw different tokens."""
    import re

    from purestep.distributed import _ckpt_fs

    seen: list[tuple[Path, str, str | None]] = []
    real = ckpt._write

    def spy(flat: Any, tmp: Path, target: Path, token: str, *rest: Any) -> Any:
        seen.append((tmp, token, _ckpt_fs.marker_token(tmp)))
        return real(flat, tmp, target, token, *rest)

    monkeypatch.setattr(ckpt, "_write", spy)
    for name in ("a", "b"):
        ckpt.save(_small(1), tmp_path / name)
    assert [t.parent for t, _, _ in seen] == [tmp_path, tmp_path]
    for (tmp, token, marked), name in zip(seen, "ab", strict=True):
        assert re.fullmatch(r"[0-9a-f]{12}", token), token
        assert tmp.name == f"{name}.tmp-{token}" and marked == token
    assert seen[0][1] != seen[1][1]


def test_a_failed_token_collective_fails_the_save_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If agreeing on the scratch token fails, save raises CheckpointWriteError naming the
    checkpoint and the failure (chained), and leaves no directory behind."""
    boom = RuntimeError("peer 1 is gone")

    def gather(group: Any, value: Any) -> list[Any]:
        raise boom

    monkeypatch.setattr(ckpt, "_gather", gather)
    target = tmp_path / "c"
    with pytest.raises(ckpt.CheckpointWriteError) as e:
        ckpt.save(_small(1), target)
    assert str(e.value) == (
        f"saving checkpoint {target}: a collective with the other ranks failed: peer 1 is gone"
    )
    assert e.value.path == target and e.value.__cause__ is boom
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("donate", [False, True], ids=["fresh", "donated"])
def test_a_damaged_per_rank_record_fails_its_load_and_leaves_like_unchanged(
    tmp_path: Path, donate: bool
) -> None:
    """load_per_rank verifies every record it reads (by default); a donated load checks them
    all before writing, so like keeps its values."""
    p = tmp_path / "c"
    pos = TensorDict({"a": torch.arange(4), "b": torch.arange(8)}, [])
    ckpt.save(_small(1), p, per_rank=pos)
    md = json.loads((p / ckpt.METADATA_FILE).read_bytes())
    (rec,) = [r for r in md["integrity"]["records"] if r["key"].endswith(".b")]
    f = p / rec["file"]
    data = bytearray(f.read_bytes())
    data[rec["offset"] + rec["length"] - 1] ^= 0xFF
    f.write_bytes(bytes(data))
    like = pos.apply(torch.zeros_like)
    with pytest.raises(ckpt.CheckpointCorruptError, match="fails its xxh3_64 checksum"):
        ckpt.load_per_rank(p, like=like, donate=donate)
    assert not like["a"].any() and not like["b"].any()
    out = ckpt.load_per_rank(p, like=like, verify=False)
    assert torch.equal(out["a"], pos["a"]) and not torch.equal(out["b"], pos["b"])


# -- crash safety --------------------------------------------------------------------------

# One child imports torch once, then forks one saver per run (importing torch per run would
# cost seconds each). Saver i saves step 0, 1, 2, ... into roots[i] and reports on stdout.
_ZYGOTE = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from tensordict import TensorDict
    from purestep import checkpoint as ckpt

    torch.set_num_threads(1)

    def report(*parts):  # one write(2) per line: atomic on a pipe, so lines never interleave
        os.write(1, (" ".join(map(str, parts)) + "\\n").encode())

    def state(step):
        return TensorDict({
            "params": {f"w{i}": torch.full((250_000,), float(step * 10 + i)) for i in range(8)},
            "rng": torch.tensor(step * 1_000_003, dtype=torch.int64),
            "step": torch.tensor(step),
        }, [])

    def saver(i, root, async_):
        step = 0
        while True:
            s = state(step)
            report(i, "saving", step)
            t = time.perf_counter()
            h = ckpt.save(s, ckpt.step_dir(root, step), async_=async_)
            if h is not None:
                h.wait()
            report(i, "done", step, time.perf_counter() - t)
            step += 1

    runs = [(r.split(":")[0], r.split(":")[1] == "1") for r in sys.argv[1:]]
    pids = []
    for i, (root, async_) in enumerate(runs):
        pid = os.fork()
        if pid == 0:
            try:
                saver(i, root, async_)
            finally:
                os._exit(1)
        report(i, "pid", pid)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    """
)


def _child_state(step: int) -> TensorDict:
    return TensorDict(
        {
            "params": {f"w{i}": torch.full((250_000,), float(step * 10 + i)) for i in range(8)},
            "rng": torch.tensor(step * 1_000_003, dtype=torch.int64),
            "step": torch.tensor(step),
        },
        [],
    )


def _kill_mid_save(runs: list[tuple[Path, bool, float]]) -> list[tuple[int, int]]:
    """SIGKILL saver i ``fraction_i`` of a save's duration after it starts its third save.

    Returns per run (last step reported done, last step reported being saved).
    """
    args = [f"{root}:{int(async_)}" for root, async_, _ in runs]
    proc = subprocess.Popen(
        [sys.executable, "-c", _ZYGOTE, *args],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.stdout is not None
    pids: dict[int, int] = {}
    done = [-1] * len(runs)
    saving = [-1] * len(runs)
    duration = [0.05] * len(runs)
    timers: list[threading.Timer] = []
    try:
        for line in proc.stdout:
            i_str, what, value, *rest = line.split()
            i = int(i_str)
            if what == "pid":
                pids[i] = int(value)
            elif what == "done":
                done[i], duration[i] = int(value), float(rest[0])
            elif what == "saving":
                saving[i] = int(value)
                if saving[i] == 2:
                    delay = runs[i][2] * duration[i]
                    timers.append(threading.Timer(delay, os.kill, (pids[i], signal.SIGKILL)))
                    timers[-1].start()
    finally:
        for t in timers:
            t.join(30)
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
        proc.stdout.close()
    return list(zip(done, saving, strict=True))


def test_sigkill_during_save_leaves_the_previous_checkpoint_latest(tmp_path: Path) -> None:
    """A SIGKILL at a random point of a save never exposes a partial checkpoint.

    Savers (sync and async) are killed at seeded random fractions of a save's
    duration into their third save. latest() is the last save that finished
    (or a later one that finished before the kill landed); every complete
    checkpoint loads and equals what was saved at its step; every other
    directory has a scratch name.
    """
    rnd = random.Random(0)
    runs = [(tmp_path / f"run{i}", i % 2 == 1, rnd.uniform(0.0, 1.2)) for i in range(6)]
    outcomes = _kill_mid_save(runs)
    interrupted = sum(any(".tmp-" in p.name for p in root.iterdir()) for root, _, _ in runs)
    assert interrupted >= 1, "no kill landed inside a save: the test exercised nothing"
    for (root, _, _), (done, saving) in zip(runs, outcomes, strict=True):
        found = ckpt.latest(root)
        assert found is not None
        assert done <= ckpt.read_metadata(found)["step"] <= saving
        for path in ckpt.checkpoints(root):
            s = ckpt.read_metadata(path)["step"]
            assert _same(ckpt.load(path, like=_child_state(0)), _child_state(s))
        for p in root.iterdir():
            assert ckpt.is_complete(p) or ".tmp-" in p.name, (
                f"{p.name}: neither complete nor scratch"
            )
        ckpt.prune(root, keep_last=1)
        assert [p.name for p in root.iterdir()] == [found.name]


# -- save: return value, parents, refused leaves --------------------------------------------


def test_a_sync_save_returns_none_with_the_checkpoint_complete_and_an_async_one_a_handle(
    tmp_path: Path,
) -> None:
    """save() without async_ returns None only once the checkpoint is complete and loadable;
    save(async_=True) returns the SaveHandle of the checkpoint's path (its wait() returns it)."""
    assert ckpt.save(_small(1), tmp_path / "a") is None
    assert ckpt.is_complete(tmp_path / "a")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no scratch left
    handle = ckpt.save(_small(2), tmp_path / "b", async_=True)
    assert isinstance(handle, ckpt.SaveHandle)
    assert handle.path == tmp_path / "b"
    assert handle.wait() == tmp_path / "b"
    assert _same(ckpt.load(tmp_path / "b", like=_small(0)), _small(2))


def test_save_creates_the_missing_parent_directories(tmp_path: Path) -> None:
    """A checkpoint path under directories that do not exist yet is saved (parents created),
    and so is one whose parent already exists."""
    deep = tmp_path / "run" / "checkpoints" / "x"
    ckpt.save(_small(1), ckpt.step_dir(deep, 1))
    ckpt.save(_small(2), ckpt.step_dir(deep, 2))
    assert ckpt.latest(deep) == ckpt.step_dir(deep, 2)
    assert _same(ckpt.load(ckpt.step_dir(deep, 1), like=_small(0)), _small(1))


def test_an_overwrite_moves_the_old_checkpoint_aside_under_the_save_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While an overwrite publishes, the replaced checkpoint waits under `<name>.old-<token>`
    (the token of the save replacing it, as in its scratch directory and marker); afterwards
    only the new checkpoint is left."""
    from purestep.distributed import _ckpt_fs

    ckpt.save(_small(1), tmp_path / "c")
    real = _ckpt_fs.rename_noreplace
    seen: list[list[str]] = []

    def spy(src: Path, dst: Path) -> None:
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        real(src, dst)

    monkeypatch.setattr(_ckpt_fs, "rename_noreplace", spy)
    ckpt.save(_small(2), tmp_path / "c", overwrite=True)
    token = _ckpt_fs.marker_token(tmp_path / "c")
    assert seen == [[f"c.old-{token}", f"c.tmp-{token}"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    assert _same(ckpt.load(tmp_path / "c", like=_small(0)), _small(2))


_NON_TENSOR = (
    "non-tensor leaves (a checkpoint holds tensors only; store numbers as 0-dim tensors and "
    "other values in save(metadata=...)): "
)


@pytest.mark.parametrize("part", ["state", "per_rank"])
def test_a_non_tensor_leaf_fails_the_save_naming_the_argument_and_the_leaf(
    tmp_path: Path, part: str
) -> None:
    """A non-tensor leaf in state or in per_rank fails the save before anything is written, with
    a CheckpointStateError naming which argument holds it and the leaf."""
    bad = TensorDict({"pos": torch.tensor(1)}, [])
    bad.set_non_tensor(("loader", "name"), "shard-3")
    state, per_rank = (bad, None) if part == "state" else (_small(1), bad)
    with pytest.raises(ckpt.CheckpointStateError) as info:
        ckpt.save(state, tmp_path / "c", per_rank=per_rank)
    assert str(info.value) == (
        f"cannot checkpoint {part}: {_NON_TENSOR}loader.name (non-tensor data: str)"
    )
    assert list(tmp_path.iterdir()) == []


# -- load_per_rank -------------------------------------------------------------------------


def _positions() -> TensorDict:
    return TensorDict({"loader": {"pos": torch.tensor(123), "epoch": torch.tensor(2)}}, [])


@pytest.mark.parametrize("which", ["load", "load_per_rank"])
def test_loads_read_exactly_the_dcp_metadata_bytes_they_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    """load and load_per_rank hand DCP the .metadata bytes they checked: damage to the file
    right after the check does not reach the load, which returns what was saved."""
    from purestep.distributed import _ckpt_read

    ckpt.save(_small(1), tmp_path / "c", per_rank=_positions())
    real = _ckpt_read.verify_metadata_file

    def verify_then_damage(path: Path, md: Any) -> bytes:
        data = real(path, md)
        f = path / ".metadata"
        f.write_bytes(f.read_bytes()[:-1] + b"\0")
        return data

    monkeypatch.setattr(_ckpt_read, "verify_metadata_file", verify_then_damage)
    if which == "load":
        assert _same(ckpt.load(tmp_path / "c", like=_small(0)), _small(1))
    else:
        like = _positions().apply(torch.zeros_like)
        assert _same(ckpt.load_per_rank(tmp_path / "c", like=like), _positions())
