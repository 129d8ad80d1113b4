"""Fault tests of ``purestep.loop.run``: SIGKILL anywhere and SIGTERM, then ``resume="latest"``.

A subprocess (``tests/_loop_worker.py``) trains a small MLP with frequent
checkpoints and is killed at chosen events: at a random step, on entering a
save, and between writing a checkpoint and publishing it. Restarted with
``resume="latest"`` until it finishes, it must end with a state bitwise equal
to an uninterrupted run of the same length (run in this process), and its
metrics log, after the loop's rule (records past the resumed step are dropped
on restart), must equal the uninterrupted run's: every step exactly once, with
the same values. The SIGTERM test uses stateful data rebuilt from another seed
on restart, so only its restored ``state_dict`` gives the same batches; the
distributed test does the same on two gloo ranks, with the signal reaching one.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase

import _loop_worker as worker
from purestep import checkpoint as ckpt
from purestep import loop
from purestep.testing import assert_trees_equal
from purestep.testing.workers import WorkerPool

WORKER = Path(__file__).with_name("_loop_worker.py")
NUM_STEPS = 24
SAVE_EVERY = 3
TIMEOUT_S = 120


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run the in-process reference with the worker's thread count (same kernels, same bits)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _reference(tmp: Path, data: str, data_seed: int) -> tuple[Any, list[dict[str, Any]]]:
    step, state = worker.build(NUM_STEPS)
    final = loop.run(
        step,
        state,
        worker.make_data(data, data_seed),
        num_steps=NUM_STEPS,
        checkpoint_dir=tmp / "reference",
        save_every=SAVE_EVERY,
        progress=False,
    )
    return final, loop.read_metrics(tmp / "reference" / "metrics.jsonl")


def _start(run_dir: Path, out: Path, *, data: str, data_seed: int, pause_at_rename: int = 0) -> Any:
    cmd = [
        sys.executable,
        str(WORKER),
        f"--dir={run_dir}",
        f"--out={out}",
        f"--num-steps={NUM_STEPS}",
        f"--save-every={SAVE_EVERY}",
        f"--data={data}",
        f"--data-seed={data_seed}",
        f"--pause-at-rename={pause_at_rename}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    err = open(out.with_suffix(".stderr"), "a")  # noqa: SIM115 (closed in _finish)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    proc.err_file = err  # type: ignore[attr-defined]
    return proc


def _finish(proc: Any, out: Path) -> str:
    proc.wait(TIMEOUT_S)
    proc.err_file.close()
    return out.with_suffix(".stderr").read_text()


def _run_until(proc: Any, out: Path, trigger: str | None, sig: int = signal.SIGKILL) -> list[str]:
    """Read the worker's lines; send ``sig`` on the first line equal to ``trigger``."""
    watchdog = threading.Timer(TIMEOUT_S, proc.kill)
    watchdog.start()
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.strip()
            lines.append(line)
            if line == trigger:
                proc.send_signal(sig)
                break
    finally:
        watchdog.cancel()
    if trigger is not None and (not lines or lines[-1] != trigger):
        stderr = _finish(proc, out)
        pytest.fail(f"worker never printed {trigger!r}; output: {lines[-5:]}\n{stderr[-3000:]}")
    for _ in proc.stdout:  # drain after the signal
        pass
    stderr = _finish(proc, out)
    if trigger is None and proc.returncode != 0:
        pytest.fail(f"worker failed with {proc.returncode}:\n{stderr[-3000:]}")
    return lines


def _check_finished(tmp: Path, run_dir: Path, out: Path, data: str, data_seed: int) -> None:
    ref_state, ref_log = _reference(tmp, data, data_seed)
    final = torch.load(out, weights_only=False)
    assert_trees_equal(final, ref_state, what="state after kills and resumes vs uninterrupted")
    log = loop.read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in log] == list(range(1, NUM_STEPS + 1))
    assert log == ref_log
    kept = ckpt.checkpoints(run_dir)
    assert [p.name for p in kept] == [ckpt.step_dir(run_dir, s).name for s in (21, 24)]
    assert not [p for p in run_dir.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_killed_anywhere_and_resumed_equals_uninterrupted(tmp_path: Path, one_thread: None) -> None:
    """SIGKILL at a random step, on entering a save, and between writing and publishing a
    checkpoint; each restart resumes from the newest complete checkpoint; the final
    state is bitwise the uninterrupted run's and the log has each step once."""
    rnd = random.Random(0)
    run_dir, out = tmp_path / "run", tmp_path / "final.pt"
    # 1) at a random step (the worker may be inside the step or the save after it)
    kill_step = rnd.randrange(1, 10)
    lines = _run_until(_start(run_dir, out, data="list", data_seed=0), out, f"STEP {kill_step}")
    assert f"STEP {kill_step}" in lines
    # 2) right after a save starts (the scratch directory is being written)
    save_at = rnd.choice([s for s in range(12, 18) if s % SAVE_EVERY == 0])
    proc = _start(run_dir, out, data="list", data_seed=0)
    _run_until(proc, out, f"SAVE_START {save_at}")
    assert all(s <= save_at for s in _complete_steps(run_dir))
    # 3) after a checkpoint is fully written in its scratch directory, before its rename
    before = _complete_steps(run_dir)
    proc = _start(run_dir, out, data="list", data_seed=0, pause_at_rename=2)
    _run_until(proc, out, "RENAME")
    after = _complete_steps(run_dir)
    assert max(after) == max(before) + SAVE_EVERY  # the first save published, the second not
    assert any(".tmp-" in p.name for p in run_dir.iterdir())
    # 4) to the end
    lines = _run_until(_start(run_dir, out, data="list", data_seed=0), out, None)
    assert lines[-1] == "DONE"
    _check_finished(tmp_path, run_dir, out, "list", 0)


def _complete_steps(run_dir: Path) -> list[int]:
    return [int(ckpt.read_metadata(p)["step"]) for p in ckpt.checkpoints(run_dir)]


def test_sigterm_saves_a_checkpoint_that_resumes_to_the_same_state(
    tmp_path: Path, one_thread: None
) -> None:
    """SIGTERM after step k: the worker finishes its step, saves a checkpoint at its current
    step and exits with status 143; resuming from it gives the uninterrupted final state.

    The data is stateful and the restart builds it from another seed, so only its restored
    state_dict reproduces the interrupted run's batch order.
    """
    run_dir, out = tmp_path / "run", tmp_path / "final.pt"
    proc = _start(run_dir, out, data="stateful", data_seed=1)
    lines = _run_until(proc, out, "STEP 10", sig=signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, lines
    assert "DONE" not in lines
    newest = ckpt.latest(run_dir)
    assert newest is not None
    stopped_at = int(ckpt.read_metadata(newest)["step"])
    assert 10 <= stopped_at < NUM_STEPS
    assert loop.read_metrics(run_dir / "metrics.jsonl")[-1]["step"] == stopped_at
    lines = _run_until(_start(run_dir, out, data="stateful", data_seed=2), out, None)
    assert lines[0] == f"STEP {stopped_at + 1}"
    _check_finished(tmp_path, run_dir, out, "stateful", 1)


@pytest.mark.distributed
def test_two_ranks_stop_together_and_resume_their_own_data(tmp_path: Path) -> None:
    """World size 2 (gloo), each rank with its own stateful data shard: SIGTERM reaching rank 1
    only stops both ranks after the same step, reporting SIGTERM on both (as does SIGTERM
    reaching both ranks at once), with one checkpoint holding each rank's data
    state; resumed with data built from other seeds, both ranks end bitwise equal to an
    uninterrupted run."""
    with WorkerPool(2) as pool:
        ref = pool.run(worker.distributed_run, str(tmp_path / "ref"), 8, 0)
        stop = pool.run(worker.distributed_run, str(tmp_path / "run"), 8, 0, term_at=3)
        assert [o["preempted"] for o in stop] == [3, 3]
        assert [o["signum"] for o in stop] == [signal.SIGTERM, signal.SIGTERM]
        both = pool.run(
            worker.distributed_run, str(tmp_path / "both"), 8, 0, term_at=5, term_ranks=(0, 1)
        )
        # Every rank reports the signal itself, not a sum of the ranks' flags (signal 30).
        assert [(o["preempted"], o["signum"]) for o in both] == [(5, signal.SIGTERM)] * 2
        md = ckpt.read_metadata(ckpt.latest(tmp_path / "run"))
        assert md["step"] == 3
        assert sorted(md["per_rank_keys"]) == ["0", "1"]
        assert "loop.data_state" in md["per_rank_keys"]["1"]
        out = pool.run(worker.distributed_run, str(tmp_path / "run"), 8, 50)
    assert [o["preempted"] for o in out] == [None, None]
    for r in range(2):
        assert_trees_equal(
            out[r]["state"], ref[r]["state"], what=f"rank {r} resumed vs uninterrupted"
        )
    assert_trees_equal(ref[1]["state"], ref[0]["state"], what="rank 1 vs rank 0")
    steps = [r["step"] for r in loop.read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert steps == list(range(1, 9))


# -- in-process: signal handlers, the control group and collective timeouts (world size 1) --------


def _count(state: TensorDictBase, batch: Any) -> tuple[TensorDictBase, dict[str, Any]]:
    return state.set("step", state["step"] + 1).set("w", state["w"] + batch["x"].sum()), {}


def _count_state() -> TensorDict:
    return TensorDict({"step": torch.tensor(0), "w": torch.zeros(())}, [])


_ONES = [{"x": torch.ones(2)}]


@pytest.fixture
def own_handlers() -> Iterator[dict[int, list[int]]]:
    """SIGINT and SIGTERM handled by recording functions of this test (whatever the runner had:
    mutmut's workers ignore SIGINT and exit on SIGTERM); the runner's handlers come back after."""
    seen: dict[int, list[int]] = {signal.SIGINT: [], signal.SIGTERM: []}
    old = {s: signal.getsignal(s) for s in seen}
    for s in seen:
        signal.signal(s, lambda signum, frame: seen[signum].append(signum))
    try:
        yield seen
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def _one_rank_group() -> Iterator[None]:
    """A gloo process group of world size 1 in this process (skips if there is one already)."""
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


class _SignalAt:
    """``_count``, sending ``sig`` to this process after step ``at``."""

    def __init__(self, at: int, sig: int) -> None:
        self.at, self.sig = at, sig

    def __call__(self, state: TensorDictBase, batch: Any) -> tuple[TensorDictBase, dict[str, Any]]:
        out, metrics = _count(state, batch)
        if int(out["step"]) == self.at:
            os.kill(os.getpid(), self.sig)
        return out, metrics


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_run_catches_the_first_signal_and_gives_back_the_callers_handlers(
    own_handlers: dict[int, list[int]], sig: int
) -> None:
    """Inside run the first SIGTERM/SIGINT is run's (Preempted after that step), not the
    caller's handler; after run the caller's own handlers of both signals are back."""
    before = {s: signal.getsignal(s) for s in own_handlers}
    with pytest.raises(loop.Preempted) as e:
        loop.run(_SignalAt(2, sig), _count_state(), _ONES, num_steps=5, progress=False)
    assert (e.value.step, e.value.code) == (2, 128 + sig)
    assert own_handlers == {signal.SIGINT: [], signal.SIGTERM: []}
    assert {s: signal.getsignal(s) for s in own_handlers} == before


def test_a_stop_signal_polls_zero_until_entered_and_can_be_entered_again(
    own_handlers: dict[int, list[int]],
) -> None:
    """StopSignal before its context: no signal. Entered twice in a row, each exit gives the
    previous handlers back, and each context catches its own signal."""
    from purestep.loop._signals import StopSignal

    before = {s: signal.getsignal(s) for s in own_handlers}
    stop = StopSignal()
    assert stop.poll() == 0
    for _ in range(2):
        with stop:
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.poll() == signal.SIGTERM
        assert {s: signal.getsignal(s) for s in own_handlers} == before
    assert own_handlers == {signal.SIGINT: [], signal.SIGTERM: []}


def test_on_a_gloo_default_group_the_stop_flag_needs_no_group_of_its_own(
    own_handlers: dict[int, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """World size 1 on gloo: the control group for the stop flag is the default group (None),
    asked for again it is the cached answer; run still stops on SIGTERM after that step."""
    from purestep.loop import _signals

    monkeypatch.setattr(_signals, "_group_cache", None)
    with _one_rank_group():
        assert _signals._control_group() is None
        assert _signals._control_group() is None
        with pytest.raises(loop.Preempted) as e:
            loop.run(
                _SignalAt(3, signal.SIGTERM), _count_state(), _ONES, num_steps=5, progress=False
            )
        assert e.value.step == 3


@pytest.mark.parametrize("known", [True, False], ids=["timeout_known", "timeout_unknown"])
def test_a_timed_out_collective_in_a_step_names_the_rank_the_timeout_and_the_step(
    monkeypatch: pytest.MonkeyPatch, known: bool
) -> None:
    """With a process group (gloo, world size 1), a step failing with gloo's timeout error
    raises CollectiveTimeoutError naming rank, world size, the timeout in force
    (collective_timeout=7: '7 s'; 'unknown' when the group's timeout cannot be read) and the
    step, with torch's error as the cause."""
    from purestep.distributed import timeouts

    cause = RuntimeError("Timed out waiting 7000ms for recv operation to complete")

    def stuck(state: TensorDictBase, batch: Any) -> Any:
        if int(state["step"]) == 1:
            raise cause
        return _count(state, batch)

    if not known:
        monkeypatch.setattr(timeouts, "get_timeout", lambda group=None: None)
    with _one_rank_group(), pytest.raises(loop.CollectiveTimeoutError) as e:
        loop.run(stuck, _count_state(), _ONES, num_steps=3, progress=False, collective_timeout=7)
    assert str(e.value) == (
        "run: rank 0 of 1 waited longer than the collective timeout "
        f"({'7 s' if known else 'unknown'}) for the other ranks in step 2 (state['step'] was 1): "
        "another rank is stuck (or far slower). Stopping; the newest complete checkpoint is "
        f"intact. (RuntimeError: {cause})"
    )
    assert e.value.__cause__ is cause


def test_on_a_non_gloo_default_group_the_stop_flag_gets_one_gloo_group_per_default_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A default group of another backend (as nccl on GPUs; here its name is faked on a one-rank
    gloo group) gets its own gloo group for the stop flag: made once, reused while the default
    group lives, and made afresh for a new default group."""
    from purestep.loop import _signals

    real = dist.get_backend
    monkeypatch.setattr(_signals, "_group_cache", None)
    monkeypatch.setattr(
        _signals.dist, "get_backend", lambda group=None: "nccl" if group is None else real(group)
    )
    made = []
    for _ in range(2):
        with _one_rank_group():
            g = _signals._control_group()
            assert g is not None and real(g) == "gloo"
            assert _signals._control_group() is g
            made.append(g)
    assert made[0] is not made[1]
