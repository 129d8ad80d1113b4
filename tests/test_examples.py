"""Smoke tests of the examples: ``--quick`` runs write the promised summary and figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, out: Path, *extra: str) -> dict[str, object]:
    pytest.importorskip("matplotlib")
    pytest.importorskip("tqdm")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / script),
            "--quick",
            "--no-progress",
            "--out",
            str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    summary: dict[str, object] = json.loads((out / "summary.json").read_text())
    return summary


def test_toy2d_quick(tmp_path: Path) -> None:
    """toy2d --quick writes summary.json with every reported metric, and both figures."""
    summary = _run("toy2d.py", tmp_path)
    for key in (
        "sw_teacher_32step",
        "sw_teacher_1step",
        "sw_dmd2_1step",
        "sw_kd_4step",
        "nft_reward_before",
        "nft_reward_after",
        "nft_kl",
        "wall_time_s",
    ):
        assert key in summary, f"summary.json lacks {key!r}: {sorted(summary)}"
    assert (tmp_path / "samples.png").stat().st_size > 0
    assert (tmp_path / "losses.png").stat().st_size > 0


@pytest.mark.slow
def test_digits_quick(tmp_path: Path) -> None:
    """digits --quick writes the Fréchet distances, accuracies and image grids."""
    pytest.importorskip("sklearn")
    summary = _run("digits.py", tmp_path)
    for key in ("fd_teacher_32step", "fd_teacher_1step", "fd_dmd2_1step", "accuracy_dmd2_1step"):
        assert key in summary
    for name in ("data", "teacher_32step", "teacher_1step", "dmd2_1step"):
        assert (tmp_path / f"grid_{name}.png").exists()
