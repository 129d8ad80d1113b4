"""Tests of ``purestep.loop.run`` in process: equivalence with a hand loop, resume, data
position, metrics and sinks, preemption by SIGINT, bad inputs; and ``purestep.plot``."""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import signal
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, TensorDictBase

import purestep as ps
from purestep import checkpoint as ckpt
from purestep import loop, plot
from purestep.testing import assert_trees_equal, snapshot

# -- fixtures: a small regression model, and a toy step whose metrics are known in advance ----


def _batches(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {"x": torch.randn(6, 3, generator=g), "y": torch.randn(6, 1, generator=g)} for _ in range(n)
    ]


def _model(hidden: int = 8) -> tuple[Any, TensorDict]:
    g = torch.Generator().manual_seed(0)
    params = TensorDict(
        {"w1": torch.randn(hidden, 3, generator=g), "w2": torch.randn(1, hidden, generator=g)}, []
    )

    def loss_fn(p: Any, b: Any, key: torch.Tensor) -> Any:
        pred = torch.tanh(b["x"] @ p["m", "w1"].T) @ p["m", "w2"].T
        return ((pred - b["y"]) ** 2).mean(), {"pred_mean": pred.mean()}

    opt = {"m": ps.optim.adamw(1e-2)}
    return ps.train_step(ps.value_and_grad(loss_fn), opt), ps.init_state({"m": params}, opt, seed=3)


def _hand_loop(step: Any, state: TensorDictBase, data: list[Any], n: int) -> TensorDictBase:
    """The reference: prepare, then the steps over data repeated, by hand."""
    state = step.prepare(state)
    for i in range(int(state["step"]), n):
        state, _ = step(state, data[i % len(data)])
    return state


class _Toy:
    """A step over ``{"step", "acc"}`` whose metrics are functions of the input step and batch."""

    def __call__(self, state: TensorDictBase, batch: TensorDictBase) -> Any:
        s = state["step"]
        out = TensorDict({"step": s + 1, "acc": state["acc"] + batch["v"].sum()}, [])
        metrics = TensorDict(
            {"s": s.double(), "nested": {"sq": (s * s).double()}, "batch": batch["v"][0]}, []
        )
        return out, metrics


def _toy_state() -> TensorDict:
    return TensorDict({"step": torch.tensor(0), "acc": torch.tensor(0.0, dtype=torch.float64)}, [])


def _toy_data(n: int) -> list[dict[str, torch.Tensor]]:
    return [{"v": torch.tensor([float(i)], dtype=torch.float64)} for i in range(n)]


class _Record:
    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, float]]] = []

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        self.calls.append((step, dict(metrics)))


def _run(step: Any, state: Any, data: Any, **kw: Any) -> Any:
    kw.setdefault("progress", False)
    return loop.run(step, state, data, **kw)


# -- equivalence and resume -------------------------------------------------------------------


@settings(max_examples=6, deadline=None)
@given(num_steps=st.integers(1, 9), num_batches=st.integers(1, 4), log_every=st.integers(1, 4))
def test_run_equals_the_hand_loop_over_repeated_data(
    num_steps: int, num_batches: int, log_every: int
) -> None:
    """run(num_steps) == the same steps by hand over the data re-iterated, bitwise."""
    step, state = _model()
    data = _batches(num_batches)
    out = _run(step, snapshot(state), data, num_steps=num_steps, log_every=log_every, sinks=())
    assert_trees_equal(out, _hand_loop(step, snapshot(state), data, num_steps))
    assert "loop" not in out


@settings(max_examples=4, deadline=None)
@given(
    stop=st.integers(1, 7),
    save_every=st.sampled_from([None, 1, 2, 3]),
    num_batches=st.integers(1, 3),
)
def test_resume_latest_continues_to_the_uninterrupted_state(
    tmp_path_factory: pytest.TempPathFactory, stop: int, save_every: int | None, num_batches: int
) -> None:
    """A run to `stop` then a resumed run to 8 == one run to 8 (state bitwise; log once per step)."""
    d = tmp_path_factory.mktemp("run")
    step, state = _model()
    data = _batches(num_batches)
    _run(step, snapshot(state), data, num_steps=stop, checkpoint_dir=d, save_every=save_every)
    assert ckpt.latest(d) == ckpt.step_dir(d, stop)
    out = _run(step, snapshot(state), data, num_steps=8, checkpoint_dir=d, save_every=save_every)
    assert_trees_equal(out, _hand_loop(step, snapshot(state), data, 8))
    assert [r["step"] for r in loop.read_metrics(d / "metrics.jsonl")] == list(range(1, 9))


@settings(max_examples=4, deadline=None)
@given(stop=st.integers(1, 7), save_every=st.sampled_from([1, 2, 3]))
def test_async_saves_resume_to_the_uninterrupted_state(
    tmp_path_factory: pytest.TempPathFactory, stop: int, save_every: int
) -> None:
    """With async_save, a run to `stop` then a resumed run to 8 == one run to 8, bitwise.

    Every periodic checkpoint is complete and loadable once run returns, and
    each equals the state of the uninterrupted run at its step.
    """
    d = tmp_path_factory.mktemp("run")
    step, state = _model()
    data = _batches(2)
    kw: dict[str, Any] = {"checkpoint_dir": d, "save_every": save_every, "async_save": True}
    _run(step, snapshot(state), data, num_steps=stop, keep_last=10, **kw)
    assert ckpt.latest(d) == ckpt.step_dir(d, stop)
    out = _run(step, snapshot(state), data, num_steps=8, keep_last=10, **kw)
    assert_trees_equal(out, _hand_loop(step, snapshot(state), data, 8))
    for path in ckpt.checkpoints(d):
        at = ckpt.read_metadata(path)["step"]
        loaded = ckpt.load(path, like=_with_loop_keys(out))
        del loaded["loop"]
        assert_trees_equal(loaded, _hand_loop(step, snapshot(state), data, at))


def _with_loop_keys(state: TensorDict) -> TensorDict:
    full = state.copy()
    full.set("loop", TensorDict({"batches_consumed": torch.tensor(0)}, []))
    return full


def test_async_saves_keep_the_newest_checkpoints(tmp_path: Path) -> None:
    """With async_save and save_every=1, keep_last newest checkpoints remain when run returns."""
    step, state = _model()
    _run(
        step,
        snapshot(state),
        _batches(2),
        num_steps=6,
        checkpoint_dir=tmp_path,
        save_every=1,
        keep_last=2,
        async_save=True,
    )
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step_00000005", "step_00000006"]


def test_checkpoint_holds_the_data_position(tmp_path: Path) -> None:
    """loop.batches_consumed (global) and per-rank epoch/position are saved with the state."""
    step, state = _model()
    _run(step, state, _batches(3), num_steps=7, checkpoint_dir=tmp_path)
    md = ckpt.read_metadata(ckpt.step_dir(tmp_path, 7))
    assert "loop.batches_consumed" in md["keys"]
    assert set(md["per_rank_keys"]["0"]) == {"loop.epoch", "loop.position"}
    pos = TensorDict({"loop": {"epoch": torch.tensor(0), "position": torch.tensor(0)}}, [])
    got = ckpt.load_per_rank(ckpt.step_dir(tmp_path, 7), like=pos)
    assert (int(got["loop", "epoch"]), int(got["loop", "position"])) == (2, 1)  # 7 = 3 + 3 + 1


def test_a_hand_written_checkpoint_resumes_with_one_batch_per_step(tmp_path: Path) -> None:
    """A checkpoint saved with checkpoint.save (no loop keys) resumes; step batches are skipped."""
    step, state = _model()
    data = _batches(3)
    mid = _hand_loop(step, snapshot(state), data, 4)
    ckpt.save(mid, ckpt.step_dir(tmp_path, 4))
    out = _run(step, snapshot(state), data, num_steps=8, checkpoint_dir=tmp_path)
    assert_trees_equal(out, _hand_loop(step, snapshot(state), data, 8))


def test_keep_last_keeps_the_newest_checkpoints(tmp_path: Path) -> None:
    """With save_every=1 only the keep_last newest checkpoints remain, also while fewer exist."""
    step, state = _model()
    _run(
        step,
        snapshot(state),
        _batches(2),
        num_steps=2,
        checkpoint_dir=tmp_path / "a",
        save_every=1,
        keep_last=3,
    )
    assert [p.name for p in ckpt.checkpoints(tmp_path / "a")] == ["step_00000001", "step_00000002"]
    _run(
        step,
        snapshot(state),
        _batches(2),
        num_steps=6,
        checkpoint_dir=tmp_path / "b",
        save_every=1,
        keep_last=2,
    )
    assert [p.name for p in ckpt.checkpoints(tmp_path / "b")] == ["step_00000005", "step_00000006"]


# -- data -----------------------------------------------------------------------------------


def test_data_is_reiterated_when_exhausted_and_set_epoch_is_called() -> None:
    """With 3 batches and 8 steps the step sees batches 0 1 2 0 1 2 0 1; set_epoch(n) before pass n."""

    class Data:
        def __init__(self) -> None:
            self.epochs: list[int] = []

        def set_epoch(self, n: int) -> None:
            self.epochs.append(n)

        def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
            return iter(_toy_data(3))

    rec, data = _Record(), Data()
    _run(_Toy(), _toy_state(), data, num_steps=8, sinks=[rec])
    assert [m["batch"] for _, m in rec.calls] == [0, 1, 2, 0, 1, 2, 0, 1]
    assert data.epochs == [0, 1, 2]


def test_one_shot_iterators_and_empty_data_fail_clearly() -> None:
    """A generator that runs out names the need for a re-iterable; empty data says so."""
    gen = iter(_toy_data(2))
    with pytest.raises(ValueError, match="re-iterable"):
        _run(_Toy(), _toy_state(), gen, num_steps=5, sinks=())
    with pytest.raises(ValueError, match="yielded no batches"):
        _run(_Toy(), _toy_state(), [], num_steps=5, sinks=())


# -- metrics and sinks -----------------------------------------------------------------------


def test_log_records_hold_interval_means() -> None:
    """Records at multiples of log_every and the last step hold the mean over their interval;
    nested names join with '/'."""
    rec = _Record()
    _run(_Toy(), _toy_state(), _toy_data(4), num_steps=10, log_every=4, sinks=[rec])
    assert [s for s, _ in rec.calls] == [4, 8, 10]
    for (at, metrics), lo in zip(rec.calls, [0, 4, 8], strict=True):
        ss = list(range(lo, at))  # the toy's metric "s" is the input step
        assert metrics["s"] == sum(ss) / len(ss)
        assert metrics["nested/sq"] == sum(s * s for s in ss) / len(ss)
        assert all(type(v) is float for v in metrics.values())


class _Counting(torch.Tensor):
    """Counts reads of values to the host (item, tolist, float, ...)."""

    reads = 0
    _READS = frozenset(
        {
            torch.Tensor.item,
            torch.Tensor.tolist,
            torch.Tensor.__float__,
            torch.Tensor.__bool__,
            torch.Tensor.__int__,
            torch.Tensor.numpy,
        }
    )

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in cls._READS:
            _Counting.reads += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_metrics_are_read_to_the_host_once_per_log_point() -> None:
    """Metric tensors are read to the host once per log point, not once per step or metric."""

    def step(state: TensorDictBase, batch: TensorDictBase) -> Any:
        m = {k: torch.tensor(1.5).as_subclass(_Counting) for k in ("a", "b", "c")}
        return TensorDict({"step": state["step"] + 1}, []), m

    _Counting.reads = 0
    rec = _Record()
    _run(
        step,
        TensorDict({"step": torch.tensor(0)}, []),
        _toy_data(2),
        num_steps=12,
        log_every=4,
        sinks=[rec],
    )
    assert len(rec.calls) == 3
    assert _Counting.reads == 3
    assert rec.calls[0][1] == {"a": 1.5, "b": 1.5, "c": 1.5}


def test_file_sinks_write_the_same_records(tmp_path: Path) -> None:
    """jsonl, csv and a callable receive the same (step, metrics) records."""
    rec = _Record()
    _run(
        _Toy(),
        _toy_state(),
        _toy_data(3),
        num_steps=5,
        log_every=2,
        checkpoint_dir=tmp_path,
        sinks=("jsonl", "csv", rec),
    )
    expected = [{"step": s, **m} for s, m in rec.calls]
    assert [s for s, _ in rec.calls] == [2, 4, 5]
    assert loop.read_metrics(tmp_path / "metrics.jsonl") == expected
    lines = (tmp_path / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    assert header == ["step", "s", "nested/sq", "batch"]
    rows = [dict(zip(header, map(float, ln.split(",")), strict=True)) for ln in lines[1:]]
    assert rows == [{k: float(v) for k, v in e.items()} for e in expected]


def test_file_sinks_drop_records_after_the_resumed_step(tmp_path: Path) -> None:
    """Records past the resumed checkpoint's step (and torn lines) are dropped on restart."""
    step, state = _model()
    _run(
        step,
        snapshot(state),
        _batches(2),
        num_steps=3,
        checkpoint_dir=tmp_path,
        sinks=("jsonl", "csv"),
    )
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"step": 9, "loss": 1.0}) + "\n" + '{"step": 10, "lo')
    with open(tmp_path / "metrics.csv", "a") as fh:
        fh.write("9,1,1,1\n")
    _run(
        step,
        snapshot(state),
        _batches(2),
        num_steps=5,
        checkpoint_dir=tmp_path,
        sinks=("jsonl", "csv"),
    )
    assert [r["step"] for r in loop.read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    csv_steps = [ln.split(",")[0] for ln in (tmp_path / "metrics.csv").read_text().splitlines()]
    assert csv_steps == ["step", "1", "2", "3", "4", "5"]


def test_tensorboard_sink_holds_the_same_records_as_jsonl(tmp_path: Path) -> None:
    """The tensorboard sink's scalars (tag, step, value) equal the JSONL records (skipped without tensorboard)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _run(
        _Toy(),
        _toy_state(),
        _toy_data(2),
        num_steps=5,
        log_every=2,
        checkpoint_dir=tmp_path,
        sinks=("tensorboard", "jsonl"),
    )
    records = loop.read_metrics(tmp_path / "metrics.jsonl")
    expected = {
        (tag, int(r["step"]), float(v)) for r in records for tag, v in r.items() if tag != "step"
    }
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    got = {(tag, e.step, e.value) for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    assert {(t, s) for t, s, _ in got} == {(t, s) for t, s, _ in expected}
    for tag, step, value in expected:
        (match,) = [v for t, s, v in got if (t, s) == (tag, step)]
        assert match == pytest.approx(value, rel=1e-6), (tag, step)


def test_eval_metrics_are_logged_with_the_eval_prefix() -> None:
    """eval_fn runs every eval_every steps on the state after that step; its metrics arrive as
    eval/<name> in the record of that step (one record per step)."""
    rec, seen = _Record(), []

    def eval_fn(state: TensorDictBase) -> dict[str, Any]:
        seen.append(int(state["step"]))
        return {"acc": state["acc"], "deep": {"x": 2.0}}

    _run(
        _Toy(),
        _toy_state(),
        _toy_data(3),
        num_steps=7,
        log_every=2,
        sinks=[rec],
        eval_fn=eval_fn,
        eval_every=3,
    )
    assert seen == [3, 6]
    assert [s for s, _ in rec.calls] == [2, 3, 4, 6, 7]
    by_step = dict(rec.calls)
    assert set(by_step[3]) == {"eval/acc", "eval/deep/x"}
    assert by_step[3]["eval/acc"] == 0 + 1 + 2
    assert {"s", "eval/acc"} <= set(by_step[6])


class _ImageRecord(_Record):
    def __init__(self) -> None:
        super().__init__()
        self.images: list[tuple[int, str, torch.Tensor]] = []

    def image(self, step: int, name: str, pixels: torch.Tensor) -> None:
        self.images.append((step, name, pixels))


def test_eval_images_are_written_as_png_files_and_to_image_sinks(tmp_path: Path) -> None:
    """eval_fn may return loop.Image values next to its scalars: each becomes
    images/eval_<name>_<step>.png (decoded pixel for pixel) and reaches sinks with image();
    the scalar records are unchanged."""
    image_mod = pytest.importorskip("PIL.Image")
    rec = _ImageRecord()

    def eval_fn(state: TensorDictBase) -> dict[str, Any]:
        v = state["acc"].float() / 10
        return {"acc": state["acc"], "samples": loop.Image(torch.stack([v.expand(2, 3)] * 3))}

    _run(
        _Toy(),
        _toy_state(),
        _toy_data(3),
        num_steps=4,
        checkpoint_dir=tmp_path,
        sinks=("jsonl", rec),
        eval_fn=eval_fn,
        eval_every=2,
    )
    assert [(s, n) for s, n, _ in rec.images] == [(2, "eval/samples"), (4, "eval/samples")]
    for step, _, pixels in rec.images:
        acc = float(sum(i % 3 for i in range(step)))  # batch i holds v = i % 3
        want = plot.image_grid(torch.full((3, 2, 3), acc / 10))
        assert torch.equal(pixels, want)
        with image_mod.open(tmp_path / "images" / f"eval_samples_{step:08d}.png") as im:
            back = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
            assert torch.equal(back.reshape(pixels.shape), pixels)
    records = loop.read_metrics(tmp_path / "metrics.jsonl")
    assert all("eval/samples" not in r for r in records)
    if importlib.util.find_spec("tensorboard") is not None:  # the tensorboard sink's images
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        tb = tmp_path / "tb"
        _run(
            _Toy(),
            _toy_state(),
            _toy_data(3),
            num_steps=4,
            sinks=[loop.TensorBoardSink(tb)],
            eval_fn=eval_fn,
            eval_every=2,
        )
        acc = EventAccumulator(str(tb))
        acc.Reload()
        got = [(e.step, e.width, e.height) for e in acc.Images("eval/samples")]
        assert got == [(2, 9, 7), (4, 9, 7)]
    assert [r.get("eval/acc") for r in records] == [None, 1.0, None, 3.0]


# -- preemption ----------------------------------------------------------------------------


def test_sigint_saves_at_the_current_step_and_resumes_exactly(tmp_path: Path) -> None:
    """SIGINT during step 4's logging: run saves a checkpoint at step 4 and raises Preempted
    (code 130) with the state; resuming ends where an uninterrupted run ends."""
    step, state = _model()
    data = _batches(3)

    def interrupt(s: int, m: dict[str, float]) -> None:
        if s == 4:
            os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(loop.Preempted) as info:
        _run(
            step,
            snapshot(state),
            data,
            num_steps=9,
            checkpoint_dir=tmp_path,
            save_every=3,
            sinks=("jsonl", interrupt),
        )
    assert signal.getsignal(signal.SIGINT) is before
    e = info.value
    assert (e.code, e.step, e.checkpoint) == (130, 4, ckpt.step_dir(tmp_path, 4))
    assert ckpt.latest(tmp_path) == ckpt.step_dir(tmp_path, 4)
    assert_trees_equal(e.state, _hand_loop(step, snapshot(state), data, 4))
    out = _run(step, snapshot(state), data, num_steps=9, checkpoint_dir=tmp_path, save_every=3)
    assert_trees_equal(out, _hand_loop(step, snapshot(state), data, 9))
    assert [r["step"] for r in loop.read_metrics(tmp_path / "metrics.jsonl")] == list(range(1, 10))


class _SignalAt:
    """The toy step, sending ``sig`` to this process once, after it computes step ``at``."""

    def __init__(self, at: int, sig: int) -> None:
        self.at, self.sig, self.sent = at, sig, False

    def __call__(self, state: TensorDictBase, batch: TensorDictBase) -> Any:
        out, metrics = _Toy()(state, batch)
        if int(out["step"]) == self.at and not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.sig)
        return out, metrics


@settings(max_examples=8, deadline=None)
@given(at=st.integers(1, 9), log_every=st.integers(1, 5), save_every=st.sampled_from([None, 3]))
def test_a_preempted_and_resumed_run_logs_what_an_uninterrupted_one_logs(
    tmp_path_factory: pytest.TempPathFactory, at: int, log_every: int, save_every: int | None
) -> None:
    """SIGTERM after any step, then resume='latest': metrics.jsonl equals the uninterrupted run's
    (the window's metrics before the stop are carried in the checkpoint, not logged early)."""
    ref_dir, dirs = tmp_path_factory.mktemp("ref"), tmp_path_factory.mktemp("pre")
    kw: dict[str, Any] = {"num_steps": 10, "log_every": log_every, "save_every": save_every}
    kw["sinks"] = ("jsonl",)
    _run(_Toy(), _toy_state(), _toy_data(3), checkpoint_dir=ref_dir, **kw)
    with pytest.raises(loop.Preempted):
        _run(_SignalAt(at, signal.SIGTERM), _toy_state(), _toy_data(3), checkpoint_dir=dirs, **kw)
    _run(_Toy(), _toy_state(), _toy_data(3), checkpoint_dir=dirs, resume="latest", **kw)
    ref = (ref_dir / "metrics.jsonl").read_text()
    assert (dirs / "metrics.jsonl").read_text() == ref


def test_preemption_prints_the_checkpoint_and_how_to_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM: stderr names the signal, the step, the checkpoint and resume='latest'; without a
    checkpoint_dir it says nothing was saved."""
    with pytest.raises(loop.Preempted):
        _run(
            _SignalAt(4, signal.SIGTERM),
            _toy_state(),
            _toy_data(3),
            num_steps=9,
            checkpoint_dir=tmp_path,
        )
    err = capsys.readouterr().err
    assert "SIGTERM received; stopped after step 4" in err
    assert str(ckpt.step_dir(tmp_path, 4)) in err and "resume='latest'" in err
    with pytest.raises(loop.Preempted):
        _run(_SignalAt(2, signal.SIGTERM), _toy_state(), _toy_data(3), num_steps=9)
    assert "nothing was saved" in capsys.readouterr().err


def test_a_second_signal_interrupts_at_once(tmp_path: Path) -> None:
    """A second SIGINT raises KeyboardInterrupt where the program is; no checkpoint is saved."""

    def interrupt_twice(s: int, m: dict[str, float]) -> None:
        if s == 2:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        _run(
            _Toy(),
            _toy_state(),
            _toy_data(2),
            num_steps=5,
            checkpoint_dir=tmp_path,
            sinks=[interrupt_twice],
        )
    assert signal.getsignal(signal.SIGINT) is before
    assert ckpt.checkpoints(tmp_path) == []


def test_after_a_first_sigterm_a_second_one_terminates() -> None:
    """The first SIGTERM re-arms SIGTERM to the default action (terminate at once); run then
    raises Preempted with code 143, and the previous handler is back afterwards."""
    armed: list[Any] = []

    def term(s: int, m: dict[str, float]) -> None:
        if s == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            armed.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(loop.Preempted) as info:
        _run(_Toy(), _toy_state(), _toy_data(2), num_steps=5, sinks=[term])
    assert armed == [signal.SIG_DFL]
    assert (info.value.code, info.value.step, info.value.checkpoint) == (143, 2, None)
    assert signal.getsignal(signal.SIGTERM) is before


# -- bad inputs: clear errors, and nothing that looks like a checkpoint -----------------------


def test_a_batch_missing_a_key_names_it_before_anything_is_saved(tmp_path: Path) -> None:
    """The step reads batch["y"], the data has only "x": the error names "y" at step 0."""
    step, state = _model()
    data = [{"x": torch.ones(6, 3)}]
    with pytest.raises(loop.BatchKeyError, match=r"no key 'y'.*batch keys: \['x'\]"):
        _run(step, state, data, num_steps=3, checkpoint_dir=tmp_path, save_every=1)
    assert ckpt.checkpoints(tmp_path) == []


def test_a_missing_nested_batch_key_is_named_with_its_path() -> None:
    """batch["cond", "label"] on a batch whose "cond" has only "text": the error names the
    whole path the step asked for, also inside accumulate's microbatches (splits that carry
    the "index" the step adds)."""

    def loss_fn(p: Any, b: Any, key: torch.Tensor) -> Any:
        return (p["m", "w"] * b["cond", "label"]).sum(), {}

    opt = {"m": ps.optim.sgd(0.1)}
    state = ps.init_state({"m": TensorDict({"w": torch.ones(2)}, [])}, opt, seed=0)
    data = [{"x": torch.ones(4, 2), "cond": {"text": torch.ones(4, 2)}}]
    for grad_fn in (ps.value_and_grad(loss_fn), ps.accumulate(ps.value_and_grad(loss_fn), 2)):
        with pytest.raises(loop.BatchKeyError, match=r"no key \('cond', 'label'\)"):
            _run(ps.train_step(grad_fn, opt), state, data, num_steps=1)


def test_the_missing_batch_key_does_not_depend_on_tensordicts_message() -> None:
    """The key is read from the failed lookup itself (the traceback), not parsed from the
    KeyError's text: a reworded message still names it, and a KeyError that merely reads like
    tensordict's but comes from another TensorDict (the state) or a dict is no batch key."""
    from purestep.loop._run import _missing_batch_key

    batch = TensorDict({"x": torch.ones(2)}, [2])
    with pytest.raises(KeyError) as on_batch:
        batch["y"]
    on_batch.value.args = ("reworded by a future tensordict",)
    assert _missing_batch_key(on_batch.value, batch) == "y"
    state = TensorDict({"step": torch.tensor(0)}, [])
    with pytest.raises(KeyError) as on_state:
        state["y"]
    assert _missing_batch_key(on_state.value, batch) is None
    with pytest.raises(KeyError) as on_dict:
        {}["y"]
    on_dict.value.args = ("key \"y\" not found in TensorDict with keys ['x']",)
    assert _missing_batch_key(on_dict.value, batch) is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_steps": 0}, "num_steps must be an int >= 1"),
        ({"num_steps": -3}, "num_steps must be an int >= 1"),
        ({"num_steps": 2.5}, "num_steps must be an int >= 1"),
        ({"num_steps": 3, "save_every": 0, "checkpoint_dir": "x"}, "save_every"),
        ({"num_steps": 3, "save_every": 2}, "save_every needs a checkpoint_dir"),
        ({"num_steps": 3, "keep_last": 0}, "keep_last"),
        ({"num_steps": 3, "log_every": 0}, "log_every"),
        ({"num_steps": 3, "eval_every": 2}, "eval_fn is None"),
        ({"num_steps": 3, "sinks": ("jsonl", "nope")}, "unknown sink 'nope'"),
        ({"num_steps": 3, "collective_timeout": 0}, "collective_timeout must be positive"),
    ],
)
def test_bad_arguments_fail_before_any_step(kwargs: dict[str, Any], match: str) -> None:
    """Bad arguments raise ValueError naming the argument, before the step is called."""

    def step(state: Any, batch: Any) -> Any:
        raise AssertionError("the step must not run")

    with pytest.raises(ValueError, match=match):
        loop.run(step, _toy_state(), _toy_data(1), progress=False, **kwargs)


def test_an_unwritable_checkpoint_dir_fails_before_any_step(tmp_path: Path) -> None:
    """A checkpoint_dir that cannot be created (its parent is a file) names the directory."""
    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "ckpt"
    with pytest.raises(OSError, match=r"checkpoint_dir .* is not writable"):
        _run(_Toy(), _toy_state(), _toy_data(1), num_steps=2, checkpoint_dir=bad)


def test_resume_from_something_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    """resume=PATH of a missing or non-checkpoint directory fails naming the path."""
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises((FileNotFoundError, ValueError), match="is not a checkpoint"):
            _run(
                _Toy(),
                _toy_state(),
                _toy_data(1),
                num_steps=2,
                checkpoint_dir=tmp_path / "c",
                resume=path,
            )
    assert ckpt.checkpoints(tmp_path / "c") == []


def test_a_checkpoint_with_other_keys_lists_them(tmp_path: Path) -> None:
    """Resuming a state from a checkpoint of a different model lists missing and unexpected keys."""
    step, state = _model()
    _run(step, snapshot(state), _batches(1), num_steps=1, checkpoint_dir=tmp_path)
    # a consistent state of another model: w1 gone, w3 added (in params and optimizer state)
    other_params = TensorDict({"w2": torch.zeros(1, 8), "w3": torch.zeros(2)}, [])
    other = ps.init_state({"m": other_params}, {"m": ps.optim.adamw(1e-2)}, seed=3)
    with pytest.raises(ValueError, match=r"(?s)cannot resume.*params\.m\.w3.*opt_state\.m\.mu\.w1"):
        _run(step, other, _batches(1), num_steps=3, checkpoint_dir=tmp_path)
    with pytest.raises(ValueError, match="already holds checkpoints"):
        _run(step, snapshot(state), _batches(1), num_steps=3, checkpoint_dir=tmp_path, resume=None)
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step_00000001"]


# -- plot ----------------------------------------------------------------------------------


def test_plot_draws_one_panel_per_family(tmp_path: Path) -> None:
    """python -m purestep.plot's main: loss, lr, grad_norm and eval panels into a PNG."""
    pytest.importorskip("matplotlib")
    from purestep import plot

    step, state = _model()
    _run(
        step,
        state,
        _batches(2),
        num_steps=4,
        checkpoint_dir=tmp_path,
        eval_fn=lambda s: {"loss": 1.0},
        eval_every=2,
    )
    out = tmp_path / "curves.png"
    assert plot.main([str(tmp_path / "metrics.jsonl"), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fams = plot.families(["loss", "m/lr", "m/grad_norm", "pred_mean", "eval/loss"])
    assert list(fams) == ["loss", "lr", "grad_norm", "pred_mean", "eval/loss"]


# -- file sinks used directly (without run's start), CSV round-trips ---------------------------


def _csv_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    import csv

    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
        return list(reader.fieldnames or []), rows


_FOREIGN_CELL = st.text(st.sampled_from('aX ,"\n\r'), min_size=0, max_size=6)


@settings(max_examples=15, deadline=None)
@given(notes=st.lists(_FOREIGN_CELL, min_size=1, max_size=3))
def test_csv_column_growth_keeps_foreign_cells_with_commas_quotes_and_newlines(
    tmp_path_factory: pytest.TempPathFactory, notes: list[str]
) -> None:
    """A new metric name rewrites the file with a wider header; cells already in the file (here a
    hand-added "note" column holding commas, quotes, newlines) read back unchanged with the csv
    module, cells that need no quoting are written bare, and old rows get an empty new cell."""
    import csv

    path = tmp_path_factory.mktemp("csv") / "metrics.csv"
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n", quoting=csv.QUOTE_ALL)
        w.writerow(["step", "loss", "note"])
        for i, note in enumerate(notes, 1):
            w.writerow([i, 0.5, note])
    sink = loop.CSVSink(path)
    n = len(notes) + 1
    sink(n, {"loss": 0.25, "acc": 1.5})
    sink.close()
    header, rows = _csv_rows(path)
    assert header == ["step", "loss", "note", "acc"]
    assert [r["note"] for r in rows] == [*notes, ""]
    assert [r["acc"] for r in rows] == [""] * len(notes) + ["1.5"]
    assert [r["step"] for r in rows] == [str(i) for i in range(1, n + 1)]
    lines = path.read_text().split("\n")
    bare = [note for note in notes if not any(c in note for c in ',"\n\r')]
    for note in bare:  # written as is, not quoted
        assert any(ln.endswith(f",{note},") for ln in lines), (note, lines)


def test_csv_sink_used_without_start_writes_a_header_and_empty_missing_cells(
    tmp_path: Path,
) -> None:
    """Called directly (no start), CSVSink creates missing parent folders, writes the "step"
    header even for a record with no metrics, leaves metrics absent from a record empty, and
    reopens the file after close()."""
    path = tmp_path / "a" / "b" / "metrics.csv"
    sink = loop.CSVSink(path)
    sink(1, {})
    sink(2, {"loss": 0.5})
    sink.close()
    sink(3, {"acc": 2.0})
    sink(4, {"loss": 0.25})
    sink.close()
    assert path.read_text().splitlines() == [
        "step,loss,acc",
        "1,,",
        "2,0.5,",
        "3,,2.0",
        "4,0.25,",
    ]


def test_a_new_csv_sink_appends_to_an_existing_file_with_its_columns(tmp_path: Path) -> None:
    """A second CSVSink on an existing file (no start) keeps its columns and rows and appends."""
    path = tmp_path / "metrics.csv"
    first = loop.CSVSink(path)
    first(1, {"loss": 1.0, "acc": 0.5})
    first.close()
    second = loop.CSVSink(path)
    second(2, {"acc": 0.75})
    second.close()
    assert path.read_text().splitlines() == ["step,loss,acc", "1,1.0,0.5", "2,,0.75"]


def test_csv_start_on_an_empty_file_or_one_without_a_step_column_keeps_no_rows(
    tmp_path: Path,
) -> None:
    """An empty metrics.csv gets a "step" header; a file without a "step" column holds no rows."""
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    sink = loop.CSVSink(empty)
    sink.start(0)
    sink(1, {"loss": 2.0})
    sink.close()
    assert empty.read_text().splitlines() == ["step,loss", "1,2.0"]
    other = tmp_path / "other.csv"
    other.write_text("epoch,loss\n1,2.0\n")
    sink = loop.CSVSink(other)
    sink.start(5)
    sink.close()
    assert other.read_text().splitlines() == ["epoch,loss"]


def test_jsonl_sink_used_directly_creates_folders_reopens_and_stores_non_finite_as_strings(
    tmp_path: Path,
) -> None:
    """JSONLSink creates missing parent folders, reopens after close(), writes finite values as
    JSON numbers and non-finite ones as the strings "nan"/"inf"/"-inf" (valid JSON), which
    read_metrics returns as floats."""
    path = tmp_path / "a" / "b" / "metrics.jsonl"
    sink = loop.JSONLSink(path)
    sink(1, {"loss": 0.5, "n": float("nan")})
    sink.close()
    sink(2, {"loss": float("inf"), "m": float("-inf")})
    sink.close()
    raw = [json.loads(ln, parse_constant=lambda c: pytest.fail(c)) for ln in path.open()]
    assert raw == [
        {"step": 1, "loss": 0.5, "n": "nan"},
        {"step": 2, "loss": "inf", "m": "-inf"},
    ]
    back = loop.read_metrics(path)
    assert back[0]["loss"] == 0.5 and back[0]["n"] != back[0]["n"]
    assert back[1] == {"step": 2, "loss": float("inf"), "m": float("-inf")}
    assert all(type(r["step"]) is int for r in back)


def test_read_metrics_skips_records_without_an_int_step_and_keeps_other_values_as_is(
    tmp_path: Path,
) -> None:
    """Lines that are not objects, or lack an int "step", are skipped; only string values become
    floats (an int value stays an int, as written)."""
    path = tmp_path / "m.jsonl"
    path.write_text(
        "\n".join(
            [
                "[1, 2]",
                '{"loss": 1.0}',
                '{"step": "3", "loss": 1.0}',
                '{"step": 4, "count": 3, "x": "nan"}',
                "",
            ]
        )
    )
    (rec,) = loop.read_metrics(path)
    assert rec["step"] == 4 and type(rec["count"]) is int and rec["count"] == 3
    assert type(rec["step"]) is int and isinstance(rec["x"], float)


def test_jsonl_start_keeps_a_last_record_without_a_newline_on_its_own_line(tmp_path: Path) -> None:
    """start() keeps a complete last record that lacks its newline, ending it with one, so the
    next record starts on its own line."""
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}')
    sink = loop.JSONLSink(path)
    sink.start(2)
    sink(3, {"loss": 0.25})
    sink.close()
    assert path.read_text() == (
        '{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n{"step": 3, "loss": 0.25}\n'
    )


# -- sink specs, images, tensorboard ----------------------------------------------------------


def test_a_single_sink_name_or_callable_is_accepted_without_a_tuple(tmp_path: Path) -> None:
    """sinks="jsonl" and sinks=callable mean the one-element tuples."""
    rec = _Record()
    _run(_Toy(), _toy_state(), _toy_data(2), num_steps=2, sinks=rec)
    assert [s for s, _ in rec.calls] == [1, 2]
    _run(_Toy(), _toy_state(), _toy_data(2), num_steps=2, checkpoint_dir=tmp_path, sinks="jsonl")
    assert [r["step"] for r in loop.read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


@pytest.mark.parametrize(
    ("sinks", "error", "match"),
    [
        (("nope",), ValueError, r"unknown sink 'nope'; expected one of \['csv', 'jsonl', "),
        (("nope",), ValueError, r"or a callable \(step, metrics\) -> None$"),
        (
            (3,),
            TypeError,
            r"^sink 3 is a int; expected a name \['csv', 'jsonl', 'tensorboard'\] or a callable "
            r"\(step, metrics\) -> None$",
        ),
    ],
)
def test_a_bad_sink_is_named_with_the_accepted_kinds(sinks: Any, error: type, match: str) -> None:
    """An unknown name or a non-callable sink fails before any step, listing the names and the
    callable signature."""
    with pytest.raises(error, match=match):
        loop.run(_Toy(), _toy_state(), _toy_data(1), num_steps=1, progress=False, sinks=sinks)


def test_image_keeps_uint8_images_and_tiles_everything_else_with_its_options() -> None:
    """uint8 [H, W] and [H, W, 3] are kept as they are; a uint8 [N, H, W] batch (even with W 3 or
    with H 3) and float batches are tiled by image_grid with the given ncol and value_range."""
    g = torch.Generator().manual_seed(0)
    gray = torch.randint(0, 256, (4, 5), dtype=torch.uint8, generator=g)
    rgb = torch.randint(0, 256, (4, 5, 3), dtype=torch.uint8, generator=g)
    assert torch.equal(loop.Image(gray).pixels, gray)
    assert torch.equal(loop.Image(rgb).pixels, rgb)
    for batch in (
        torch.randint(0, 256, (3, 4, 5), dtype=torch.uint8, generator=g),
        torch.randint(0, 256, (3, 4, 4), dtype=torch.uint8, generator=g),
        torch.randint(0, 256, (2, 3, 5, 3), dtype=torch.uint8, generator=g),
    ):
        assert torch.equal(loop.Image(batch).pixels, plot.image_grid(batch)), batch.shape
    x = torch.rand(5, 3, 2, 2, generator=g)
    got = loop.Image(x, ncol=1, value_range=(0.0, 1.0)).pixels
    assert torch.equal(got, plot.image_grid(x, ncol=1, value_range=(0.0, 1.0)))
    assert got.shape[:2] == (5 * 3 + 1, 2 + 2)
    with pytest.raises(TypeError, match="Image: expected a tensor, got list"):
        loop.Image([[0, 1]])  # type: ignore[arg-type]


def _tb_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_tensorboard_sink_used_directly_writes_into_its_dir_and_reopens_after_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without start, scalars and images go to log_dir; after close() the next record reopens."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(tmp_path)
    log_dir = tmp_path / "tb"
    sink = loop.TensorBoardSink(log_dir)
    sink.image(1, "rgb", torch.zeros(2, 3, 3, dtype=torch.uint8))
    sink.close()
    sink(2, {"loss": 0.5})
    sink.close()
    sink.image(3, "gray", torch.zeros(4, 5, dtype=torch.uint8))
    sink(3, {"loss": 0.25})
    sink.close()
    assert _tb_scalars(log_dir) == {"loss": [(2, 0.5), (3, 0.25)]}
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    assert [(e.step, e.width, e.height) for e in acc.Images("rgb")] == [(1, 3, 2)]
    assert [(e.step, e.width, e.height) for e in acc.Images("gray")] == [(3, 5, 4)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tb"]  # nothing written elsewhere


def test_tensorboard_start_purges_the_steps_after_the_resumed_one(tmp_path: Path) -> None:
    """start(2) after steps 1..4 were logged hides steps 3 and 4 of the first run: the log holds
    steps 1, 2 from it and 3, 4 from the second."""
    pytest.importorskip("tensorboard")
    first = loop.TensorBoardSink(tmp_path)
    first.start(0)
    for s in range(1, 5):
        first(s, {"loss": float(s)})
    first.close()
    second = loop.TensorBoardSink(tmp_path)
    second.start(2)
    for s in (3, 4):
        second(s, {"loss": 10.0 * s})
    second.close()
    assert _tb_scalars(tmp_path) == {"loss": [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]}


def test_tensorboard_sink_without_tensorboard_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without the tensorboard package the sink raises ImportError naming pip install tensorboard."""
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(
        ImportError,
        match=r"^the 'tensorboard' sink needs the tensorboard package: pip install tensorboard$",
    ):
        loop.TensorBoardSink(tmp_path)


# -- metric buffer: means in float64, exact pending/restore -----------------------------------


_METRIC_VALUE = st.one_of(
    st.floats(-1e6, 1e6, width=32).map(lambda v: torch.tensor(v, dtype=torch.float32)),
    st.floats(-1e3, 1e3, width=16).map(lambda v: torch.tensor(v, dtype=torch.float16)),
    st.integers(-(2**40), 2**40).map(lambda v: torch.tensor(v, dtype=torch.int64)),
    st.floats(-1e6, 1e6),
)


@settings(max_examples=30, deadline=None)
@given(values=st.lists(_METRIC_VALUE, min_size=1, max_size=5), split=st.integers(0, 5))
def test_metric_means_are_exact_float64_and_survive_pending_and_restore(
    values: list[Any], split: int
) -> None:
    """pop() is the float64 mean of the values a metric reported (any mix of float16/float32/int
    tensors and Python floats); carrying the first values across a restart with pending() and
    restore() (before new values arrive) gives the same mean."""
    from fractions import Fraction

    from purestep.loop._metrics import MetricBuffer

    exact = [Fraction(float(v)) for v in values]
    want = float(torch.tensor([float(x) for x in exact], dtype=torch.float64).mean())
    buf = MetricBuffer()
    assert not buf
    for v in values:
        buf.add({"m": v})
    assert buf
    assert buf.pop() == {"m": want}
    assert not buf
    first, rest = values[:split], values[split:]
    before = MetricBuffer()
    for v in first:
        before.add({"m": v})
    after = MetricBuffer()
    for v in rest:
        after.add({"m": v})
    after.restore(before.pending())
    assert after.pop() == ({"m": want} if first or rest else {})


def test_flat_metrics_averages_tensors_in_float64_and_keeps_scalars_as_they_are() -> None:
    """Non-scalar tensors become their float64 mean (float32 on a device without float64, here
    meta); one-element tensors keep their dtype; Python numbers become float64 tensors."""
    from purestep.loop._metrics import flat_metrics

    x = torch.tensor([1.0, 2.0**-24, 0.0], dtype=torch.float32)
    m = flat_metrics({"v": x, "one": torch.tensor([0.5], dtype=torch.float16), "py": 0.1})
    assert m["v"].dtype == torch.float64 and float(m["v"]) == (1.0 + 2.0**-24) / 3
    assert m["v"].shape == () and m["one"].shape == () and m["one"].dtype == torch.float16
    assert m["py"].dtype == torch.float64 and float(m["py"]) == 0.1
    two = flat_metrics({"t": torch.tensor([1.0, 3.0])})["t"]
    assert two.dtype == torch.float64 and float(two) == 2.0
    meta = flat_metrics({"x": torch.zeros(3, device="meta", dtype=torch.float16)})["x"]
    assert meta.dtype == torch.float32 and meta.device.type == "meta"
    with pytest.raises(TypeError, match=r"^metric 'a/b' is a str; metrics must be numbers"):
        flat_metrics({"a": {"b": "x"}})


def test_metric_buffer_clear_restore_order_and_bad_pending() -> None:
    """clear() drops the values and the buffer keeps working; restore() puts the saved values
    before those already added; malformed pending metrics raise ValueError naming the entry."""
    from purestep.loop._metrics import MetricBuffer

    buf = MetricBuffer()
    buf.add({"a": 1.0})
    buf.clear()
    assert not buf and buf.pop() == {}
    buf.add({"a": 4.0})
    buf.restore({"a": [(1.0).hex(), (0.1).hex()]})
    assert buf.pending() == {"a": [(1.0).hex(), (0.1).hex(), (4.0).hex()]}
    assert buf.pop() == {"a": (1.0 + 0.1 + 4.0) / 3}
    with pytest.raises(ValueError, match=r"^pending metrics: bad entry 1: \['0x1p0'\]$"):
        MetricBuffer().restore({1: ["0x1p0"]})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"^pending metrics: bad entry 'a': '0x1p0'$"):
        MetricBuffer().restore({"a": "0x1p0"})
    with pytest.raises(ValueError, match=r"^pending metrics: bad values of 'a': \['zz'\]$"):
        MetricBuffer().restore({"a": ["zz"]})


# -- data: stateful loaders, samplers, messages ------------------------------------------------


class _StatefulData:
    """Three batches a pass, ``seed * 10 + i``; the position inside a pass is in state_dict()."""

    def __init__(self, seed: int) -> None:
        self.seed, self.next_i = seed, 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while self.next_i < 3:
            self.next_i += 1
            yield {"v": torch.tensor([float(self.seed * 10 + self.next_i - 1)])}
        self.next_i = 0

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "next_i": self.next_i}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.seed, self.next_i = sd["seed"], sd["next_i"]


def test_a_stateful_loader_is_restored_from_its_state_dict(tmp_path: Path) -> None:
    """Data with state_dict()/load_state_dict() resumes from its saved state, not by skipping:
    rebuilt with another seed, the resumed run still sees the interrupted run's batches."""
    rec = _Record()
    kw: dict[str, Any] = {"checkpoint_dir": tmp_path, "save_every": 2, "sinks": [rec]}
    _run(_Toy(), _toy_state(), _StatefulData(1), num_steps=4, **kw)
    _run(_Toy(), _toy_state(), _StatefulData(7), num_steps=8, resume="latest", **kw)
    assert [m["batch"] for _, m in rec.calls] == [10, 11, 12, 10, 11, 12, 10, 11]


def test_data_with_state_dict_but_no_load_state_dict_is_resumed_by_skipping(
    tmp_path: Path,
) -> None:
    """Only data with both state_dict() and load_state_dict() is stateful; data with just one
    of them resumes by skipping batches of a fresh pass."""

    class HalfStateful:
        def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
            return iter(_toy_data(3))

        def state_dict(self) -> dict[str, int]:
            raise AssertionError("not stateful: state_dict must not be called")

    rec = _Record()
    kw: dict[str, Any] = {"checkpoint_dir": tmp_path, "save_every": 2, "sinks": [rec]}
    _run(_Toy(), _toy_state(), HalfStateful(), num_steps=4, **kw)
    _run(_Toy(), _toy_state(), HalfStateful(), num_steps=6, resume="latest", **kw)
    assert [m["batch"] for _, m in rec.calls] == [0, 1, 2, 0, 1, 2]


def test_a_loader_state_that_cannot_be_saved_fails_before_any_step_naming_the_loader() -> None:
    """A state_dict() holding something other than plain containers fails early, naming the type."""

    class OddState(_StatefulData):
        def state_dict(self) -> Any:
            return {"fn": _Toy()}

    with pytest.raises(
        TypeError, match=r"^data\.state_dict\(\) of OddState cannot be checkpointed"
    ):
        _run(_Toy(), _toy_state(), OddState(1), num_steps=2, sinks=())


def test_set_epoch_of_the_sampler_is_called_when_data_has_none() -> None:
    """data.sampler.set_epoch(n) is called before pass n when data has no set_epoch of its own."""

    class Sampler:
        def __init__(self) -> None:
            self.epochs: list[int] = []

        def set_epoch(self, n: int) -> None:
            self.epochs.append(n)

    class Data:
        sampler = Sampler()

        def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
            return iter(_toy_data(2))

    _run(_Toy(), _toy_state(), Data(), num_steps=5, sinks=())
    assert Data.sampler.epochs == [0, 1, 2]


def test_data_messages_name_the_type_the_pass_and_the_batch_counts(tmp_path: Path) -> None:
    """Non-iterable data, a one-shot iterator that runs out, and data shorter than the saved
    position fail with the type, pass and counts named."""
    with pytest.raises(TypeError, match=r"^data is a int; expected an iterable of batches$"):
        _run(_Toy(), _toy_state(), 5, num_steps=2, sinks=())
    with pytest.raises(
        ValueError,
        match=r"^data \(list_iterator\) yielded no batches in pass 1 after 3 batches in earlier "
        r"passes; the loop re-iterates data when it is exhausted, so pass a re-iterable "
        r"\(a list, a DataLoader\), not a one-shot iterator or generator$",
    ):
        _run(_Toy(), _toy_state(), iter(_toy_data(3)), num_steps=5, sinks=())
    with pytest.raises(ValueError, match=r"^data \(list\) yielded no batches$"):
        _run(_Toy(), _toy_state(), [], num_steps=5, sinks=())
    kw: dict[str, Any] = {"checkpoint_dir": tmp_path, "save_every": 2, "sinks": ()}
    _run(_Toy(), _toy_state(), _toy_data(3), num_steps=2, **kw)
    with pytest.raises(
        ValueError,
        match=r"^cannot restore the data position: pass 0 of data \(list\) has 1 batches, but "
        r"the checkpoint was saved after 2 batches of it; did the data change\?$",
    ):
        _run(_Toy(), _toy_state(), _toy_data(1), num_steps=4, resume="latest", **kw)


@settings(max_examples=15, deadline=None)
@given(names=st.lists(st.text(st.sampled_from('ab ,"/'), min_size=1, max_size=5), max_size=3))
def test_csv_metric_names_with_commas_or_quotes_read_back_as_their_columns(
    tmp_path_factory: pytest.TempPathFactory, names: list[str]
) -> None:
    """Metric names holding commas or quotes are quoted in the header: the csv module reads each
    value back under its own name, also after a second sink reopens the file."""
    path = tmp_path_factory.mktemp("csv") / "metrics.csv"
    names = list(dict.fromkeys(n for n in names if n != "step"))
    values = {n: float(i) for i, n in enumerate(names)}
    sink = loop.CSVSink(path)
    sink(1, values)
    sink.close()
    again = loop.CSVSink(path)
    again(2, {**values, "extra": 0.5})
    again.close()
    header, rows = _csv_rows(path)
    assert header == ["step", *names, "extra"]
    assert rows[0] == {"step": "1", **{n: repr(v) for n, v in values.items()}, "extra": ""}
    assert rows[1] == {"step": "2", **{n: repr(v) for n, v in values.items()}, "extra": "0.5"}


# -- progress bar ----------------------------------------------------------------------------


class _FakeBar:
    """Stands in for tqdm: records how the loop drives its progress bar."""

    made: ClassVar[list[_FakeBar]] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.updates: list[int] = []
        self.postfixes: list[tuple[dict[str, str], bool]] = []
        self.closed = False
        _FakeBar.made.append(self)

    def update(self, n: int) -> None:
        self.updates.append(n)

    def set_postfix(self, postfix: dict[str, str], refresh: bool = True) -> None:
        self.postfixes.append((postfix, refresh))

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_tqdm(monkeypatch: pytest.MonkeyPatch) -> type[_FakeBar]:
    _FakeBar.made = []
    monkeypatch.setitem(sys.modules, "tqdm.auto", types.SimpleNamespace(tqdm=_FakeBar))
    return _FakeBar


class _ManyMetrics:
    """A step reporting eight metrics m0..m7 = (step + 1) / (k + 3) (more than a bar shows)."""

    def __call__(self, state: TensorDictBase, batch: TensorDictBase) -> Any:
        s = state["step"] + 1
        metrics = {f"m{k}": s.double() / (k + 3) for k in range(8)}
        return TensorDict({"step": s, "acc": state["acc"]}, []), metrics


def test_the_progress_bar_counts_from_the_resumed_step_and_shows_each_record(
    tmp_path: Path, fake_tqdm: type[_FakeBar]
) -> None:
    """By default (progress=True) a bar labelled "train" runs from the resumed step to num_steps,
    advances by each step, shows the first six metrics of every record (4 significant digits,
    without forcing a redraw), redraws at most twice a second, follows the terminal's width,
    and is closed at the end."""
    loop.run(_ManyMetrics(), _toy_state(), _toy_data(2), num_steps=3, checkpoint_dir=tmp_path)
    fake_tqdm.made = []
    rec = _Record()
    loop.run(
        _ManyMetrics(),
        _toy_state(),
        _toy_data(2),
        num_steps=7,
        checkpoint_dir=tmp_path,
        log_every=2,
        sinks=[rec],
    )
    (bar,) = fake_tqdm.made
    assert bar.kwargs == {
        "total": 7,
        "initial": 3,
        "desc": "train",
        "dynamic_ncols": True,
        "mininterval": 0.5,
    }
    assert bar.updates == [1, 1, 1, 1]
    assert [s for s, _ in rec.calls] == [4, 6, 7]
    shown = [({f"m{k}": f"{m[f'm{k}']:.4g}" for k in range(6)}, False) for _, m in rec.calls]
    assert bar.postfixes == shown
    assert bar.closed


def test_no_progress_bar_without_progress_or_tqdm(
    fake_tqdm: type[_FakeBar], monkeypatch: pytest.MonkeyPatch
) -> None:
    """progress=False makes no bar; without tqdm installed run trains without one."""
    loop.run(_Toy(), _toy_state(), _toy_data(2), num_steps=2, progress=False, sinks=())
    assert fake_tqdm.made == []
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # import tqdm.auto raises ImportError
    out = loop.run(_Toy(), _toy_state(), _toy_data(2), num_steps=2, desc="x", sinks=())
    assert int(out["step"]) == 2


def test_an_error_in_a_sinks_start_propagates_unchanged() -> None:
    """A sink whose start() raises: that error reaches the caller, not one from the cleanup."""

    class Failing(_Record):
        def start(self, step: int) -> None:
            raise RuntimeError(f"sink cannot start at {step}")

    with pytest.raises(RuntimeError, match="sink cannot start at 0"):
        _run(_Toy(), _toy_state(), _toy_data(1), num_steps=2, sinks=[Failing()])


# -- run's contract, message by message (each message pinned whole) ----------------------------


def _never_called(state: Any, batch: Any) -> Any:
    raise AssertionError("the step must not run")


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"num_steps": None}, ValueError, "run: num_steps must be an int >= 1, got None"),
        (
            {"save_every": 0, "checkpoint_dir": "x"},
            ValueError,
            "run: save_every must be an int >= 1, got 0",
        ),
        ({"keep_last": 0}, ValueError, "run: keep_last must be an int >= 1, got 0"),
        ({"log_every": 0}, ValueError, "run: log_every must be an int >= 1, got 0"),
        (
            {"eval_every": 0, "eval_fn": dict},
            ValueError,
            "run: eval_every must be an int >= 1, got 0",
        ),
        ({"save_every": 2}, ValueError, "run: save_every needs a checkpoint_dir"),
        ({"eval_every": 2}, ValueError, "run: eval_every is set but eval_fn is None"),
        ({"step": 3}, TypeError, "run: step and eval_fn must be callables"),
        ({"eval_fn": 3}, TypeError, "run: step and eval_fn must be callables"),
        ({"state": {"step": 0}}, TypeError, "run: state is a dict; expected a TensorDict"),
        (
            {"collective_timeout": "5"},
            TypeError,
            "run: collective_timeout must be seconds or a timedelta, got '5'",
        ),
        (
            {"collective_timeout": True},
            TypeError,
            "run: collective_timeout must be seconds or a timedelta, got True",
        ),
        (
            {"collective_timeout": datetime.timedelta(0)},
            ValueError,
            "run: collective_timeout must be positive, got datetime.timedelta(0)",
        ),
        (
            {"state": TensorDict({"step": torch.tensor(0), "loop": torch.tensor(0)}, [])},
            ValueError,
            "run: the state has a top-level key 'loop', reserved for the loop",
        ),
    ],
    ids=[
        "num_steps-None",
        "save_every-0",
        "keep_last-0",
        "log_every-0",
        "eval_every-0",
        "save_every-without-dir",
        "eval_every-without-eval_fn",
        "step-not-callable",
        "eval_fn-not-callable",
        "state-a-dict",
        "timeout-a-string",
        "timeout-a-bool",
        "timeout-zero-timedelta",
        "state-with-loop-key",
    ],
)
def test_each_bad_argument_fails_before_any_step_with_its_whole_message(
    overrides: dict[str, Any], error: type[Exception], message: str
) -> None:
    """Each bad argument raises its own error type with a message naming the argument and the
    value at fault (pinned whole), before the step is called."""
    kwargs: dict[str, Any] = {"step": _never_called, "state": _toy_state(), "num_steps": 3}
    kwargs |= overrides
    with pytest.raises(error) as info:
        loop.run(data=_toy_data(1), progress=False, sinks=(), **kwargs)
    assert type(info.value) is error
    assert str(info.value) == message


def test_a_state_without_a_step_counter_is_a_key_error_saying_how_to_build_one() -> None:
    """A state without "step" raises KeyError whose message says to use init_state."""
    with pytest.raises(KeyError) as info:
        _run(_never_called, TensorDict({"acc": torch.tensor(0.0)}, []), _toy_data(1), num_steps=1)
    assert info.value.args == (
        "run: the state has no 'step' counter (build it with purestep.init_state)",
    )


def test_the_smallest_allowed_values_are_accepted(tmp_path: Path) -> None:
    """keep_last=1 keeps one checkpoint, eval_every=1 evaluates after every step, and a
    sub-second collective_timeout (seconds or timedelta) is accepted without a process group."""
    seen: list[int] = []

    def eval_fn(state: TensorDictBase) -> dict[str, Any]:
        seen.append(int(state["step"]))
        return {}

    for timeout in (0.5, datetime.timedelta(seconds=0.5)):
        seen.clear()
        out = _run(
            _Toy(),
            _toy_state(),
            _toy_data(2),
            num_steps=3,
            checkpoint_dir=tmp_path / str(timeout),
            save_every=1,
            keep_last=1,
            eval_fn=eval_fn,
            eval_every=1,
            collective_timeout=timeout,
            sinks=(),
        )
        assert int(out["step"]) == 3
        assert seen == [1, 2, 3]
        assert [p.name for p in ckpt.checkpoints(tmp_path / str(timeout))] == ["step_00000003"]


def test_keep_last_defaults_to_three_checkpoints(tmp_path: Path) -> None:
    """Without keep_last, save_every=1 over 5 steps leaves the 3 newest checkpoints."""
    _run(_Toy(), _toy_state(), _toy_data(2), num_steps=5, checkpoint_dir=tmp_path, save_every=1)
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == [f"step_0000000{i}" for i in (3, 4, 5)]


@pytest.mark.parametrize("async_save", [None, False, True])
def test_only_periodic_saves_of_async_save_are_written_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool | None
) -> None:
    """checkpoint.save gets async_=True for the periodic checkpoints with async_save=True, and
    async_=False for the last step's and for every checkpoint without it (the default)."""
    from purestep.distributed import checkpoint as dckpt

    calls: list[tuple[str, Any]] = []
    real = dckpt.save

    def spy(state: Any, path: Any, **kw: Any) -> Any:
        calls.append((Path(path).name, kw.get("async_", "absent")))
        return real(state, path, **kw)

    monkeypatch.setattr(dckpt, "save", spy)
    kw = {} if async_save is None else {"async_save": async_save}
    _run(
        _Toy(), _toy_state(), _toy_data(2), num_steps=3, checkpoint_dir=tmp_path, save_every=1, **kw
    )
    expect = [bool(async_save), bool(async_save), False]
    assert calls == [(f"step_0000000{i}", a) for i, a in zip((1, 2, 3), expect, strict=True)]


def test_a_steps_prepare_runs_first_and_its_state_is_trained() -> None:
    """step.prepare(state) runs before the first step and run trains the state it returns."""

    class Prepared(_Toy):
        def prepare(self, state: TensorDictBase) -> TensorDictBase:
            out = state.clone()
            out["acc"] = torch.tensor(100.0, dtype=torch.float64)
            return out

    out = _run(Prepared(), _toy_state(), _toy_data(3), num_steps=3, sinks=())
    assert float(out["acc"]) == 100.0 + 0 + 1 + 2


@pytest.mark.parametrize(
    ("returns", "name"),
    [("state", "TensorDict"), ("dict-state", "tuple"), ("triple", "tuple")],
)
def test_a_step_that_does_not_return_state_and_metrics_is_named(returns: str, name: str) -> None:
    """A step returning a bare state, a (dict, metrics) pair or a 3-tuple raises TypeError
    naming what it returned and what is expected."""

    def step(state: TensorDictBase, batch: TensorDictBase) -> Any:
        new, metrics = _Toy()(state, batch)
        return {
            "state": new,
            "dict-state": (dict(new.items()), metrics),
            "triple": (new, metrics, None),
        }[returns]

    with pytest.raises(TypeError) as info:
        _run(step, _toy_state(), _toy_data(1), num_steps=2, sinks=())
    assert str(info.value) == (
        f"run: the step returned {name}; expected (state, metrics) with state a TensorDict"
    )


@pytest.mark.parametrize(
    ("bad", "error", "why"),
    [
        ("oops", TypeError, "batch is str; expected a TensorDict or a dict of tensors"),
        ({"v": torch.ones(2), "w": torch.ones(3)}, ps.BatchError, None),
    ],
    ids=["a-string", "disagreeing-sizes"],
)
def test_a_bad_batch_is_named_with_its_step_and_keeps_its_error_type(
    bad: Any, error: type[Exception], why: str | None
) -> None:
    """The third batch is not a batch: run raises as_batch's error type, its message prefixed
    with the step it was for."""
    why = why or "batch entries disagree on the leading (batch) dimension: 2: v; 3: w"
    data = [*_toy_data(2), bad]
    with pytest.raises(error) as info:
        _run(_Toy(), _toy_state(), data, num_steps=4, sinks=())
    assert type(info.value) is error
    assert str(info.value) == f"run: the batch for step 2: {why}"


def _reads(lookup: str) -> Any:
    """A step over the toy state that reads its batch in the way ``lookup`` names."""

    def step(state: TensorDictBase, batch: TensorDictBase) -> Any:
        if lookup == "item":
            batch["y"]
        elif lookup == "one-tuple":
            batch[("y",)]
        elif lookup == "nested-node":
            batch["cond"]["label"]
        elif lookup == "del":
            batch.del_("y")
        elif lookup == "in-apply":
            state.apply(lambda v: v * batch["y"].sum())
        return _Toy()(state, batch)

    return step


@pytest.mark.parametrize("lookup", ["item", "one-tuple", "nested-node", "del", "in-apply"])
def test_a_missing_batch_key_is_named_with_the_step_however_it_is_looked_up(lookup: str) -> None:
    """The second batch lacks "y" (or "cond" lacks "label"): whether the step indexes the
    batch, a node of it, with a 1-tuple, deletes the key or reads it inside state.apply, the
    BatchKeyError names the key, the step (1) and the batch's keys."""
    key = "label" if lookup == "nested-node" else "y"
    full = {"v": torch.ones(1, dtype=torch.float64), "y": torch.ones(1)}
    full["cond"] = {"label": torch.ones(1)}
    short = {"v": torch.ones(1, dtype=torch.float64), "cond": {"text": torch.ones(1)}}
    with pytest.raises(loop.BatchKeyError) as info:
        _run(_reads(lookup), _toy_state(), [full, short], num_steps=3, sinks=())
    assert str(info.value) == (
        f"run: the batch for step 1 has no key {key!r}, which the step reads "
        "(batch keys: ['cond', 'v'])"
    )


def test_a_key_error_that_is_not_a_missing_batch_key_passes_through_unchanged() -> None:
    """KeyErrors from a batch method called with a function (batch.apply) or with a key the
    batch has (renaming onto a taken name) are not missing batch keys: they reach the caller
    as they were raised."""
    lookup: dict[str, int] = {}

    def apply_step(state: TensorDictBase, batch: TensorDictBase) -> Any:
        batch.apply(lambda v: v * lookup["scale"])
        return _Toy()(state, batch)

    def rename_step(state: TensorDictBase, batch: TensorDictBase) -> Any:
        batch.rename_key_(("cond", "text"), "v", safe=True)
        return _Toy()(state, batch)

    batch = {"v": torch.ones(1, dtype=torch.float64), "cond": {"text": torch.ones(1)}}
    with pytest.raises(KeyError) as info:
        _run(apply_step, _toy_state(), [batch], num_steps=1, sinks=())
    assert type(info.value) is KeyError and info.value.args == ("scale",)
    with pytest.raises(KeyError) as info:
        _run(rename_step, _toy_state(), [batch], num_steps=1, sinks=())
    assert type(info.value) is KeyError
    assert info.value.args == ("key v already present in TensorDict.",)


def test_batch_key_error_without_a_message_is_empty() -> None:
    """str(BatchKeyError()) is "" (KeyError's own str would be "''" or fail)."""
    assert str(loop.BatchKeyError()) == ""


def test_a_step_that_does_not_advance_the_counter_is_refused() -> None:
    """A step that leaves state["step"] where it was (here at step 1) raises RuntimeError
    naming the value, even if later steps would advance it."""
    calls = [0]

    def step(state: TensorDictBase, batch: TensorDictBase) -> Any:
        calls[0] += 1
        new, metrics = _Toy()(state, batch)
        if calls[0] == 2:
            new["step"] = state["step"]
        return new, metrics

    with pytest.raises(RuntimeError) as info:
        _run(step, _toy_state(), _toy_data(2), num_steps=4, sinks=())
    assert str(info.value) == "run: the step did not advance state['step'] (was 1, now 1)"


def test_resuming_at_num_steps_returns_the_state_and_past_it_is_refused(tmp_path: Path) -> None:
    """A run resumed at exactly num_steps runs no step and returns the saved state; with
    num_steps below the saved step it raises ValueError naming both."""
    done = _run(_Toy(), _toy_state(), _toy_data(2), num_steps=3, checkpoint_dir=tmp_path)
    again = _run(_never_called, _toy_state(), _toy_data(2), num_steps=3, checkpoint_dir=tmp_path)
    assert_trees_equal(again, done)
    with pytest.raises(ValueError, match=r"^run: resumed at step 3, past num_steps=2$"):
        _run(_never_called, _toy_state(), _toy_data(2), num_steps=2, checkpoint_dir=tmp_path)


def test_eval_fn_without_eval_every_runs_at_the_last_step_only() -> None:
    """eval_fn and no eval_every: it is evaluated once, on the final state."""
    seen: list[int] = []

    def eval_fn(state: TensorDictBase) -> dict[str, Any]:
        seen.append(int(state["step"]))
        return {"acc": state["acc"]}

    rec = _Record()
    _run(_Toy(), _toy_state(), _toy_data(3), num_steps=4, log_every=2, sinks=[rec], eval_fn=eval_fn)
    assert seen == [4]
    assert rec.calls[-1][1]["eval/acc"] == 0 + 1 + 2 + 0


@pytest.mark.parametrize("returned", [[1.0], 2.0, None])
def test_an_eval_fn_that_returns_no_dict_is_named(returned: Any) -> None:
    """eval_fn returning a list, a float or None raises TypeError naming the returned type."""
    with pytest.raises(TypeError) as info:
        _run(_Toy(), _toy_state(), _toy_data(1), num_steps=1, eval_fn=lambda s: returned)
    assert str(info.value) == (
        f"run: eval_fn returned {type(returned).__name__}; expected a dict of metrics"
    )


def test_preempted_without_a_checkpoint_dir_logs_the_window_at_the_stop(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SIGTERM after step 2 with log_every=5 and no checkpoint_dir: the metrics of steps 1-2
    are logged (their means) at step 2, Preempted carries the signal, and stderr says nothing
    was saved (whole line)."""
    rec = _Record()
    with pytest.raises(loop.Preempted) as info:
        _run(
            _SignalAt(2, signal.SIGTERM),
            _toy_state(),
            _toy_data(3),
            num_steps=9,
            log_every=5,
            sinks=[rec],
        )
    e = info.value
    assert (e.code, e.step, e.signum, e.checkpoint) == (143, 2, signal.SIGTERM, None)
    assert rec.calls == [(2, {"s": 0.5, "nested/sq": 0.5, "batch": 0.5})]
    assert capsys.readouterr().err == (
        "purestep.loop.run: SIGTERM received; stopped after step 2; no checkpoint_dir, so "
        "nothing was saved (Preempted.state holds the state)\n"
    )


def test_preemption_message_names_the_checkpoint_and_the_dir_to_resume_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With a checkpoint_dir, stderr is one line: the signal, the step, the checkpoint path and
    the exact arguments to resume with."""
    with pytest.raises(loop.Preempted) as info:
        _run(
            _SignalAt(3, signal.SIGINT),
            _toy_state(),
            _toy_data(3),
            num_steps=9,
            checkpoint_dir=tmp_path,
        )
    assert info.value.signum == signal.SIGINT
    path = ckpt.step_dir(tmp_path, 3)
    assert capsys.readouterr().err == (
        f"purestep.loop.run: SIGINT received; stopped after step 3; checkpoint saved to {path}. "
        f"To continue, run again with checkpoint_dir={str(tmp_path)!r} and resume='latest'\n"
    )


@settings(max_examples=10, deadline=None)
@given(at=st.integers(1, 4), save_every=st.sampled_from([None, 1, 2]), resumed=st.booleans())
@example(at=1, save_every=None, resumed=False)
@example(at=2, save_every=2, resumed=False)
@example(at=1, save_every=1, resumed=True)
def test_a_preemption_leaves_exactly_the_checkpoints_of_its_saves_and_its_step(
    tmp_path_factory: pytest.TempPathFactory, at: int, save_every: int | None, resumed: bool
) -> None:
    """Preempted after step `at` (of a fresh run, or of one resumed from step 1): the
    checkpoint of step `at` exists, written once (also when `at` is a save point, where the
    periodic save already wrote it), next to the periodic ones."""
    root = tmp_path_factory.mktemp("pre")
    first = 0
    if resumed:
        _run(_Toy(), _toy_state(), _toy_data(3), num_steps=1, checkpoint_dir=root)
        first = 1
    stop_at = first + at
    with pytest.raises(loop.Preempted) as info:
        _run(
            _SignalAt(stop_at, signal.SIGTERM),
            _toy_state(),
            _toy_data(3),
            num_steps=9,
            checkpoint_dir=root,
            save_every=save_every,
            keep_last=9,
        )
    assert info.value.checkpoint == ckpt.step_dir(root, stop_at)
    periodic = {s for s in range(first + 1, stop_at) if save_every and s % save_every == 0}
    expect = sorted(periodic | {stop_at} | ({1} if resumed else set()))
    assert [p.name for p in ckpt.checkpoints(root)] == [f"step_{s:08d}" for s in expect]


class _Closing(_Record):
    def __init__(self) -> None:
        super().__init__()
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_sinks_are_closed_once_when_run_returns_or_fails() -> None:
    """A sink's close() is called once at the end of the run, and also when the step fails."""
    ok, failed = _Closing(), _Closing()
    _run(_Toy(), _toy_state(), _toy_data(1), num_steps=2, sinks=[ok])
    assert (ok.closed, len(ok.calls)) == (1, 2)
    with pytest.raises(loop.BatchKeyError):
        _run(_reads("item"), _toy_state(), _toy_data(1), num_steps=2, sinks=[failed])
    assert failed.closed == 1


def test_a_failed_background_save_does_not_hide_the_runs_own_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With async_save, a step failing while a failed background save is in flight raises the
    step's error (the save's failure is moot then), and that checkpoint does not exist."""
    from purestep.distributed import checkpoint as dckpt

    def failing_write(*args: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(dckpt, "_write", failing_write)
    data = [*_toy_data(1), {"x": torch.ones(1)}]
    with pytest.raises(loop.BatchKeyError) as info:
        _run(
            _Toy(),
            _toy_state(),
            data,
            num_steps=3,
            checkpoint_dir=tmp_path,
            save_every=1,
            async_save=True,
        )
    assert str(info.value).startswith("run: the batch for step 1 has no key 'v'")
    assert ckpt.checkpoints(tmp_path) == []


def test_image_repr_shows_the_pixel_shape() -> None:
    """repr(Image) shows the shape of its uint8 pixels."""
    assert repr(loop.Image(torch.zeros(5, 4, 3, dtype=torch.uint8))) == "Image((5, 4, 3))"


def test_a_loader_state_is_loaded_weights_only_even_if_the_environment_allows_pickles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (torch.load's opt-out for calls that pass no
    weights_only) does not make a loader state holding an object checkpointable: it is still
    refused before any step, since loading it back could run code."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")

    class OddState(_StatefulData):
        def state_dict(self) -> Any:
            return {"fn": _Toy()}

    with pytest.raises(
        TypeError, match=r"^data\.state_dict\(\) of OddState cannot be checkpointed"
    ):
        _run(_never_called, _toy_state(), OddState(1), num_steps=2, sinks=())
