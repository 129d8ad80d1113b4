"""Properties of DiffusionNFT-style RL (``purestep.methods.nft``)."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, TensorDictBase
from torch import nn

import purestep as ps
from purestep import optim, rng, testing, tree
from purestep.methods import flow, nft

FAST = settings(max_examples=20, deadline=None)


class VelocityNet(nn.Module):
    """A tiny conditional velocity model ``v(x_t, t, label)``."""

    def __init__(self, dim: int = 2, hidden: int = 16, seed: int = 0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim + 2, hidden), nn.Tanh(), nn.Linear(hidden, dim))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor, t: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, t[:, None], label[:, None].to(x.dtype)], dim=1))


def _reward(x0: torch.Tensor, prompt: TensorDictBase) -> torch.Tensor:
    """Higher for samples whose first coordinate matches the sign of the label (+-1)."""
    return torch.sigmoid(2.0 * x0[:, 0] * prompt["label"].to(x0.dtype))


def _prompts(p: int = 2, start: int = 0) -> TensorDict:
    labels = torch.tensor([1.0, -1.0]).repeat(p)[:p]
    return TensorDict({"label": labels, "index": torch.arange(start, start + p)}, [p])


def _make(
    net: nn.Module,
    *,
    donate: bool = False,
    k: int = 1,
    decay: nft.DecayLike = 0.3,
    opt: optim.Transform | None = None,
) -> nft.NFTStep:
    return nft.make_step(
        net,
        _reward,
        opt or optim.adamw(1e-2),
        reference_params=ps.params_of("reference", net),
        sample_shape=(2,),
        config=nft.NFTConfig(beta=0.7, kl_weight=0.1, cond_keys=("label",)),
        group_size=4,
        sample_steps=3,
        inner_epochs=2,
        minibatch_size=4,
        accumulate=k,
        decay=decay,
        donate=donate,
    )


def _state(net: nn.Module, opt: optim.Transform | None = None) -> TensorDict:
    return nft.init_state(net, opt or optim.adamw(1e-2), seed=3)


# --- advantages ----------------------------------------------------------------------------


@FAST
@given(
    rewards=st.lists(
        st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=6),
        min_size=1,
        max_size=4,
    ).filter(lambda rows: len({len(r) for r in rows}) == 1)
)
def test_advantages_are_group_mean_over_population_std_plus_1e4(
    rewards: list[list[float]],
) -> None:
    """adv[p, g] == (r[p, g] - mean_p) / (pstdev_p + 1e-4), computed independently in Python."""
    r = torch.tensor(rewards, dtype=torch.float64)
    adv = nft.advantages(r)
    for p, row in enumerate(rewards):
        mean = math.fsum(row) / len(row)
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in row) / len(row))
        for g, x in enumerate(row):
            expected = (x - mean) / (std + 1e-4)
            assert math.isclose(float(adv[p, g]), expected, rel_tol=1e-9, abs_tol=1e-9)
    flat = nft.advantages(r.reshape(-1), group_size=r.shape[1])
    assert torch.equal(flat, adv.reshape(-1))


def test_advantages_of_a_constant_group_are_exactly_zero() -> None:
    """A group whose rewards are all equal has zero advantage (std 0, numerator 0)."""
    adv = nft.advantages(torch.tensor([[0.3, 0.3, 0.3], [1.0, 2.0, 3.0]]))
    assert torch.equal(adv[0], torch.zeros(3))
    assert bool((adv[1, 0] < 0) & (adv[1, 2] > 0))


def test_advantages_reject_a_group_size_that_does_not_divide() -> None:
    """A 1-D reward vector needs a group_size that divides its length."""
    with pytest.raises(ValueError, match="group_size"):
        nft.advantages(torch.ones(5), group_size=2)


@given(adv=st.floats(-100, 100), clip=st.floats(0.1, 10))
@FAST
def test_optimality_weight_is_clipped_affine_map_into_unit_interval(
    adv: float, clip: float
) -> None:
    """rho = clip(adv, -c, c) / 2c + 1/2: in [0, 1], 1/2 at 0, 0 and 1 beyond the clip."""
    rho = float(nft.optimality_weight(torch.tensor(adv, dtype=torch.float64), clip))
    assert 0.0 <= rho <= 1.0
    expected = min(max(adv, -clip), clip) / (2 * clip) + 0.5
    assert math.isclose(rho, expected, abs_tol=1e-12)


# --- old policy update ---------------------------------------------------------------------


@FAST
@given(decay=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_old_update_is_lerp_towards_student(decay: float, seed: int) -> None:
    """old' == lerp(old, student, 1 - decay) ~= decay * old + (1 - decay) * student; pure unless donated."""
    g = torch.Generator().manual_seed(seed)
    student = TensorDict(
        {"a": {"w": torch.randn(3, 2, generator=g)}, "b": torch.randn(4, generator=g)}, []
    )
    old = student.apply(lambda t: torch.randn(t.shape, generator=g))
    state = TensorDict({"params": {"student": student, "old": old}}, [])
    keep = testing.snapshot(state)
    out = nft.old_update(state, decay)
    testing.assert_trees_equal(state, keep, what="input of old_update")
    for s, o, n in zip(
        tree.leaves(student), tree.leaves(old), tree.leaves(out["params", "old"]), strict=True
    ):
        assert torch.equal(n, torch.lerp(o, s, 1.0 - decay))
        expected = decay * o.double() + (1.0 - decay) * s.double()
        torch.testing.assert_close(n.double(), expected, rtol=0, atol=1e-5)
    testing.assert_trees_equal(out["params", "student"], keep["params", "student"])
    donated = nft.old_update(testing.snapshot(state), decay, donate=True)
    testing.assert_trees_equal(donated, out, what="donate=True vs donate=False")


def test_old_update_endpoints_are_exact() -> None:
    """decay = 0 copies the student, decay = 1 keeps the old policy, bit for bit."""
    state = TensorDict(
        {
            "params": {
                "student": {"w": torch.tensor([0.1, -3.7])},
                "old": {"w": torch.tensor([2.3, 1e-8])},
            }
        },
        [],
    )
    assert torch.equal(
        nft.old_update(state, 0.0)["params", "old", "w"], state["params", "student", "w"]
    )
    assert torch.equal(
        nft.old_update(state, 1.0)["params", "old", "w"], state["params", "old", "w"]
    )
    with pytest.raises(ValueError, match="decay"):
        nft.old_update(state, 1.5)


def test_ramp_decay_is_flat_then_linear_then_capped() -> None:
    """ramp_decay(s) = min(max(s - flat, 0) * rate, max)."""
    d = nft.ramp_decay(flat_steps=3, rate=0.1, max_decay=0.35)
    got = [d(s) for s in (0, 3, 4, 5, 6, 100)]
    assert got == pytest.approx([0.0, 0.0, 0.1, 0.2, 0.3, 0.35], abs=1e-12)


# --- rollouts ------------------------------------------------------------------------------


def test_sample_rows_depend_only_on_their_prompt_id_and_group_position() -> None:
    """Sampling prompts with ids [2, 3] gives the same rows as the matching slice of ids [0..3]."""
    net = VelocityNet()
    params = ps.params_of("old", net)
    key = rng.key(11)
    kw = {"group_size": 3, "steps": 4, "sample_shape": (2,), "cond_keys": ("label",)}
    full = nft.sample(net, params, _prompts(4), key, **kw)
    part = nft.sample(net, params, _prompts(4)[2:], key, **kw)
    assert torch.equal(part["index"], full["index"][6:])
    torch.testing.assert_close(part["x0"], full["x0"][6:], rtol=1e-6, atol=1e-6)
    assert part["group"].tolist() == [0, 0, 0, 1, 1, 1]
    assert full["index"].tolist() == list(range(12))


def test_sample_is_the_euler_solution_of_the_old_velocity() -> None:
    """x0 equals flow.euler_sample of the model from the per-sample noise rng.normal(key, index=i)."""
    net = VelocityNet()
    params = ps.params_of("old", net)
    key = rng.key(5)
    out = nft.sample(
        net,
        params,
        _prompts(2),
        key,
        group_size=2,
        steps=3,
        sample_shape=(2,),
        cond_keys=("label",),
    )
    noise = rng.normal(key, (4, 2), index=torch.arange(4))
    label = torch.tensor([1.0, 1.0, -1.0, -1.0])
    x = flow.euler_sample(
        lambda x, t: ps.call(net, params, x, t, label=label), noise, flow.timestep_schedule(3)
    )
    assert torch.equal(out["x0"], x)


# --- the NFT loss --------------------------------------------------------------------------


def _loss_batch(seed: int, b: int, adv: torch.Tensor | None = None) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "x0": torch.randn(b, 2, generator=g, dtype=torch.float64),
            "adv": torch.randn(b, generator=g, dtype=torch.float64) * 2 if adv is None else adv,
            "index": torch.arange(10, 10 + b),
            "prompt": {"label": torch.tensor([1.0, -1.0]).repeat(b)[:b].double()},
        },
        [b],
    )


def _fm_grad(
    net: nn.Module,
    params: TensorDictBase,
    batch: TensorDictBase,
    key: torch.Tensor,
    rho: torch.Tensor,
    cfg: nft.NFTConfig,
) -> TensorDict:
    """Gradient of mean_i (2 rho_i - 1) * mean_d (x_t - t v - x0)^2 / w_i, written out by hand."""
    x0, idx = batch["x0"], batch["index"]
    t = cfg.timesteps.sample(
        rng.fold_in(key, int(flow.Purpose.TIMESTEP)), x0.shape[0], index=idx, dtype=x0.dtype
    )
    eps = rng.normal(
        rng.fold_in(key, int(flow.Purpose.NOISE)), tuple(x0.shape), index=idx, dtype=x0.dtype
    )
    x_t = (1 - t[:, None]) * x0 + t[:, None] * eps
    leaves = [p.detach().requires_grad_(True) for p in tree.leaves(params)]
    v = ps.call(net, tree.rebuild(params, leaves), x_t, t, label=batch["prompt", "label"])
    err = x_t - t[:, None] * v - x0
    w = err.detach().abs().mean(dim=1).clamp_min(cfg.weight_eps)
    fm = (err**2).mean(dim=1) / w
    grads = torch.autograd.grad(((2 * rho - 1) * fm).mean(), leaves)
    return tree.rebuild(params, list(grads))


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), beta=st.sampled_from([0.05, 0.5, 1.0, 3.0]))
def test_nft_gradient_at_the_old_policy_is_rho_weighted_flow_matching_gradient(
    seed: int, beta: float
) -> None:
    """With student == old and no KL, grad L_nft = grad mean_i (2 rho_i - 1) L_fm,i, for every beta.

    Derivation (module docstring): at theta = theta_old, v+ = v- = v_old, the
    adaptive weights agree, and d v+/dv = beta, d v-/dv = -beta, so
    d/dv (rho L+ + (1 - rho) L-) / beta = (2 rho - 1) d L_fm / dv.
    """
    net = VelocityNet(seed=seed % 7).double()
    p = ps.params_of("student", net)
    cfg = nft.NFTConfig(beta=beta, kl_weight=0.0, cond_keys=("label",))
    loss_fn = nft.loss_fn(net, None, None, cfg)
    batch = _loss_batch(seed, 6)
    key = rng.key(seed)
    params = TensorDict({"student": p, "old": tree.clone(p)}, [])
    grads, _ = ps.value_and_grad(loss_fn)(params, batch, key, roles=["student"])
    rho = nft.optimality_weight(batch["adv"], cfg.adv_clip)
    expected = _fm_grad(net, p, batch, key, rho, cfg)
    testing.assert_trees_close(grads["student"], expected, rtol=1e-9, atol=1e-12)


def test_nft_gradient_vanishes_for_zero_advantage_at_the_old_policy() -> None:
    """adv = 0 (rho = 1/2), student == old, no KL: the positive and negative terms cancel."""
    net = VelocityNet().double()
    p = ps.params_of("student", net)
    loss_fn = nft.loss_fn(net, None, None, nft.NFTConfig(kl_weight=0.0, cond_keys=("label",)))
    batch = _loss_batch(0, 8, adv=torch.zeros(8, dtype=torch.float64))
    params = TensorDict({"student": p, "old": tree.clone(p)}, [])
    grads, metrics = ps.value_and_grad(loss_fn)(params, batch, rng.key(1), roles=["student"])
    assert max(float(g.abs().max()) for g in tree.leaves(grads["student"])) < 1e-12
    assert float(metrics["loss"]) > 0  # the value does not vanish, only its gradient


def test_kl_term_gradient_is_the_squared_velocity_distance_gradient() -> None:
    """Only the KL term (adv = 0, student == old): grad = kl_weight * grad mean (v - v_ref)^2."""
    net = VelocityNet().double()
    ref_net = VelocityNet(seed=9).double()
    p = ps.params_of("student", net)
    ref = ps.params_of("reference", ref_net)
    cfg = nft.NFTConfig(kl_weight=0.25, cond_keys=("label",))
    batch = _loss_batch(2, 5, adv=torch.zeros(5, dtype=torch.float64))
    key = rng.key(4)
    params = TensorDict({"student": p, "old": tree.clone(p)}, [])
    grads, metrics = ps.value_and_grad(nft.loss_fn(net, None, ref, cfg))(
        params, batch, key, roles=["student"]
    )
    x0, idx = batch["x0"], batch["index"]
    t = cfg.timesteps.sample(
        rng.fold_in(key, int(flow.Purpose.TIMESTEP)), 5, index=idx, dtype=x0.dtype
    )
    eps = rng.normal(rng.fold_in(key, int(flow.Purpose.NOISE)), (5, 2), index=idx, dtype=x0.dtype)
    x_t = (1 - t[:, None]) * x0 + t[:, None] * eps
    label = batch["prompt", "label"]
    leaves = [q.detach().requires_grad_(True) for q in tree.leaves(p)]
    v = ps.call(net, tree.rebuild(p, leaves), x_t, t, label=label)
    v_ref = ps.call(net, ref, x_t, t, label=label)
    kl = ((v - v_ref) ** 2).mean()
    expected = torch.autograd.grad(0.25 * kl, leaves)
    testing.assert_trees_close(
        grads["student"], tree.rebuild(p, list(expected)), rtol=1e-9, atol=1e-12
    )
    assert math.isclose(float(metrics["student", "kl"]), float(kl.detach()), rel_tol=1e-12)


def test_old_params_get_no_gradient_and_kl_needs_a_reference() -> None:
    """The old policy is passed detached; kl_weight > 0 without reference params is an error."""
    net = VelocityNet().double()
    p = ps.params_of("student", net)
    loss_fn = nft.loss_fn(net, None, p, nft.NFTConfig(cond_keys=("label",)))
    params = TensorDict({"student": p, "old": tree.clone(p)}, [])
    grads, _ = ps.value_and_grad(loss_fn)(params, _loss_batch(0, 4), rng.key(0), roles=["student"])
    assert list(grads.keys()) == ["student"]
    with pytest.raises(ValueError, match="reference_params"):
        nft.loss_fn(net, None, None, nft.NFTConfig(kl_weight=0.1))


def test_inner_grad_fn_is_accumulation_invariant() -> None:
    """train_step(accumulate(value_and_grad(nft_loss), k)) gives the same state for k = 1, 2, 4."""
    net = VelocityNet()
    cfg = nft.NFTConfig(kl_weight=0.1, cond_keys=("label",))
    loss_fn = nft.loss_fn(net, None, ps.params_of("reference", VelocityNet(seed=4)), cfg)
    opt = optim.adamw(1e-2)
    batch = _loss_batch(3, 8).apply(lambda t: t.float() if t.is_floating_point() else t)
    testing.assert_accumulation_invariant(
        lambda k: ps.train_step(ps.accumulate(ps.value_and_grad(loss_fn), k), {"student": opt}),
        _state(net, opt),
        [batch, batch],
    )


# --- the outer step ------------------------------------------------------------------------


def test_outer_step_is_pure_and_deterministic() -> None:
    """The outer step never mutates its inputs and repeats bitwise from the same state."""
    net = VelocityNet()
    step = _make(net)
    state = _state(net)
    testing.assert_pure(step, state, _prompts(2))
    testing.assert_deterministic(step, state, [_prompts(2), _prompts(2, start=2)])


def test_outer_step_donation_gives_the_same_result() -> None:
    """donate=True equals donate=False over several outer steps (with a ramping old decay)."""
    net = VelocityNet()
    decay = nft.ramp_decay(flat_steps=1, rate=0.3, max_decay=0.9)
    testing.assert_donation_safe(
        lambda d: _make(net, donate=d, decay=decay),
        _state(net),
        [_prompts(2), _prompts(2, 2), _prompts(2, 4)],
    )


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_outer_step_is_accumulation_invariant(opt_name: str) -> None:
    """The outer step gives the same state and metrics for inner accumulation k = 1, 2, 4."""
    net = VelocityNet()
    opt = optim.adamw(1e-2) if opt_name == "adamw" else optim.sgd(0.05, momentum=0.9)
    testing.assert_accumulation_invariant(
        lambda k: _make(net, k=k, opt=opt), _state(net, opt), [_prompts(2), _prompts(2, 2)]
    )


def test_outer_step_resumes_exactly_from_a_saved_state() -> None:
    """Save after one outer step, load, continue with a fresh step: bitwise the uninterrupted run."""
    net = VelocityNet()
    decay = nft.ramp_decay(rate=0.4, max_decay=0.8)
    testing.assert_resume_exact(
        _make(net, decay=decay),
        _state(net),
        [_prompts(2), _prompts(2, 2), _prompts(2, 4)],
        save_at=1,
        restart_step=_make(net, decay=decay),
    )


def test_counters_keys_and_roles_after_outer_steps() -> None:
    """step += 1 per outer step; inner_step and the optimizer count += epochs * N / minibatch.

    The old policy moves only by the old-policy update (decay 1 keeps it exactly),
    the reference is not in state, and every inner update draws a distinct key.
    """
    net = VelocityNet()
    step = _make(net, decay=1.0)
    state = step.prepare(_state(net))
    assert sorted(state["params"].keys()) == ["old", "student"]
    assert list(state["opt_state"].keys()) == ["student"]
    old0 = testing.snapshot(state["params", "old"])
    student0 = testing.snapshot(state["params", "student"])
    for _ in range(2):
        state, metrics = step(state, _prompts(2))
    # N = 2 prompts * 4 = 8 rollouts, minibatch 4, 2 epochs -> 4 inner updates per outer step
    assert int(state["step"]) == 2
    assert int(state["extra", "inner_step"]) == 8
    assert int(state["opt_state", "student", "count"]) == 8
    testing.assert_trees_equal(state["params", "old"], old0, what="old with decay 1")
    with pytest.raises(AssertionError):
        testing.assert_trees_equal(state["params", "student"], student0)
    inner_root = rng.fold_in(state["rng"], nft.INNER_ROOT)
    inner_keys = {int(rng.fold_in(inner_root, u)) for u in range(8)}
    outer_keys = {int(rng.fold_in(state["rng"], s)) for s in range(8)}
    assert len(inner_keys) == 8
    assert not inner_keys & outer_keys
    for name in (
        ("rollout", "reward"),
        ("rollout", "reward_std"),
        "loss",
        ("student", "policy_loss"),
        ("student", "kl"),
        ("student", "rho"),
        ("old", "decay"),
    ):
        assert name in metrics, name
    assert float(metrics["old", "decay"]) == 1.0


def test_decay_zero_makes_old_equal_student_after_each_outer_step() -> None:
    """With decay 0 the next rollouts are on-policy: old == student bitwise after the step."""
    net = VelocityNet()
    state, _ = _make(net, decay=0.0)(_state(net), _prompts(2))
    testing.assert_trees_equal(state["params", "old"], state["params", "student"])


def test_outer_step_errors_name_the_problem() -> None:
    """Bad reward shapes, indivisible minibatches and aliased old/student params raise clearly."""
    net = VelocityNet()
    state = _state(net)
    bad_reward = nft.make_step(
        net,
        lambda x, c: x,
        optim.adamw(1e-2),  # the optimizer the state was built for (_state)
        reference_params=None,
        sample_shape=(2,),
        config=nft.NFTConfig(kl_weight=0.0, cond_keys=("label",)),
        group_size=2,
    )
    with pytest.raises(ValueError, match=r"reward_fn must return a tensor of shape \(4,\)"):
        bad_reward(state, _prompts(2))
    step = _make(net)
    odd = attrs.evolve(step, minibatch_size=3)
    with pytest.raises(ValueError, match=r"8 rollouts .* minibatch_size=3"):
        odd(state, _prompts(2))
    with pytest.raises(KeyError, match="label"):
        step(state, TensorDict({"other": torch.ones(2)}, [2]))
    aliased = state.copy()
    aliased["params", "old"] = state["params", "student"]
    with pytest.raises(ValueError, match="shares memory"):
        _make(net, donate=True)(aliased, _prompts(2))


# --- learning ------------------------------------------------------------------------------


def test_nft_increases_the_reward_of_a_random_policy() -> None:
    """A few outer steps raise the mean reward of fresh samples (held-out noise, student params)."""
    net = VelocityNet(seed=1)
    opt = optim.adamw(1e-2)
    step = nft.make_step(
        net,
        _reward,
        opt,
        reference_params=ps.params_of("reference", net),
        sample_shape=(2,),
        config=nft.NFTConfig(beta=1.0, kl_weight=1e-3, cond_keys=("label",)),
        group_size=16,
        sample_steps=4,
        inner_epochs=2,
        minibatch_size=32,
        decay=0.0,
    )
    state = _state(net, opt)
    prompts = _prompts(4)
    eval_prompts = _prompts(64, start=1000)

    def mean_reward(s: TensorDictBase) -> float:
        ro = nft.sample(
            net,
            s["params", "student"],
            eval_prompts,
            rng.key(99),
            group_size=4,
            steps=4,
            sample_shape=(2,),
            cond_keys=("label",),
        )
        return float(_reward(ro["x0"], ro["prompt"]).mean())

    before = mean_reward(state)
    for i in range(10):
        state, _ = step(state, _prompts(4, start=4 * i) if i else prompts)
    after = mean_reward(state)
    print(f"reward before {before:.3f} after {after:.3f}")
    assert after > before + 0.15, (before, after)


def test_deprecated_names_warn_and_still_work() -> None:
    """nft_loss_fn and make_step(accumulate_steps=) are the old names of loss_fn / accumulate=."""
    net = VelocityNet(seed=0).double()
    cfg = nft.NFTConfig(kl_weight=0.0, cond_keys=("label",))
    with pytest.warns(DeprecationWarning, match="nft.loss_fn"):
        old = nft.nft_loss_fn(net, None, None, cfg)
    batch = _loss_batch(0, 4)
    params = TensorDict({"student": ps.params_of("s", net), "old": ps.params_of("o", net)}, [])
    a, _ = old(params, batch, rng.key(0))
    b, _ = nft.loss_fn(net, None, None, cfg)(params, batch, rng.key(0))
    assert torch.equal(a, b)
    with pytest.warns(DeprecationWarning, match="accumulate="):
        step = nft.make_step(
            net,
            lambda x, c: x[:, 0],
            ps.optim.sgd(0.1),
            reference_params=None,
            sample_shape=(2,),
            config=cfg,
            accumulate_steps=2,
        )
    assert step.inner.grad_fn is not None
