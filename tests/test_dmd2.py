"""DMD2 (``purestep.methods.dmd2``): step properties, cadence and the direction of the student's gradient."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from _tiny import TinyNet, one_thread  # noqa: F401 (one_thread is a fixture)
from purestep import optim, rng, testing, value_and_grad
from purestep.export import module_variables
from purestep.methods import dmd2, flow

pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(seed: int, b: int = 8, classes: int | None = None) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    out = {"x0": torch.randn(b, 2, generator=g)}
    if classes is not None:
        out["label"] = torch.randint(0, classes, (b,), generator=g)
    return TensorDict(out, batch_size=[b])


CONFIGS = {
    "one_step": dmd2.DMD2Config(generator_update_interval=2),
    "simulate_3step": dmd2.DMD2Config(
        student_steps=(1.0, 0.6, 0.3),
        generator_update_interval=2,
        score_timesteps=flow.TimestepDist(low=0.1, high=0.9, shift=2.0),
    ),
    "data_2step_cfg": dmd2.DMD2Config(
        student_steps=(0.9, 0.4),
        rollout="data",
        guidance_scale=3.0,
        cond_keys=("label",),
        null_cond={"label": 3},
        generator_update_interval=2,
    ),
}


def _setup(
    name: str, opts: dict[str, optim.Transform]
) -> tuple[TinyNet, TinyNet, dmd2.DMD2Config, TensorDict, list[TensorDict]]:
    classes = 3 if name == "data_2step_cfg" else None
    student, teacher = TinyNet(classes=classes, seed=1), TinyNet(classes=classes, seed=2)
    state = dmd2.init_state(student=student, critic=teacher, optimizers=opts, seed=3)
    # a critic that differs from the teacher, so the student's gradient is non-zero
    state["params", "critic"] = flow.frozen_params(TinyNet(classes=classes, seed=4))
    batches = [_batch(20 + i, classes=classes) for i in range(3)]
    return student, teacher, CONFIGS[name], state, batches


def _adam_opts() -> dict[str, optim.Transform]:
    return {"student": optim.adam(lr=1e-2), "critic": optim.adam(lr=1e-2, betas=(0.0, 0.999))}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_dmd2_step_is_pure_deterministic_and_donation_safe(name: str) -> None:
    """The step leaves inputs untouched, repeats bitwise, and donate=True equals donate=False."""
    opts = _adam_opts()
    student, teacher, cfg, state, batches = _setup(name, opts)
    step = dmd2.make_step(
        student=student,
        teacher=teacher,
        teacher_params=module_variables(teacher),
        optimizers=opts,
        config=cfg,
    )
    testing.assert_pure(step, state, batches[0])
    testing.assert_deterministic(step, state, batches)
    testing.assert_donation_safe(
        lambda d: dmd2.make_step(
            student=student,
            teacher=teacher,
            teacher_params=module_variables(teacher),
            optimizers=opts,
            config=cfg,
            donate=d,
            ema=0.9,
        ),
        state,
        batches,
    )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_dmd2_is_accumulation_invariant(name: str) -> None:
    """accumulate(k) for k = 1, 2, 4 gives the same states and metrics over student and critic steps."""
    opts = {"student": optim.sgd(lr=0.1), "critic": optim.sgd(lr=0.1, momentum=0.5)}
    student, teacher, cfg, state, batches = _setup(name, opts)
    testing.assert_accumulation_invariant(
        lambda k: dmd2.make_step(
            student=student,
            teacher=teacher,
            teacher_params=module_variables(teacher),
            optimizers=opts,
            config=cfg,
            accumulate=k,
        ),
        state,
        batches,
        ks=(1, 2, 4),
    )


@pytest.mark.parametrize("interval", [1, 3])
def test_student_updates_every_n_steps_and_critic_every_step(interval: int) -> None:
    """The student changes only on multiples of generator_update_interval, the critic on every step."""
    opts = _adam_opts()
    student, teacher, _, state, batches = _setup("one_step", opts)
    cfg = dmd2.DMD2Config(generator_update_interval=interval)
    step = dmd2.make_step(
        student=student,
        teacher=teacher,
        teacher_params=module_variables(teacher),
        optimizers=opts,
        config=cfg,
    )
    seq = batches * 2
    testing.assert_cadence(step, state, seq, "student", interval)
    testing.assert_cadence(step, state, seq, "critic", 1)


def test_student_work_is_skipped_when_not_live() -> None:
    """On a critic-only step the loss has no student term and no student metrics."""
    opts = _adam_opts()
    student, teacher, cfg, state, batches = _setup("one_step", opts)
    grad_fn = value_and_grad(
        dmd2.loss_fn(
            student=student, teacher=teacher, teacher_params=module_variables(teacher), config=cfg
        )
    )
    grads, metrics = grad_fn(state["params"], batches[0], rng.key(0), roles=["critic"])
    assert list(grads.keys()) == ["critic"]
    assert ("student", "dmd_g_abs") not in metrics.keys(True)
    assert ("student", "loss") not in metrics.keys(True)
    grads, metrics = grad_fn(state["params"], batches[0], rng.key(0), roles=["student", "critic"])
    assert set(grads.keys()) == {"student", "critic"}
    assert ("student", "dmd_g_abs") in metrics.keys(True)


@pytest.mark.parametrize("rollout", ["simulate", "data"])
def test_student_gradient_vanishes_when_critic_equals_teacher(rollout: str) -> None:
    """With critic == teacher and guidance 1, g == 0: zero student loss and gradient."""
    opts = _adam_opts()
    student, teacher = TinyNet(seed=1), TinyNet(seed=2)
    state = dmd2.init_state(
        student=student, critic=teacher, optimizers=opts, seed=0
    )  # critic starts as the teacher
    cfg = dmd2.DMD2Config(student_steps=(1.0, 0.5), rollout=rollout)  # type: ignore[arg-type]
    grad_fn = value_and_grad(
        dmd2.loss_fn(
            student=student, teacher=teacher, teacher_params=module_variables(teacher), config=cfg
        )
    )
    grads, metrics = grad_fn(state["params"], _batch(0), rng.key(0), roles=["student"])
    assert float(metrics["student", "loss"]) == 0.0
    for g in grads["student"].values(True, True):
        assert torch.equal(g, torch.zeros_like(g))


class _PointMass(nn.Module):
    """The exact velocity of a point mass at ``a``: v = (x - a) / t, so x0 = a."""

    def __init__(self, a: torch.Tensor) -> None:
        super().__init__()
        self.a = nn.Parameter(a.clone())

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return (x - self.a) / t[:, None]


def test_student_gradient_points_from_fake_towards_real() -> None:
    """Teacher x0 = a, critic x0 = b, student x0 = c: descending the loss moves c along a - b."""
    a, b, c = torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 0.5]), torch.tensor([0.2, 0.3])
    teacher, student = _PointMass(a), _PointMass(c)
    params = TensorDict(
        {"student": flow.frozen_params(student), "critic": flow.frozen_params(_PointMass(b))}, []
    )
    grad_fn = value_and_grad(
        dmd2.loss_fn(
            student=student,
            teacher=teacher,
            teacher_params=module_variables(teacher),
            config=dmd2.DMD2Config(),
        )
    )
    grads, _ = grad_fn(params, _batch(0), rng.key(0), roles=["student"])
    step_dir = -grads["student", "a"]
    cos = torch.dot(step_dir, a - b) / (step_dir.norm() * (a - b).norm())
    assert float(cos) > 0.999


def test_init_state_copies_the_teacher_into_the_critic() -> None:
    """The critic starts as an independent copy of the teacher's params; the teacher is not state."""
    opts = _adam_opts()
    student, teacher = TinyNet(seed=1), TinyNet(seed=2)
    state = dmd2.init_state(student=student, critic=teacher, optimizers=opts, seed=0)
    assert set(state["params"].keys()) == {"student", "critic"}
    testing.assert_trees_equal(state["params", "critic"], flow.frozen_params(teacher))
    state["params", "critic", "out", "bias"].add_(1.0)
    assert not torch.equal(teacher.out.bias.detach(), state["params", "critic", "out", "bias"])


def test_teacher_module_is_unchanged_by_training() -> None:
    """Training the critic (which runs on the teacher's module) leaves the teacher's weights intact."""
    opts = _adam_opts()
    student, teacher, cfg, state, batches = _setup("one_step", opts)
    before = flow.frozen_params(teacher)
    step = dmd2.make_step(
        student=student,
        teacher=teacher,
        teacher_params=module_variables(teacher),
        optimizers=opts,
        config=cfg,
        donate=True,
    )
    for b in batches:
        state, _ = step(state, b)
    testing.assert_trees_equal(flow.frozen_params(teacher), before)


def test_config_validation_names_the_field() -> None:
    """Bad hyperparameters fail at construction with the field's name."""
    with pytest.raises(ValueError, match="student_steps"):
        dmd2.DMD2Config(student_steps=(0.5,))  # simulate must start at 1.0
    with pytest.raises(ValueError, match="student_steps"):
        dmd2.DMD2Config(student_steps=(1.0, 1.0))
    with pytest.raises(ValueError, match="generator_update_interval"):
        dmd2.DMD2Config(generator_update_interval=0)
    with pytest.raises(ValueError, match="null_cond"):
        dmd2.DMD2Config(cond_keys=("label",), guidance_scale=2.0)
    with pytest.raises(KeyError, match="critic"):
        dmd2.make_step(
            student=TinyNet(),
            teacher=TinyNet(),
            teacher_params=module_variables(TinyNet()),
            optimizers={"student": optim.sgd(lr=0.1)},
        )
