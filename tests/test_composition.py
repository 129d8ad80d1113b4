"""Wrappers compose in any order: ``with_ema``, ``skip_nonfinite`` and a user's own wrapper.

Each pair is composed both ways around a ``train_step`` and the result is put through the
property kit (purity, determinism, exact resume) and compared with the other order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, TensorDictBase
from torch import nn

import purestep as ps
from purestep import testing
from purestep.errors import NonFiniteError, StateError
from purestep.step import Batch, Step

Wrap = Callable[[Step], Step]


@attrs.frozen
class LossScale:
    """A user's wrapper: any Step in, any Step out (adds a ``scaled_loss`` metric)."""

    inner: Step
    scale: float = 2.0

    def prepare(self, state: TensorDictBase) -> TensorDict:
        return self.inner.prepare(state)

    def __call__(self, state: TensorDictBase, batch: Batch) -> tuple[TensorDict, TensorDict]:
        new_state, metrics = self.inner(state, batch)
        metrics.set("scaled_loss", metrics.get("loss") * self.scale)
        return new_state, metrics


WRAPPERS: dict[str, Wrap] = {
    "ema": lambda s: ps.with_ema(s, 0.9, ["student"]),
    "skip": lambda s: ps.skip_nonfinite(s, max_consecutive=2),
    "user": LossScale,
}


def _setup(
    donate: bool = False,
) -> tuple[nn.Module, Step, TensorDict, list[dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))

    def loss_fn(
        params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        y = ps.call(net, params["student"], batch["x"])
        return ((y - batch["y"]) ** 2).mean(), {}

    opt = {"student": ps.optim.adamw(1e-2)}
    base = ps.train_step(ps.value_and_grad(loss_fn), opt, donate=donate)
    state = ps.init_state({"student": net}, opt, seed=0)
    g = torch.Generator().manual_seed(1)
    batches = [
        {"x": torch.randn(4, 3, generator=g), "y": torch.randn(4, 1, generator=g)} for _ in range(4)
    ]
    return net, base, state, batches


def _run(step: Step, state: TensorDict, batches: list[dict[str, torch.Tensor]]) -> TensorDict:
    state = step.prepare(state)
    for b in batches:
        state, _ = step(state, b)
    return state


PAIRS = list(itertools.permutations(WRAPPERS, 2))


@pytest.mark.parametrize(("outer", "inner"), PAIRS)
def test_every_pair_of_wrappers_composes_and_keeps_the_property_kit(outer: str, inner: str) -> None:
    """``outer(inner(train_step))`` is pure, deterministic and resume-exact, for every ordered
    pair of with_ema, skip_nonfinite and a user wrapper."""
    net, base, state, batches = _setup()
    step = WRAPPERS[outer](WRAPPERS[inner](base))
    state = step.prepare(state)
    testing.assert_pure(step, state, batches[0], modules=[net])
    testing.assert_deterministic(step, state, batches[:2])
    testing.assert_resume_exact(step, state, batches, save_at=2)


@pytest.mark.parametrize(("a", "b"), list(itertools.combinations(WRAPPERS, 2)))
def test_both_orders_of_a_pair_give_the_same_state(a: str, b: str) -> None:
    """``a(b(s))`` and ``b(a(s))`` end in the same state (bitwise) after several steps."""
    _, base, state, batches = _setup()
    ab = _run(WRAPPERS[a](WRAPPERS[b](base)), state, batches)
    ba = _run(WRAPPERS[b](WRAPPERS[a](base)), state, batches)
    assert set(ab.keys(include_nested=True, leaves_only=True)) == set(
        ba.keys(include_nested=True, leaves_only=True)
    )
    for k in ab.keys(include_nested=True, leaves_only=True):
        assert torch.equal(ab.get(k), ba.get(k)), k


@pytest.mark.parametrize("order", ["skip(user(s))", "ema(skip(user(s)))"])
def test_skip_nonfinite_around_a_user_wrapper_discards_a_nonfinite_step(order: str) -> None:
    """Around a step that is not a train_step, a NaN loss leaves params, opt_state and EMA
    exactly as they were, advances the step and counts the skip."""
    _, base, state, batches = _setup()
    user = LossScale(base)
    step: Step = ps.skip_nonfinite(user)
    if order.startswith("ema"):
        step = ps.with_ema(step, 0.9, ["student"])
    state = step.prepare(state)
    state, _ = step(state, batches[0])
    bad = {"x": batches[1]["x"], "y": torch.full_like(batches[1]["y"], float("nan"))}
    new, metrics = step(state, bad)
    assert bool(metrics["skipped"])
    assert int(new["step"]) == int(state["step"]) + 1
    assert int(new["skip", "total"]) == 1
    for k in ("params", "opt_state") + (("ema",) if "ema" in state.keys() else ()):
        for path in state[k].keys(include_nested=True, leaves_only=True):
            assert torch.equal(new[k].get(path), state[k].get(path)), (k, path)


def test_skip_nonfinite_refuses_a_foreign_step_that_donates() -> None:
    """A user's wrapper around a donating train_step has written its input before its metrics
    show a NaN, so skip_nonfinite refuses it, naming donation."""
    _, base, _, _ = _setup(donate=True)
    with pytest.raises(ValueError, match="donate"):
        ps.skip_nonfinite(LossScale(base))


def test_with_ema_and_skip_nonfinite_refuse_what_is_not_a_step() -> None:
    """Non-callables are refused at wrap time, naming what was given."""
    with pytest.raises(TypeError, match="int"):
        ps.with_ema(3, 0.9, ["student"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="str"):
        ps.skip_nonfinite("step")  # type: ignore[arg-type]


def _plain_step(state: TensorDictBase, batch: Batch) -> tuple[TensorDict, TensorDict]:
    """A foreign step without ``prepare`` or ``every``: the params move by the batch's ``d``,
    the output shares every other node of the input (``ema`` included: not a ``state.copy()``,
    which makes new nested nodes), no loss metric."""
    out = TensorDict(dict(state.items()), state.batch_size)
    out["step"] = state["step"] + 1
    params = state["params"].copy()
    params["student"] = state["params", "student"].apply(lambda t: t + batch["d"].mean())
    out["params"] = params
    return out, TensorDict({"count": torch.ones((), dtype=torch.int64)}, [])


def test_ema_period_follows_the_cadence_of_the_train_step_inside_any_wrappers() -> None:
    """period(role) is the role's ``every`` (default on_update for every > 1), found through
    user wrappers and skip_nonfinite; 1 with on_update=False, for every=1, for roles without
    a cadence and for steps that are not train steps."""
    gf = ps.value_and_grad(lambda p, b, k: (p["a", "w"].sum() + p["b", "w"].sum(), {}))
    opts = {"a": ps.optim.sgd(0.1), "b": ps.optim.sgd(0.1)}
    for n in (1, 2, 3):
        base = ps.train_step(gf, opts, every={"a": n})
        for inner in (base, LossScale(base), ps.skip_nonfinite(LossScale(base))):
            assert ps.with_ema(inner, 0.9, ["a"]).period("a") == n
            assert ps.with_ema(inner, 0.9, ["a"], on_update=True).period("a") == n
            assert ps.with_ema(inner, 0.9, ["a"], on_update=False).period("a") == 1
            assert ps.with_ema(inner, 0.9, ["a", "b"]).period("b") == 1
    assert ps.with_ema(_plain_step, 0.9, ["a"], on_update=True).period("a") == 1


def test_ema_of_each_role_moves_exactly_when_that_role_updates() -> None:
    """Two roles, the first updated every 2nd step: at an odd step the first role's EMA stays
    and the second role's EMA still moves."""
    torch.manual_seed(0)
    net_a, net_b = nn.Linear(3, 1), nn.Linear(3, 1)

    def loss_fn(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        ya, yb = ps.call(net_a, p["a"], b["x"]), ps.call(net_b, p["b"], b["x"])
        return {"a": (ya - b["y"]).pow(2).mean(), "b": (yb - b["y"]).pow(2).mean()}, {}

    opts = {"a": ps.optim.sgd(0.1), "b": ps.optim.sgd(0.1)}
    base = ps.train_step(ps.value_and_grad(loss_fn), opts, every={"a": 2})
    step = ps.with_ema(base, 0.5, ["a", "b"])
    state = step.prepare(ps.init_state({"a": net_a, "b": net_b}, opts, seed=0))
    _, _, _, batches = _setup()
    for i, b in enumerate(batches):
        new, _ = step(state, b)
        for role, moves in (("a", i % 2 == 0), ("b", True)):
            same = torch.equal(new["ema", role, "weight"], state["ema", role, "weight"])
            assert same != moves, (i, role)
        state = new


def test_with_ema_is_pure_around_a_step_whose_output_shares_the_inputs_nodes() -> None:
    """A foreign step may return a shallow copy of its input; with_ema then writes the EMA
    into a copy of its own, never into the input's ``ema`` node."""
    _, _, state, _ = _setup()
    step = ps.with_ema(_plain_step, 0.5, ["student"])
    state = step.prepare(state)
    before = testing.snapshot(state)
    new, _ = step(state, {"d": torch.ones(2)})
    testing.assert_trees_equal(state, before, what="the input of with_ema(foreign step)")
    w = state["params", "student", "0", "weight"]
    torch.testing.assert_close(new["ema", "student", "0", "weight"], w + 0.5)


def test_wrappers_report_donation_as_a_bool() -> None:
    """``donate`` of with_ema and skip_nonfinite wrappers is True or False, never None."""
    for d in (False, True):
        _, base, _, _ = _setup(donate=d)
        assert ps.with_ema(base, 0.9, ["student"]).donate is d
        assert ps.with_ema(LossScale(base), 0.9, ["student"]).donate is d
    assert ps.with_ema(_plain_step, 0.9, ["student"]).donate is False
    assert ps.skip_nonfinite(_plain_step).donate is False


def test_prepare_of_a_wrapper_adds_what_every_step_inside_keeps_in_state() -> None:
    """prepare fixes the state's structure from step 0 through every layer: skip counters of
    an inner skip_nonfinite, the EMA of an inner with_ema, ema_buffers added to a state that
    already has an EMA; a foreign step without prepare is prepared as is."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    opt = {"student": ps.optim.sgd(0.1)}
    gf = ps.value_and_grad(lambda p, b, k: (ps.call(net, p["student"], b["x"]).mean(), {}))
    state = ps.init_state({"student": net}, opt, seed=0)
    base = ps.train_step(gf, opt)
    assert "skip" in ps.with_ema(ps.skip_nonfinite(base), 0.9, ["student"]).prepare(state).keys()
    inner_ema = LossScale(ps.with_ema(base, 0.9, ["student"]))
    assert "ema" in ps.skip_nonfinite(inner_ema).prepare(state).keys()
    with_ema = ps.with_ema(base, 0.9, ["student"]).prepare(state)
    both = ps.with_ema(base, 0.9, ["student"], buffers=True).prepare(with_ema)
    assert {"ema", "ema_buffers"} <= set(both.keys())
    testing.assert_trees_equal(both["ema_buffers", "student"], state["buffers", "student"])
    plain = ps.with_ema(_plain_step, 0.9, ["student"]).prepare(state)
    testing.assert_trees_equal(plain["ema", "student"], state["params", "student"])
    assert "skip" in ps.skip_nonfinite(_plain_step).prepare(state).keys()


def _message(exc: type[Exception], fn: Callable[[], object]) -> str:
    """The whole message of the ``exc`` that ``fn()`` raises."""
    with pytest.raises(exc) as info:
        fn()
    return str(info.value)


def test_with_ema_and_skip_nonfinite_refuse_bad_arguments_with_whole_messages() -> None:
    """Each wrong argument of with_ema / skip_nonfinite is refused at wrap time with a message
    naming the function, the argument and the value; decay 0 and 1 (the bounds) are accepted."""
    _, base, _, _ = _setup()
    for decay in (0.0, 1.0):
        assert ps.with_ema(base, decay, ["student"]).decay == decay
    assert (
        _message(ValueError, lambda: ps.with_ema(base, 1.5, ["student"]))
        == "with_ema: decay must be in [0, 1], got 1.5"
    )
    assert (
        _message(TypeError, lambda: ps.with_ema(base, 0.9, "student"))
        == "with_ema: roles must be a list of role names; use ['student']"
    )
    assert _message(ValueError, lambda: ps.with_ema(base, 0.9, [])) == "with_ema: roles is empty"
    assert (
        _message(ValueError, lambda: ps.with_ema(base, 0.9, ["student"], start_step=-1))
        == "with_ema: start_step must be >= 0, got -1"
    )
    for who, wrap in (
        ("with_ema", lambda: ps.with_ema(3, 0.9, ["student"])),  # type: ignore[arg-type]
        ("skip_nonfinite", lambda: ps.skip_nonfinite(3)),  # type: ignore[call-overload]
    ):
        assert _message(TypeError, wrap) == (
            f"{who} wraps a step function step(state, batch) -> (state, metrics) (a "
            "purestep.step.Step); got int"
        )
    for bad in (True, 1.5):
        assert (
            _message(TypeError, lambda: ps.skip_nonfinite(base, max_consecutive=bad))  # type: ignore[arg-type]  # noqa: B023
            == f"skip_nonfinite: max_consecutive must be an int, got {bad!r}"
        )
    assert (
        _message(ValueError, lambda: ps.skip_nonfinite(base, max_consecutive=-1))
        == "skip_nonfinite: max_consecutive must be >= 0, got -1"
    )
    _, donating, _, _ = _setup(donate=True)
    assert _message(ValueError, lambda: ps.skip_nonfinite(LossScale(donating))) == (
        "skip_nonfinite: LossScale donates its input state, so its input is already "
        "overwritten when its metrics show a non-finite loss; build it with donate=False "
        "(train_step steps fuse the check and may donate)"
    )


def _reporting_step(state: TensorDictBase, batch: Batch) -> tuple[TensorDict, TensorDict]:
    """A foreign step whose metrics are its batch (a tree of tensors); the params move by 1."""
    out = state.copy()
    out["step"] = state["step"] + 1
    out["params", "student"] = state["params", "student"].apply(lambda t: t + 1)
    return out, TensorDict(dict(batch), [])


SKIP_WRAPS: dict[str, Callable[[int], Step]] = {
    "skip(foreign)": lambda m: ps.skip_nonfinite(_reporting_step, max_consecutive=m),
    "skip(skip(foreign)) rewrapped": lambda m: ps.skip_nonfinite(
        ps.skip_nonfinite(_reporting_step, max_consecutive=m + 3), max_consecutive=m
    ),
    "skip(ema(foreign))": lambda m: ps.skip_nonfinite(
        ps.with_ema(_reporting_step, 0.9, ["student"]), max_consecutive=m
    ),
}


@settings(max_examples=15)
@given(st.sampled_from(sorted(SKIP_WRAPS)), st.integers(0, 2))
def test_max_consecutive_skips_pass_and_one_more_raises_in_every_composition(
    wrap: str, m: int
) -> None:
    """Property: around a foreign step, however skip_nonfinite is composed (alone, re-wrapped
    with a new max_consecutive, around with_ema), ``m`` consecutive non-finite steps are skipped
    (params unchanged) and the next one raises NonFiniteError naming the count, m and the step."""
    _, _, state, _ = _setup()
    step = SKIP_WRAPS[wrap](m)
    state = step.prepare(state)
    params = testing.snapshot(state["params"])
    bad = {"loss": torch.tensor(float("nan"))}
    for _ in range(m):
        state, metrics = step(state, bad)
        assert bool(metrics["skipped"])
    testing.assert_trees_equal(state["params"], params, what="params after skipped steps")
    assert int(state["skip", "consecutive"]) == m
    assert _message(NonFiniteError, lambda: step(state, bad)) == (
        f"{m + 1} consecutive steps with a non-finite loss or gradient (max_consecutive={m}), "
        f"last at step {m}"
    )


@settings(max_examples=20)
@given(
    st.sampled_from(["loss", "grad_norm", "acc"]),
    st.booleans(),
    st.sampled_from([float("nan"), float("inf"), 1.0]),
)
def test_a_foreign_step_is_skipped_exactly_when_a_floating_loss_or_grad_norm_is_not_finite(
    name: str, nested: bool, value: float
) -> None:
    """Property: skip_nonfinite around a foreign step discards its result exactly when a floating
    metric named ``loss`` or ``grad_norm`` (at any depth) is not finite; other floating metrics
    and integer ones are not looked at, and with no loss metric at all nothing is skipped. The
    ``skipped`` metric is a boolean scalar either way."""
    _, _, state, _ = _setup()
    step = ps.skip_nonfinite(_reporting_step)
    state = step.prepare(state)
    metric = torch.tensor(value)
    batch: dict[str, Any] = {"count": torch.ones((), dtype=torch.int64)}
    batch.update({"student": {name: metric}} if nested else {name: metric})
    new, metrics = step(state, batch)
    skipped = name != "acc" and value != 1.0
    assert metrics["skipped"].dtype == torch.bool and metrics["skipped"].shape == ()
    assert bool(metrics["skipped"]) is skipped
    moved = state["params"].apply(lambda t: t + (0 if skipped else 1))
    testing.assert_trees_equal(new["params"], moved, what="params")
    assert int(new["step"]) == 1
    assert (int(new["skip", "total"]), int(new["skip", "consecutive"])) == (int(skipped),) * 2


def test_a_good_step_after_a_skip_resets_the_count_without_touching_its_input() -> None:
    """Around a foreign step (whose output shares the input's tensors), the good step after a
    skipped one sets consecutive to 0 and keeps total in its output only: its input still
    counts 1 consecutive skip."""
    _, _, state, _ = _setup()
    step = ps.skip_nonfinite(_reporting_step)
    state, _ = step(step.prepare(state), {"loss": torch.tensor(float("nan"))})
    before = testing.snapshot(state)
    new, metrics = step(state, {"loss": torch.tensor(1.0)})
    testing.assert_trees_equal(state, before, what="the input of the good step")
    assert not bool(metrics["skipped"])
    assert (int(new["skip", "total"]), int(new["skip", "consecutive"])) == (1, 0)


def test_skip_counters_missing_a_count_are_refused_naming_it() -> None:
    """A ``state["skip"]`` tree without its ``total`` count is refused by prepare, naming it."""
    _, _, state, _ = _setup()
    state["skip"] = TensorDict({"consecutive": torch.zeros((), dtype=torch.int64)}, [])
    with pytest.raises(StateError) as info:
        ps.skip_nonfinite(_reporting_step).prepare(state)
    assert str(info.value) == (
        "skip_nonfinite: state['skip', 'total'] must be an int64 0-dim tensor (a count of "
        "skipped steps); drop state['skip'] and call step.prepare to rebuild it"
    )
    assert info.value.path == ("skip", "total")


def test_with_ema_prepare_refuses_a_role_without_params_or_buffers_naming_the_path() -> None:
    """A role that has no params, or (with buffers=True) no buffers, is refused by prepare with
    a message naming the role (and the roles that do have params) and the path at fault."""
    _, base, state, _ = _setup()
    with pytest.raises(StateError) as info:
        ps.with_ema(base, 0.9, ["teacher"]).prepare(state)
    assert str(info.value) == (
        "with_ema: role 'teacher' has no params in state (roles with params: ['student'])"
    )
    assert info.value.path == ("params", "teacher")
    with pytest.raises(StateError) as info:
        ps.with_ema(base, 0.9, ["student"], buffers=True).prepare(state)
    assert str(info.value) == (
        "with_ema(buffers=True): role 'student' has no buffers in state "
        "(its module has no persistent buffers)"
    )
    assert info.value.path == ("buffers", "student")


def _bn_setup() -> tuple[Step, TensorDict, list[dict[str, torch.Tensor]]]:
    """A train step on a net with BatchNorm (float running stats, an int64 count)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    opt = {"student": ps.optim.sgd(0.1)}
    gf = ps.value_and_grad(lambda p, b, k: (ps.call(net, p["student"], b["x"]).mean(), {}))
    _, _, _, batches = _setup()
    return ps.train_step(gf, opt), ps.init_state({"student": net}, opt, seed=0), batches


def test_ema_buffers_copy_the_buffers_before_start_step_and_average_them_after() -> None:
    """with_ema(buffers=True, start_step=2) against the unwrapped step: at steps 0 and 1 the
    EMA params and buffers are exact copies of the step's params and buffers; from step 2 on
    they are lerp(ema, new, 1 - decay) of them (the int64 count always copied)."""
    base, state, batches = _bn_setup()
    step = ps.with_ema(base, 0.5, ["student"], buffers=True, start_step=2)
    state = step.prepare(state)
    for i, b in enumerate(batches[:3]):
        plain, _ = base(state.exclude("ema", "ema_buffers"), b)
        new, _ = step(state, b)
        for src, dst in (("params", "ema"), ("buffers", "ema_buffers")):
            for path in plain[src, "student"].keys(include_nested=True, leaves_only=True):
                live, ema = plain[src, "student"].get(path), state[dst, "student"].get(path)
                want = live if i < 2 or not live.is_floating_point() else torch.lerp(ema, live, 0.5)
                assert torch.equal(new[dst, "student"].get(path), want), (i, dst, path)
        state = new


def test_with_ema_refuses_ema_buffers_that_do_not_match_the_buffers() -> None:
    """An ``ema_buffers`` leaf of another shape than its buffer is refused at the step, naming
    both paths."""
    base, state, batches = _bn_setup()
    step = ps.with_ema(base, 0.9, ["student"], buffers=True)
    state = step.prepare(state)
    state["ema_buffers", "student", "1", "running_mean"] = torch.zeros(5)
    with pytest.raises(StateError) as info:
        step(state, batches[0])
    assert str(info.value) == (
        "with_ema: ema_buffers.student does not match buffers.student: "
        "ema_buffers.student.1.running_mean is a torch.float32 tensor of shape (5,), but "
        "buffers.student.1.running_mean is a torch.float32 tensor of shape (4,). Change them "
        "together (or drop the key and let step.prepare rebuild it)"
    )


class _Link:
    """A minimal user wrapper (only ``inner`` and ``__call__``), mutable to build cycles."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, state: TensorDictBase, batch: Batch) -> tuple[TensorDict, TensorDict]:
        return self.inner(state, batch)  # type: ignore[no-any-return]


def test_wrappers_look_through_at_most_64_levels_of_inner_steps_and_survive_a_cycle() -> None:
    """with_ema finds the donation and the cadence of a train step 63 user wrappers deep, not 64
    deep (the search through ``inner`` is bounded), and a cycle of ``inner`` links ends: no
    donation, cadence 1."""
    gf = ps.value_and_grad(lambda p, b, k: (p["a", "w"].sum(), {}))
    base: Step = ps.train_step(gf, {"a": ps.optim.sgd(0.1)}, every={"a": 3}, donate=True)
    for depth, found in ((63, True), (64, False)):
        step: Any = base
        for _ in range(depth):
            step = _Link(step)
        ema = ps.with_ema(step, 0.9, ["a"])
        assert (ema.donate, ema.period("a")) == ((True, 3) if found else (False, 1)), depth
    a, b = _Link(None), _Link(None)
    a.inner, b.inner = b, a
    cyclic = ps.with_ema(a, 0.9, ["a"])  # type: ignore[arg-type]
    assert (cyclic.donate, cyclic.period("a")) == (False, 1)
