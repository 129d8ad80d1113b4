"""Misuse gets a clear error, never a silent wrong step (issue 11).

One table: each misuse a new user makes (schedules, state, roles, batches,
donation), the exception type, and a piece of the message that names the
user's object. Every row also checks that nothing the call was given changed
(errors are raised before anything is mutated). Then the properties: random
valid states step, random wrong ones raise a purestep error naming the exact
key path; schedules know the first count at which they go negative.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, TensorDictBase
from torch import nn

import purestep as ps
from _ids import safe_id
from purestep import errors, optim, rng, testing, tree
from purestep.optim import schedules

# --- shared setup ---------------------------------------------------------------------


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(2, 1)


def _loss(net: nn.Module) -> Callable[..., Any]:
    def loss_fn(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        return ((ps.call(net, p["student"], b["x"]) - b["y"]) ** 2).mean(), {}

    return loss_fn


BATCH = {"x": torch.ones(4, 2), "y": torch.zeros(4, 1)}


@dataclass
class Setup:
    net: nn.Module
    opts: dict[str, optim.Transform]
    step: Any
    state: TensorDict
    extra: dict[str, Any] = field(default_factory=dict)


def _setup(opt: optim.Transform | None = None, *, donate: bool = False, **kw: Any) -> Setup:
    net = _net()
    opts = {"student": opt or optim.adamw(1e-2)}
    step = ps.train_step(ps.value_and_grad(_loss(net)), opts, donate=donate, **kw)
    return Setup(net, opts, step, ps.init_state({"student": net}, opts, seed=0))


def _grads(state: TensorDictBase, role: str = "student") -> TensorDict:
    return TensorDict({role: state["params", "student"].apply(torch.ones_like)}, [])


Run = tuple[Callable[[], object], list[TensorDictBase]]


@dataclass(frozen=True)
class Case:
    """A misuse: ``make()`` returns the failing call and the trees it must leave unchanged."""

    name: str
    make: Callable[[], Run]
    exc: type[BaseException]
    match: str


# --- the misuses ----------------------------------------------------------------------


def _schedule_negative_later() -> Run:
    return (lambda: optim.adamw(lr=schedules.linear(0.1, -0.1, 10))), []


def _warmup_negative_peak() -> Run:
    return (lambda: optim.adamw(lr=schedules.warmup_cosine(-1.0, 2, 10))), []


def _join_negative_later() -> Run:
    sched = schedules.join([schedules.constant(0.1), schedules.linear(0.1, -1.0, 4)], [10])
    return (lambda: optim.sgd(lr=sched)), []


def _user_schedule_negative_at_update_2() -> Run:
    s = _setup(optim.sgd(lr=lambda n: 0.1 - 0.1 * n))
    state, _ = s.step(s.state, BATCH)
    state, _ = s.step(state, BATCH)
    return (lambda: s.step(state, BATCH)), [state]


def _user_schedule_nan() -> Run:
    s = _setup(optim.adamw(lr=lambda n: 1e-3 if n == 0 else math.nan), donate=True)
    state, _ = s.step(s.state, BATCH)
    return (lambda: s.step(state, BATCH)), [state]


def _lr_overflows_params() -> Run:
    return (lambda: ps.init_state({"student": _net()}, {"student": optim.sgd(1e300)}, seed=0)), []


def _user_schedule_overflows_later() -> Run:
    s = _setup(optim.sgd(lr=lambda n: 1e-3 if n == 0 else 1e300))
    state, _ = s.step(s.state, BATCH)
    return (lambda: s.step(state, BATCH)), [state]


def _empty_batch() -> Run:
    s = _setup()
    return (lambda: s.step(s.state, {"x": torch.ones(0, 2), "y": torch.zeros(0, 1)})), [s.state]


def _empty_tensordict_batch() -> Run:
    s = _setup(donate=True)
    batch = TensorDict({"x": torch.ones(0, 2), "y": torch.zeros(0, 1)}, [0])
    return (lambda: s.step(s.state, batch)), [s.state]


def _duplicate_index() -> Run:
    s = _setup(donate=True)
    batch = {**BATCH, "index": torch.tensor([5, 3, 5, 0])}
    return (lambda: s.step(s.state, batch)), [s.state]


def _duplicate_index_compiled() -> Run:
    s = _setup()
    step = ps.compile(s.step, backend="eager")  # the host checks the batch before the graph
    batch = {**BATCH, "index": torch.tensor([5, 3, 5, 0])}
    return (lambda: step(s.state, batch)), [s.state]


def _duplicate_index_under_accumulate() -> Run:
    net = _net()
    opts = {"student": optim.sgd(0.1)}
    step = ps.train_step(ps.accumulate(ps.value_and_grad(_loss(net)), 2), opts)
    state = ps.init_state({"student": net}, opts, seed=0)
    batch = TensorDict({**BATCH, "index": torch.tensor([1, 2, 3, 1])}, [4])
    return (lambda: step(state, batch)), [state]


def _same_tensordict_for_two_roles() -> Run:
    td = TensorDict.from_module(_net()).detach().clone()
    opts = {"a": optim.sgd(0.1), "b": optim.sgd(0.1)}
    return (lambda: ps.init_state({"a": td, "b": td}, opts, seed=0)), [td]


def _same_tensor_under_two_keys() -> Run:
    w = torch.ones(3)
    td = TensorDict({"w": w, "v": w}, [])
    return (lambda: ps.init_state({"m": td}, {"m": optim.sgd(0.1)}, seed=0)), [td]


def _expanded_param() -> Run:
    td = TensorDict({"w": torch.ones(1).expand(3)}, [])
    return (lambda: ps.init_state({"m": td}, {"m": optim.sgd(0.1)}, seed=0)), []


def _shared_leaves_in_a_hand_built_state() -> Run:
    s = _setup(donate=True)
    state = s.state.clone()
    state["opt_state", "student", "mu", "weight"] = state["params", "student", "weight"]
    return (lambda: s.step(state, BATCH)), [state]


def _train_step_without_optimizers() -> Run:
    return (lambda: ps.train_step(ps.value_and_grad(_loss(_net())), {})), []


def _train_step_with_a_transform_not_a_mapping() -> Run:
    gf = ps.value_and_grad(_loss(_net()))
    return (lambda: ps.train_step(gf, optim.adamw(1e-3))), []  # type: ignore[arg-type]


def _accumulate_true() -> Run:
    return (lambda: ps.accumulate(ps.value_and_grad(_loss(_net())), True)), []


def _every_true() -> Run:
    gf = ps.value_and_grad(_loss(_net()))
    return (lambda: ps.train_step(gf, {"student": optim.sgd(0.1)}, every={"student": True})), []


def _every_unknown_role() -> Run:
    gf = ps.value_and_grad(_loss(_net()))
    return (lambda: ps.train_step(gf, {"student": optim.sgd(0.1)}, every={"critic": 2})), []


def _donated_state_stepped_again() -> Run:
    s = _setup(donate=True)
    state = s.state
    s.step(state, BATCH)
    return (lambda: s.step(state, BATCH)), [state]


def _donated_state_given_to_apply_gradients() -> Run:
    s = _setup()
    state = s.state
    ps.apply_gradients(state, _grads(state), s.opts, donate=True)
    return (lambda: ps.apply_gradients(state, _grads(state), s.opts)), [state]


def _donated_state_given_to_with_ema() -> Run:
    s = _setup(donate=True)
    step = ps.with_ema(s.step, 0.9, ["student"])
    state = step.prepare(s.state)
    step(state, BATCH)
    return (lambda: step(state, BATCH)), [state]


def _donated_skipped_step_reused() -> Run:
    net = _net()
    opts = {"student": optim.sgd(0.1)}

    def nan_loss(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        return ps.call(net, p["student"], b["x"]).sum() * math.nan, {}

    step = ps.skip_nonfinite(ps.train_step(ps.value_and_grad(nan_loss), opts, donate=True))
    state = step.prepare(ps.init_state({"student": net}, opts, seed=0))
    step(state, BATCH)
    return (lambda: step(state, BATCH)), [state]


def _grads_for_an_unknown_role() -> Run:
    s = _setup()
    grads = _grads(s.state, "nope")
    opts = {"nope": optim.sgd(0.1)}
    return (lambda: ps.apply_gradients(s.state, grads, opts)), [s.state]


def _roles_names_an_unknown_role() -> Run:
    s = _setup()
    return (lambda: ps.apply_gradients(s.state, _grads(s.state), s.opts, roles=["nope"])), [s.state]


def _roles_given_as_a_string() -> Run:
    s = _setup()
    return (lambda: ps.apply_gradients(s.state, _grads(s.state), s.opts, roles="student")), [
        s.state
    ]


def _adamw_state_stepped_with_sgd() -> Run:
    s = _setup(optim.adamw(1e-3))
    other = ps.train_step(ps.value_and_grad(_loss(s.net)), {"student": optim.sgd(0.1, 0.9)})
    return (lambda: other(s.state, BATCH)), [s.state]


def _sgd_state_stepped_with_adamw_in_apply_gradients() -> Run:
    s = _setup(optim.sgd(0.1, momentum=0.9))
    opts = {"student": optim.adamw(1e-3)}
    return (lambda: ps.apply_gradients(s.state, _grads(s.state), opts, donate=True)), [s.state]


def _state_without(key: str) -> Callable[[], Run]:
    def make() -> Run:
        s = _setup()
        state = s.state.exclude(key)
        return (lambda: s.step(state, BATCH)), [state]

    return make


def _step_counter_of_another_dtype() -> Run:
    s = _setup()
    state = s.state.clone()
    state["step"] = torch.zeros((), dtype=torch.float32)
    return (lambda: s.step(state, BATCH)), [state]


def _params_without_a_leaf() -> Run:
    s = _setup(donate=True)
    state = s.state.clone()
    del state["params", "student", "bias"]
    return (lambda: s.step(state, BATCH)), [state]


def _params_with_an_extra_leaf() -> Run:
    s = _setup()
    state = s.state.clone()
    state["params", "student", "extra"] = torch.zeros(3)
    return (lambda: s.step(state, BATCH)), [state]


def _params_reshaped_in_place_after_a_step() -> Run:
    s = _setup(donate=True)
    state, _ = s.step(s.state, BATCH)  # its nodes are checked now
    state["params", "student", "bias"] = torch.zeros(3)  # edited in place
    return (lambda: s.step(state, BATCH)), [state]


def _optimizer_for_a_role_without_params() -> Run:
    s = _setup()
    opts = {"student": s.opts["student"], "critic": optim.sgd(0.1)}
    step = ps.train_step(ps.value_and_grad(_loss(s.net)), opts)
    return (lambda: step(s.state, BATCH)), [s.state]


def _loss_returns_a_bare_tensor() -> Run:
    s = _setup()
    net = s.net

    def bare(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        return (ps.call(net, p["student"], b["x"]) ** 2).mean()

    step = ps.train_step(ps.value_and_grad(bare), s.opts)
    return (lambda: step(s.state, BATCH)), [s.state]


def _loss_returns_a_string_metric() -> Run:
    s = _setup()
    net = s.net

    def loss_fn(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        return (ps.call(net, p["student"], b["x"]) ** 2).mean(), {"n": 4, "phase": "warmup"}

    step = ps.train_step(ps.value_and_grad(loss_fn), s.opts)
    return (lambda: step(s.state, BATCH)), [s.state]


def _grad_fn_given_a_bare_tensor_role() -> Run:
    params = TensorDict({"model": {"w": torch.ones(2)}, "w": torch.ones(2)}, [])

    def loss_fn(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        return (p["model", "w"] * p["w"]).sum(), {}

    grad_fn = ps.value_and_grad(loss_fn)
    return (lambda: grad_fn(params, TensorDict({}, []), torch.tensor(0))), [params]


def _state_and_batch_swapped() -> Run:
    s = _setup()
    return (lambda: s.step(BATCH, s.state)), [s.state]


def _init_state_given_a_module() -> Run:
    return (lambda: ps.init_state(_net(), {}, seed=0)), []  # type: ignore[arg-type]


def _ema_of_another_shape() -> Run:
    s = _setup()
    step = ps.with_ema(s.step, 0.9, ["student"])
    state = step.prepare(s.state).clone()
    state["ema", "student", "bias"] = torch.zeros(2)
    return (lambda: step(state, BATCH)), [state]


def _rng_shape(fn: Callable[..., Any]) -> Callable[[], Run]:
    return lambda: ((lambda: fn(rng.key(0), (2**62, 4))), [])


CASES = [
    # schedules: checked over their whole domain when the optimizer is built
    Case("linear lr goes negative", _schedule_negative_later, errors.ScheduleError, "count 6"),
    Case("warmup_cosine(peak=-1)", _warmup_negative_peak, errors.ScheduleError, "count 1"),
    Case("join goes negative", _join_negative_later, errors.ScheduleError, "count 11"),
    Case(
        "user lr callable negative",
        _user_schedule_negative_at_update_2,
        errors.ScheduleError,
        "at update 2",
    ),
    Case("user lr callable NaN", _user_schedule_nan, errors.ScheduleError, "is nan"),
    Case("lr=1e300", _lr_overflows_params, errors.ScheduleError, "overflows torch.float32"),
    Case(
        "user lr reaches 1e300",
        _user_schedule_overflows_later,
        errors.ScheduleError,
        "at update 1 is 1e+300",
    ),
    # batches
    Case("B=0 dict batch", _empty_batch, errors.BatchError, "B=0"),
    Case("B=0 TensorDict batch", _empty_tensordict_batch, errors.BatchError, "B=0"),
    Case("duplicate index", _duplicate_index, errors.BatchError, "5 at positions [0, 2]"),
    Case(
        "duplicate index, compiled",
        _duplicate_index_compiled,
        errors.BatchError,
        "5 at positions [0, 2]",
    ),
    Case(
        "duplicate index, accumulate",
        _duplicate_index_under_accumulate,
        errors.BatchError,
        "1 at positions [0, 3]",
    ),
    # memory shared between roles or leaves
    Case(
        "one TensorDict for two roles",
        _same_tensordict_for_two_roles,
        errors.StateError,
        "params.a.weight shares memory with params.b.weight",
    ),
    Case(
        "one tensor under two keys",
        _same_tensor_under_two_keys,
        errors.StateError,
        "params.m.w shares memory with params.m.v",
    ),
    Case("expanded param", _expanded_param, errors.StateError, "params.m.w overlaps itself"),
    Case(
        "moment aliases a param (donated)",
        _shared_leaves_in_a_hand_built_state,
        errors.StateError,
        "params.student.weight shares memory with opt_state.student.mu.weight",
    ),
    # step construction
    Case(
        "train_step(grad_fn, {})", _train_step_without_optimizers, ValueError, "optimizers is empty"
    ),
    Case(
        "train_step(grad_fn, adamw())",
        _train_step_with_a_transform_not_a_mapping,
        TypeError,
        "optimizers is a Transform",
    ),
    Case("accumulate(grad_fn, True)", _accumulate_true, TypeError, "got True"),
    Case("every={'student': True}", _every_true, TypeError, "every['student']"),
    Case("every for an unknown role", _every_unknown_role, errors.RoleError, "every['critic']"),
    # donation
    Case(
        "donated state stepped again",
        _donated_state_stepped_again,
        errors.DonatedStateError,
        "donated train_step at step 0",
    ),
    Case(
        "donated state to apply_gradients",
        _donated_state_given_to_apply_gradients,
        errors.DonatedStateError,
        "apply_gradients(donate=True)",
    ),
    Case(
        "donated state to with_ema",
        _donated_state_given_to_with_ema,
        errors.DonatedStateError,
        "with_ema: this state was donated",
    ),
    Case(
        "donated skipped step reused",
        _donated_skipped_step_reused,
        errors.DonatedStateError,
        "(skipped)",
    ),
    # roles
    Case(
        "grads for an unknown role",
        _grads_for_an_unknown_role,
        errors.RoleError,
        "grads for role 'nope', but the state has no params.nope",
    ),
    Case(
        "roles=['nope']",
        _roles_names_an_unknown_role,
        errors.RoleError,
        "no optimizer for role 'nope'",
    ),
    Case("roles='student'", _roles_given_as_a_string, TypeError, "use ['student']"),
    Case(
        "optimizer for a role without params",
        _optimizer_for_a_role_without_params,
        errors.StateError,
        "no params.critic",
    ),
    # state structure
    Case(
        "adamw state, sgd step",
        _adamw_state_stepped_with_sgd,
        errors.StateError,
        "missing opt_state.student.momentum_buffer",
    ),
    Case(
        "sgd state, adamw apply_gradients",
        _sgd_state_stepped_with_adamw_in_apply_gradients,
        errors.StateError,
        "unexpected opt_state.student.momentum_buffer",
    ),
    Case("state without step", _state_without("step"), errors.StateError, "no 'step'"),
    Case("state without rng", _state_without("rng"), errors.StateError, "no 'rng'"),
    Case("state without opt_state", _state_without("opt_state"), errors.StateError, "'opt_state'"),
    Case("state without params", _state_without("params"), errors.StateError, "no 'params'"),
    Case(
        "float step counter",
        _step_counter_of_another_dtype,
        errors.StateError,
        "state['step'] is a torch.float32 tensor",
    ),
    Case(
        "params missing a leaf",
        _params_without_a_leaf,
        errors.StateError,
        "params.student.bias is missing",
    ),
    Case(
        "params with an extra leaf",
        _params_with_an_extra_leaf,
        errors.StateError,
        "params.student.extra has no optimizer state",
    ),
    Case(
        "param reshaped in place after a step",
        _params_reshaped_in_place_after_a_step,
        errors.StateError,
        "for params.student.bias",
    ),
    Case(
        "ema of another shape",
        _ema_of_another_shape,
        errors.StateError,
        "ema.student.bias is a torch.float32 tensor of shape (2,)",
    ),
    # calls
    Case(
        "loss returns a bare tensor",
        _loss_returns_a_bare_tensor,
        TypeError,
        "loss_fn must return (loss, metrics), got a Tensor",
    ),
    Case(
        "loss returns a string metric",
        _loss_returns_a_string_metric,
        TypeError,
        "loss_fn returned metric 'phase' = 'warmup' of type str; a metric must be a tensor or "
        "a number",
    ),
    Case(
        "value_and_grad given a bare tensor role",
        _grad_fn_given_a_bare_tensor_role,
        TypeError,
        "params['w'] is a Tensor, not a tree of tensors: value_and_grad takes params as "
        "{role: {name: tensor}}; put it under a role, e.g. {'model': {'w': ...}}",
    ),
    Case("step(batch, state)", _state_and_batch_swapped, TypeError, "step(state, batch)"),
    Case("init_state(module, ...)", _init_state_given_a_module, TypeError, "params is a Linear"),
    Case("rng.normal((2**62, 4))", _rng_shape(rng.normal), ValueError, "about 2**64"),
    Case("rng.uniform((2**62, 4))", _rng_shape(rng.uniform), ValueError, "about 2**64"),
    Case(
        "rng.randint((2**62, 4))",
        _rng_shape(lambda k, s: rng.randint(k, 0, 10, s)),
        ValueError,
        "about 2**64",
    ),
    Case(
        "rng.bernoulli((2**62, 4))",
        _rng_shape(lambda k, s: rng.bernoulli(k, 0.5, s)),
        ValueError,
        "about 2**64",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[safe_id(c.name) for c in CASES])
def test_misuse_raises_a_clear_error_before_anything_changes(case: Case) -> None:
    """Each misuse raises the documented type, naming the user's object, and mutates nothing."""
    call, watched = case.make()
    before = [testing.snapshot(t) for t in watched]
    with pytest.raises(case.exc) as info:
        call()
    assert case.match in str(info.value), str(info.value)
    for t, b in zip(watched, before, strict=True):
        testing.assert_trees_equal(t, b, what=f"input of {case.name!r} after the error")


def test_purestep_errors_are_the_builtins_they_replace() -> None:
    """except ValueError / KeyError / RuntimeError clauses still catch purestep's errors."""
    assert issubclass(errors.StateError, KeyError) and issubclass(errors.StateError, ValueError)
    assert issubclass(errors.RoleError, KeyError) and issubclass(errors.BatchError, ValueError)
    assert issubclass(errors.ScheduleError, ValueError)
    assert issubclass(errors.DonatedStateError, RuntimeError)
    assert issubclass(errors.NonFiniteError, FloatingPointError)
    assert issubclass(errors.ModuleInUseError, RuntimeError)
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.PurestepError)
        assert getattr(ps, name) is getattr(errors, name)
    e = errors.StateError("params.m.w is missing", path=("params", "m", "w"))
    assert str(e) == "params.m.w is missing"  # not KeyError's quoted repr


# --- apply_gradients: its own argument checks, whole messages -------------------------------


def _apply_setup() -> tuple[TensorDict, dict[str, optim.Transform], TensorDict]:
    """A one-role sgd state (lr 0.1, no momentum), its optimizers and all-ones grads."""
    s = _setup(optim.sgd(0.1))
    return s.state, s.opts, _grads(s.state)


APPLY_TYPE_ERRORS: dict[str, tuple[Callable[..., object], str]] = {
    "grads a dict": (
        lambda s, o, g: ps.apply_gradients(s, g.to_dict(), o),
        "apply_gradients: grads is a dict; expected a TensorDict {role: tree} as value_and_grad "
        "returns",
    ),
    "optimizers a list": (
        lambda s, o, g: ps.apply_gradients(s, g, list(o.values())),
        "apply_gradients: optimizers is a list; expected a mapping {role: Transform}, e.g. "
        "{'student': optim.adamw(1e-3)}",
    ),
    "roles an int": (
        lambda s, o, g: ps.apply_gradients(s, g, o, roles=3),
        "apply_gradients: roles must be a list of role names, got 3",
    ),
    "roles a string": (
        lambda s, o, g: ps.apply_gradients(s, g, o, roles="student"),
        "apply_gradients: roles must be a list of role names, got 'student'; use ['student']",
    ),
}


@pytest.mark.parametrize("name", sorted(APPLY_TYPE_ERRORS))
def test_apply_gradients_refuses_arguments_of_the_wrong_type_saying_what_it_got(name: str) -> None:
    """grads not a TensorDict, optimizers not a mapping, roles not a list: a TypeError whose
    whole message names the call, the type given and what is expected (the ``[role]`` hint only
    for a string)."""
    call, message = APPLY_TYPE_ERRORS[name]
    state, opts, grads = _apply_setup()
    before = testing.snapshot(state)
    with pytest.raises(TypeError) as info:
        call(state, opts, grads)
    assert str(info.value) == message
    testing.assert_trees_equal(state, before, what="the state after the error")


APPLY_ROLE_ERRORS: dict[str, tuple[Callable[..., object], str]] = {
    "no optimizer": (
        lambda s, o, g: ps.apply_gradients(s, g, o, roles=["critic"]),
        "apply_gradients: no optimizer for role 'critic' (optimizers: ['student'])",
    ),
    "no grads": (
        lambda s, o, g: ps.apply_gradients(s, g, {**o, "critic": optim.sgd(0.1)}, roles=["critic"]),
        "apply_gradients: no grads for role 'critic' (grads has roles ['student'])",
    ),
    "no params": (
        lambda s, o, g: ps.apply_gradients(
            s, TensorDict({"critic": g["student"]}, []), {"critic": optim.sgd(0.1)}
        ),
        "apply_gradients: grads for role 'critic', but the state has no params.critic "
        "(roles with params: ['student'])",
    ),
}


@pytest.mark.parametrize("name", sorted(APPLY_ROLE_ERRORS))
def test_apply_gradients_names_the_role_it_cannot_update_in_message_and_attribute(
    name: str,
) -> None:
    """A role without an optimizer, grads or params raises RoleError with ``.role`` set to it
    and a message listing the roles there are; nothing is changed."""
    call, message = APPLY_ROLE_ERRORS[name]
    state, opts, grads = _apply_setup()
    before = testing.snapshot(state)
    with pytest.raises(errors.RoleError) as info:
        call(state, opts, grads)
    assert str(info.value) == message
    assert info.value.role == "critic"
    testing.assert_trees_equal(state, before, what="the state after the error")


def test_apply_gradients_refuses_a_donated_state_before_looking_at_its_roles() -> None:
    """A donated state is refused first (its buffers belong to the state that step returned),
    even when its roles do not fit the grads either; the message names apply_gradients."""
    state, opts, grads = _apply_setup()
    ps.apply_gradients(state, grads, opts, donate=True)
    with pytest.raises(errors.DonatedStateError) as info:
        ps.apply_gradients(
            state, TensorDict({"critic": grads["student"]}, []), {"critic": opts["student"]}
        )
    assert str(info.value).startswith(
        "apply_gradients: this state was donated to apply_gradients(donate=True) (donate=True), "
        "which updated its buffers in place"
    ), str(info.value)


def test_apply_gradients_state_errors_name_apply_gradients() -> None:
    """A state that does not fit the optimizers raises a StateError whose message is prefixed
    with apply_gradients (not another caller's name)."""
    state, opts, grads = _apply_setup()
    with pytest.raises(errors.StateError) as info:
        ps.apply_gradients(state.exclude("opt_state"), grads, opts)
    assert str(info.value) == (
        "apply_gradients: the state has no 'opt_state' ({role: optimizer state}); it has "
        "['params', 'rng', 'step']. Build states with purestep.init_state (and step.prepare "
        "for the keys wrappers add)"
    )


def test_apply_gradients_is_pure_by_default_and_applies_the_sgd_formula() -> None:
    """Without donate the input is neither changed nor marked donated: two calls on it give
    the same new state, params - lr * grad, with ``step`` untouched."""
    state, opts, grads = _apply_setup()
    before = testing.snapshot(state)
    a = ps.apply_gradients(state, grads, opts)
    b = ps.apply_gradients(state, grads, opts)
    assert not ps.step.is_donated(state)
    testing.assert_trees_equal(state, before, what="the input after two calls")
    testing.assert_trees_equal(a, b)
    want = state["params", "student"].apply(lambda p: p - 0.1)
    testing.assert_trees_equal(a["params", "student"], want)
    assert int(a["step"]) == int(state["step"]) == 0


def test_apply_gradients_needs_no_step_or_rng_counters() -> None:
    """apply_gradients does not read ``step`` or ``rng``: a state without them is updated
    exactly like the full state, donated or not."""
    for donate in (False, True):
        state, opts, grads = _apply_setup()
        want = ps.apply_gradients(state.clone(), grads, opts)
        got = ps.apply_gradients(state.exclude("step", "rng"), grads, opts, donate=donate)
        assert sorted(got.keys()) == ["opt_state", "params"]
        testing.assert_trees_equal(got, want.exclude("step", "rng"), what=f"donate={donate}")


def test_a_donated_apply_gradients_refuses_params_sharing_memory() -> None:
    """donate=True with two params that share memory is a StateError naming both (the donated
    update would write that memory twice) and changes nothing; without donate the same state
    is updated out of place."""
    state, opts, grads = _apply_setup()
    state["params", "student", "bias"] = state["params", "student", "weight"].view(-1)[:1]
    before = testing.snapshot(state)
    with pytest.raises(errors.StateError) as info:
        ps.apply_gradients(state, grads, opts, donate=True)
    assert str(info.value).startswith(
        "apply_gradients: params.student.weight shares memory with params.student.bias, so a "
        "donated step would update that memory twice."
    ), str(info.value)
    testing.assert_trees_equal(state, before, what="the state after the error")
    assert not ps.step.is_donated(state)
    out = ps.apply_gradients(state, grads, opts)
    testing.assert_trees_equal(state, before, what="the state after a non-donated update")
    testing.assert_trees_equal(
        out["params", "student"], state["params", "student"].apply(lambda p: p - 0.1)
    )


def test_a_bound_role_is_updated_in_place_by_a_donated_apply_gradients_only() -> None:
    """Params that are a module's own nn.Parameters (a bound role, as FSDP binds them) need
    donate=True: without it a ValueError says so; with it the module's parameters are the
    returned params, updated in place by the sgd formula."""
    net = _net()
    opts = {"student": optim.sgd(0.1)}
    state = ps.init_state({"student": net}, opts, seed=0)
    state["params", "student"] = TensorDict(dict(net.named_parameters()), [])
    grads = _grads(state)
    with pytest.raises(ValueError, match="bound to a module") as info:
        ps.apply_gradients(state, grads, opts)
    assert str(info.value) == (
        "role 'student' is bound to a module (FSDP); its params are the module's own "
        "parameters and are updated in place: build the step with donate=True"
    )
    w0 = net.weight.detach().clone()
    out = ps.apply_gradients(state, grads, opts, donate=True)
    assert out["params", "student", "weight"] is net.weight
    torch.testing.assert_close(net.weight.detach(), w0 - 0.1, rtol=0, atol=1e-7)


def test_a_donated_apply_gradients_updates_in_place_and_shares_the_subtrees() -> None:
    """donate=True returns a new top-level node holding the input's own subtrees and buffers
    (no copies), updated in place by the sgd formula; the input is then marked donated."""
    state, opts, grads = _apply_setup()
    want = state["params", "student"].apply(lambda p: p - 0.1)
    params, opt_state = state["params"], state["opt_state"]
    weight = state["params", "student", "weight"]
    out = ps.apply_gradients(state, grads, opts, donate=True)
    assert out is not state and ps.step.is_donated(state) and not ps.step.is_donated(out)
    assert out["params"] is params and out["opt_state"] is opt_state
    assert out["params", "student", "weight"] is weight
    testing.assert_trees_equal(out["params", "student"], want)


def test_apply_gradients_names_the_role_whose_optimizer_failed() -> None:
    """An optimizer's error (a negative scheduled lr, grads of the wrong shape) is re-raised
    with its type and the role in front of its message; nothing is changed."""
    opts = {"student": optim.sgd(lambda n: 0.1 if n < 1 else -1.0)}
    state = ps.init_state({"student": _net()}, opts, seed=0)
    grads = _grads(state)
    state = ps.apply_gradients(state, grads, opts)
    before = testing.snapshot(state)
    with pytest.raises(errors.ScheduleError) as info:
        ps.apply_gradients(state, grads, opts, donate=True)
    assert str(info.value) == (
        "role 'student': sgd: the learning rate at update 1 is -1.0; it must be finite and >= 0 "
        "(check the schedule)"
    )
    grads["student", "bias"] = torch.ones(3)
    with pytest.raises(ValueError, match="grads at bias") as wrong:
        ps.apply_gradients(state, grads, opts)
    assert (
        str(wrong.value)
        == "role 'student': grads at bias has shape (3,), but params has shape (1,)"
    )
    assert type(wrong.value) is ValueError
    testing.assert_trees_equal(state, before, what="the state after the errors")
    assert not ps.step.is_donated(state)


def test_apply_gradients_on_a_state_edited_after_its_check_names_the_wrong_key() -> None:
    """A checked state whose param is then replaced in place by one of another shape: the
    optimizer's error becomes a StateError of apply_gradients naming both key paths."""
    opts = {"student": optim.adamw(1e-2)}
    state = ps.init_state({"student": _net()}, opts, seed=0)
    grads = _grads(state)
    state = ps.apply_gradients(state, grads, opts)  # its nodes are checked now
    state["params", "student", "bias"] = torch.zeros(3)
    with pytest.raises(errors.StateError) as info:
        ps.apply_gradients(state, grads, opts)
    assert str(info.value) == (
        "apply_gradients: opt_state.student does not fit params.student (optimizer adamw): "
        "opt_state.student.mu.bias, opt_state.student.nu.bias are a torch.float32 tensor of "
        "shape (1,), expected a torch.float32 tensor of shape (3,) for params.student.bias. "
        "params and opt_state must describe the same parameters: change them together, or "
        "rebuild the state with init_state"
    )
    assert isinstance(info.value.__cause__, ValueError)


def _two_roles() -> tuple[TensorDict, dict[str, optim.Transform], TensorDict]:
    """Roles a and b (sgd, lr 0.1) and grads for both, b's bias grad of the wrong shape."""
    opts = {"a": optim.sgd(0.1), "b": optim.sgd(0.1)}
    state = ps.init_state({"a": _net(), "b": _net()}, opts, seed=0)
    grads = TensorDict({r: state["params", r].apply(torch.ones_like) for r in "ab"}, [])
    grads["b", "bias"] = torch.ones(3)
    return state, opts, grads


@pytest.mark.parametrize("donate", [False, True])
def test_apply_gradients_failing_at_the_second_role_consumes_only_a_donated_state(
    donate: bool,
) -> None:
    """Roles a then b, b's grads of the wrong shape: the error names b. Without donate the
    state is unchanged and usable; donated, a was already updated in place, so the state is
    marked as donated to a call that failed part-way."""
    state, opts, grads = _two_roles()
    before = testing.snapshot(state)
    with pytest.raises(ValueError, match="grads at bias") as info:
        ps.apply_gradients(state, grads, opts, roles=["a", "b"], donate=donate)
    assert str(info.value) == "role 'b': grads at bias has shape (3,), but params has shape (1,)"
    assert ps.step.is_donated(state) == donate
    if not donate:
        testing.assert_trees_equal(state, before, what="the state after the error")
        return
    with pytest.raises(errors.DonatedStateError) as used:
        ps.apply_gradients(state, grads, opts, roles=["a"])
    assert str(used.value).startswith(
        "apply_gradients: this state was donated to an apply_gradients call that failed "
        "part-way (donate=True)"
    ), str(used.value)


def test_a_donated_apply_gradients_failing_at_its_first_role_leaves_the_state_usable() -> None:
    """The first role's optimizer checks its inputs before writing: when it fails, nothing
    was updated, the donated state is not consumed and steps normally afterwards."""
    state, opts, grads = _two_roles()
    before = testing.snapshot(state)
    with pytest.raises(ValueError, match="grads at bias") as info:
        ps.apply_gradients(state, grads, opts, roles=["b", "a"], donate=True)
    assert str(info.value) == "role 'b': grads at bias has shape (3,), but params has shape (1,)"
    assert not ps.step.is_donated(state)
    testing.assert_trees_equal(state, before, what="the state after the error")
    out = ps.apply_gradients(state, grads, opts, roles=["a"], donate=True)
    testing.assert_trees_equal(out["params", "a"], before["params", "a"].apply(lambda p: p - 0.1))


# --- train_step: its argument checks, whole messages ------------------------------------------


def _sum_loss(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
    return sum(t.sum() for t in tree.leaves(p["student"])) * b["x"].mean(), {}


TRAIN_STEP_ERRORS: dict[str, tuple[dict[str, Any], type[Exception], str]] = {
    "grad_fn an int": (
        {"grad_fn": 3},
        TypeError,
        "train_step: grad_fn is a int, not callable; pass value_and_grad(loss_fn) (optionally "
        "wrapped in accumulate)",
    ),
    "optimizers a list": (
        {"optimizers": [optim.sgd(0.1)]},
        TypeError,
        "train_step: optimizers is a list; expected a mapping {role: Transform}, e.g. "
        "{'student': optim.adamw(1e-3)}",
    ),
    "optimizers empty": (
        {"optimizers": {}},
        ValueError,
        "train_step: optimizers is empty, so the step would update nothing while "
        "state['step'] advances; pass {role: Transform} for the roles to train",
    ),
    "optimizer a string": (
        {"optimizers": {"student": "sgd"}},
        TypeError,
        "optimizers['student'] is str, not a Transform",
    ),
    "every a list": (
        {"every": [2]},
        TypeError,
        "train_step: every is a list; expected a mapping {role: N}",
    ),
    "every for another role": (
        {"every": {"critic": 2}},
        errors.RoleError,
        "train_step: every['critic'] given, but there is no optimizer for it "
        "(optimizers: ['student'])",
    ),
    "every True": (
        {"every": {"student": True}},
        TypeError,
        "train_step: every['student'] must be an int N >= 1 (update on steps that are "
        "multiples of N), got True",
    ),
    "every a float": (
        {"every": {"student": 2.0}},
        TypeError,
        "train_step: every['student'] must be an int N >= 1 (update on steps that are "
        "multiples of N), got 2.0",
    ),
    "every 0": (
        {"every": {"student": 0}},
        ValueError,
        "train_step: every['student'] must be a positive int, got 0",
    ),
    "every -1": (
        {"every": {"student": -1}},
        ValueError,
        "train_step: every['student'] must be a positive int, got -1",
    ),
    "donate 1": ({"donate": 1}, TypeError, "train_step: donate must be a bool, got 1"),
    "grad_norm None": (
        {"grad_norm": None},
        TypeError,
        "train_step: grad_norm must be a bool, got None",
    ),
}


@pytest.mark.parametrize("name", sorted(TRAIN_STEP_ERRORS))
def test_train_step_refuses_bad_arguments_when_built_with_the_whole_message(name: str) -> None:
    """Each wrong argument of train_step raises, when the step is built, the documented type
    with a message naming the argument and the value given."""
    change, exc, message = TRAIN_STEP_ERRORS[name]
    kw: dict[str, Any] = {
        "grad_fn": ps.value_and_grad(_sum_loss),
        "optimizers": {"student": optim.sgd(0.1)},
        **change,
    }
    with pytest.raises(exc) as info:
        ps.train_step(kw.pop("grad_fn"), kw.pop("optimizers"), **kw)
    assert type(info.value) is exc
    assert str(info.value) == message
    if exc is errors.RoleError:
        assert info.value.role == "critic"


def test_train_step_keeps_its_own_copy_of_the_arguments() -> None:
    """The built step holds the grad function, a copy of optimizers and every (editing the
    caller's dicts afterwards changes nothing) and the flags as given; defaults: every role
    each step, no donation, the grad-norm metric on; every N=1 is allowed."""
    gf = ps.value_and_grad(_sum_loss)
    sgd = optim.sgd(0.1)
    opts = {"student": sgd}
    every = {"student": 2}
    step = ps.train_step(gf, opts, every=every, donate=True, grad_norm=False)
    opts["critic"] = optim.sgd(0.2)
    every["student"] = 5
    assert step.grad_fn is gf
    assert list(step.optimizers) == ["student"] and step.optimizers["student"] is sgd
    assert step.every == {"student": 2}
    assert step.donate is True and step.grad_norm is False
    plain = ps.train_step(gf, {"student": sgd})
    assert plain.every == {} and plain.donate is False and plain.grad_norm is True
    assert plain.due_roles(0) == plain.due_roles(7) == ["student"]
    each = ps.train_step(gf, {"student": sgd}, every={"student": 1})  # 1 is the smallest N
    assert each.every == {"student": 1} and each.due_roles(7) == ["student"]
    assert [step.due_roles(n) for n in range(5)] == [["student"], [], ["student"], [], ["student"]]


# --- donation: the mark costs nothing and never blocks the returned state -----------------


def test_a_donated_step_returns_a_new_state_that_keeps_working() -> None:
    """Donated steps chain: each returns a fresh top-level state sharing the buffers."""
    s = _setup(donate=True)
    state = s.state
    weight = state["params", "student", "weight"]
    for _ in range(3):
        new, _ = s.step(state, BATCH)
        assert new is not state and ps.step.is_donated(state) and not ps.step.is_donated(new)
        assert new["params", "student", "weight"] is weight  # updated in its own buffer
        state = new
    assert int(state["step"]) == 3


def test_a_failed_donated_step_before_any_update_leaves_the_state_usable() -> None:
    """An error raised before the first in-place write does not consume the state."""
    s = _setup(optim.sgd(lr=lambda n: 0.1 if n < 1 else -1.0), donate=True)
    state, _ = s.step(s.state, BATCH)
    with pytest.raises(errors.ScheduleError):
        s.step(state, BATCH)
    assert not ps.step.is_donated(state)
    with pytest.raises(errors.BatchError):
        s.step(state, {"x": torch.ones(0, 2), "y": torch.zeros(0, 1)})
    assert not ps.step.is_donated(state)


def test_the_non_donated_path_never_marks_its_input() -> None:
    """donate=False: the input may be stepped again (a fork), giving the same result."""
    s = _setup()
    a, _ = s.step(s.state, BATCH)
    b, _ = s.step(s.state, BATCH)
    testing.assert_trees_equal(a, b)


def test_a_donated_state_used_again_raises_naming_the_caller_and_the_step() -> None:
    """check_live raises DonatedStateError with the whole message (who, what it was donated to,
    how to continue) for the marked state only; its copies and the fresh top are live."""
    from purestep.step import _donation

    state = TensorDict({"step": torch.zeros((), dtype=torch.int64)}, [])
    copy = state.copy()
    _donation.mark_donated(state, "a donated train_step at step 7")
    top = _donation.fresh_top(state)
    with pytest.raises(errors.DonatedStateError) as info:
        _donation.check_live(state, "with_ema")
    assert str(info.value) == (
        "with_ema: this state was donated to a donated train_step at step 7 (donate=True), "
        "which updated its buffers in place and returned a new state that owns them; using "
        "this one again would apply a second update to the same buffers. Continue from the "
        "state that step returned (state, metrics = step(state, batch)), or build the step "
        "with donate=False to keep its input"
    )
    for live in (copy, top, TensorDict({}, [])):
        _donation.check_live(live, "with_ema")
        assert not ps.step.is_donated(live)


class _Slotted:
    """A state-like object without a ``__dict__`` (weak references only)."""

    __slots__ = ("__weakref__",)


class _Bare:
    """Neither a ``__dict__`` nor weak references: it cannot be marked."""

    __slots__ = ()


def test_an_object_without_a_dict_is_marked_by_a_weak_entry_that_dies_with_it() -> None:
    """An object without ``__dict__`` is marked in a side table keyed by its id, holding a weak
    reference: marked (twice: the last mark is the one named) it reads as donated, and its entry
    goes when it dies; one without weak references is left unmarked."""
    import gc

    from purestep.step import _donation

    obj, other = _Slotted(), _Slotted()
    key = id(obj)
    _donation.mark_donated(obj, "a first step")  # type: ignore[arg-type]
    _donation.mark_donated(obj, "a second step")  # type: ignore[arg-type]
    assert ps.step.is_donated(obj) and not ps.step.is_donated(other)  # type: ignore[arg-type]
    with pytest.raises(
        errors.DonatedStateError, match=r"^t: this state was donated to a second step "
    ):
        _donation.check_live(obj, "t")  # type: ignore[arg-type]
    assert key in _donation._OTHER
    del obj
    gc.collect()
    assert key not in _donation._OTHER
    bare = _Bare()
    _donation.mark_donated(bare, "a step")  # type: ignore[arg-type]
    assert not ps.step.is_donated(bare)  # type: ignore[arg-type]
    assert id(bare) not in _donation._OTHER


@pytest.mark.parametrize(
    ("batch_size", "names", "device"),
    [
        ([], None, None),
        ([], None, "cpu"),
        ([3], None, None),
        ([3, 2], None, "cpu"),
        ([3, 2], ["b", None], None),
        ([3], ["b"], "cpu"),
    ],
)
def test_fresh_top_is_a_new_top_level_with_the_same_entries_shape_names_and_device(
    batch_size: list[int], names: list[str | None] | None, device: str | None
) -> None:
    """fresh_top returns a new TensorDict sharing the entries (subtrees are the same objects),
    with the input's batch size, device and dimension names; unnamed stays unnamed (tensordict
    keeps its no-names fast paths)."""
    from purestep.step import _donation

    state = TensorDict(
        {"w": torch.ones(*batch_size, 4), "sub": {"m": torch.zeros(*batch_size, 1)}},
        batch_size,
        device=device,
        names=names,
    )
    top = _donation.fresh_top(state)
    assert type(top) is TensorDict and top is not state
    assert top["w"] is state["w"] and top["sub"] is state["sub"]
    assert top.batch_size == state.batch_size and top.device == state.device
    assert top.names == state.names
    assert top._has_names() is (names is not None)
    top.set("new", torch.zeros(batch_size))
    assert "new" not in state.keys()


# --- properties ---------------------------------------------------------------------------

OPTIMIZERS: dict[str, Callable[[], optim.Transform]] = {
    "adamw": lambda: optim.adamw(1e-2),
    "adam_amsgrad": lambda: optim.adam(1e-2, amsgrad=True),
    "sgd_momentum": lambda: optim.sgd(0.1, momentum=0.9, dampening=0.1),
    "lion": lambda: optim.lion(1e-3),
    "clip_adamw": lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2)),
}
KINDS = ("drop", "rename", "reshape", "retype")


def _sum_sq_loss(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
    losses = {
        role: sum((t.float() ** 2).sum() for t in tree.leaves(p[role])) * b["x"].mean()
        for role in p.keys()
    }
    return losses, {}


@st.composite
def built_states(draw: st.DrawFn) -> tuple[TensorDict, dict[str, optim.Transform]]:
    """A valid state: 1-2 roles of random param trees, each with a random stateful optimizer."""
    roles = draw(st.sampled_from([("a",), ("a", "b")]))
    params = {r: draw(testing.param_trees(max_leaves=4)) for r in roles}
    opts = {r: OPTIMIZERS[draw(st.sampled_from(sorted(OPTIMIZERS)))]() for r in roles}
    return ps.init_state(params, opts, seed=draw(st.integers(0, 9))), opts


def _mutate(state: TensorDict, draw: st.DrawFn) -> tuple[TensorDict, list[str]]:
    """A copy of ``state`` with one thing wrong; returns it and the key paths the error must name."""
    bad = state.clone()
    where = draw(st.sampled_from(["params", "opt_state", "role", "counter"]))
    if where == "role":
        top = draw(st.sampled_from(["params", "opt_state"]))
        role = draw(st.sampled_from(sorted(bad[top].keys())))
        del bad[top, role]
        return bad, [f"{top}.{role}"]
    if where == "counter":
        key = draw(st.sampled_from(["step", "rng"]))
        if draw(st.booleans()):
            del bad[key]
        else:
            bad[key] = bad[key].to(torch.int32)
        return bad, [key]
    items = list(zip(tree.paths(bad[where]), tree.leaves(bad[where]), strict=True))
    path, leaf = draw(st.sampled_from(items))
    full = (where, *path)
    name = tree.format_path(full)
    kind = draw(st.sampled_from(KINDS))
    if kind == "drop":
        del bad[full]
        return bad, [name]
    if kind == "rename":
        del bad[full]
        bad[(*full[:-1], full[-1] + "_renamed")] = leaf
        return bad, [name, name + "_renamed"]
    if kind == "reshape":
        bad[full] = torch.zeros((*leaf.shape, 2), dtype=leaf.dtype)
        return bad, [name]
    other = {torch.float32: torch.float64, torch.float64: torch.float32}.get(
        leaf.dtype, torch.float32
    )
    bad[full] = leaf.to(other)
    return bad, [name]


@settings(max_examples=60, deadline=None)
@given(built=built_states(), data=st.data(), donate=st.booleans(), use_apply=st.booleans())
def test_every_step_succeeds_on_valid_states_and_names_the_wrong_key_path_otherwise(
    built: tuple[TensorDict, dict[str, optim.Transform]],
    data: st.DataObject,
    donate: bool,
    use_apply: bool,
) -> None:
    """Valid random states step; a leaf dropped/renamed/reshaped/re-typed or a role or counter
    missing raises a PurestepError whose message names that exact key path, and changes nothing."""
    state, opts = built
    step = ps.train_step(ps.value_and_grad(_sum_sq_loss), opts, donate=donate)
    batch = {"x": torch.ones(2, 1)}

    grads = TensorDict({r: state["params", r].apply(torch.ones_like) for r in opts}, [])

    def run(s: TensorDict) -> None:
        if use_apply:
            ps.apply_gradients(s, grads, opts, donate=donate)
        else:
            step(s, batch)

    bad, names = _mutate(state, data.draw)
    if use_apply and names in (["step"], ["rng"]):
        return  # apply_gradients does not use the counters
    run(state.clone())  # the valid state steps
    before = testing.snapshot(bad)
    with pytest.raises(errors.PurestepError) as info:
        run(bad)
    message = str(info.value)
    assert all(n in message for n in names), (names, message)
    testing.assert_trees_equal(bad, before, what="the wrong state after the error")


@settings(max_examples=100, deadline=None)
@given(
    kind=st.sampled_from(["constant", "linear", "cosine", "warmup_cosine", "warmup_linear", "pc"]),
    a=st.floats(-2.0, 2.0),
    b=st.floats(-2.0, 2.0),
    steps=st.integers(1, 60),
    warm=st.integers(0, 20),
    offset=st.integers(0, 30),
)
def test_first_count_below_zero_is_the_first_negative_count_of_purestep_schedules(
    kind: str, a: float, b: float, steps: int, warm: int, offset: int
) -> None:
    """first_count_below(s) == min{n : s(n) < 0} (or None), checked by evaluating every count,
    also for a schedule joined after another; optimizers refuse exactly those schedules."""
    make: dict[str, Callable[[], optim.Schedule]] = {
        "constant": lambda: schedules.constant(a),
        "linear": lambda: schedules.linear(a, b, steps),
        "cosine": lambda: schedules.cosine_decay(a, steps, end=b),
        "warmup_cosine": lambda: schedules.warmup_cosine(a, warm, warm + steps, init=b, end=b),
        "warmup_linear": lambda: schedules.warmup_linear(b, warm, warm + steps, init=a),
        "pc": lambda: schedules.piecewise_constant(a, {steps: -1.0 if b < 0 else 1.0}),
    }
    s = make[kind]()
    joined = schedules.join([schedules.constant(1.0), s], [offset])
    horizon = warm + steps + 2
    for sched, shift in ((s, 0), (joined, offset)):
        brute = next((n for n in range(horizon + shift) if sched(n) < 0), None)
        assert schedules.first_count_below(sched) == brute
        if brute is None:
            optim.sgd(lr=sched)
        else:
            with pytest.raises(errors.ScheduleError, match=f"count {brute}"):
                optim.sgd(lr=sched)


@settings(max_examples=100, deadline=None)
@given(
    kind=st.sampled_from(["constant", "linear", "cosine", "warmup_cosine", "pc"]),
    a=st.floats(-2.0, 2.0),
    b=st.floats(-2.0, 2.0),
    steps=st.integers(1, 60),
    warm=st.integers(1, 20),
    every=st.integers(1, 5),
)
def test_first_count_below_of_in_steps_is_the_first_negative_update_or_left_to_the_updates(
    kind: str, a: float, b: float, steps: int, warm: int, every: int
) -> None:
    """For in_steps(s, every), first_count_below is min{n : s(every * n) < 0} whenever s stays
    negative once it goes negative (ramps, constants, piecewise constants); for a schedule that
    comes back up (a warmup into a negative peak, then a decay) it is that or None, never a
    wrong count, and None leaves the check to each update."""
    make: dict[str, Callable[[], optim.Schedule]] = {
        "constant": lambda: schedules.constant(a),
        "linear": lambda: schedules.linear(a, b, steps),
        "cosine": lambda: schedules.cosine_decay(a, steps, end=b),
        "warmup_cosine": lambda: schedules.warmup_cosine(a, warm, warm + steps, init=b, end=b),
        "pc": lambda: schedules.piecewise_constant(a, {steps: -1.0 if b < 0 else 1.0}),
    }
    sched = schedules.in_steps(make[kind](), every=every)
    horizon = (warm + steps) // every + 2
    brute = next((n for n in range(horizon) if sched(n) < 0), None)
    found = schedules.first_count_below(sched)
    if kind == "warmup_cosine":
        assert found in (brute, None)
    else:
        assert found == brute
    if found is not None:
        with pytest.raises(errors.ScheduleError, match=f"count {found}"):
            optim.sgd(lr=sched)


def test_first_count_below_cannot_see_into_user_callables() -> None:
    """A plain callable is opaque (None); it is checked at every update instead."""
    assert schedules.first_count_below(lambda n: -1.0) is None
    joined = schedules.join([lambda n: 1.0, schedules.constant(-1.0)], [3])
    assert schedules.first_count_below(joined) == 3


def test_schedule_values_that_overflow_are_refused_when_built() -> None:
    """Interpolating between huge end points, or products of scales, must stay finite."""
    with pytest.raises(ValueError, match="end - start overflows"):
        schedules.linear(1e308, -1e308, 10)
    with pytest.raises(ValueError, match=r"init - end|end - init"):
        schedules.cosine_decay(-1e308, 10, end=1e308)
    with pytest.raises(ValueError, match="boundary 3"):
        schedules.piecewise_constant(1e300, {3: 1e10})


def test_replacing_a_role_subtree_after_a_step_is_checked_again() -> None:
    """The once-per-structure cache is keyed by node identity: a new subtree is a new check."""
    s = _setup(donate=True)
    state, _ = s.step(s.state, BATCH)
    state["params", "student"] = TensorDict({"weight": torch.zeros(1, 2)}, [])
    with pytest.raises(errors.StateError, match=r"params\.student\.bias is missing"):
        s.step(state, BATCH)


# --- the step-boundary check, message by message ------------------------------------------
# check_state (run at every step's entry) names the key path at fault, what is there, what
# belongs there and how to build it; each row asserts those pieces and the error's .path.


def _params() -> TensorDict:
    return TensorDict({"w": torch.ones(2), "b": torch.ones(1)}, [])


def _vstate(opt: optim.Transform | None = None) -> tuple[TensorDict, dict[str, optim.Transform]]:
    opts = {"m": opt or optim.adamw(1e-3)}
    return ps.init_state({"m": _params()}, opts, seed=0), opts


def _edited(edit: Callable[[TensorDict], Any], opt: optim.Transform | None = None) -> Any:
    state, _ = _vstate(opt)
    return edit(state.clone())


def _set(path: tuple[str, ...], value: Any) -> Callable[[TensorDict], TensorDict]:
    def edit(state: TensorDict) -> TensorDict:
        state[path] = value
        return state

    return edit


def _drop(path: tuple[str, ...]) -> Callable[[TensorDict], TensorDict]:
    def edit(state: TensorDict) -> TensorDict:
        del state[path]
        return state

    return edit


def _reordered(path: tuple[str, ...]) -> Callable[[TensorDict], TensorDict]:
    def edit(state: TensorDict) -> TensorDict:
        node = state[path]
        state[path] = TensorDict({k: node[k] for k in reversed(list(node.keys()))}, [])
        return state

    return edit


@dataclass(frozen=True)
class StateCase:
    """``edit`` breaks a valid adamw (or ``opt``) state; check_state must say ``pieces``."""

    name: str
    edit: Callable[[TensorDict], Any]
    pieces: tuple[str, ...]
    path: tuple[str, ...] | None
    opt: Callable[[], optim.Transform] = lambda: optim.adamw(1e-3)
    exc: type[BaseException] = errors.StateError
    step_opt: Callable[[], optim.Transform] | None = None  # the step's optimizer, if not opt


STATE_CASES = [
    StateCase(
        "not a TensorDict",
        lambda s: dict(s.items()),
        (
            "train_step: state is a dict, expected the TensorDict built by purestep.init_state "
            "(steps are called as step(state, batch))",
        ),
        None,
        exc=TypeError,
    ),
    StateCase(
        "no params",
        _drop(("params",)),
        (
            "train_step: the state has no 'params' ({role: tree of params}); it has "
            "['opt_state', 'rng', 'step']. Build states with purestep.init_state (and "
            "step.prepare for the keys wrappers add)",
        ),
        ("params",),
    ),
    StateCase(
        "no step",
        _drop(("step",)),
        ("train_step: the state has no 'step' (an int64 0-dim tensor: the steps taken)",),
        ("step",),
    ),
    StateCase(
        "no rng",
        _drop(("rng",)),
        ("train_step: the state has no 'rng' (an int64 0-dim tensor: the root PRNG key)",),
        ("rng",),
    ),
    StateCase(
        "float step",
        _set(("step",), torch.zeros(())),
        (
            "train_step: state['step'] is a torch.float32 tensor of shape (); it must be an "
            "int64 0-dim tensor (the steps taken). Build states with purestep.init_state",
        ),
        ("step",),
    ),
    StateCase(
        "rng of two numbers",
        _set(("rng",), torch.zeros(2, dtype=torch.int64)),
        ("train_step: state['rng'] is a torch.int64 tensor of shape (2,)", "the root PRNG key"),
        ("rng",),
    ),
    StateCase(
        "step of shape (1,)",
        _set(("step",), torch.zeros(1, dtype=torch.int64)),
        (
            "train_step: state['step'] is a torch.int64 tensor of shape (1,); it must be an "
            "int64 0-dim tensor (the steps taken). Build states with purestep.init_state",
        ),
        ("step",),
    ),
    StateCase(
        "rng of shape (1, 1)",
        _set(("rng",), torch.zeros(1, 1, dtype=torch.int64)),
        ("train_step: state['rng'] is a torch.int64 tensor of shape (1, 1); it must be",),
        ("rng",),
    ),
    StateCase(
        "rng of no numbers",
        _set(("rng",), torch.zeros(0, dtype=torch.int64)),
        ("state['rng'] is a torch.int64 tensor of shape (0,)",),
        ("rng",),
    ),
    StateCase(
        "step is a tree",
        _set(("step",), TensorDict({"n": torch.zeros((), dtype=torch.int64)}, [])),
        ("train_step: state['step'] is a TensorDict; it must be",),
        ("step",),
    ),
    StateCase(
        "buffers of a role without params",
        _set(("buffers", "ghost"), TensorDict({"n": torch.zeros(1)}, [])),
        (
            "train_step: the state has buffers for role 'ghost' but no params for it (roles "
            "with params: ['m'])",
        ),
        ("buffers", "ghost"),
    ),
    StateCase(
        "no opt_state",
        _drop(("opt_state",)),
        ("train_step: the state has no 'opt_state' ({role: optimizer state}); it has [",),
        ("opt_state",),
    ),
    StateCase(
        "no params for the role",
        _set(("params",), TensorDict({"other": _params()}, [])),
        (
            "train_step: the state has no params.m (role 'm' has an optimizer; roles with "
            "params: ['other']); build the state with init_state for every role the step "
            "updates",
        ),
        ("params", "m"),
    ),
    StateCase(
        "no opt_state for the role",
        _set(("opt_state",), TensorDict({"other": TensorDict({}, [])}, [])),
        (
            "train_step: the state has no opt_state.m (roles with an optimizer state: "
            "['other']); build it with init_state(..., optimizers) using the optimizers of "
            "this step",
        ),
        ("opt_state", "m"),
    ),
    StateCase(
        "integer param",
        _set(("params", "m", "w"), torch.ones(2, dtype=torch.int64)),
        (
            "train_step: params.m.w has dtype torch.int64; trainable params must be floating "
            "point (integer tensors belong in state['buffers'])",
        ),
        ("params", "m", "w"),
    ),
    StateCase(
        "sgd-with-momentum state, adamw step",
        lambda s: s,
        (
            "train_step: opt_state.m was not built by this step's optimizer for role 'm' "
            "(adamw): opt_state.m has keys ['count', 'lr', 'momentum_buffer'], its optimizer "
            "keeps ['count', 'lr', 'mu', 'nu', 'steps'] (missing opt_state.m.mu, "
            "opt_state.m.nu, opt_state.m.steps; unexpected opt_state.m.momentum_buffer). A "
            "state built for one optimizer (or other hyperparameters) cannot be stepped with "
            "another: build it with init_state(..., optimizers) using the optimizers of this "
            "step",
        ),
        ("opt_state", "m"),
        opt=lambda: optim.sgd(0.1, momentum=0.9),
        step_opt=lambda: optim.adamw(1e-3),
    ),
    StateCase(
        "plain sgd state, adamw step: only missing keys",
        lambda s: s,
        ("(missing opt_state.m.mu, opt_state.m.nu, opt_state.m.steps). A state",),
        ("opt_state", "m"),
        opt=lambda: optim.sgd(0.1),
        step_opt=lambda: optim.adamw(1e-3),
    ),
    StateCase(
        "an extra moment: only unexpected keys",
        _set(("opt_state", "m", "extra"), torch.zeros(1)),
        ("(unexpected opt_state.m.extra). A state",),
        ("opt_state", "m"),
    ),
    StateCase(
        "a moment tree replaced by a tensor",
        _set(("opt_state", "m", "mu"), torch.zeros(2)),
        (
            "(adamw): opt_state.m.mu is a torch.float32 tensor of shape (2,), expected a tree "
            "with keys ['w', 'b']. A state",
        ),
        ("opt_state", "m"),
    ),
    StateCase(
        "the count replaced by a tree",
        _set(("opt_state", "m", "count"), TensorDict({}, [])),
        (
            "(adamw): opt_state.m.count is a TensorDict, expected a torch.int64 tensor of "
            "shape (). A state",
        ),
        ("opt_state", "m"),
    ),
    StateCase(
        "the count re-typed",
        _set(("opt_state", "m", "count"), torch.zeros((), dtype=torch.int32)),
        (
            "train_step: opt_state.m does not fit params.m (optimizer adamw): opt_state.m.count "
            "is a torch.int32 tensor of shape (), expected a torch.int64 tensor of shape (). "
            "params and opt_state must describe the same parameters: change them together, "
            "or rebuild the state with init_state",
        ),
        ("opt_state", "m", "count"),
    ),
    StateCase(
        "a param without adamw state",
        _set(("params", "m", "extra"), torch.zeros(3)),
        (
            "(optimizer adamw): params.m.extra has no optimizer state (opt_state.m.mu.extra, "
            "opt_state.m.nu.extra, opt_state.m.steps.extra are missing). params",
        ),
        ("params", "m", "extra"),
    ),
    StateCase(
        "a param without sgd state",
        _set(("params", "m", "extra"), torch.zeros(3)),
        (
            "(optimizer sgd): params.m.extra has no optimizer state "
            "(opt_state.m.momentum_buffer.extra is missing). params",
        ),
        ("params", "m", "extra"),
        opt=lambda: optim.sgd(0.1, momentum=0.9),
    ),
    StateCase(
        "adamw state of a dropped param",
        _drop(("params", "m", "b")),
        (
            "(optimizer adamw): opt_state.m.mu.b, opt_state.m.nu.b, opt_state.m.steps.b are "
            "the state of no param (params.m.b is missing: dropped or renamed?). params",
        ),
        ("opt_state", "m", "mu", "b"),
    ),
    StateCase(
        "sgd state of a dropped param",
        _drop(("params", "m", "b")),
        (
            "(optimizer sgd): opt_state.m.momentum_buffer.b is the state of no param "
            "(params.m.b is missing: dropped or renamed?). params",
        ),
        ("opt_state", "m", "momentum_buffer", "b"),
        opt=lambda: optim.sgd(0.1, momentum=0.9),
    ),
    StateCase(
        "a moment reshaped",
        _set(("opt_state", "m", "mu", "w"), torch.zeros(3)),
        (
            "(optimizer adamw): opt_state.m.mu.w is a torch.float32 tensor of shape (3,), "
            "expected a torch.float32 tensor of shape (2,) for params.m.w. params",
        ),
        ("opt_state", "m", "mu", "w"),
    ),
    StateCase(
        "a param reshaped: every moment of it",
        _set(("params", "m", "w"), torch.zeros(3)),
        (
            "(optimizer adamw): opt_state.m.mu.w, opt_state.m.nu.w are a torch.float32 tensor "
            "of shape (2,), expected a torch.float32 tensor of shape (3,) for params.m.w. params",
        ),
        ("opt_state", "m", "mu", "w"),
    ),
    StateCase(
        "moments in another order",
        _reordered(("opt_state", "m", "momentum_buffer")),
        (
            "(optimizer sgd): opt_state.m.momentum_buffer lists its leaves in another order "
            "than params.m (position 0: 'b' vs 'w'); the optimizer pairs them by position. "
            "params",
        ),
        ("opt_state", "m", "momentum_buffer"),
        opt=lambda: optim.sgd(0.1, momentum=0.9),
    ),
]


@pytest.mark.parametrize("case", STATE_CASES, ids=[safe_id(c.name) for c in STATE_CASES])
def test_check_state_names_the_key_path_what_is_there_and_how_to_build_it(
    case: StateCase,
) -> None:
    """Each broken state raises the documented error whose message holds every piece (the key
    path, what is there, what belongs there, the fix) and whose .path is the key at fault."""
    opt = case.opt()
    state = _edited(case.edit, opt)
    step_opt = case.step_opt() if case.step_opt is not None else opt
    with pytest.raises(case.exc) as info:
        ps.step.check_state(state, {"m": step_opt}, who="train_step")
    message = str(info.value)
    for piece in case.pieces:
        assert piece in message, (piece, message)
    if case.path is not None:
        assert info.value.path == case.path  # type: ignore[attr-defined]


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 9))
def test_check_state_lists_the_first_six_problems_and_counts_the_rest(n: int) -> None:
    """n params without optimizer state: the message lists the first min(n, 6), joined by '; ',
    then '(and n - 6 more)' exactly when n > 6; .path is the first one."""
    opts = {"m": optim.sgd(0.1, momentum=0.9)}
    state = ps.init_state({"m": TensorDict({"keep": torch.ones(1)}, [])}, opts, seed=0)
    for i in range(n):
        state["params", "m", f"p{i}"] = torch.zeros(1)
    with pytest.raises(errors.StateError) as info:
        ps.step.check_state(state, opts, who="train_step")
    parts = [
        f"params.m.p{i} has no optimizer state (opt_state.m.momentum_buffer.p{i} is missing)"
        for i in range(min(n, 6))
    ]
    more = f" (and {n - 6} more)" if n > 6 else ""
    assert f"(optimizer sgd): {'; '.join(parts)}{more}. params and" in str(info.value)
    assert "more)" in str(info.value) if n > 6 else "more)" not in str(info.value)
    assert info.value.path == ("params", "m", "p0")


@settings(max_examples=20, deadline=None)
@given(params=testing.param_trees(max_leaves=4), data=st.data())
def test_check_state_names_the_nested_key_path_of_a_bad_leaf(
    params: TensorDict, data: st.DataObject
) -> None:
    """For any leaf of a nested params tree: made integer, its params path is named; its moment
    reshaped, the moment's path and the param's are named; .path is that key."""
    opts = {"m": optim.adamw(1e-3)}
    state = ps.init_state({"m": params}, opts, seed=0)
    path = data.draw(st.sampled_from(tree.paths(state["params", "m"])))
    name = tree.format_path(path)
    bad = state.clone()
    bad["params", "m", *path] = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(errors.StateError) as info:
        ps.step.check_state(bad, opts, who="train_step")
    assert f"params.m.{name} has dtype torch.int64" in str(info.value)
    assert info.value.path == ("params", "m", *path)
    bad = state.clone()
    leaf = bad["opt_state", "m", "mu", *path]
    bad["opt_state", "m", "mu", *path] = torch.zeros((*leaf.shape, 2), dtype=leaf.dtype)
    with pytest.raises(errors.StateError) as info:
        ps.step.check_state(bad, opts, who="train_step")
    assert f"opt_state.m.mu.{name} is a {leaf.dtype} tensor of shape" in str(info.value)
    assert f"for params.m.{name}" in str(info.value)
    assert info.value.path == ("opt_state", "m", "mu", *path)


# --- with_ema's check of its trees (check_pair) --------------------------------------------


def _ema_edit(edit: Callable[[TensorDict], Any]) -> Run:
    s = _setup()
    step = ps.with_ema(s.step, 0.9, ["student"])
    state = step.prepare(s.state).clone()
    edit(state)
    return (lambda: step(state, BATCH)), [state]


EMA_CASES = [
    (
        "a leaf missing",
        _drop(("ema", "student", "bias")),
        "ema.student.bias is missing. Change",
        ("ema", "student", "bias"),
    ),
    (
        "every leaf missing",
        _set(("ema", "student"), TensorDict({}, [])),
        "ema.student.weight is missing; ema.student.bias is missing. Change",
        ("ema", "student", "weight"),
    ),
    (
        "an extra leaf",
        _set(("ema", "student", "extra"), torch.zeros(1)),
        "ema.student.extra has no params.student counterpart. Change",
        ("ema", "student", "extra"),
    ),
    (
        "leaves in another order",
        _reordered(("ema", "student")),
        "ema.student lists its leaves in another order. Change",
        ("ema", "student"),
    ),
    (
        "a leaf of another shape",
        _set(("ema", "student", "bias"), torch.zeros(2)),
        "ema.student.bias is a torch.float32 tensor of shape (2,), but params.student.bias is "
        "a torch.float32 tensor of shape (1,). Change",
        ("ema", "student", "bias"),
    ),
]


@pytest.mark.parametrize(
    ("name", "edit", "piece", "path"), EMA_CASES, ids=[safe_id(c[0]) for c in EMA_CASES]
)
def test_with_ema_names_each_ema_leaf_that_does_not_match_its_param(
    name: str, edit: Callable[[TensorDict], Any], piece: str, path: tuple[str, ...]
) -> None:
    """An EMA tree that does not match params raises StateError naming the EMA key paths, the
    param it shadows, and the fix; .path is the first key at fault; nothing changes."""
    call, watched = _ema_edit(edit)
    before = [testing.snapshot(t) for t in watched]
    with pytest.raises(errors.StateError) as info:
        call()
    message = str(info.value)
    assert message.startswith("with_ema: ema.student does not match params.student: "), message
    assert piece in message, message
    assert message.endswith("(or drop the key and let step.prepare rebuild it)"), message
    assert info.value.path == path
    for t, b in zip(watched, before, strict=True):
        testing.assert_trees_equal(t, b)


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 8))
def test_check_pair_lists_at_most_six_problems(n: int) -> None:
    """Of n missing EMA leaves, the first min(n, 6) are named, in params order."""
    from purestep.step._validate import check_pair

    a = TensorDict({f"p{i}": torch.zeros(1) for i in range(n)}, [])
    with pytest.raises(errors.StateError) as info:
        check_pair(a, TensorDict({}, []), ("params", "m"), ("ema", "m"), who="w", tag="ema")
    listed = "; ".join(f"ema.m.p{i} is missing" for i in range(min(n, 6)))
    assert f"w: ema.m does not match params.m: {listed}. Change" in str(info.value)


def _count_walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the calls of tree.paths (every per-leaf check starts with one)."""
    calls = [0]
    paths = tree.paths

    def counting(td: Any) -> Any:
        calls[0] += 1
        return paths(td)

    monkeypatch.setattr(tree, "paths", counting)
    return calls


def test_a_pair_that_matched_or_was_registered_is_not_walked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """check_pair remembers a pair that passed, and remember_pair registers one, by the identity
    of both trees and the tag: checking them again walks no leaf; another tag is checked."""
    from purestep.step._validate import check_pair, remember_pair

    a, b = _params(), _params()
    at = (("params", "m"), ("ema", "m"))
    calls = _count_walks(monkeypatch)
    check_pair(a, b, *at, who="with_ema", tag="ema")
    assert calls[0] > 0
    calls[0] = 0
    check_pair(a, b, *at, who="with_ema", tag="ema")
    assert calls[0] == 0
    check_pair(a, b, *at, who="with_ema", tag="ema_buffers")
    assert calls[0] > 0
    c, d = _params(), _params()
    remember_pair(c, d, "ema")
    calls[0] = 0
    check_pair(c, d, *at, who="with_ema", tag="ema")
    assert calls[0] == 0
    for x, y in ((a, d), (c, b)):  # the identity of each tree counts
        check_pair(x, y, *at, who="with_ema", tag="ema")
        assert calls[0] > 0
        calls[0] = 0


def test_check_state_walks_a_structure_once_per_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A state that passed (or was registered with remember) is not walked again for the same
    optimizer; for another optimizer it is checked (and refused when it does not fit)."""
    from purestep.step._validate import remember

    state, opts = _vstate()
    calls = _count_walks(monkeypatch)
    ps.step.check_state(state, opts, who="train_step")
    assert calls[0] > 0
    calls[0] = 0
    ps.step.check_state(state, opts, who="train_step")
    assert calls[0] == 0
    with pytest.raises(errors.StateError, match=r"missing opt_state\.m\.momentum_buffer"):
        ps.step.check_state(state, {"m": optim.sgd(0.1, momentum=0.9)}, who="train_step")
    other, _ = _vstate()
    remember(other, opts)
    calls[0] = 0
    ps.step.check_state(other, opts, who="train_step")
    assert calls[0] == 0
    ps.step.check_state(other, opts, who="train_step", cached=False)
    assert calls[0] > 0


def test_diagnose_rechecks_without_the_cache_and_without_the_counters() -> None:
    """diagnose finds a leaf replaced in place after the check (the cache would skip it), names
    the caller, does not require step/rng, refuses shared leaves only when donating, and
    returns None when the state is fine or the failure is not the state's."""
    from purestep.step._validate import diagnose

    state, opts = _vstate()
    ps.step.check_state(state, opts, who="train_step")
    state["params", "m", "w"] = torch.zeros(3)  # in place: the checked node is kept
    ps.step.check_state(state, opts, who="train_step")  # not re-checked up front
    found = diagnose(state, opts, who="train_step")
    assert found is not None and found.path == ("opt_state", "m", "mu", "w")
    assert str(found).startswith("train_step: opt_state.m does not fit params.m")
    fine, _ = _vstate()
    assert diagnose(fine.exclude("step", "rng"), opts, who="apply_gradients") is None
    shared = fine.clone()
    shared["opt_state", "m", "mu", "w"] = shared["params", "m", "w"]
    assert diagnose(shared, opts, who="train_step") is None
    found = diagnose(shared, opts, who="train_step", donate=True)
    assert found is not None and "params.m.w shares memory with opt_state.m.mu.w" in str(found)
    assert diagnose({"not": "a state"}, opts, who="train_step") is None


def test_describe_says_what_a_value_is() -> None:
    """Tensors by dtype and shape, other objects by type, nothing as 'missing'."""
    from purestep.step._validate import _describe

    assert _describe(torch.zeros(2, 3, dtype=torch.int32)) == "a torch.int32 tensor of shape (2, 3)"
    assert _describe(TensorDict({}, [])) == "a TensorDict"
    assert _describe(None) == "missing"


def _alias_under(key: str, state: TensorDict) -> tuple[str, str]:
    """Put a view of params.m.w (or of step) under ``key``; the two paths that now share."""
    w = state["params", "m", "w"]
    if key == "opt_state":
        state["opt_state", "m", "mu", "w"] = w
        return "params.m.w", "opt_state.m.mu.w"
    if key == "step":
        state["buffers", "m", "n"] = state["step"]
        return "buffers.m.n", "step"
    state[key, "m", "w"] = w
    return "params.m.w", f"{key}.m.w"


@pytest.mark.parametrize(
    "key", ["opt_state", "buffers", "ema", "ema_buffers", "skip", "step", "extra", "rng"]
)
def test_a_donated_check_refuses_shared_memory_with_every_key_a_step_writes(key: str) -> None:
    """With donate=True, a leaf that shares memory with one a step writes (params, opt_state,
    buffers, ema, ema_buffers, skip, step) is refused, naming both paths, whether it is itself
    written or only read (rng) or passed through (extra: a donated update would change it);
    without donation nothing is refused."""
    state, opts = _vstate()
    if key == "rng":  # a view of step under rng: each donated step.add_(1) would advance rng
        state["rng"] = state["step"]
        a, b = "step", "rng"
    else:
        a, b = _alias_under(key, state)
    ps.step.check_state(state.clone(recurse=False), opts, who="train_step")
    with pytest.raises(errors.StateError) as info:
        ps.step.check_state(state, opts, who="train_step", donate=True, cached=False)
    message = str(info.value)
    assert message.startswith("train_step: ") and "so a donated step would update" in message
    assert f"{a} shares memory with {b}" in message or f"{b} shares memory with {a}" in message
    assert info.value.path is not None and tree.format_path(info.value.path) in (a, b)
    unwritten = {"rng": "rng", "extra": "extra.m.w"}.get(key)
    assert (unwritten is not None) == ("is not written by the step" in message)
    if unwritten is not None:
        assert f". {unwritten} is not written by the step" in message


def test_a_donated_check_lets_leaves_the_step_never_writes_share_memory() -> None:
    """Leaves under keys a step only reads or passes through (rng, user keys) may share memory
    with each other: a donated step writes neither, so nothing is refused."""
    state, opts = _vstate()
    shared = torch.zeros(3)
    state["extra_a"] = shared
    state["extra_b"] = TensorDict({"v": shared[1:]}, [])
    ps.step.check_state(state, opts, who="train_step", donate=True, cached=False)


def test_donation_with_rng_aliasing_step_is_refused_not_silently_different() -> None:
    """A state whose rng is a view of its step trains to different keys when donated (the
    in-place step.add_(1) advances rng too), so the donated step refuses it; the plain step
    runs it and leaves rng alone."""
    net = torch.nn.Linear(2, 1)
    opt = {"m": optim.sgd(1e-2)}

    def loss_fn(params: Any, batch: Any, key: Any) -> Any:
        pred = ps.call(net, params["m"], batch["x"])
        return (pred**2).mean(), {}

    batch = {"x": torch.ones(4, 2)}
    state = ps.init_state({"m": net}, opt, seed=0)
    state["rng"] = state["step"]
    plain, _ = ps.train_step(ps.value_and_grad(loss_fn), opt)(state, batch)
    assert int(plain["rng"]) == 0 and int(plain["step"]) == 1
    with pytest.raises(errors.StateError, match=r"rng shares memory with step.*rng is not wr"):
        ps.train_step(ps.value_and_grad(loss_fn), opt, donate=True)(state, batch)


@pytest.mark.parametrize("edit", ["opt_state", "rng"])
def test_a_donated_step_rechecks_sharing_that_a_cached_check_never_saw(edit: str) -> None:
    """The check cache does not hide aliasing from a donated step: a state first run by a
    plain step (cached without the sharing check) is still refused by the donated step, and
    an edit of a top-level leaf (rng made a view of step) after a donated step is refused by
    the next one, though its (params, opt_state) nodes are cached."""
    net = torch.nn.Linear(2, 1)
    opt = {"m": optim.adamw(1e-2)}

    def loss_fn(params: Any, batch: Any, key: Any) -> Any:
        return (ps.call(net, params["m"], batch["x"]) ** 2).mean(), {}

    batch = {"x": torch.ones(4, 2)}
    donated = ps.train_step(ps.value_and_grad(loss_fn), opt, donate=True)
    state = ps.init_state({"m": net}, opt, seed=0)
    if edit == "opt_state":
        state["opt_state", "m", "mu", "weight"] = state["params", "m", "weight"]
        ps.train_step(ps.value_and_grad(loss_fn), opt)(state, batch)  # fine, and now cached
        match = r"params.m.weight shares memory with opt_state.m.mu.weight"
    else:
        state, _ = donated(state, batch)  # passes, and its output is cached
        state["rng"] = state["step"]
        match = r"rng shares memory with step"
    with pytest.raises(errors.StateError, match=match):
        donated(state, batch)


def test_bounded_caches_keep_their_bound() -> None:
    """The per-structure caches drop their oldest entries: they never grow past their bound."""
    from purestep.step import _batch, _validate

    keep = [(_params(), _params()) for _ in range(_validate._CACHE_SIZE + 5)]
    for a, b in keep:
        _validate.remember_pair(a, b, "ema")
    assert len(_validate._CHECKED) == _validate._CACHE_SIZE
    idx = [torch.arange(3) for _ in range(70)]
    for i in idx:
        ps.step.check_index(i)
    assert len(_batch._DISTINCT) == 64
    opts = [optim.sgd(0.1) for _ in range(40)]
    for o in opts:
        ps.step.check_state(ps.init_state({"m": _params()}, {"m": o}, seed=0), {"m": o}, who="t")
    assert len(_validate._EXPECTED) == 32


@pytest.mark.parametrize("shape", [(1,), (2,), (1, 1)])
@pytest.mark.parametrize("counter", ["total", "consecutive"])
def test_skip_counters_that_are_not_0_dim_are_refused_by_prepare(
    counter: str, shape: tuple[int, ...]
) -> None:
    """skip_nonfinite's prepare refuses a skip counter that is not an int64 0-dim tensor
    (also one element of shape (1,)), naming state['skip', counter]."""
    state, opts = _vstate()

    def loss_fn(params: Any, batch: Any, key: Any) -> Any:
        return (params["m", "w"] ** 2).sum(), {}

    step = ps.skip_nonfinite(ps.train_step(ps.value_and_grad(loss_fn), opts))
    state = step.prepare(state)
    state["skip", counter] = torch.zeros(shape, dtype=torch.int64)
    with pytest.raises(errors.StateError) as info:
        step.prepare(state)
    assert str(info.value) == (
        f"skip_nonfinite: state['skip', {counter!r}] must be an int64 0-dim tensor (a count of "
        "skipped steps); drop state['skip'] and call step.prepare to rebuild it"
    )
    assert info.value.path == ("skip", counter)


def test_a_skip_entry_that_is_not_a_tree_is_refused_naming_its_type() -> None:
    """state['skip'] as a tensor (not the counters' tree) is refused with the whole message."""
    from purestep.step import _counters

    with pytest.raises(errors.StateError) as info:
        _counters.add_skip_counters(TensorDict({"step": torch.tensor(0), "skip": torch.tensor(0)}))
    assert str(info.value) == (
        "skip_nonfinite: state['skip'] is a Tensor; it keeps a tree {'total', 'consecutive'} "
        "there (drop it and call step.prepare to rebuild)"
    )
    assert info.value.path == ("skip",)


def test_a_missing_skip_counter_is_refused_naming_it() -> None:
    """A skip tree without 'consecutive' is a StateError at ('skip', 'consecutive')."""
    from purestep.step import _counters

    state = TensorDict({"skip": {"total": torch.zeros((), dtype=torch.int64)}})
    with pytest.raises(errors.StateError, match=r"state\['skip', 'consecutive'\]") as info:
        _counters.add_skip_counters(state)
    assert info.value.path == ("skip", "consecutive")


def test_all_finite_checks_only_grad_norms_and_floating_loss_metrics() -> None:
    """A non-finite non-loss metric is ignored; a loss alone (no norms) is checked; with nothing
    to check the answer is a 0-dim bool True."""
    from purestep.step import _counters

    nan = torch.tensor(float("nan"))
    one = torch.tensor(1.0)
    other = TensorDict({"s": {"loss": one, "abs_err": nan}})
    assert bool(_counters.all_finite(other, {"s": one}))
    assert bool(_counters.all_finite(TensorDict({"s": {"loss": one}}), {}))
    assert not bool(_counters.all_finite(TensorDict({"s": {"loss": nan}}), {}))
    empty = _counters.all_finite(TensorDict({"n": torch.tensor(3)}), {})
    assert empty.dtype == torch.bool and empty.shape == () and bool(empty)


def test_a_skipped_step_reports_skipped_as_a_0_dim_bool() -> None:
    """skip_update sets metrics['skipped'] to a 0-dim bool True and counts the skip."""
    from purestep.step import _counters

    state = _counters.add_skip_counters(TensorDict({"step": torch.tensor(4)}))
    out, m = _counters.skip_update(state, TensorDict({}), donate=False, max_consecutive=None)
    assert m["skipped"].dtype == torch.bool and m["skipped"].shape == ()
    assert bool(m["skipped"])
    assert (int(out["step"]), int(out["skip", "total"]), int(out["skip", "consecutive"])) == (
        5,
        1,
        1,
    )


# --- call: DTensor params (FSDP2-sharded modules), one process -----------------------------


class _FSDPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x))  # type: ignore[no-any-return]


def test_call_with_dtensor_params_refuses_all_but_detached_views_of_an_fsdp_modules_own() -> None:
    """An FSDP2-managed module (``fully_shard``) always runs with its own sharded params. Given
    DTensor params, ``call`` refuses, whole message each: grad enabled; a copy that shares no
    memory; a key that names no parameter. Detached views under ``no_grad`` run the module
    itself, keyed dropout included (the same output as its own params with that key). A module
    ``fully_shard`` does not manage takes DTensor params functionally, like plain tensors.

    One process (gloo, world size 1, an in-memory store), destroyed at the end.
    """
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group in this process")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        net = _FSDPNet()
        fully_shard(net, mesh=mesh)
        own = TensorDict(dict(net.named_parameters()), []).unflatten_keys(".")
        x = torch.ones(8, 3)
        misspelt = TensorDict({"lin": {"wieght": own["lin", "weight"].detach()}}, [])
        messages = []
        for grad, p in [(True, own.detach()), (False, own.clone()), (False, misspelt)]:
            with pytest.raises(ValueError, match=r"^call: ") as info, torch.set_grad_enabled(grad):
                ps.call(net, p, x)
            messages.append(str(info.value))
        assert messages == [
            "call: FSDP_FSDPNet got DTensor params that are not its bound parameters; an "
            "FSDP-sharded module always runs with its own parameters. To stop gradients into "
            "them, call it under torch.no_grad() (detached views are fine there)",
            "call: param 'lin.weight' is a DTensor that does not share memory with "
            "FSDP_FSDPNet's own (FSDP-sharded) parameter; an FSDP module always runs with its "
            "own parameters: copy other weights (e.g. an EMA) into them first",
            "call: FSDP_FSDPNet has no parameter 'lin.wieght'",
        ]
        key = rng.key(1)
        with torch.no_grad():
            expected = ps.call(net, own, x, key=key)  # its own nn.Parameters: run as it is
            detached = ps.call(net, own.detach(), x, key=key)
        assert bool((expected == 0).any()) and bool((expected != 0).any())  # dropout dropped
        assert torch.equal(detached, expected)

        plain = nn.Linear(3, 3)
        zeros = TensorDict(
            {
                n: distribute_tensor(torch.zeros_like(t), mesh, [Replicate()])
                for n, t in plain.named_parameters()
            },
            [],
        )
        out = ps.call(plain, zeros, distribute_tensor(x, mesh, [Replicate()]))
        assert torch.equal(out.full_tensor(), torch.zeros(8, 3))  # the given (zero) weights
    finally:
        dist.destroy_process_group()


# --- bound-role hooks: registered once, run on bound roles only ----------------------------


def test_bound_hooks_registered_twice_run_once_and_metrics_hooks_see_bound_leaves_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Registering a bound-backward or bound-metrics hook twice registers it once: it runs
    once per use. reduce_bound_metrics passes metrics through the hooks with the leaves of the
    bound roles only (a module's own nn.Parameters), and returns them untouched (no hook runs)
    when no role is bound."""
    from purestep.step import _bound

    monkeypatch.setattr(_bound, "_BOUND_HOOKS", [])
    monkeypatch.setattr(_bound, "_BOUND_METRICS_HOOKS", [])
    lin = nn.Linear(2, 1)
    own = TensorDict(dict(lin.named_parameters()), [])
    plain = TensorDict({"w": torch.ones(2)}, [])
    metrics = TensorDict({"loss": torch.tensor(1.0)}, [])
    seen: list[list[torch.Tensor]] = []

    def on_metrics(leaves: Any, m: TensorDict) -> TensorDict:
        seen.append(list(leaves))
        return m.apply(lambda t: t * 2)

    assert _bound.reduce_bound_metrics(TensorDict({"a": plain}), metrics) is metrics
    ps.step.register_bound_metrics_hook(on_metrics)
    ps.step.register_bound_metrics_hook(on_metrics)
    assert _bound.reduce_bound_metrics(TensorDict({"a": plain}), metrics) is metrics
    assert seen == []
    out = _bound.reduce_bound_metrics(TensorDict({"a": plain, "b": own}), metrics)
    assert float(out["loss"]) == 2.0  # the hook ran once
    assert len(seen) == 1 and [id(t) for t in seen[0]] == [id(lin.weight), id(lin.bias)]

    calls: list[tuple[list[torch.Tensor], int]] = []
    hook = lambda leaves, mb: calls.append((list(leaves), mb.index))  # noqa: E731
    ps.step.register_bound_backward_hook(hook)
    ps.step.register_bound_backward_hook(hook)
    loss = lin(torch.ones(1, 2)).sum()
    grads = _bound.bound_grads({"b": loss}, {"b": list(lin.parameters())}, [])
    assert [([id(t) for t in ls], i) for ls, i in calls] == [([id(lin.weight), id(lin.bias)], 0)]
    assert torch.equal(grads["b"][0], torch.ones(1, 2)) and lin.weight.grad is None
