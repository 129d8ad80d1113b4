"""The quickstart example runs end to end and writes its outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_writes_metrics_summary_and_figure(tmp_path: Path) -> None:
    """A short quickstart run writes metrics.jsonl, summary.json and samples.png."""
    pytest.importorskip("matplotlib")
    pytest.importorskip("tqdm")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "quickstart.py"),
            "--steps",
            "120",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_loss"] < 3.0
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["step"] == 119
    assert (tmp_path / "samples.png").stat().st_size > 0
