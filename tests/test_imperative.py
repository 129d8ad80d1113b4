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


class _Buffered(nn.Module):
    """Every kind of buffer a real model registers, in the order that matters to the check:
    at the root a ``None`` buffer and a non-persistent one (a rotary table) *before* a
    persistent one, a nested BatchNorm (updated by the forward), and one persistent tensor
    registered in two submodules (deduplicated, as ``named_buffers`` does)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("absent", None)
        self.register_buffer("table", torch.arange(3.0), persistent=False)
        self.register_buffer("scale", torch.full((3,), 0.5))
        self.inp = nn.Linear(3, 4)
        self.norm = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 2)
        shared = torch.ones(2)
        self.a, self.b = nn.Module(), nn.Module()
        self.a.register_buffer("shift", shared)
        self.b.register_buffer("shift", shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.inp(x * self.scale + self.table))
        return self.out(torch.tanh(h)) + self.a.shift


def test_a_module_with_every_kind_of_buffer_matches_and_its_buffers_are_compared() -> None:
    """Root-level, nested, shared, non-persistent and ``None`` buffers: the check passes for
    purestep's own step (BatchNorm statistics updated by both sides), and a step that does
    not update the statistics is caught, naming the nested buffer."""
    torch.manual_seed(0)
    net = _Buffered()
    testing.assert_matches_imperative(net, _mse, optim.adamw(1e-2), _batches())

    inner = ps.train_step(ps.value_and_grad(_loss_fn(net, _mse)), {"model": optim.adamw(1e-2)})

    def frozen_stats(state: TensorDictBase, batch: Any) -> Any:
        new, metrics = inner(state, batch)
        return new.set(("buffers", "model"), state["buffers", "model"].clone()), metrics

    with pytest.raises(
        AssertionError, match=r"after step 0.*first difference at buffers\.norm\.running_mean"
    ):
        testing.assert_matches_imperative(
            net, _mse, optim.adamw(1e-2), _batches(), step=frozen_stats
        )


def test_a_compiled_module_is_checked_through_the_module_it_wraps() -> None:
    """``torch.compile(model)`` (an ``OptimizedModule``, whose parameter names start with
    ``_orig_mod.``) is compared by the wrapped module's names, as purestep states name them."""
    compiled = torch.compile(_mlp(), backend="eager")
    testing.assert_matches_imperative(compiled, _mse, optim.sgd(0.1), _batches(n=2))


def test_a_state_without_the_role_names_the_role_and_the_roles_it_has() -> None:
    """A state (or a step's prepared state) without params for ``role`` is refused before any
    comparison, naming the role and the roles the state has."""
    net = _mlp()
    opts = {"model": optim.sgd(0.1)}
    state = ps.init_state({"model": net}, opts, seed=0)
    step = ps.train_step(ps.value_and_grad(_loss_fn(net, _mse)), opts)
    with pytest.raises(
        AssertionError, match=r"the state has no params for role 'student' \(roles: \['model'\]\)"
    ):
        testing.assert_matches_imperative(
            net, _mse, optim.sgd(0.1), _batches(), step=step, state=state, role="student"
        )

    def no_params(state: TensorDictBase, batch: Any) -> Any:
        return state, {}

    with pytest.raises(AssertionError, match=r"no params for role 'model' \(roles: \[\]\)"):
        testing.assert_matches_imperative(
            net, _mse, optim.sgd(0.1), _batches(), step=no_params, state=state.exclude("params")
        )


def test_a_loss_that_is_not_a_scalar_on_the_purestep_side_only_names_that_side() -> None:
    """The scalar check runs on each side and says which one returned what."""

    def loss(forward: Callable[..., Any], batch: TensorDictBase) -> torch.Tensor:
        out = _mse(forward, batch)
        return out if isinstance(forward, nn.Module) else out.reshape(1, 1).expand(2, 1)

    with pytest.raises(TypeError, match=r"on the purestep side; got Tensor of shape \(2, 1\)"):
        testing.assert_matches_imperative(_mlp(), loss, optim.sgd(0.1), _batches())


def test_each_donate_flag_builds_a_step_with_that_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """``donate=(False, True)`` checks two built steps, one not donating and one donating."""
    import purestep.testing.imperative as imperative

    built: list[Any] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        step = ps.train_step(*args, **kwargs)
        built.append(step.donate)
        return step

    monkeypatch.setattr(imperative, "train_step", spy)
    testing.assert_matches_imperative(_mlp(), _mse, optim.sgd(0.1), _batches(n=1))
    assert built == [False, True]
    built.clear()
    testing.assert_matches_imperative(_mlp(), _mse, optim.sgd(0.1), _batches(n=1), donate=True)
    assert built == [True]


def test_a_scheduled_torch_optimizer_starts_at_the_schedules_first_lr_and_keeps_closures() -> None:
    """The derived optimizer's lr is ``schedule(0)`` before any step, ``schedule(n)`` at the
    n-th step, and ``step(closure)`` still calls the closure and returns its loss."""
    schedule = optim.schedules.warmup_cosine(1e-2, 2, 5)
    p = nn.Parameter(torch.ones(2))
    opt = testing.torch_optimizer_for(optim.sgd(schedule))([p])
    assert opt.param_groups[0]["lr"] == float(schedule(0)) == 0.0
    calls: list[int] = []

    def closure() -> torch.Tensor:
        calls.append(1)
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    for n in range(3):
        before = float((p.detach() ** 2).sum())
        assert float(opt.step(closure).detach()) == before
        assert opt.param_groups[0]["lr"] == float(schedule(n))
    assert len(calls) == 3
