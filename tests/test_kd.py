"""Trajectory distillation (``purestep.methods.kd``): the trajectory cache and step properties."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from _tiny import TinyNet, one_thread  # noqa: F401 (one_thread is a fixture)
from purestep import optim, rng, testing
from purestep.methods import flow, kd

pytestmark = pytest.mark.usefixtures("one_thread")


STEPS = (1.0, 0.5, 0.25)


def _generate(path: Path, **kw: object) -> Path:
    args: dict[str, object] = {
        "num_samples": 10,
        "sample_shape": (2,),
        "student_steps": STEPS,
        "teacher_steps": 6,
        "key": rng.key(7),
        "chunk_size": 4,
    }
    args.update(kw)
    return kd.generate_trajectories(TinyNet(seed=3), path, **args)  # type: ignore[arg-type]


def _files(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


def test_interrupted_generation_resumes_to_identical_files(tmp_path: Path) -> None:
    """Stopping after one chunk (and leaving a stale temp file), then resuming, gives the same bytes."""
    full = _generate(tmp_path / "full")
    part = tmp_path / "part"
    _generate(part, max_chunks=1)
    assert sorted(f.name for f in part.iterdir()) == ["chunk_000000.pt", "meta.json"]
    (part / ".chunk_000001.pt.tmp-4242").write_bytes(b"half-written")  # a crash mid-write
    with pytest.raises(FileNotFoundError, match="chunk_000001"):
        kd.load_trajectories(part)
    _generate(part, max_chunks=1)
    _generate(part)
    assert _files(part) == _files(full)
    testing.assert_trees_equal(kd.load_trajectories(part), kd.load_trajectories(full))


def test_trajectories_match_the_teacher_sampler(tmp_path: Path) -> None:
    """Recorded states are the teacher's Euler states: x_1 is the noise, x0 the ODE's end."""
    teacher = TinyNet(seed=3)
    _generate(tmp_path)
    data = kd.load_trajectories(tmp_path)
    assert data.batch_size == (10 * len(STEPS),)
    assert data["t"][: len(STEPS)].tolist() == list(STEPS)
    idx = torch.arange(10)
    noise = rng.normal(flow.purpose_key(rng.key(7), flow.Purpose.NOISE), (10, 2), index=idx)
    x_t = data["x_t"].reshape(10, len(STEPS), 2)
    assert torch.equal(x_t[:, 0], noise)
    schedule = kd.teacher_schedule(6, STEPS)
    x0, traj = flow.sample(teacher, None, noise, schedule, return_trajectory=True)
    torch.testing.assert_close(data["x0"].reshape(10, len(STEPS), 2)[:, 0], x0)
    torch.testing.assert_close(x_t[:, 2], traj[schedule.index(0.25)])


def test_teacher_schedule_contains_the_student_steps() -> None:
    """The merged schedule is strictly decreasing from 1 to 0 and contains every student step."""
    s = kd.teacher_schedule(5, (1.0, 0.7, 0.35))
    assert s[0] == 1.0 and s[-1] == 0.0
    assert all(b < a for a, b in itertools.pairwise(s))
    for t in (0.7, 0.35, 0.6, 0.4, 0.2):
        assert any(abs(t - v) < 1e-12 for v in s)


def test_resume_with_other_settings_is_refused(tmp_path: Path) -> None:
    """A cache generated with other settings is not silently mixed: the error names the field."""
    _generate(tmp_path, max_chunks=1)
    with pytest.raises(ValueError, match="chunk_size"):
        _generate(tmp_path, chunk_size=5)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["num_samples"] == 10


def test_conditional_cache_stores_the_condition(tmp_path: Path) -> None:
    """With a condition (and CFG) the labels are stored and repeated per student step."""
    teacher = TinyNet(classes=3, seed=1)
    labels = torch.tensor([0, 1, 2, 0, 1])
    kd.generate_trajectories(
        teacher,
        tmp_path,
        num_samples=5,
        sample_shape=(2,),
        student_steps=(1.0, 0.5),
        teacher_steps=4,
        key=rng.key(0),
        chunk_size=2,
        cond={"label": labels},
        null_cond={"label": 3},
        guidance_scale=2.0,
    )
    data = kd.load_trajectories(tmp_path)
    assert data["label"].tolist() == labels.repeat_interleave(2).tolist()


def _rows(tmp_path: Path) -> TensorDict:
    _generate(tmp_path)
    return kd.load_trajectories(tmp_path)


def test_kd_step_is_pure_deterministic_and_donation_safe(tmp_path: Path) -> None:
    """The step leaves inputs untouched, repeats bitwise, and donate=True equals donate=False."""
    data = _rows(tmp_path)
    student, opt = TinyNet(seed=5), optim.adam(lr=1e-2)
    state = kd.init_state(student, opt, seed=0)
    batches = [data[:8], data[8:16]]
    step = kd.make_step(student, opt)
    testing.assert_pure(step, state, batches[0])
    testing.assert_deterministic(step, state, batches)
    testing.assert_donation_safe(
        lambda d: kd.make_step(student, opt, donate=d, ema=0.9), state, batches
    )


def test_kd_is_accumulation_invariant(tmp_path: Path) -> None:
    """accumulate(k) for k = 1, 2, 4 gives the same states and metrics."""
    data = _rows(tmp_path)
    student, opt = TinyNet(seed=5), optim.sgd(lr=0.1, momentum=0.9)
    state = kd.init_state(student, opt, seed=0)
    testing.assert_accumulation_invariant(
        lambda k: kd.make_step(student, opt, accumulate=k), state, [data[:8], data[8:16]]
    )


def test_kd_loss_is_half_mse_of_the_implied_x0(tmp_path: Path) -> None:
    """The loss is 0.5 * mse(x_t - t v, x0): zero for a student that predicts the targets exactly."""
    data = _rows(tmp_path)[:6]
    student = TinyNet(seed=5)
    params = TensorDict({"student": flow.frozen_params(student)}, [])
    loss, _ = kd.loss_fn(student)(params, data, rng.key(0))
    v = student(data["x_t"], data["t"])
    ref = 0.5 * ((data["x_t"] - data["t"][:, None] * v - data["x0"]) ** 2).mean()
    torch.testing.assert_close(loss, ref)


def test_batches_visit_every_row_once_per_epoch() -> None:
    """Each epoch is a permutation of the rows; the stream is a pure function of the key."""
    data = TensorDict({"x": torch.arange(12.0)}, [12])
    it = kd.batches(data, 4, key=rng.key(3))
    epoch = [next(it) for _ in range(3)]
    assert sorted(torch.cat([b["x"] for b in epoch]).tolist()) == list(range(12))
    assert torch.cat([b["index"] for b in epoch]).tolist() == list(range(12))
    again = kd.batches(data, 4, key=rng.key(3))
    for b in epoch:
        assert torch.equal(next(again)["x"], b["x"])


def test_batches_draw_order_and_ids_on_the_data_device() -> None:
    """kd.batches of data on a device (meta standing in for CUDA) keeps order and ids there."""
    data = TensorDict({"x": torch.zeros(6, 2, device="meta")}, [6], device="meta")
    batch = next(kd.batches(data, 3, key=rng.key(0)))
    assert batch["x"].device.type == "meta"
    assert batch["index"].device.type == "meta"
