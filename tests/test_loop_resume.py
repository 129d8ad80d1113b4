"""Safe resume in ``purestep.loop.run``: damaged checkpoints are skipped (with a warning naming
them), and resuming from an older checkpoint never deletes newer checkpoints or their log."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

import purestep as ps
from purestep import checkpoint as ckpt
from purestep import loop
from purestep.distributed import _ckpt_integrity
from purestep.testing import assert_trees_equal, snapshot

DATA_FILE = "__0_0.distcp"


def _model() -> tuple[Any, TensorDict]:
    g = torch.Generator().manual_seed(0)
    params = TensorDict(
        {"w1": torch.randn(8, 3, generator=g), "w2": torch.randn(1, 8, generator=g)}, []
    )

    def loss_fn(p: Any, b: Any, key: torch.Tensor) -> Any:
        pred = torch.tanh(b["x"] @ p["m", "w1"].T) @ p["m", "w2"].T
        return ((pred - b["y"]) ** 2).mean(), {}

    opt = {"m": ps.optim.adamw(1e-2)}
    return ps.train_step(ps.value_and_grad(loss_fn), opt), ps.init_state({"m": params}, opt, seed=3)


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        {"x": torch.randn(6, 3, generator=g), "y": torch.randn(6, 1, generator=g)} for _ in range(n)
    ]


def _run(d: Path, num_steps: int, **kw: Any) -> Any:
    step, state = _model()
    kw.setdefault("save_every", 2)
    kw.setdefault("keep_last", 10)
    return loop.run(
        step,
        snapshot(state),
        _batches(3),
        num_steps=num_steps,
        checkpoint_dir=d,
        progress=False,
        **kw,
    )


def _reference(tmp: Path, n: int) -> Any:
    return _run(tmp / "reference", n)


def _listing(d: Path) -> dict[str, bytes]:
    """Every file under ``d`` with its bytes (to prove nothing changed)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _assert_warned(caught: Any, pattern: str) -> None:
    messages = [str(w.message) for w in caught]
    assert any(re.search(pattern, m) for m in messages), (pattern, messages)


def _assert_at_callers_line(w: Any) -> None:
    """A loop warning is attributed to the caller of ``run`` (this file's helpers), not to purestep.

    Not checked under mutmut (``MUTANT_UNDER_TEST`` set): its trampolines add frames to every
    call of a mutated function, so no stack level points here then, not even the original's.
    """
    if "MUTANT_UNDER_TEST" not in os.environ:
        assert w.filename == __file__, (w.filename, w.lineno)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_resume_from_an_older_checkpoint_into_its_own_dir_is_refused_and_changes_nothing(
    tmp_path: Path,
) -> None:
    """resume=step_2 into the run dir that holds step_4 and step_6: a ValueError naming them,
    and every file of the run (checkpoints, metrics log) is byte-for-byte unchanged."""
    d = tmp_path / "run"
    _run(d, 6)
    before = _listing(d)
    with pytest.raises(
        ValueError, match=r"step 2.*step_00000004, step_00000006.*new checkpoint_dir"
    ):
        _run(d, 6, resume=ckpt.step_dir(d, 2))
    assert _listing(d) == before


def test_resume_from_an_older_checkpoint_into_a_new_dir_branches(tmp_path: Path) -> None:
    """The documented way to branch: resume=old/step_2 with a fresh checkpoint_dir continues from
    step 2 there (same final state as an uninterrupted run), and the old run is untouched."""
    old, new = tmp_path / "run", tmp_path / "branch"
    _run(old, 6)
    before = _listing(old)
    out = _run(new, 8, resume=ckpt.step_dir(old, 2))
    assert_trees_equal(out, _reference(tmp_path, 8), what="branch from step 2 vs uninterrupted")
    assert _listing(old) == before
    assert [r["step"] for r in loop.read_metrics(new / "metrics.jsonl")] == list(range(3, 9))
    assert [p.name for p in ckpt.checkpoints(new)] == [f"step_0000000{s}" for s in (4, 6, 8)]


def test_resume_latest_skips_a_checkpoint_with_a_flipped_bit_and_warns(tmp_path: Path) -> None:
    """A bit flip inside the newest checkpoint's data (sizes intact, so latest() still offers it)
    fails verification at load; run warns naming it, resumes from the one before, and ends
    bitwise equal to an uninterrupted run. The damaged one is kept, renamed *.damaged-*."""
    d = tmp_path / "run"
    _run(d, 6)
    newest = ckpt.step_dir(d, 6)
    _flip(newest / DATA_FILE, (newest / DATA_FILE).stat().st_size // 2)
    assert ckpt.latest(d) == newest  # cheap check: sizes are right
    with pytest.warns(UserWarning, match="step_00000006") as caught:
        out = _run(d, 8)
    _assert_warned(caught, r"skips damaged checkpoint step_00000006: .*fails its xxh3_64 checksum")
    _assert_warned(caught, r"renamed the damaged checkpoint step_00000006 to .*\.damaged-")
    assert_trees_equal(out, _reference(tmp_path, 8), what="resumed past a damaged checkpoint")
    aside = [p.name for p in d.iterdir() if ".damaged-" in p.name]
    assert len(aside) == 1 and aside[0].startswith("step_00000006.damaged-")
    assert [p.name for p in ckpt.checkpoints(d)][-2:] == ["step_00000006", "step_00000008"]
    assert [r["step"] for r in loop.read_metrics(d / "metrics.jsonl")] == list(range(1, 9))


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_resume_latest_skips_an_incomplete_checkpoint_and_warns(
    tmp_path: Path, damage: str
) -> None:
    """A truncated or missing data file makes the newest checkpoint incomplete (no data read):
    latest() skips it, run warns naming it and why, and resumes from the one before."""
    d = tmp_path / "run"
    _run(d, 6)
    f = ckpt.step_dir(d, 6) / DATA_FILE
    if damage == "truncate":
        os.truncate(f, f.stat().st_size - 1)
    else:
        f.unlink()
    assert not ckpt.is_complete(ckpt.step_dir(d, 6))
    assert ckpt.latest(d) == ckpt.step_dir(d, 4)
    assert ckpt.damaged(d)[0][0] == ckpt.step_dir(d, 6)
    with pytest.warns(UserWarning, match="step_00000006") as caught:
        out = _run(d, 8)
    _assert_warned(caught, r"skips damaged or incomplete checkpoints: step_00000006 \(.*__0_0")
    _assert_warned(caught, r"renamed the damaged checkpoint step_00000006 to .*\.damaged-")
    assert_trees_equal(out, _reference(tmp_path, 8), what="resumed past an incomplete checkpoint")


def test_resume_latest_with_only_damaged_checkpoints_refuses(tmp_path: Path) -> None:
    """If every checkpoint is damaged, resume='latest' raises instead of silently starting over."""
    d = tmp_path / "run"
    _run(d, 2, save_every=None)
    os.truncate(ckpt.step_dir(d, 2) / DATA_FILE, 10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ckpt.CheckpointCorruptError, match="no intact checkpoint"):
            _run(d, 4)
    assert (ckpt.step_dir(d, 2) / DATA_FILE).stat().st_size == 10  # left as it was


def test_run_never_replaces_a_checkpoint_another_job_wrote(tmp_path: Path) -> None:
    """A checkpoint already at the path run is about to save (another job in the same dir) makes
    the save fail with CheckpointExistsError; the other job's checkpoint is unchanged."""
    d = tmp_path / "run"
    _run(d, 4)
    other = tmp_path / "other"
    shutil.copytree(d, other)
    ckpt.prune(d, keep_last=1)  # d now holds only step 4; 'other' keeps step 2 and 4
    before = _listing(ckpt.step_dir(other, 4))
    # a second job resumes from step 2 into 'other', which already has step 4: refused up front
    with pytest.raises(ValueError, match="later checkpoints"):
        _run(other, 6, resume=ckpt.step_dir(other, 2))
    assert _listing(ckpt.step_dir(other, 4)) == before


# -- resume by path: which checkpoints in checkpoint_dir count as later ------------------------


def _refused(resume: Path, at: int, root: Path, names: list[str]) -> str:
    """The whole ValueError message of a resume path refused for the later ``names``."""
    return (
        f"run: resume={str(resume)!r} is at step {at}, but checkpoint_dir {str(root)!r} holds "
        f"later checkpoints ({', '.join(names)}); resuming there would replace them and drop "
        f"their metric records. To branch from step {at}, pass a new checkpoint_dir (resume may "
        "point into this one); to continue the run, pass resume='latest'"
    )


def _damaged_copy(src: Path, dst: Path) -> None:
    """A damaged checkpoint at ``dst``: ``src`` copied, its data file truncated by one byte."""
    shutil.copytree(src, dst)
    os.truncate(dst / DATA_FILE, (dst / DATA_FILE).stat().st_size - 1)


@pytest.mark.parametrize(
    ("name", "later"),
    [
        ("step_00000006", True),  # the loop's own name, a later step
        ("step_6", True),  # unpadded, still a later step
        ("step_4", False),  # the step resumed from is not later
        ("step_x6", False),  # not digits after step_
        ("best_00000009", False),  # not step_: never the loop's
    ],
)
def test_resume_by_path_is_refused_only_for_a_damaged_checkpoint_named_at_a_later_step(
    tmp_path: Path, name: str, later: bool
) -> None:
    """A damaged (incomplete) directory in checkpoint_dir blocks resume=<path at step 4> exactly
    when it is named step_<digits> with a step after 4; the error names it and says how to branch
    or continue; otherwise the run resumes (and, at num_steps, returns the checkpoint's state)."""
    d = tmp_path / "run"
    _run(d, 4)
    _damaged_copy(ckpt.step_dir(d, 4), d / name)
    assert [p.name for p, _ in ckpt.damaged(d)] == [name]
    resume = ckpt.step_dir(d, 4)
    if later:
        with pytest.raises(ValueError, match=re.escape(_refused(resume, 4, d, [name])) + "$"):
            _run(d, 4, resume=resume)
    else:
        out = _run(d, 4, resume=resume)
        assert_trees_equal(out, _reference(tmp_path, 4), what="resumed at num_steps")


def test_resume_by_path_from_the_newest_step_or_a_copy_of_it_continues(tmp_path: Path) -> None:
    """Older checkpoints, and a checkpoint at the very step resumed from (resume is a copy of
    it elsewhere), are not later: both resumes continue to the uninterrupted final state."""
    d = tmp_path / "run"
    _run(d, 4)
    backup = tmp_path / "backup" / "step_00000004"
    shutil.copytree(ckpt.step_dir(d, 4), backup)
    out = _run(d, 6, resume=ckpt.step_dir(d, 4))
    assert_trees_equal(out, _reference(tmp_path, 6), what="resumed from the newest by path")
    other = tmp_path / "other"
    _run(other, 4)
    out = _run(other, 6, resume=backup)
    assert_trees_equal(out, _reference(tmp_path, 6), what="resumed from a copy of step 4")


def test_a_resume_checkpoint_without_a_step_counts_as_step_minus_one(tmp_path: Path) -> None:
    """A checkpoint saved by hand without a 'step' counter is at step -1 for the later-checkpoint
    check: resuming from it into a dir that holds step_00000002 is refused, naming both."""
    d = tmp_path / "run"
    _run(d, 2)
    hand = tmp_path / "hand"
    ckpt.save(TensorDict({"w": torch.zeros(2)}, []), hand)
    assert ckpt.read_metadata(hand)["step"] is None
    with pytest.raises(ValueError, match=re.escape(_refused(hand, -1, d, ["step_00000002"])) + "$"):
        _run(d, 4, resume=hand)


def test_resume_none_runs_without_a_dir_and_refuses_a_dir_holding_checkpoints(
    tmp_path: Path,
) -> None:
    """resume=None without checkpoint_dir trains from scratch; with a checkpoint_dir that holds
    checkpoints it raises, naming the dir and the newest checkpoint and how to continue."""
    step, state = _model()
    out = loop.run(step, snapshot(state), _batches(3), num_steps=4, resume=None, progress=False)
    assert_trees_equal(out, _reference(tmp_path, 4), what="resume=None, no checkpoint_dir")
    d = tmp_path / "run"
    _run(d, 4)
    message = (
        f"run: checkpoint_dir {str(d)!r} already holds checkpoints (newest: step_00000004) and "
        "resume=None; pass resume='latest' to continue that run, or use a fresh directory"
    )
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        _run(d, 6, resume=None)


def test_a_resume_that_is_no_path_or_no_checkpoint_is_named_with_its_details(
    tmp_path: Path,
) -> None:
    """resume=3: TypeError naming it. resume=<a directory without metadata.json>: the checkpoint
    error, its message prefixed with the resume value, keeping its path and file."""
    with pytest.raises(TypeError) as t:
        _run(tmp_path / "run", 2, resume=3)
    assert str(t.value) == "run: resume must be 'latest', None or a path, got 3"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ckpt.CheckpointNotFoundError) as e:
        _run(tmp_path / "run", 2, resume=empty)
    assert str(e.value) == (
        f"run: resume={str(empty)!r} is not a checkpoint: not a purestep checkpoint: {empty} "
        f"(no {ckpt.METADATA_FILE})"
    )
    assert (e.value.path, e.value.file, e.value.key) == (empty, ckpt.METADATA_FILE, None)


# -- resume='latest' over several damaged checkpoints --------------------------------------------


def test_resume_latest_names_every_damaged_checkpoint_once(tmp_path: Path) -> None:
    """Two incomplete checkpoints: with an intact one left, one warning (at the caller's line)
    lists both with their problems; with none left, CheckpointCorruptError names both and the
    directory (its path attribute)."""
    d = tmp_path / "run"
    _run(d, 6)
    for s in (4, 6):
        f = ckpt.step_dir(d, s) / DATA_FILE
        os.truncate(f, f.stat().st_size - 1)
    why = {int(p.name[5:]): reason for p, reason in ckpt.damaged(d)}
    with pytest.warns(UserWarning, match="skips damaged") as caught:
        _run(d, 2)
    skips = [w for w in caught if "skips damaged" in str(w.message)]
    assert [str(w.message) for w in skips] == [
        "run: resume='latest' skips damaged or incomplete checkpoints: "
        f"step_00000004 ({why[4]}); step_00000006 ({why[6]})"
    ]
    _assert_at_callers_line(skips[0])
    shutil.rmtree(ckpt.step_dir(d, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ckpt.CheckpointCorruptError) as e:
            _run(d, 8)
    assert str(e.value) == (
        f"run: resume='latest': no intact checkpoint in {str(d)!r}, only damaged ones "
        "(step_00000004, step_00000006); move them away to start afresh"
    )
    assert e.value.path == d


def test_resume_latest_raises_the_oldest_error_when_every_checkpoint_fails_to_load(
    tmp_path: Path,
) -> None:
    """Bit flips in both checkpoints (sizes intact, so both are offered): the newest is skipped
    with a warning, and the oldest one's load error is raised (it names that checkpoint)."""
    d = tmp_path / "run"
    _run(d, 4)
    for s in (2, 4):
        f = ckpt.step_dir(d, s) / DATA_FILE
        _flip(f, f.stat().st_size // 2)
    with (
        pytest.warns(UserWarning, match="skips damaged checkpoint") as caught,
        pytest.raises(ckpt.CheckpointCorruptError) as e,
    ):
        _run(d, 6)
    assert e.value.path == ckpt.step_dir(d, 2), str(e.value)
    skipped = [str(w.message) for w in caught if "skips damaged checkpoint" in str(w.message)]
    assert len(skipped) == 1 and skipped[0].startswith(
        "run: resume='latest' skips damaged checkpoint step_00000004: "
    ), skipped


# -- restoring the data position -----------------------------------------------------------------


class _StatefulBatches:
    """``_batches(3)`` each pass, with the position inside a pass in ``state_dict()``."""

    def __init__(self) -> None:
        self.next_i = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        batches = _batches(3)
        while self.next_i < len(batches):
            self.next_i += 1
            yield batches[self.next_i - 1]
        self.next_i = 0

    def state_dict(self) -> dict[str, int]:
        return {"next_i": self.next_i}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.next_i = sd["next_i"]


def _run_data(d: Path, num_steps: int, data: Any, **kw: Any) -> Any:
    step, state = _model()
    return loop.run(
        step, snapshot(state), data, num_steps=num_steps, checkpoint_dir=d, progress=False, **kw
    )


def _loop_warnings(caught: Any) -> list[Any]:
    return [w for w in caught if str(w.message).startswith("checkpoint ")]


@pytest.mark.parametrize("saved_with", ["stateful", "list"])
def test_resuming_across_stateful_and_plain_data_skips_batches_and_says_so(
    tmp_path: Path, saved_with: str
) -> None:
    """A checkpoint with a loader state resumed with plain data, or one without resumed with
    stateful data: one warning naming the checkpoint and the fallback (skipping batches), and
    the run ends where an uninterrupted one does."""
    d = tmp_path / "run"
    first, then = (_StatefulBatches(), _batches(3))
    if saved_with == "list":
        first, then = then, first
    _run_data(d, 4, first, save_every=2)
    path = ckpt.step_dir(d, 4)
    with pytest.warns(UserWarning, match="by skipping batches instead") as caught:
        out = _run_data(d, 6, then)
    if saved_with == "stateful":
        want = (
            f"checkpoint {path} holds a data loader state, but data has no load_state_dict(); "
            "restoring the position by skipping batches instead"
        )
    else:
        want = (
            f"checkpoint {path} holds no data loader state; restoring the position of the "
            "stateful data by skipping batches instead"
        )
    assert [str(w.message) for w in _loop_warnings(caught)] == [want]
    _assert_at_callers_line(_loop_warnings(caught)[0])
    assert_trees_equal(out, _reference(tmp_path, 6), what=f"saved with {saved_with} data")


@pytest.mark.parametrize("fields", ["world_size", "world_size,per_rank_keys,metadata"])
def test_a_checkpoint_of_another_world_size_resumes_by_skipping_and_says_so(
    tmp_path: Path, fields: str
) -> None:
    """metadata.json says world size 2 (this run has 1): the per-rank data positions do not
    apply; one warning names both sizes and the batches skipped, and the run ends where an
    uninterrupted one does. The same without the optional per_rank_keys and metadata fields
    (a checkpoint written by another writer)."""
    d = tmp_path / "run"
    _run(d, 4, save_every=4)
    path = ckpt.step_dir(d, 4)
    md = json.loads((path / ckpt.METADATA_FILE).read_bytes())
    md["world_size"] = 2
    for drop in fields.split(",")[1:]:
        del md[drop]
    (path / ckpt.METADATA_FILE).write_bytes(_ckpt_integrity.seal(md))
    with pytest.warns(UserWarning, match="world size 2") as caught:
        out = _run(d, 6)
    assert [str(w.message) for w in _loop_warnings(caught)] == [
        f"checkpoint {path} was saved on world size 2, not 1: its per-rank data positions do "
        "not apply; skipping 4 batches from the start of data instead"
    ]
    _assert_at_callers_line(_loop_warnings(caught)[0])
    assert_trees_equal(out, _reference(tmp_path, 6), what="resumed across world sizes")


def test_a_checkpoint_with_other_keys_keeps_its_path_in_the_error(tmp_path: Path) -> None:
    """The mismatch error of a resume is re-raised with the resume's context and the original
    error's path and key attributes."""
    d = tmp_path / "run"
    _run(d, 2)
    step, state = _model()
    opt = {"m": ps.optim.adamw(1e-2)}
    state = ps.init_state({"m": state["params", "m"].set("w3", torch.zeros(2))}, opt, seed=3)
    with pytest.raises(ckpt.CheckpointMismatchError) as e:
        loop.run(step, state, _batches(3), num_steps=4, checkpoint_dir=d, progress=False)
    assert str(e.value).startswith(f"run: cannot resume from {ckpt.step_dir(d, 2)}: checkpoint ")
    assert e.value.path == ckpt.step_dir(d, 2)


def test_resuming_never_writes_into_the_state_passed_to_run(tmp_path: Path) -> None:
    """run is functional on resume too: the state passed in (its structure is all that is used)
    is unchanged, with the usual params and with a state that has no params at all."""
    d = tmp_path / "run"
    _run(d, 2)
    step, state = _model()
    before = snapshot(state)
    _run_state = loop.run(step, state, _batches(3), num_steps=4, checkpoint_dir=d, progress=False)
    assert_trees_equal(state, before, what="the state passed to a resumed run")
    assert int(_run_state["step"]) == 4

    def count(st: Any, batch: Any) -> Any:
        return st.set("step", st["step"] + 1).set("w", st["w"] + batch["x"].sum()), {}

    plain = TensorDict({"step": torch.tensor(0), "w": torch.zeros(())}, [])
    e = tmp_path / "plain"
    loop.run(count, plain.clone(), _batches(3), num_steps=2, checkpoint_dir=e, progress=False)
    kept = plain.clone()
    out = loop.run(count, plain, _batches(3), num_steps=3, checkpoint_dir=e, progress=False)
    assert_trees_equal(plain, kept, what="a params-less state passed to a resumed run")
    assert int(out["step"]) == 3


# -- pending metrics in a hand-made checkpoint's metadata --------------------------------------


def test_pending_metrics_of_a_hand_saved_checkpoint(tmp_path: Path) -> None:
    """A checkpoint saved by hand whose metadata has another 'loop' value resumes (no pending
    metrics); a metadata.loop.pending_metrics that is not a mapping is refused, naming it."""
    _, state = _model()
    odd, bad = tmp_path / "odd", tmp_path / "bad"
    ckpt.save(state, odd, metadata={"loop": 3})
    ckpt.save(state, bad, metadata={"loop": {"pending_metrics": [1, 2]}})
    out = _run(tmp_path / "a", 2, resume=odd)
    assert_trees_equal(out, _reference(tmp_path, 2), what="resumed from a hand-saved step 0")
    message = f"checkpoint {bad}: metadata.loop.pending_metrics is not a mapping: [1, 2]"
    with pytest.raises(ckpt.CheckpointFormatError, match=re.escape(message) + "$"):
        _run(tmp_path / "b", 2, resume=bad)


# -- saving: the checkpoint dir, a damaged checkpoint in the way, the metadata ------------------


def test_checkpoint_dir_parents_are_created_and_an_unwritable_one_is_named(tmp_path: Path) -> None:
    """checkpoint_dir under missing parents is created; under a regular file it is not writable:
    OSError naming it, with the cause's message."""
    nested = tmp_path / "a" / "b" / "run"
    _run(nested, 2)
    assert ckpt.checkpoints(nested) == [ckpt.step_dir(nested, 2)]
    (tmp_path / "file").write_text("")
    under = tmp_path / "file" / "run"
    with pytest.raises(OSError, match=r"is not writable") as e:
        _run(under, 2)
    assert (
        str(e.value) == f"run: checkpoint_dir {str(under)!r} is not writable: {e.value.__cause__}"
    )


def test_the_checkpoint_metadata_records_the_batches_consumed(tmp_path: Path) -> None:
    """metadata.loop of a loop checkpoint holds the data position (batches consumed)."""
    d = tmp_path / "run"
    _run(d, 4)
    assert ckpt.read_metadata(ckpt.step_dir(d, 4))["metadata"] == {"loop": {"batches_consumed": 4}}


def test_a_damaged_checkpoint_in_the_way_is_renamed_with_its_reason(tmp_path: Path) -> None:
    """A bit-flipped checkpoint at a step saved again is renamed <name>.damaged-<12 hex> with a
    warning (at the caller's line) naming both names and verify's error."""
    d = tmp_path / "run"
    _run(d, 6)
    newest = ckpt.step_dir(d, 6)
    _flip(newest / DATA_FILE, (newest / DATA_FILE).stat().st_size // 2)
    with pytest.raises(ckpt.CheckpointCorruptError) as verified:
        ckpt.verify(newest)
    with pytest.warns(UserWarning, match="renamed the damaged") as caught:
        _run(d, 6)
    (aside,) = [p.name for p in d.iterdir() if ".damaged-" in p.name]
    assert re.fullmatch(r"step_00000006\.damaged-[0-9a-f]{12}", aside), aside
    renamed = [w for w in caught if "renamed the damaged" in str(w.message)]
    assert [str(w.message) for w in renamed] == [
        f"run: renamed the damaged checkpoint step_00000006 to {aside} (kept) to save a new "
        f"step_00000006; it was damaged: {verified.value}"
    ]
    _assert_at_callers_line(renamed[0])


def test_a_foreign_directory_at_the_save_path_is_refused_and_kept(tmp_path: Path) -> None:
    """A directory that is not a purestep checkpoint at the path of a save: the save fails with
    CheckpointExistsError and the directory is left as it was."""
    d = tmp_path / "run"
    _run(d, 2)
    foreign = ckpt.step_dir(d, 4)
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ckpt.CheckpointExistsError):
        _run(d, 4)
    assert _listing(foreign) == {"notes.txt": b"mine"}


def test_async_save_writes_the_periodic_checkpoints_in_the_background_and_the_last_in_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run(async_save=True) asks purestep.checkpoint.save for a background write at each
    periodic checkpoint and for a synchronous one at the last step and at a preemption's stop;
    without it, all are sync."""
    from purestep.distributed import checkpoint as dckpt

    calls: list[tuple[str, bool]] = []
    real = dckpt.save

    def spy(state: Any, path: Any, **kw: Any) -> Any:
        calls.append((Path(path).name, kw.get("async_", False)))
        return real(state, path, **kw)

    monkeypatch.setattr(dckpt, "save", spy)
    _run(tmp_path / "a", 6, async_save=True)
    assert calls == [("step_00000002", True), ("step_00000004", True), ("step_00000006", False)]
    calls.clear()
    _run(tmp_path / "s", 4)
    assert calls == [("step_00000002", False), ("step_00000004", False)]
    calls.clear()
    step, state = _model()

    def term_after_3(st: Any, batch: Any) -> Any:
        out = step(st, batch)
        if int(out[0]["step"]) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    old = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # not the runner's
    try:
        with pytest.raises(loop.Preempted):
            loop.run(
                term_after_3,
                snapshot(state),
                _batches(3),
                num_steps=6,
                checkpoint_dir=tmp_path / "p",
                save_every=2,
                async_save=True,
                progress=False,
            )
    finally:
        signal.signal(signal.SIGTERM, old)
    assert calls == [("step_00000002", True), ("step_00000003", False)]  # the stop's is sync


def test_a_state_bound_to_fsdp2_modules_resumes_into_its_modules(tmp_path: Path) -> None:
    """One gloo rank, the params bound to an FSDP2 module: a run resumed from step 2 loads the
    checkpoint into the module's own parameters and ends where an uninterrupted run ends."""
    from _optim import one_rank_mesh
    from purestep.distributed import fsdp

    def net(seed: int) -> torch.nn.Module:
        g = torch.Generator().manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        return m

    def run_bound(d: Path, num_steps: int) -> Any:
        m = net(0)
        opt = {"m": ps.optim.sgd(0.1)}

        def loss_fn(p: Any, b: Any, key: torch.Tensor) -> Any:
            return ((ps.call(m, p["m"], b["x"]) - b["y"]) ** 2).mean(), {}

        step = ps.train_step(ps.value_and_grad(loss_fn), opt, donate=True)
        state = ps.init_state({"m": fsdp.bind(m, mesh=mesh)}, opt, seed=3)
        out = loop.run(
            step,
            state,
            _batches(3),
            num_steps=num_steps,
            checkpoint_dir=d,
            save_every=2,
            progress=False,
        )
        return fsdp.gather(out)

    with one_rank_mesh() as mesh:
        want = run_bound(tmp_path / "ref", 4)
        run_bound(tmp_path / "run", 2)
        got = run_bound(tmp_path / "run", 4)
    assert_trees_equal(got, want, what="bound state resumed at step 2 vs uninterrupted")
