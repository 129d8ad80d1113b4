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
from tensordict import TensorDict, TensorDictBase
from torch import nn

import purestep as ps
from purestep import testing
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
    the output is a shallow copy of the input (its nodes are the input's), no loss metric."""
    out = state.copy()
    out["step"] = state["step"] + 1
    out["params", "student"] = state["params", "student"].apply(lambda t: t + batch["d"].mean())
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
