"""Wrappers compose in any order: ``with_ema``, ``skip_nonfinite`` and a user's own wrapper.

Each pair is composed both ways around a ``train_step`` and the result is put through the
property kit (purity, determinism, exact resume) and compared with the other order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

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
