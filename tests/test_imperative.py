"""testing.assert_matches_imperative: it passes on matching steps and names what diverges."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import TensorDictBase
from torch import nn

import purestep as ps
from purestep import optim, testing


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))


def _batches(n: int = 3, b: int = 6, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {"x": torch.randn(b, 3, generator=g), "y": torch.randn(b, 2, generator=g)} for _ in range(n)
    ]


def _mse(forward: Callable[..., Any], batch: TensorDictBase) -> torch.Tensor:
    return ((forward(batch["x"]) - batch["y"]) ** 2).mean()


def _loss_fn(
    model: nn.Module, loss: Callable[..., torch.Tensor], role: str = "model"
) -> Callable[..., Any]:
    def loss_fn(params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor) -> Any:
        return loss(functools.partial(ps.call, model, params[role]), batch), {}

    return loss_fn


@pytest.mark.parametrize(
    "opt",
    [
        optim.adamw(1e-2, weight_decay=0.1),
        optim.adam(1e-2, weight_decay=0.05, amsgrad=True),
        optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
        optim.sgd(0.1),
        optim.adamw(optim.schedules.warmup_cosine(1e-2, 2, 5)),
    ],
    ids=["adamw", "adam-amsgrad", "sgd-nesterov", "sgd-plain", "adamw-schedule"],
)
def test_matching_steps_pass_for_each_derived_optimizer(opt: optim.Transform) -> None:
    testing.assert_matches_imperative(_mlp(), _mse, opt, _batches(4))


@pytest.mark.parametrize("k", [2, 4])
def test_accumulated_step_matches_imperative_microbatch_loop(k: int) -> None:
    """Microbatches of 6 samples cut 3+3 / 2+2+1+1, weighted n_i / B on both sides."""
    testing.assert_matches_imperative(_mlp(), _mse, optim.adamw(1e-2), _batches(3), accumulate=k)


def test_the_model_is_left_untouched() -> None:
    net = _mlp()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    testing.assert_matches_imperative(net, _mse, optim.adamw(1e-2), _batches(2))
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_step_with_the_wrong_learning_rate_is_caught_and_named() -> None:
    net = _mlp()
    wrong = ps.train_step(ps.value_and_grad(_loss_fn(net, _mse)), {"model": optim.adamw(1.1e-2)})
    with pytest.raises(AssertionError) as e:
        testing.assert_matches_imperative(net, _mse, optim.adamw(1e-2), _batches(), step=wrong)
    msg = str(e.value)
    assert "after step 0" in msg
    assert "params.0.weight" in msg  # the first leaf in module order
    assert "max abs diff" in msg and "max rel diff" in msg


def test_a_step_that_drops_one_gradient_names_that_parameter() -> None:
    """The purestep loss detaches the last bias: only params.2.bias diverges."""
    net = _mlp()

    def loss_fn(params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor) -> Any:
        p = params["model"].clone()
        p["2", "bias"] = p["2", "bias"].detach()
        return _mse(functools.partial(ps.call, net, p), batch), {}

    wrong = ps.train_step(ps.value_and_grad(loss_fn), {"model": optim.sgd(0.1)})
    with pytest.raises(AssertionError, match=r"after step 0.*params\.2\.bias"):
        testing.assert_matches_imperative(net, _mse, optim.sgd(0.1), _batches(), step=wrong)


def test_a_step_that_diverges_later_names_the_later_step() -> None:
    """Equal on step 0, wrong from step 1 (the loss is scaled once the step counter moves)."""
    net = _mlp()

    def loss_fn(params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor) -> Any:
        scale = 1.0 if calls[0] == 0 else 2.0
        calls[0] += 1
        return scale * _mse(functools.partial(ps.call, net, params["model"]), batch), {}

    calls = [0]
    wrong = ps.train_step(ps.value_and_grad(loss_fn), {"model": optim.sgd(0.1)})
    with pytest.raises(AssertionError, match=r"after step 1\)"):
        testing.assert_matches_imperative(net, _mse, optim.sgd(0.1), _batches(), step=wrong)


def test_tolerances_accept_a_tiny_difference_that_bitwise_rejects() -> None:
    net = _mlp()
    close = ps.train_step(
        ps.value_and_grad(_loss_fn(net, _mse)), {"model": optim.sgd(0.1 * (1 + 1e-6))}
    )
    with pytest.raises(AssertionError, match="not bitwise equal"):
        testing.assert_matches_imperative(net, _mse, optim.sgd(0.1), _batches(), step=close)
    testing.assert_matches_imperative(
        net, _mse, optim.sgd(0.1), _batches(), step=close, rtol=1e-4, atol=1e-6
    )


def test_a_step_that_writes_into_the_module_is_caught() -> None:
    net = _mlp()
    inner = ps.train_step(ps.value_and_grad(_loss_fn(net, _mse)), {"model": optim.sgd(0.1)})

    def leaky(state: TensorDictBase, batch: Any) -> Any:
        with torch.no_grad():
            net[0].bias.add_(1.0)  # a module whose forward (or a hook) keeps state in itself
        return inner(state, batch)

    with pytest.raises(AssertionError, match=r"module's own tensors.*0\.bias"):
        testing.assert_matches_imperative(net, _mse, optim.sgd(0.1), _batches(), step=leaky)


def test_a_state_without_the_modules_buffers_is_named() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    state = ps.init_state({"model": net}, {"model": optim.sgd(0.1)}, seed=0)
    if "buffers" in state.keys():
        del state["buffers"]
    step = ps.train_step(ps.value_and_grad(_loss_fn(net, _mse)), {"model": optim.sgd(0.1)})
    with pytest.raises(AssertionError, match=r"persistent buffers.*\('buffers', 'model'\)"):
        testing.assert_matches_imperative(
            net, _mse, optim.sgd(0.1), _batches(), step=step, state=state
        )


def test_an_explicit_torch_optimizer_is_used_for_the_imperative_side() -> None:
    """Lion has no torch.optim twin: without a factory it is refused; a wrong one is caught."""
    with pytest.raises(ValueError, match=r"no torch\.optim counterpart.*lion"):
        testing.assert_matches_imperative(_mlp(), _mse, optim.lion(1e-3), _batches())
    with pytest.raises(AssertionError, match="after step 0"):
        testing.assert_matches_imperative(
            _mlp(),
            _mse,
            optim.adamw(1e-2),
            _batches(),
            torch_optimizer=lambda ps_: torch.optim.SGD(ps_, lr=1e-2),
        )
    testing.assert_matches_imperative(
        _mlp(),
        _mse,
        optim.sgd(1e-2),
        _batches(),
        torch_optimizer=lambda ps_: torch.optim.SGD(ps_, lr=1e-2, fused=True),
    )


def test_a_loss_that_is_not_a_scalar_is_refused() -> None:
    with pytest.raises(TypeError, match=r"scalar tensor.*shape \(6, 2\)"):
        testing.assert_matches_imperative(
            _mlp(), lambda f, b: f(b["x"]), optim.sgd(0.1), _batches()
        )


def test_frozen_parameters_stay_out_of_both_sides() -> None:
    net = _mlp()
    net[0].weight.requires_grad_(False)
    testing.assert_matches_imperative(net, _mse, optim.adamw(1e-2), _batches())


def test_derived_torch_optimizers_have_the_same_hyperparameters() -> None:
    p = [nn.Parameter(torch.ones(2))]
    adamw = testing.torch_optimizer_for(optim.adamw(1e-3, betas=(0.8, 0.9), eps=1e-6))(p)
    assert isinstance(adamw, torch.optim.AdamW)
    assert adamw.defaults["betas"] == (0.8, 0.9) and adamw.defaults["eps"] == 1e-6
    adam = testing.torch_optimizer_for(optim.adam(1e-3, weight_decay=0.1))(p)
    assert type(adam) is torch.optim.Adam and adam.defaults["weight_decay"] == 0.1
    half = [nn.Parameter(torch.ones(2, dtype=torch.bfloat16))]
    sgd = testing.torch_optimizer_for(optim.sgd(0.1, momentum=0.5))(half)
    assert sgd.defaults["fused"] is False and sgd.defaults["foreach"] is True
    with pytest.raises(ValueError, match="chain"):
        testing.torch_optimizer_for(optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1)))


def test_a_model_with_dropout_mismatches_with_a_hint_about_the_global_rng() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    with pytest.raises(AssertionError, match=r"after step 0.*global RNG"):
        testing.assert_matches_imperative(net, _mse, optim.sgd(0.1), _batches())
    testing.assert_matches_imperative(net.eval(), _mse, optim.sgd(0.1), _batches())


def test_a_non_donating_step_that_writes_into_its_input_state_is_caught() -> None:
    net = _mlp()
    inner = ps.train_step(ps.value_and_grad(_loss_fn(net, _mse)), {"model": optim.sgd(0.1)})

    class Leaky:
        donate = False  # promises purity, as train_step(donate=False) does

        def __call__(self, state: TensorDictBase, batch: Any) -> Any:
            out = inner(state, batch)
            state["params", "model", "2", "bias"].zero_()
            return out

    with pytest.raises(AssertionError, match=r"step 0\): the input state.*params\.model\.2\.bias"):
        testing.assert_matches_imperative(net, _mse, optim.sgd(0.1), _batches(), step=Leaky())
