"""Smoke test of ``examples/dmd2_diffusers.py`` (the recipe of docs/methods.md on a diffusers DiT).

An uninterrupted run, and next to it (concurrently, one thread each) a run
that is preempted (SIGTERM) during a DMD2 step and exits with 143 naming its
checkpoint; the same command again resumes every stage and finishes with the
uninterrupted run's EMA student (bitwise), its exported diffusers directory
reloads to the same samples, and ``summary.json`` holds the Fréchet distances.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("diffusers")
pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "dmd2_diffusers.py"


def _start(out: Path, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--no-progress", "--out", str(out), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    return proc.returncode, stdout, stderr


def test_dmd2_diffusers_smoke_preempted_resumes_to_the_uninterrupted_student(
    tmp_path: Path,
) -> None:
    """--preempt-at 4 exits 143 with the resume hint; rerunning finishes with the uninterrupted
    run's EMA student (sha256 of its params), an exact export round trip and the FDs."""
    ref_dir, run_dir = tmp_path / "uninterrupted", tmp_path / "preempted"
    ref, first = _start(ref_dir), _start(run_dir, "--preempt-at", "4")
    (rc, out, err), (ref_rc, ref_out, ref_err) = _finish(first), _finish(ref)
    assert ref_rc == 0, ref_out[-2000:] + ref_err[-3000:]
    assert rc == 143, out[-2000:] + err[-3000:]
    assert "SIGTERM received; stopped after step 5" in err, err[-2000:]
    assert "resume='latest'" in err
    assert (run_dir / "dmd2" / "step_00000005").is_dir()
    assert not (run_dir / "summary.json").exists()

    rc, out, err = _finish(_start(run_dir))
    assert rc == 0, out[-2000:] + err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    reference = json.loads((ref_dir / "summary.json").read_text())
    for key in (
        "fd_teacher_32step_vs_heldout",
        "fd_teacher_1step_vs_teacher_32step",
        "fd_student_1step_vs_teacher_32step",
        "fd_student_1step_vs_heldout",
    ):
        assert isinstance(summary[key], float) and summary[key] >= 0.0, (key, summary[key])
    assert summary["export_reload_max_abs_diff"] == 0.0
    assert summary["student_sha256"] == reference["student_sha256"]
    for key in ("fd_student_1step_vs_teacher_32step", "fd_teacher_32step_vs_heldout"):
        assert summary[key] == reference[key], key
    assert (run_dir / "student_diffusers" / "config.json").is_file()
    assert sorted(p.name for p in (run_dir / "dmd2" / "images").iterdir()) == [
        "eval_samples_00000003.png",
        "eval_samples_00000006.png",
        "eval_samples_00000009.png",
    ]
    records = [json.loads(line) for line in (run_dir / "dmd2" / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == list(range(1, 10))
    assert all("eval/fd_vs_teacher_32step" in r for r in records if r["step"] % 3 == 0)
    assert (run_dir / "dmd2" / "metrics.jsonl").read_text() == (
        ref_dir / "dmd2" / "metrics.jsonl"
    ).read_text()
