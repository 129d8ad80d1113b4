"""The property checks fail on steps that break their property, and name where."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from tensordict import TensorDict, TensorDictBase
from torch import nn

import purestep as ps
from purestep import optim, testing


def _state() -> TensorDict:
    return TensorDict(
        {"params": {"m": {"w": torch.ones(3)}}, "step": torch.zeros((), dtype=torch.int64)}, []
    )


def _next(state: TensorDictBase, w: torch.Tensor) -> TensorDict:
    out = state.copy()
    out["params", "m", "w"] = w
    out["step"] = state["step"] + 1
    return out  # type: ignore[no-any-return]


def _empty() -> TensorDict:
    return TensorDict({}, [])


def test_assert_trees_equal_names_the_first_diverging_path_and_size() -> None:
    """The message names the key path and the max abs/rel difference."""
    a = TensorDict({"a": {"b": torch.zeros(2)}, "c": torch.ones(2)}, [])
    b = a.clone()
    b["a", "b"][1] = 0.5
    with pytest.raises(AssertionError, match=r"a\.b.*max abs diff 0\.5"):
        testing.assert_trees_equal(b, a)


def test_assert_trees_equal_distinguishes_nan_payload_free_bitwise_equality() -> None:
    """NaN equals NaN bitwise; -0.0 differs from 0.0 bitwise."""
    nan = TensorDict({"x": torch.tensor([float("nan")])}, [])
    testing.assert_trees_equal(nan, nan.clone())
    with pytest.raises(AssertionError, match="x"):
        testing.assert_trees_equal(
            TensorDict({"x": torch.tensor([-0.0])}, []), TensorDict({"x": torch.tensor([0.0])}, [])
        )


def test_assert_pure_catches_in_place_mutation_of_state() -> None:
    """A step that updates params in place is reported as mutating its input."""

    def bad(state: TensorDictBase, batch: Any) -> tuple[TensorDict, TensorDict]:
        state["params", "m", "w"].add_(1.0)
        return _next(state, state["params", "m", "w"]), _empty()

    with pytest.raises(AssertionError, match=r"input state.*params\.m\.w"):
        testing.assert_pure(bad, _state(), {"x": torch.ones(2)})


def test_assert_pure_catches_mutation_of_the_batch() -> None:
    """Writing into the batch is reported."""

    def bad(state: TensorDictBase, batch: TensorDictBase) -> tuple[TensorDict, TensorDict]:
        batch["x"].mul_(2)
        return _next(state, state["params", "m", "w"] + 1), _empty()

    with pytest.raises(AssertionError, match="input batch"):
        testing.assert_pure(bad, _state(), {"x": torch.ones(2)})


def test_assert_pure_catches_hidden_state() -> None:
    """A step with a counter in a closure gives different results on a second call."""
    calls = [0]

    def bad(state: TensorDictBase, batch: Any) -> tuple[TensorDict, TensorDict]:
        calls[0] += 1
        return _next(state, state["params", "m", "w"] + calls[0]), _empty()

    with pytest.raises(AssertionError, match="hidden state"):
        testing.assert_pure(bad, _state(), {"x": torch.ones(2)})


def test_assert_deterministic_catches_global_rng_use() -> None:
    """A step that draws from an unseeded generator is not repeatable."""
    gen = torch.Generator().manual_seed(0)

    def bad(state: TensorDictBase, batch: Any) -> tuple[TensorDict, TensorDict]:
        return _next(state, state["params", "m", "w"] + torch.rand(3, generator=gen)), _empty()

    with pytest.raises(AssertionError, match=r"params\.m\.w"):
        testing.assert_deterministic(bad, _state(), [{"x": torch.ones(2)}] * 2)


def test_assert_donation_safe_catches_a_donated_path_that_differs() -> None:
    """Different results with donate=True are reported with the key path."""

    def make(donate: bool) -> Any:
        def step(state: TensorDictBase, batch: Any) -> tuple[TensorDict, TensorDict]:
            return _next(
                state, state["params", "m", "w"] * (1.0001 if donate else 1.0) + 1
            ), _empty()

        return step

    with pytest.raises(AssertionError, match=r"donate=True vs donate=False.*params\.m\.w"):
        testing.assert_donation_safe(make, _state(), [{"x": torch.ones(2)}])


def test_assert_accumulation_invariant_catches_batch_size_dependence() -> None:
    """A loss that sums instead of averaging changes with k and is reported."""
    net = nn.Linear(2, 1)
    opt = {"m": optim.sgd(0.1)}
    gf = ps.value_and_grad(lambda p, b, k: (ps.call(net, p["m"], b["x"]).sum(), {}))
    state = ps.init_state({"m": net}, opt, seed=0)
    with pytest.raises(AssertionError, match="k=2"):
        testing.assert_accumulation_invariant(
            lambda k: ps.train_step(ps.accumulate(gf, k), opt), state, {"x": torch.ones(4, 2)}
        )


def test_assert_accumulation_invariant_catches_per_batch_noise() -> None:
    """Noise drawn per batch position rather than per sample id breaks invariance."""
    net = nn.Linear(2, 1)
    opt = {"m": optim.sgd(0.1)}

    def loss(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        noise = ps.rng.normal(key, tuple(b["x"].shape))  # no index=: depends on the cut
        return ps.call(net, p["m"], b["x"] + noise).pow(2).mean(), {}

    state = ps.init_state({"m": net}, opt, seed=0)
    with pytest.raises(AssertionError):
        testing.assert_accumulation_invariant(
            lambda k: ps.train_step(ps.accumulate(ps.value_and_grad(loss), k), opt),
            state,
            {"x": torch.ones(4, 2)},
        )


def test_assert_resume_exact_catches_state_kept_outside_the_state() -> None:
    """A step object that counts its own calls diverges after a restart."""

    class Counting:
        def __init__(self) -> None:
            self.n = 0

        def __call__(self, state: TensorDictBase, batch: Any) -> tuple[TensorDict, TensorDict]:
            self.n += 1
            return _next(state, state["params", "m", "w"] * 0.5 + self.n), _empty()

    with pytest.raises(AssertionError, match=r"resumed after step 2.*params\.m\.w"):
        testing.assert_resume_exact(
            Counting(), _state(), [{"x": torch.ones(1)}] * 4, save_at=2, restart_step=Counting()
        )


def test_assert_cadence_catches_updates_off_cadence() -> None:
    """A role updated every step fails a check for every=2, naming the step."""

    def step(state: TensorDictBase, batch: Any) -> tuple[TensorDict, TensorDict]:
        return _next(state, state["params", "m", "w"] + 1), _empty()

    with pytest.raises(AssertionError, match="changed at step 1"):
        testing.assert_cadence(step, _state(), [{"x": torch.ones(1)}] * 3, "m", 2)


def test_assert_cadence_catches_a_missed_update() -> None:
    """A role never updated fails on its first due step."""

    def step(state: TensorDictBase, batch: Any) -> tuple[TensorDict, TensorDict]:
        return _next(state, state["params", "m", "w"]), _empty()

    with pytest.raises(AssertionError, match="should update at step 0"):
        testing.assert_cadence(step, _state(), [{"x": torch.ones(1)}] * 2, "m", 1)


@settings(max_examples=10, deadline=None)
@given(testing.states(), testing.batches(B=4, fields={"x": (3,)}))
def test_strategies_produce_valid_states_and_batches(state: TensorDict, batch: TensorDict) -> None:
    """states() builds init_state outputs; batches() has the requested batch size and fields."""
    assert int(state["step"]) == 0
    assert set(state["params"].keys()) == {"student"}
    assert batch.batch_size == torch.Size([4]) and batch["x"].shape == (4, 3)


@settings(max_examples=10, deadline=None)
@given(testing.sgd_hparams())
def test_sgd_hparams_are_accepted_by_torch_and_purestep(h: dict[str, Any]) -> None:
    """Every drawn sgd_hparams() is valid for both torch.optim.SGD and optim.sgd."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], **h)
    optim.sgd(**h)
