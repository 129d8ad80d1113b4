"""Supervised flow matching (``purestep.methods.finetune``): step properties and the loss maths."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torch import nn

from purestep import optim, rng, testing, value_and_grad
from purestep.methods import finetune, flow


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny models run fastest on one intra-op thread (and robustly on a busy machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class TinyNet(nn.Module):
    """v(x_t, t[, label]): a 2-layer MLP, conditional when ``classes`` is set."""

    def __init__(
        self, dim: int = 2, hidden: int = 8, classes: int | None = None, seed: int = 0
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)  # tests only: module init
        self.classes = classes
        self.emb = nn.Embedding(classes + 1, hidden) if classes is not None else None
        self.inp = nn.Linear(dim + 1, hidden)
        self.out = nn.Linear(hidden, dim)

    def forward(
        self, x: torch.Tensor, t: torch.Tensor, label: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = self.inp(torch.cat([x, t[:, None].to(x.dtype)], 1))
        if self.emb is not None:
            assert label is not None
            h = h + self.emb(label)
        return self.out(torch.tanh(h))  # type: ignore[no-any-return]


def _batch(seed: int, b: int = 8, classes: int | None = None) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    out = {"x0": torch.randn(b, 2, generator=g)}
    if classes is not None:
        out["label"] = torch.randint(0, classes, (b,), generator=g)
    return TensorDict(out, batch_size=[b])


CONFIGS = {
    "velocity": finetune.FinetuneConfig(),
    "precondition": finetune.FinetuneConfig(
        precondition_outputs=True, timesteps=flow.TimestepDist(kind="logit_normal", shift=2.0)
    ),
    "conditional": finetune.FinetuneConfig(
        cond_keys=("label",), cond_dropout=0.3, null_cond={"label": 3}
    ),
}


def _setup(
    name: str, opt: optim.Transform
) -> tuple[TinyNet, finetune.FinetuneConfig, TensorDict, list[TensorDict]]:
    classes = 3 if name == "conditional" else None
    net = TinyNet(classes=classes)
    cfg = CONFIGS[name]
    state = finetune.init_state(net, opt, seed=1)
    return net, cfg, state, [_batch(10, classes=classes), _batch(11, classes=classes)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_finetune_step_is_pure_deterministic_and_donation_safe(name: str) -> None:
    """The step leaves inputs untouched, repeats bitwise, and donate=True equals donate=False."""
    opt = optim.adamw(lr=1e-2)
    net, cfg, state, batches = _setup(name, opt)
    step = finetune.make_step(net, opt, cfg)
    testing.assert_pure(step, state, batches[0])
    testing.assert_deterministic(step, state, batches)
    testing.assert_donation_safe(
        lambda d: finetune.make_step(net, opt, cfg, donate=d, ema=0.9), state, batches
    )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_finetune_is_accumulation_invariant(name: str) -> None:
    """accumulate(k) for k = 1, 2, 4 gives the same states and metrics (per-sample noise)."""
    opt = optim.sgd(lr=0.1, momentum=0.9)
    net, cfg, state, batches = _setup(name, opt)
    testing.assert_accumulation_invariant(
        lambda k: finetune.make_step(net, opt, cfg, accumulate=k), state, batches, ks=(1, 2, 4)
    )


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_precondition_loss_is_t_squared_weighted_velocity_loss(seed: int) -> None:
    """mse(x_t - t v, x0) == mean(t^2 (v - (eps - x0))^2): the x0 loss reweights the v loss by t^2."""
    net = TinyNet(seed=seed % 7)
    params = TensorDict({"student": flow.frozen_params(net)}, [])
    batch = _batch(seed)
    batch.set("index", torch.arange(8))
    key = rng.key(seed)
    loss_x0, _ = finetune.loss_fn(net, finetune.FinetuneConfig(precondition_outputs=True))(
        params, batch, key
    )
    t = flow.sample_timesteps(flow.purpose_key(key, flow.Purpose.TIMESTEP), 8, index=batch["index"])
    eps = flow.noise_like(flow.purpose_key(key, flow.Purpose.NOISE), batch["x0"], batch["index"])
    x_t = flow.interpolate(batch["x0"], eps, t)
    v = net(x_t, t)
    ref = (t[:, None] ** 2 * (v - (eps - batch["x0"])) ** 2).mean()
    torch.testing.assert_close(loss_x0, ref)


def test_finetune_learns_a_point_mass() -> None:
    """Training on a single point drives the loss down and 1-step samples towards that point."""
    net = TinyNet(hidden=32)
    opt = optim.adam(lr=1e-2)
    step = finetune.make_step(net, opt, donate=True)
    state = finetune.init_state(net, opt, seed=0)
    target = torch.tensor([[1.5, -0.5]])
    batch = TensorDict({"x0": target.expand(64, 2).clone()}, [64])
    losses = []
    for _ in range(200):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert sum(losses[-20:]) / 20 < 0.35 * sum(losses[:20]) / 20
    noise = rng.normal(rng.key(5), (256, 2))
    x = flow.sample(net, state["params", "student"], noise, flow.timestep_schedule(8))
    assert isinstance(x, torch.Tensor)
    assert float((x - target).norm(dim=1).mean()) < 0.3


def test_grads_flow_only_into_the_student() -> None:
    """value_and_grad of the finetune loss returns grads shaped like the params, non-zero."""
    net = TinyNet()
    params = TensorDict({"student": flow.frozen_params(net)}, [])
    grads, metrics = value_and_grad(finetune.loss_fn(net))(params, _batch(0), rng.key(0))
    assert set(grads.keys()) == {"student"}
    assert float(sum(g.abs().sum() for g in grads["student"].values(True, True))) > 0
    assert "loss" in metrics.keys() and ("student", "t_mean") in metrics.keys(True)


def test_config_validation_names_the_field() -> None:
    """Bad hyperparameters fail at construction with the field's name."""
    with pytest.raises(ValueError, match="null_cond"):
        finetune.FinetuneConfig(cond_keys=("label",), cond_dropout=0.1)
    with pytest.raises(ValueError, match="cond_dropout"):
        finetune.FinetuneConfig(cond_dropout=1.5)
    with pytest.raises(ValueError, match="t_scale"):
        finetune.FinetuneConfig(t_scale=0.0)


def test_missing_batch_key_is_named() -> None:
    """A batch without the data key fails with the key's name."""
    net = TinyNet()
    opt = optim.sgd(lr=0.1)
    with pytest.raises(KeyError, match="x0"):
        finetune.make_step(net, opt)(
            finetune.init_state(net, opt, seed=0), {"y": torch.zeros(2, 2)}
        )


def test_init_state_copies_a_tensordict_source() -> None:
    """init_state from a TensorDict copies it, so a donated step cannot modify the caller's params."""
    net = TinyNet()
    src = flow.frozen_params(net)
    keep = src.clone()
    opt = optim.sgd(lr=0.5)
    state = finetune.init_state(src, opt, seed=0)
    finetune.make_step(net, opt, donate=True)(state, _batch(0))
    testing.assert_trees_equal(src, keep)
