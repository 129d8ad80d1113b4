"""A rank that dies or hangs ends a 2-rank gloo ``loop.run`` within seconds, with a clear error.

Each test starts two real processes (``tests/_dist_fault_worker.py``) sharing a
TCPStore held here. At step 3 rank 1 either exits (a crashed node) or sleeps
(a stuck data loader). The process group's own timeout is 10 minutes, like
torch's defaults; only ``loop.run(collective_timeout=...)`` bounds the wait.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import TCPStore  # type: ignore[attr-defined]

import _loop_worker as worker
from purestep import checkpoint as ckpt
from purestep.testing.workers import WorkerPool

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("_dist_fault_worker.py")
TIMEOUT_S = 180


def _run_pair(tmp_path: Path, fault: str, collective_timeout: float | None) -> dict[str, Any]:
    """Run both ranks; return rank 0's ``FAILED`` line, rank 1's ``FAULT`` time, exit codes."""
    store = TCPStore(
        "127.0.0.1",
        0,
        3,
        is_master=True,
        timeout=datetime.timedelta(seconds=60),
        wait_for_workers=False,
    )
    procs = []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        for rank in (0, 1):
            cmd = [
                sys.executable,
                str(WORKER),
                f"--rank={rank}",
                f"--port={store.port}",
                f"--dir={tmp_path / 'run'}",
                f"--fault={fault}",
            ]
            if collective_timeout is not None:
                cmd.append(f"--collective-timeout={collective_timeout}")
            procs.append(
                subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
                )
            )
        out0, err0 = procs[0].communicate(timeout=TIMEOUT_S)
        if fault == "die":
            out1, err1 = procs[1].communicate(timeout=TIMEOUT_S)
        else:
            procs[1].kill()
            out1, err1 = procs[1].communicate(timeout=TIMEOUT_S)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait(30)
    fault_at = [float(ln.split()[1]) for ln in out1.splitlines() if ln.startswith("FAULT")]
    failed = [ln for ln in out0.splitlines() if ln.startswith("FAILED")]
    assert fault_at, f"rank 1 never reached the fault:\n{out1}\n{err1[-3000:]}"
    assert failed, f"rank 0 did not fail:\n{out0}\n{err0[-3000:]}"
    _, when, message = failed[0].split(" ", 2)
    return {
        "delay": float(when) - fault_at[0],
        "message": message,
        "codes": (procs[0].returncode, procs[1].returncode),
    }


def test_a_dead_peer_makes_the_survivor_fail_within_seconds(tmp_path: Path) -> None:
    """Rank 1 exits during step 3: rank 0's next collective fails at once (connection closed),
    run raises and the process exits, long before any timeout; the checkpoints stay intact."""
    res = _run_pair(tmp_path, "die", None)
    assert res["codes"] == (3, 17)
    assert res["delay"] < 15, res
    assert "closed" in res["message"].lower() or "peer" in res["message"].lower(), res
    for p in ckpt.checkpoints(tmp_path / "run"):
        ckpt.verify(p)
    assert ckpt.latest(tmp_path / "run") is not None


def test_a_hung_peer_ends_the_job_after_collective_timeout(tmp_path: Path) -> None:
    """Rank 1 hangs during step 3 while the group's own timeout is 10 minutes: with
    collective_timeout=5 rank 0 raises CollectiveTimeoutError (naming the step it waited in)
    about 5 s later, instead of waiting 10 minutes."""
    res = _run_pair(tmp_path, "hang", 5.0)
    assert res["codes"][0] == 3
    assert res["message"].startswith("CollectiveTimeoutError: run: rank 0 of 2 waited longer"), res
    assert "collective timeout (5 s)" in res["message"], res
    assert re.search(r"for the other ranks (in|after) step [34]", res["message"]), res
    assert 4 <= res["delay"] < 30, res


def test_collective_timeout_applies_during_the_run_only(tmp_path: Path) -> None:
    """run(collective_timeout=7) sets the default group's timeout (and purestep's checkpoint
    group follows it) for the run, and restores the group's own timeout afterwards."""
    with WorkerPool(2, pg_timeout_s=60) as pool:
        seen = pool.run(worker.timeouts_seen, str(tmp_path / "run"))
    for r, s in enumerate(seen):
        assert s == {"before": 60, "during": 7, "checkpoint group": 7, "after": 60}, (r, s)
