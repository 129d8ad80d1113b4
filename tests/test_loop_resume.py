"""Safe resume in ``purestep.loop.run``: damaged checkpoints are skipped (with a warning naming
them), and resuming from an older checkpoint never deletes newer checkpoints or their log."""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

import purestep as ps
from purestep import checkpoint as ckpt
from purestep import loop
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
