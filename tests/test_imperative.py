"""testing.assert_matches_imperative: it passes on matching steps and names what diverges."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import attrs
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
    """``donate=(False, True)`` checks two built steps, one not donating and one donating;
    neither logs a grad norm (``grad_norm=False``: the bare imperative loop computes none)."""
    import purestep.testing.imperative as imperative

    built: list[Any] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        step = ps.train_step(*args, **kwargs)
        built.append(step.donate)
        assert step.grad_norm is False
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


# --- the contract, pinned: messages, defaults, and what each side sees -----------------------

_WHAT = "assert_matches_imperative ({where}): purestep vs the imperative loop: "
_NUM = r"[0-9][0-9.e+-]*"
_RNG_HINT = (
    " (note: the imperative loop drew from torch's global RNG, e.g. dropout; such "
    "draws differ between the two sides: use dropout 0 or model.eval() for this check)"
)


def _one_leaf_diff(where: str, path: str) -> str:
    """The full message for a single leaf that is off by 1 (abs diff 1, rel diff unknown)."""
    return (
        re.escape(_WHAT.format(where=where))
        + re.escape(f"first difference at {path} (not bitwise equal): max abs diff 1, ")
        + f"max rel diff {_NUM}"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"accumulate": 0}, "accumulate must be a positive int, got 0"),
        ({"accumulate": -2}, "accumulate must be a positive int, got -2"),
        ({"accumulate": 1.0}, "accumulate must be a positive int, got 1.0"),
        ({"accumulate": "2"}, "accumulate must be a positive int, got '2'"),
        ({"batches": []}, "assert_matches_imperative: batches is empty"),
        ({"donate": ()}, "assert_matches_imperative: donate is empty"),
    ],
    ids=[
        "accumulate_0",
        "accumulate_negative",
        "accumulate_float",
        "accumulate_str",
        "no_batches",
        "no_donate",
    ],
)
def test_invalid_arguments_are_refused_with_a_message_naming_them(
    kwargs: dict[str, Any], message: str
) -> None:
    """A non-positive or non-int ``accumulate``, no batches or no donate flag: ``ValueError``
    with exactly this message."""
    args: dict[str, Any] = {"batches": _batches(1), **kwargs}
    batches = args.pop("batches")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        testing.assert_matches_imperative(_mlp(), _mse, optim.sgd(0.1), batches, **args)


_NO_TWIN = (
    "torch_optimizer_for: no torch.optim counterpart is known for {name!r}; "
    "pass torch_optimizer=lambda params: torch.optim.YourOptimizer(params, ...)"
)


@pytest.mark.parametrize(
    "transform",
    [
        optim.lion(1e-3),
        attrs.evolve(optim.adamw(1e-3), name="adamw_scaled"),  # adam hparams, another name
        attrs.evolve(optim.lion(1e-3), name="adam"),  # the name, not the hparams
        attrs.evolve(optim.sgd(0.1), name="sgd_ema"),
        attrs.evolve(optim.lion(1e-3), name="sgd"),
    ],
    ids=[
        "lion",
        "adamw_hparams_renamed",
        "lion_named_adam",
        "sgd_hparams_renamed",
        "lion_named_sgd",
    ],
)
def test_torch_optimizer_for_needs_both_the_name_and_the_hparams_of_a_known_optimizer(
    transform: optim.Transform,
) -> None:
    """Only a transform that is ``adam``/``adamw``/``sgd`` by name *and* carries that
    optimizer's hparams has a ``torch.optim`` twin; any other (a wrapper that reuses the
    hparams, a renamed transform) is refused with the full message naming it."""
    with pytest.raises(ValueError, match=f"^{re.escape(_NO_TWIN.format(name=transform.name))}$"):
        testing.torch_optimizer_for(transform)


def test_derived_torch_optimizers_use_the_fused_kernels_for_float32_params() -> None:
    """For float32 CPU params every derived optimizer is ``fused=True`` (SGD with
    ``foreach=None``), as purestep's kernels are; SGD carries momentum, dampening, weight
    decay and Nesterov through."""
    p = [nn.Parameter(torch.ones(2))]
    for t in (optim.adamw(1e-3), optim.adam(1e-3, amsgrad=True)):
        opt = testing.torch_optimizer_for(t)(p)
        assert opt.defaults["fused"] is True and opt.defaults["amsgrad"] is t.hparams.amsgrad
    sgd = testing.torch_optimizer_for(
        optim.sgd(0.2, momentum=0.8, dampening=0.3, weight_decay=0.01)
    )(p)
    assert (sgd.defaults["fused"], sgd.defaults["foreach"]) == (True, None)
    d = sgd.defaults
    assert (d["lr"], d["momentum"], d["dampening"], d["weight_decay"], d["nesterov"]) == (
        0.2,
        0.8,
        0.3,
        0.01,
        False,
    )


def test_sgd_with_dampening_matches_imperative() -> None:
    """Dampening reaches the torch twin: SGD with momentum and dampening matches bitwise."""
    testing.assert_matches_imperative(
        _mlp(), _mse, optim.sgd(0.1, momentum=0.9, dampening=0.3), _batches(3)
    )


def _scalar_msg(side: str, got: str) -> str:
    return (
        "assert_matches_imperative: loss(forward, batch) must return a scalar tensor on "
        f"the {side} side; got {got}"
    )


def _imperative_only(value: Callable[[torch.Tensor], Any]) -> Callable[..., Any]:
    def loss(forward: Callable[..., Any], batch: TensorDictBase) -> Any:
        out = _mse(forward, batch)
        return value(out) if isinstance(forward, nn.Module) else out

    return loss


def _purestep_only(value: Callable[[torch.Tensor], Any]) -> Callable[..., Any]:
    def loss(forward: Callable[..., Any], batch: TensorDictBase) -> Any:
        out = _mse(forward, batch)
        return out if isinstance(forward, nn.Module) else value(out)

    return loss


@pytest.mark.parametrize(
    ("loss", "message"),
    [
        (_imperative_only(lambda t: float(t.detach())), _scalar_msg("imperative", "float")),
        (
            _imperative_only(lambda t: t.expand(6, 2)),
            _scalar_msg("imperative", "Tensor of shape (6, 2)"),
        ),
        (
            _imperative_only(lambda t: t.reshape(1)[:0]),
            _scalar_msg("imperative", "Tensor of shape (0,)"),
        ),
        (_purestep_only(lambda t: None), _scalar_msg("purestep", "NoneType")),
        (
            _purestep_only(lambda t: t.expand(2, 1)),
            _scalar_msg("purestep", "Tensor of shape (2, 1)"),
        ),
    ],
    ids=[
        "imperative_float",
        "imperative_matrix",
        "imperative_empty",
        "purestep_none",
        "purestep_column",
    ],
)
def test_a_loss_that_is_not_a_one_element_tensor_is_refused_naming_the_side_and_what_it_got(
    loss: Callable[..., Any], message: str
) -> None:
    """``TypeError`` with exactly: which side's loss returned what (type, and shape for a
    tensor of more or fewer than one element)."""
    with pytest.raises(TypeError) as e:
        testing.assert_matches_imperative(_mlp(), loss, optim.sgd(0.1), _batches(1))
    assert str(e.value) == message


def test_a_one_element_loss_of_any_shape_is_accepted_on_both_sides() -> None:
    """``numel() == 1`` is the requirement: a ``[1, 1]`` loss trains as its scalar does."""
    testing.assert_matches_imperative(
        _mlp(), lambda f, b: _mse(f, b).reshape(1, 1), optim.sgd(0.1), _batches(2)
    )


def _off_by_one_after(inner: Any, path: tuple[str, ...]) -> Callable[..., Any]:
    """A step that runs ``inner`` and then adds 1 to one param (in the new state only)."""

    def step(state: TensorDictBase, batch: Any) -> Any:
        new, metrics = inner(state, batch)
        return new.set(path, new.get(path) + 1.0), metrics

    return step


def test_a_step_that_diverges_in_one_leaf_gets_the_whole_message() -> None:
    """The message is exactly: the run (``your step``), the step, what is compared, the
    leaf path and its differences; no RNG note when the imperative loop drew nothing."""
    net = _mlp()
    inner = ps.train_step(ps.value_and_grad(_loss_fn(net, _mse)), {"model": optim.sgd(0.1)})
    wrong = _off_by_one_after(inner, ("params", "model", "2", "bias"))
    with pytest.raises(AssertionError) as e:
        testing.assert_matches_imperative(net, _mse, optim.sgd(0.1), _batches(), step=wrong)
    assert re.fullmatch(_one_leaf_diff("your step, after step 0", "params.2.bias"), str(e.value))


@pytest.mark.parametrize("given_step", [True, False], ids=["your_step", "built_steps"])
def test_an_initial_state_that_is_not_the_modules_weights_is_named_with_the_run(
    given_step: bool,
) -> None:
    """The initial state is compared with the module before any step, and the message says
    so exactly (``initial state``, the run's label, no RNG note)."""
    net = _mlp()
    opts = {"model": optim.sgd(0.1)}
    state = ps.init_state({"model": net}, opts, seed=0)
    state["params", "model", "0", "bias"] += 1.0
    step = ps.train_step(ps.value_and_grad(_loss_fn(net, _mse)), opts) if given_step else None
    label = "your step" if given_step else "donate=False"
    with pytest.raises(AssertionError) as e:
        testing.assert_matches_imperative(
            net, _mse, optim.sgd(0.1), _batches(), step=step, state=state
        )
    assert re.fullmatch(_one_leaf_diff(f"{label}, initial state", "params.0.bias"), str(e.value))


def test_the_global_rng_note_ends_the_first_line_before_the_list_of_leaves() -> None:
    """With dropout every leaf differs: the first line names the first leaf and ends with the
    note about torch's global RNG; then the list of every differing leaf follows."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    with pytest.raises(AssertionError) as e:
        testing.assert_matches_imperative(net, _mse, optim.sgd(0.1), _batches(), donate=True)
    first, rest = str(e.value).split("\n", 1)
    assert re.fullmatch(
        re.escape(_WHAT.format(where="donate=True, after step 0"))
        + re.escape("first difference at params.0.weight (not bitwise equal): ")
        + f"max abs diff {_NUM}, max rel diff {_NUM}"
        + re.escape(_RNG_HINT),
        first,
    )
    assert re.fullmatch(r"4 leaves differ:(\n  params\.[02]\.(weight|bias) .*){4}", rest)


def test_a_step_that_writes_into_the_module_gets_the_whole_message() -> None:
    net = _mlp()
    inner = ps.train_step(ps.value_and_grad(_loss_fn(net, _mse)), {"model": optim.sgd(0.1)})

    def leaky(state: TensorDictBase, batch: Any) -> Any:
        with torch.no_grad():
            net[2].bias.add_(1.0)
        return inner(state, batch)

    with pytest.raises(AssertionError) as e:
        testing.assert_matches_imperative(net, _mse, optim.sgd(0.1), _batches(1), step=leaky)
    assert re.fullmatch(
        re.escape(
            "assert_matches_imperative: the module's own tensors after the purestep runs "
            "(a purestep step changed them): first difference at 2.bias (not bitwise equal): "
            "max abs diff 1, "
        )
        + f"max rel diff {_NUM}",
        str(e.value),
    )


def test_the_module_check_covers_every_state_dict_entry_whatever_its_name() -> None:
    """Frozen params named ``x``, `` x`` (a space), ``0.x`` and ``0.xXX.XXy`` (in a
    submodule ``xXX`` of ``0``): entries are keyed by their dotted path only, so none hides
    or nests into another, and a step that writes into ``x`` is caught."""
    net = _mlp()
    frozen = {"x": torch.zeros(2), " x": torch.ones(2)}
    for name, value in frozen.items():
        net.register_parameter(name, nn.Parameter(value, requires_grad=False))
    net[0].register_parameter("x", nn.Parameter(torch.ones(1), requires_grad=False))
    net[0].add_module("xXX", nn.Module())
    net[0].xXX.register_parameter("XXy", nn.Parameter(torch.ones(1), requires_grad=False))
    inner = ps.train_step(ps.value_and_grad(_loss_fn(net, _mse)), {"model": optim.sgd(0.1)})

    def leaky(state: TensorDictBase, batch: Any) -> Any:
        with torch.no_grad():
            net.x.add_(1.0)
        return inner(state, batch)

    with pytest.raises(AssertionError, match=r"module's own tensors.*first difference at x "):
        testing.assert_matches_imperative(net, _mse, optim.sgd(0.1), _batches(1), step=leaky)


def test_a_non_donating_step_that_writes_into_its_input_gets_the_whole_message() -> None:
    net = _mlp()
    inner = ps.train_step(ps.value_and_grad(_loss_fn(net, _mse)), {"model": optim.sgd(0.1)})

    class Leaky:
        donate = False

        def __call__(self, state: TensorDictBase, batch: Any) -> Any:
            out = inner(state, batch)
            state["params", "model", "2", "bias"].zero_()
            return out

    with pytest.raises(AssertionError) as e:
        testing.assert_matches_imperative(net, _mse, optim.sgd(0.1), _batches(), step=Leaky())
    assert re.fullmatch(
        re.escape(
            "assert_matches_imperative (your step, step 0): the input state of a donate=False "
            "step after the step (the step wrote into it): first difference at "
            "params.model.2.bias (not bitwise equal): "
        )
        + f"max abs diff {_NUM}, max rel diff 1",
        str(e.value),
    )


def test_only_a_step_that_promises_not_to_donate_is_held_to_its_input() -> None:
    """A donating step (``donate=True``) or one that promises nothing (a plain function) may
    overwrite its input state after the step: that is not reported."""
    net = _mlp()
    inner = ps.train_step(ps.value_and_grad(_loss_fn(net, _mse)), {"model": optim.sgd(0.1)})

    def overwrite(state: TensorDictBase, batch: Any) -> Any:
        out = inner(state, batch)
        state["params", "model", "2", "bias"].zero_()
        return out

    class Donating:
        donate = True

        def __call__(self, state: TensorDictBase, batch: Any) -> Any:
            return overwrite(state, batch)

    for step in (overwrite, Donating()):
        testing.assert_matches_imperative(net, _mse, optim.sgd(0.1), _batches(), step=step)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_both_sides_loss_sees_the_same_rows_cut_as_accumulate_cuts_them(k: int) -> None:
    """Every loss call, on either side, sees the microbatches ``accumulate`` cuts (by default
    ``k = 1``: the whole batch), in order, with the batch's ``index`` rows; the purestep side
    once per donate flag."""
    seen: list[tuple[str, tuple[int, ...]]] = []

    def loss(forward: Callable[..., Any], batch: TensorDictBase) -> torch.Tensor:
        side = "imperative" if isinstance(forward, nn.Module) else "purestep"
        seen.append((side, tuple(batch["index"].tolist())))
        return _mse(forward, batch)

    kwargs = {} if k == 1 else {"accumulate": k}
    testing.assert_matches_imperative(_mlp(), loss, optim.sgd(0.1), _batches(1), **kwargs)
    rows = {1: [(0, 1, 2, 3, 4, 5)], 2: [(0, 1, 2), (3, 4, 5)], 4: [(0, 1), (2, 3), (4,), (5,)]}
    cuts = rows[k]
    assert seen == [("imperative", r) for r in cuts] + [("purestep", r) for r in cuts] * 2


@pytest.mark.parametrize(
    "opt",
    [optim.adamw(1e-2, weight_decay=0.1), optim.sgd(0.1, momentum=0.9)],
    ids=["adamw", "sgd_momentum"],
)
def test_a_parameter_without_a_gradient_in_a_step_is_left_alone_on_both_sides(
    opt: optim.Transform,
) -> None:
    """A branch used only in step 0: in later steps its params get no gradient, and the
    imperative loop (``zero_grad(set_to_none=True)``) skips them, as purestep does, so
    momentum and weight decay do not move them."""

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 2), nn.Linear(3, 2)

        def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
            return self.a(x) + self.b(x) if use_b else self.a(x)

    def loss(forward: Callable[..., Any], batch: TensorDictBase) -> torch.Tensor:
        return ((forward(batch["x"], bool(batch["use_b"][0])) - batch["y"][:, :2]) ** 2).mean()

    batches = [{**b, "use_b": torch.full((6,), i == 0)} for i, b in enumerate(_batches(3))]
    torch.manual_seed(0)
    testing.assert_matches_imperative(Branchy(), loss, opt, batches)


@pytest.mark.parametrize("seed", [None, 7], ids=["default", "seed_7"])
def test_the_default_state_is_init_state_of_the_module_with_the_seed(seed: int | None) -> None:
    """Without ``state``, a given step starts from ``init_state({role: model}, {role:
    optimizer}, seed=seed)`` (seed 0 by default): the same params, optimizer state and rng."""
    net = _mlp()
    opts = {"model": optim.adamw(1e-2)}
    inner = ps.train_step(ps.value_and_grad(_loss_fn(net, _mse)), opts)
    first: list[TensorDictBase] = []

    def recording(state: TensorDictBase, batch: Any) -> Any:
        if not first:
            first.append(state.clone())
        return inner(state, batch)

    kwargs = {} if seed is None else {"seed": seed}
    testing.assert_matches_imperative(
        net, _mse, optim.adamw(1e-2), _batches(), step=recording, **kwargs
    )
    want = ps.init_state({"model": net}, opts, seed=0 if seed is None else seed)
    testing.assert_trees_equal(first[0], want)


def test_a_steps_prepare_is_applied_to_the_initial_state() -> None:
    """A step with ``prepare`` (as ``train_step``'s) gets ``prepare(state)`` on its first
    call, and that prepared state is what is compared with the module."""
    net = _mlp()
    inner = ps.train_step(ps.value_and_grad(_loss_fn(net, _mse)), {"model": optim.sgd(0.1)})

    class Prepared:
        def prepare(self, state: TensorDictBase) -> TensorDictBase:
            return state.clone().set(("extra", "prepared"), torch.ones(()))

        def __call__(self, state: TensorDictBase, batch: Any) -> Any:
            assert ("extra", "prepared") in state.keys(include_nested=True)
            new, metrics = inner(state.exclude("extra"), batch)
            return new.set("extra", state["extra"].clone()), metrics

    testing.assert_matches_imperative(net, _mse, optim.sgd(0.1), _batches(), step=Prepared())


def test_buffers_a_state_holds_for_a_module_without_persistent_buffers_are_not_compared() -> None:
    """The comparison covers what the module has: a state with extra ``('buffers', role)``
    entries (a method's own statistics) for a module without persistent buffers passes."""
    net = _mlp()
    opts = {"model": optim.sgd(0.1)}
    inner = ps.train_step(ps.value_and_grad(_loss_fn(net, _mse)), opts)
    state = ps.init_state({"model": net}, opts, seed=0)
    state.set(("buffers", "model", "ema"), torch.zeros(3))

    def with_stats(state: TensorDictBase, batch: Any) -> Any:
        new, metrics = inner(state.exclude("buffers"), batch)
        return new.set("buffers", state["buffers"].clone()), metrics

    testing.assert_matches_imperative(
        net, _mse, optim.sgd(0.1), _batches(), step=with_stats, state=state
    )


def test_a_tolerance_given_alone_is_used_with_the_other_at_zero() -> None:
    """``rtol`` alone (``atol=0``) or ``atol`` alone (``rtol=0``) switches to the tolerant
    comparison: a relative difference of ~1e-7 passes either way."""
    net = _mlp()
    close = ps.train_step(
        ps.value_and_grad(_loss_fn(net, _mse)), {"model": optim.sgd(0.1 * (1 + 1e-6))}
    )
    testing.assert_matches_imperative(net, _mse, optim.sgd(0.1), _batches(), step=close, rtol=1e-4)
    testing.assert_matches_imperative(net, _mse, optim.sgd(0.1), _batches(), step=close, atol=1e-4)
