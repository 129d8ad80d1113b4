"""The "train a teacher, then distil it" recipe (issue 17): teacher params, cadence-aware schedules
and EMA, role-prefixed metrics, DMD2's regression loss and GAN head."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import purestep as ps
from _tiny import TinyNet, one_thread  # noqa: F401 (one_thread is a fixture)
from purestep import export, optim, rng, testing, value_and_grad
from purestep.methods import dmd2, finetune

pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(seed: int, b: int = 8) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict({"x0": torch.randn(b, 2, generator=g) + 1.0}, batch_size=[b])


def _opts(lr: optim.ScalarOrSchedule = 1e-2) -> dict[str, optim.Transform]:
    return {"student": optim.adam(lr=lr), "critic": optim.adam(lr=1e-2, betas=(0.0, 0.999))}


def _trained_teacher() -> tuple[TinyNet, TensorDict]:
    """A TinyNet teacher fine-tuned for a few steps; returns (its module, its EMA variables)."""
    teacher = TinyNet(seed=2)
    opt = optim.adam(lr=5e-2)
    step = finetune.make_step(teacher, opt, ema=0.5)
    state = step.prepare(finetune.init_state(teacher, opt, seed=0))
    for i in range(4):
        state, _ = step(state, _batch(i))
    return teacher, ps.variables(state, "student", ema=True)


def test_make_step_takes_roles_by_keyword_and_requires_the_teacher_params() -> None:
    """No positional None for the critic, and no silent copy of the teacher module's weights."""
    student, teacher = TinyNet(seed=1), TinyNet(seed=2)
    with pytest.raises(TypeError):
        dmd2.make_step(student, teacher, None, _opts())  # type: ignore[misc]
    with pytest.raises(TypeError, match="teacher_params"):
        dmd2.make_step(
            student=student,
            teacher=teacher,
            teacher_params=None,  # type: ignore[arg-type]
            optimizers=_opts(),
        )
    with pytest.raises(TypeError):
        dmd2.init_state(student, teacher, _opts(), seed=0)  # type: ignore[misc]


def test_train_a_teacher_then_distil_round_trip() -> None:
    """variables(state) -> load_params(module) -> module_variables / state_dict are one set of weights,
    and DMD2 computes with them (not with the module's initial weights)."""
    teacher, teacher_vars = _trained_teacher()
    init = export.module_variables(teacher)  # training never touched the module
    assert not torch.equal(init["out", "weight"], teacher_vars["out", "weight"])
    export.load_params(teacher, teacher_vars)
    testing.assert_trees_equal(export.module_variables(teacher), teacher_vars)
    fresh = TinyNet(seed=7)
    fresh.load_state_dict(teacher.state_dict())
    testing.assert_trees_equal(export.module_variables(fresh), teacher_vars)

    student = TinyNet(seed=1)
    opts = _opts()
    state = dmd2.init_state(student=student, critic=TinyNet(seed=4), optimizers=opts, seed=0)
    batch = _batch(10)

    def student_loss(tp: TensorDict) -> torch.Tensor:
        f = dmd2.loss_fn(student=student, teacher=TinyNet(seed=9), teacher_params=tp)
        _, metrics = value_and_grad(f)(state["params"], batch, rng.key(0), roles=["student"])
        return metrics["student", "loss"]

    assert torch.equal(student_loss(teacher_vars), student_loss(export.module_variables(teacher)))
    assert not torch.equal(student_loss(teacher_vars), student_loss(init))


def test_state_dict_export_loads_strictly_into_the_module() -> None:
    """export.state_dict(state, role, module=) has exactly module.state_dict()'s keys (frozen
    params from the module, BatchNorm buffers and their EMA from the state)."""
    net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    net[2].requires_grad_(False)  # frozen: not state
    opt = {"student": optim.sgd(0.1)}

    def loss(p: TensorDict, b: TensorDict, k: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return ps.call(net, p["student"], b["x"]).square().mean(), {}

    step = ps.with_ema(ps.train_step(ps.value_and_grad(loss), opt), 0.5, ["student"], buffers=True)
    state = step.prepare(ps.init_state({"student": net}, opt, seed=0))
    for i in range(3):
        state, _ = step(state, {"x": torch.randn(4, 2, generator=torch.Generator().manual_seed(i))})
    for ema in (False, True):
        sd = export.state_dict(state, "student", ema=ema, module=net)
        assert sorted(sd) == sorted(net.state_dict())
        target = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
        target.load_state_dict(sd)  # strict
        testing.assert_trees_equal(
            export.module_variables(target)["1"],
            ps.variables(state, "student", ema=ema)["1"],
        )
        assert torch.equal(target[2].weight, net[2].weight)
    with pytest.raises(KeyError, match="does not have"):
        export.state_dict(state, "student", module=nn.Linear(2, 3))
    with pytest.raises(KeyError, match=r"trainable parameters \['0.weight'"):
        export.load_params(target, {"0.bias": torch.zeros(3)})


def test_in_steps_sizes_the_students_schedule_in_method_steps() -> None:
    """With every=3, in_steps(linear(1, 0, 9), every=3) gives the student lr linear(step) at each
    of its updates (steps 0, 3, 6), where the plain schedule would still be at linear(count)."""
    student, teacher = TinyNet(seed=1), TinyNet(seed=2)
    sched = optim.schedules.linear(1e-2, 0.0, 9)
    opts = _opts(optim.schedules.in_steps(sched, every=3))
    step = dmd2.make_step(
        student=student,
        teacher=teacher,
        teacher_params=export.module_variables(teacher),
        optimizers=opts,
        config=dmd2.DMD2Config(generator_update_interval=3),
    )
    state = dmd2.init_state(student=student, critic=teacher, optimizers=opts, seed=0)
    lrs = {}
    for s in range(9):
        state, m = step(state, _batch(s))
        if ("student", "lr") in m.keys(True):
            lrs[s] = float(m["student", "lr"])
    assert lrs == pytest.approx({0: sched(0), 3: sched(3), 6: sched(6)})
    with pytest.raises(ValueError, match="every"):
        optim.schedules.in_steps(sched, every=0)


def _ema_run(
    on_update: bool | None, start: int = 0
) -> tuple[list[TensorDict], list[TensorDict], TensorDict]:
    student, teacher = TinyNet(seed=1), TinyNet(seed=2)
    opts = _opts()
    step = dmd2.make_step(
        student=student,
        teacher=teacher,
        teacher_params=export.module_variables(teacher),
        optimizers=opts,
        config=dmd2.DMD2Config(generator_update_interval=3),
        ema=0.5,
        ema_start_step=start,
        ema_on_update=on_update,
    )
    state = step.prepare(dmd2.init_state(student=student, critic=teacher, optimizers=opts, seed=0))
    params, emas = [], []
    for s in range(7):
        state, _ = step(state, _batch(s))
        params.append(state["params", "student"].clone())
        emas.append(state["ema", "student"].clone())
    return params, emas, state


@pytest.mark.parametrize("on_update", [None, True])
def test_ema_moves_only_on_the_students_updates(on_update: bool | None) -> None:
    """With every=3 (default on_update) the EMA changes at steps 0, 3, 6 only, by one lerp each:
    the decay is per student update, not decay**3."""
    params, emas, _ = _ema_run(on_update)
    expected = params[0].clone()
    expected = expected.apply(lambda p: p)  # at step 0 the EMA starts from the initial params
    for s in range(1, 7):
        if s % 3 == 0:
            expected = expected.apply(lambda e, p: torch.lerp(e, p, 0.5), params[s])
        else:
            assert torch.equal(params[s]["out", "weight"], params[s - 1]["out", "weight"])
        testing.assert_trees_equal(emas[s], expected)


def test_ema_on_every_step_is_decay_to_the_power_of_the_interval() -> None:
    """ema_on_update=False lerps on every step: N lerps towards unchanged params, ~decay**N."""
    params_u, emas_u, _ = _ema_run(None)
    params_e, emas_e, _ = _ema_run(False)
    testing.assert_trees_equal(params_u[-1], params_e[-1])
    assert not torch.equal(emas_u[-1]["out", "weight"], emas_e[-1]["out", "weight"])


def test_ema_start_step_copies_until_then() -> None:
    """Before ema_start_step the EMA is a copy of the params."""
    params, emas, _ = _ema_run(None, start=4)
    for s in (0, 3):
        testing.assert_trees_equal(emas[s], params[s])
    assert not torch.equal(emas[6]["out", "weight"], params[6]["out", "weight"])


def test_method_metrics_carry_the_role() -> None:
    """x0_sq, dmd_g_abs (dmd2) and t_mean (finetune) are under their role's key."""
    student, teacher = TinyNet(seed=1), TinyNet(seed=2)
    opts = _opts()
    step = dmd2.make_step(
        student=student,
        teacher=teacher,
        teacher_params=export.module_variables(teacher),
        optimizers=opts,
        config=dmd2.DMD2Config(generator_update_interval=1),
    )
    state = dmd2.init_state(student=student, critic=teacher, optimizers=opts, seed=0)
    _, m = step(state, _batch(0))
    for key in (("student", "x0_sq"), ("student", "dmd_g_abs"), ("critic", "loss")):
        assert key in m.keys(True), key
    assert "x0_sq" not in m.keys() and "dmd_g_abs" not in m.keys()
    opt = optim.sgd(0.1)
    _, m = finetune.make_step(student, opt)(finetune.init_state(student, opt, seed=0), _batch(0))
    assert ("student", "t_mean") in m.keys(True) and "t_mean" not in m.keys()


# --------------------------------------------------------------------------- regression, GAN


def _reg_batch(seed: int, b: int = 8) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    out = _batch(seed, b)
    out["reg_noise"] = torch.randn(b, 2, generator=g)
    out["reg_x0"] = torch.randn(b, 2, generator=g)
    return out


def test_regression_loss_adds_the_paired_mse_to_the_students_gradient() -> None:
    """With critic == teacher the DMD gradient is 0, so the student's gradient is exactly
    regression_weight * grad mse(z - v(z, 1), x0_teacher)."""
    student, teacher = TinyNet(seed=1), TinyNet(seed=2)
    tp = export.module_variables(teacher)
    cfg = dmd2.DMD2Config(regression_weight=0.7)
    params = TensorDict({"student": ps.params_of("s", student), "critic": tp.clone()}, [])
    batch = _reg_batch(0)
    f = dmd2.loss_fn(student=student, teacher=teacher, teacher_params=tp, config=cfg)
    grads, metrics = value_and_grad(f)(params, batch, rng.key(0), roles=["student"])

    def reg_only(p: TensorDict, b: TensorDict, k: torch.Tensor) -> tuple[torch.Tensor, dict]:
        z = b["reg_noise"]
        x0 = z - ps.call(student, p["student"], z, torch.ones(z.shape[0]))
        return 0.7 * (x0 - b["reg_x0"]).square().mean(), {}

    want, _ = value_and_grad(reg_only)(params, batch, rng.key(0), roles=["student"])
    for a, b in zip(
        grads["student"].values(True, True), want["student"].values(True, True), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert float(metrics["student", "regression"]) > 0
    with pytest.raises(KeyError, match="reg_noise"):
        value_and_grad(f)(params, _batch(0), rng.key(0), roles=["student"])
    with pytest.raises(ValueError, match="student_steps"):
        dmd2.DMD2Config(regression_weight=1.0, student_steps=(0.8,), rollout="data")


def _gan_setup(
    opts_lr: float = 1e-2,
) -> tuple[object, TensorDict, list[TensorDict], dict[str, optim.Transform]]:
    student, teacher = TinyNet(seed=1), TinyNet(seed=2)
    head = nn.Linear(8, 1)
    cfg = dmd2.DMD2Config(
        generator_update_interval=2,
        gan=dmd2.GANConfig(feature_layer="inp", student_weight=0.1, critic_weight=1.0),
    )
    opts = {**_opts(), "gan_head": optim.adam(lr=opts_lr)}

    def make(k: int = 1, donate: bool = False) -> object:
        return dmd2.make_step(
            student=student,
            teacher=teacher,
            teacher_params=export.module_variables(teacher),
            gan_head=head,
            optimizers=opts,
            config=cfg,
            accumulate=k,
            donate=donate,
        )

    state = dmd2.init_state(student=student, critic=teacher, gan_head=head, optimizers=opts, seed=0)
    return make, state, [_batch(i) for i in range(3)], opts


def test_gan_head_step_keeps_the_step_properties() -> None:
    """With the GAN head: pure, deterministic, donation-safe and accumulation-invariant; the head
    is a role of its own that updates with the critic."""
    make, state, batches, _ = _gan_setup()
    step = make()
    testing.assert_pure(step, state, batches[0])
    testing.assert_deterministic(step, state, batches)
    testing.assert_donation_safe(lambda d: make(donate=d), state, batches)
    testing.assert_accumulation_invariant(lambda k: make(k), state, batches, ks=(1, 2))
    testing.assert_cadence(step, state, batches * 2, "gan_head", 1)
    _, m = step(state, batches[0])
    for key in (("gan_head", "real_logit"), ("gan_head", "loss"), ("student", "gan_loss")):
        assert key in m.keys(True), key


def test_gan_head_learns_to_tell_real_from_student_samples() -> None:
    """Training the critic and head on fixed data separates the real and fake logits."""
    make, state, batches, _ = _gan_setup(opts_lr=5e-2)
    step = make()
    first = None
    for i in range(30):
        state, m = step(state, batches[i % 3])
        gap = float(m["gan_head", "real_logit"] - m["gan_head", "fake_logit"])
        first = gap if first is None else first
    assert gap > first + 0.5, (first, gap)


def test_gan_config_needs_its_head() -> None:
    """DMD2Config(gan=...) without gan_head (or the reverse) is refused; a bad layer is named."""
    student, teacher = TinyNet(seed=1), TinyNet(seed=2)
    tp = export.module_variables(teacher)
    cfg = dmd2.DMD2Config(gan=dmd2.GANConfig(feature_layer="nope"))
    with pytest.raises(ValueError, match="gan_head"):
        dmd2.loss_fn(student=student, teacher=teacher, teacher_params=tp, config=cfg)
    f = dmd2.loss_fn(
        student=student, teacher=teacher, teacher_params=tp, config=cfg, gan_head=nn.Linear(8, 1)
    )
    params = TensorDict(
        {
            "student": ps.params_of("s", student),
            "critic": tp.clone(),
            "gan_head": ps.params_of("h", nn.Linear(8, 1)),
        },
        [],
    )
    with pytest.raises(KeyError, match="nope"):
        f(params, _batch(0), rng.key(0))


def test_the_documented_recipe_runs_as_written(tmp_path: Path) -> None:
    """docs/methods.md's recipe at toy size: teacher with EMA through loop.run, DMD2 from its EMA
    weights with in_steps schedules and an EMA from a start step, resume, a partial load of the
    EMA student from the checkpoint, and its export into the module."""
    from purestep import checkpoint, loop

    g = torch.Generator().manual_seed(0)
    data = [
        TensorDict(
            {"x0": torch.randn(8, 2, generator=g), "label": torch.randint(0, 3, (8,), generator=g)},
            [8],
        )
        for _ in range(4)
    ]
    teacher, student = TinyNet(classes=3, seed=1), TinyNet(classes=3, seed=2)
    t_opt = optim.adamw(lr=1e-2)
    t_step = finetune.make_step(
        teacher, t_opt, finetune.FinetuneConfig(cond_keys=("label",)), donate=True, ema=0.9
    )
    t_state = loop.run(
        t_step,
        finetune.init_state(teacher, t_opt, seed=0),
        data,
        num_steps=6,
        checkpoint_dir=tmp_path / "teacher",
        resume="latest",
        progress=False,
    )
    teacher_vars = ps.variables(t_state, "student", ema=True)
    n, every = 9, 3
    lr = optim.schedules.in_steps(optim.schedules.cosine_decay(5e-3, n), every=every)
    opts = {
        "student": optim.adam(lr, betas=(0.0, 0.999)),
        "critic": optim.adam(1e-2, betas=(0.0, 0.999)),
    }
    cfg = dmd2.DMD2Config(
        generator_update_interval=every, cond_keys=("label",), null_cond={"label": 3}
    )
    step = dmd2.make_step(
        student=student,
        teacher=teacher,
        teacher_params=teacher_vars,
        optimizers=opts,
        config=cfg,
        donate=True,
        ema=0.9,
        ema_start_step=3,
    )

    def init() -> TensorDict:
        return dmd2.init_state(student=teacher_vars, critic=teacher_vars, optimizers=opts, seed=0)

    kw: dict[str, Any] = {"checkpoint_dir": tmp_path / "dmd2", "save_every": 3, "progress": False}
    loop.run(step, init(), data, num_steps=6, resume="latest", **kw)  # a first job stops at 6
    state = loop.run(step, init(), data, num_steps=n, resume="latest", **kw)  # the next resumes
    again = loop.run(step, init(), data, num_steps=n, checkpoint_dir=tmp_path / "b", progress=False)
    testing.assert_trees_equal(state, again)
    ema = checkpoint.load(checkpoint.step_dir(tmp_path / "dmd2", n), keys=["ema.student"])
    testing.assert_trees_equal(ema["ema", "student"], state["ema", "student"])
    export.load_params(student, ema["ema", "student"])
    testing.assert_trees_equal(export.module_variables(student), state["ema", "student"])
