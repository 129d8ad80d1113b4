"""Meta-tests of the property kit: every ``purestep.testing`` check fails on each defect it claims
to detect, naming the key path (or module, generator, step) at fault, and passes a correct step.

``test_testing.py`` has the first negative test of each check; here each check is handed
deliberately broken steps, save/load pairs and factories drawn by hypothesis, and the
messages of issue 17 item 7 are pinned: global-RNG consumption is named as such,
accumulation invariance compares gradients and lists every failing leaf, and a
donated step's impurity names donation as the cause.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any, cast

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, TensorDict, TensorDictBase
from torch import nn

import purestep as ps
from _ids import safe_id
from purestep import optim, testing
from purestep.testing import _compare as testing_compare
from purestep.testing import _steps as testing_steps
from purestep.testing import checks as testing_checks
from purestep.testing._global_rng import ADVICE, RngWatch, global_rng_states

StepFn = Callable[[TensorDictBase, Any], tuple[TensorDictBase, TensorDictBase]]


def _net(seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return net


def _batch(i: int, n: int = 4) -> TensorDict:
    g = torch.Generator().manual_seed(100 + i)
    return TensorDict(
        {"x": torch.randn(n, 3, generator=g), "y": torch.randn(n, 2, generator=g)}, [n]
    )


def _mse(net: nn.Module) -> Callable[..., Any]:
    def loss(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        return ((ps.call(net, p["m"], b["x"]) - b["y"]) ** 2).mean(), {}

    return loss


def _setup(
    opt: optim.Transform | None = None,
) -> tuple[nn.Module, dict[str, optim.Transform], Callable[..., Any], TensorDict]:
    net = _net()
    opts = {"m": opt if opt is not None else optim.adamw(1e-2)}
    gf = ps.value_and_grad(_mse(net))
    return net, opts, gf, ps.init_state({"m": net}, opts, seed=0)


_PARAM_LEAVES = ["0.weight", "0.bias", "2.weight", "2.bias"]


# --- the comparison helpers report every diverging leaf ---------------------------------------


@settings(max_examples=20, deadline=None)
@given(bad=st.sets(st.sampled_from(["a", "b.c", "b.d", "e"]), min_size=1))
def test_tree_comparisons_name_the_first_and_every_diverging_leaf(bad: set[str]) -> None:
    """assert_trees_equal/close: the first line names the first leaf; every bad leaf is listed."""
    a = TensorDict({"a": torch.zeros(2), "b": {"c": torch.zeros(3), "d": torch.zeros(1)}}, [])
    a["e"] = torch.zeros(2)
    b = a.clone()
    for name in bad:
        b[tuple(name.split("."))] += 1.0
    order = [n for n in ["a", "b.c", "b.d", "e"] if n in bad]
    for check in (testing.assert_trees_equal, testing.assert_trees_close):
        with pytest.raises(AssertionError) as info:
            check(b, a)
        msg = str(info.value)
        assert msg.splitlines()[0].startswith(f"trees: first difference at {order[0]}")
        listed = [ln.split()[0].rstrip(":") for ln in msg.splitlines()[2:]]
        assert listed == (order if len(order) > 1 else [])


# --- assert_pure ------------------------------------------------------------------------------


@settings(max_examples=12, deadline=None)
@given(leaf=st.sampled_from([*_PARAM_LEAVES, "opt_state.m.mu.0.weight", "step"]))
def test_assert_pure_names_the_input_leaf_a_step_wrote_into(leaf: str) -> None:
    """Writing into any input leaf is reported with that key path."""
    _, opts, gf, state = _setup()
    good = ps.train_step(gf, opts)
    path = tuple(["params", "m", *leaf.split(".")] if leaf in _PARAM_LEAVES else leaf.split("."))

    def bad(s: TensorDictBase, b: Any) -> tuple[TensorDictBase, TensorDictBase]:
        out = good(s, b)
        s.get(path).add_(1)
        return out

    name = re.escape(".".join(path))
    with pytest.raises(
        AssertionError, match=rf"input state after step.*first difference at {name}"
    ):
        testing.assert_pure(bad, state, _batch(0))
    testing.assert_pure(good, state, _batch(0))


def test_assert_pure_names_a_key_added_to_the_batch() -> None:
    """A step that adds a key to its batch is reported with the key."""

    def bad(s: TensorDictBase, b: TensorDictBase) -> tuple[TensorDictBase, TensorDictBase]:
        b["extra"] = torch.zeros(4)
        return s.clone(), TensorDict({}, [])

    with pytest.raises(
        AssertionError, match=r"input batch after step.*only in actual: \['extra'\]"
    ):
        testing.assert_pure(bad, _setup()[3], _batch(0))


def test_assert_pure_names_the_module_tensor_a_step_changed() -> None:
    """A step that writes into a module it runs (or one passed in modules=) names module and tensor."""
    net, opts, gf, state = _setup()
    teacher = _net(1)

    def through_call(s: TensorDictBase, b: Any) -> tuple[TensorDictBase, TensorDictBase]:
        ps.call(net, s["params", "m"], b["x"])
        with torch.no_grad():
            net[0].bias.add_(1)
        return s.clone(), TensorDict({}, [])

    def direct(s: TensorDictBase, b: Any) -> tuple[TensorDictBase, TensorDictBase]:
        with torch.no_grad():
            teacher[2].weight.mul_(2)
        return s.clone(), TensorDict({}, [])

    with pytest.raises(AssertionError, match=r"0\.bias"):
        testing.assert_pure(through_call, state, _batch(0))
    with pytest.raises(AssertionError, match=r"2\.weight"):
        testing.assert_pure(direct, state, _batch(0), modules=[teacher])
    testing.assert_pure(ps.train_step(gf, opts), state, _batch(0), modules=[net, teacher])


def test_assert_pure_on_a_donated_step_names_donation_as_the_cause() -> None:
    """A donate=True step fails purity by design; the message says so and what to check instead."""
    _, opts, gf, state = _setup()
    with pytest.raises(AssertionError, match=r"donates its input \(donate=True\).*donate=False"):
        # a clone: the donated step consumes the state it is given (reusing it is refused)
        testing.assert_pure(ps.train_step(gf, opts, donate=True), state.clone(), _batch(0))
    testing.assert_pure(ps.train_step(gf, opts, donate=False), state, _batch(0))


def test_assert_pure_on_a_mutating_plain_function_mentions_donation_as_a_possibility() -> None:
    """A step of unknown donation that writes its input: the message mentions donate=True."""

    def bad(s: TensorDictBase, b: Any) -> tuple[TensorDictBase, TensorDictBase]:
        s["step"].add_(1)
        return s, TensorDict({}, [])

    with pytest.raises(AssertionError, match=r"at step.*If the step donates its input"):
        testing.assert_pure(bad, _setup()[3], _batch(0))


# --- global RNG: every check names it ---------------------------------------------------------


class _LabelDrop(nn.Module):
    """Like a diffusers model in train mode: drops rows with ``torch.rand`` (the global RNG)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = (torch.rand(x.shape[0], 1) > 0.5).to(x.dtype) if self.training else 1.0
        return self.lin(x * keep)


def _global_rng_setup() -> tuple[Callable[[int], StepFn], TensorDict]:
    net = _LabelDrop()
    opts = {"m": optim.sgd(0.1)}

    def loss(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        return ((ps.call(net, p["m"], b["x"]) - b["y"]) ** 2).mean(), {}

    gf = ps.value_and_grad(loss)
    return (lambda k: ps.train_step(ps.accumulate(gf, k), opts)), ps.init_state(
        {"m": net}, opts, seed=0
    )


_GLOBAL = r"drew from torch's global RNG.*pass key= to purestep\.call"


def _during(where: str) -> str:
    return rf"drew from torch's global RNG \(its state changed during {where}.*pass key= to purestep\.call"


def test_every_check_names_global_rng_consumption_as_the_cause() -> None:
    """A module drawing from torch.rand (train-mode label dropout): each check says so."""
    make, state = _global_rng_setup()
    step = make(1)
    batches = [_batch(i) for i in range(3)]
    with pytest.raises(
        AssertionError,
        match=r"drew from torch's global RNG: its state changed during the first call",
    ):
        testing.assert_pure(step, state, batches[0])
    with pytest.raises(
        AssertionError,
        match=_during(r"step 0 of run 1 \(the cpu generator\) and 5 more step calls"),
    ):
        testing.assert_deterministic(step, state, batches)
    with pytest.raises(AssertionError, match=_during("step 0 of the donate=False run")):
        testing.assert_donation_safe(lambda d: step, state, batches)
    with pytest.raises(AssertionError, match=_during("step 0 with k=1")):
        testing.assert_accumulation_invariant(make, state, batches)
    with pytest.raises(AssertionError, match=_during("step 0 of k=1")):
        testing.assert_accumulation_invariant(make, state, batches, compare="state")
    with pytest.raises(AssertionError, match=_during("step 0 of the uninterrupted run")):
        testing.assert_resume_exact(step, state, batches, save_at=1)
    watch = RngWatch()
    testing_steps.run_watched(step, state, batches[1:], watch, "the resumed run", 1)
    assert watch.consumed == [f"step {i} of the resumed run (the cpu generator)" for i in (1, 2)]
    with pytest.raises(
        AssertionError, match=rf"cadence: role 'm' changed at step 1.*{_during('step 0')}"
    ):
        testing.assert_cadence(step, state, batches, "m", 2)


def test_a_key_seeded_call_is_not_reported_as_global_rng_use() -> None:
    """call(..., key=) seeds and restores the global generators: no check reports it."""
    net = _LabelDrop()
    opts = {"m": optim.sgd(0.1)}

    def loss(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        return ((ps.call(net, p["m"], b["x"], key=key) - b["y"]) ** 2).mean(), {}

    step = ps.train_step(ps.value_and_grad(loss), opts)
    state = ps.init_state({"m": net}, opts, seed=0)
    batches = [_batch(i) for i in range(3)]
    testing.assert_pure(step, state, batches[0])
    testing.assert_deterministic(step, state, batches)
    testing.assert_resume_exact(step, state, batches, save_at=1)


def test_rng_watch_notes_only_the_calls_that_drew() -> None:
    """RngWatch names the calls that changed a global generator's state, and only those."""
    w = RngWatch()
    w.call("a", torch.zeros, 2)
    w.call("b", torch.rand, 2)
    w.call("c", torch.ones, 1)
    assert w.consumed == ["b (the cpu generator)"]
    assert "b (the cpu generator)" in w.hint()
    assert RngWatch().hint() == ""
    assert "(its state changed during b (the cpu generator))" in w.hint()
    w.call("d", torch.rand, 1)
    assert "during b (the cpu generator) and 1 more step call)" in w.hint()
    w.call("e", torch.rand, 1)
    assert "during b (the cpu generator) and 2 more step calls)" in w.hint()
    assert "cpu" in global_rng_states()


# --- assert_deterministic, assert_donation_safe ------------------------------------------------


@settings(max_examples=8, deadline=None)
@given(leaf=st.sampled_from(_PARAM_LEAVES))
def test_assert_deterministic_names_the_leaf_and_run_of_a_hidden_counter(leaf: str) -> None:
    """A step whose result depends on how often it ran names the state leaf it changed (last step)."""
    _, opts, gf, state = _setup()
    good = ps.train_step(gf, opts)
    calls = [0]

    def bad(s: TensorDictBase, b: Any) -> tuple[TensorDictBase, TensorDictBase]:
        out, m = good(s, b)
        calls[0] += 1
        if calls[0] == 6:  # the last step of the second run
            out["params", "m", *leaf.split(".")] = out["params", "m", *leaf.split(".")] + 1e-3
        return out, m

    with pytest.raises(AssertionError, match=rf"run 2 vs run 1.*params\.m\.{re.escape(leaf)}"):
        testing.assert_deterministic(bad, state, [_batch(i) for i in range(3)])
    testing.assert_deterministic(good, state, [_batch(i) for i in range(3)])


def test_assert_donation_safe_names_an_input_written_by_the_donate_false_build() -> None:
    """make_step(False) writing into its input fails, naming the leaf."""
    _, opts, gf, state = _setup()

    def make(donate: bool) -> StepFn:
        inner = ps.train_step(gf, opts, donate=donate)

        def step(s: TensorDictBase, b: Any) -> tuple[TensorDictBase, TensorDictBase]:
            out = inner(s, b)
            s["params", "m", "2", "bias"].zero_()
            return out

        return step if not donate else inner

    with pytest.raises(
        AssertionError, match=r"input state of the donate=False run.*params\.m\.2\.bias"
    ):
        testing.assert_donation_safe(make, state, [_batch(0)])
    testing.assert_donation_safe(lambda d: ps.train_step(gf, opts, donate=d), state, [_batch(0)])


def test_assert_donation_safe_names_a_differing_metric() -> None:
    """Equal states but a metric that differs with donation: the metric is named."""
    _, opts, gf, state = _setup()

    def make(donate: bool) -> StepFn:
        inner = ps.train_step(gf, opts, donate=donate)

        def step(s: TensorDictBase, b: Any) -> tuple[TensorDictBase, TensorDictBase]:
            out, m = inner(s, b)
            m["loss"] = m["loss"] + (1.0 if donate else 0.0)
            return out, m

        return step

    with pytest.raises(AssertionError, match=r"metrics of step 0 with donate=True.*loss"):
        testing.assert_donation_safe(make, state, [_batch(0)])


# --- assert_accumulation_invariant ----------------------------------------------------------


class _SoftmaxBias(nn.Module):
    """softmax(x W + b) with a scalar b: the true gradient of b is exactly zero (like a key bias)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 8, generator=g))
        self.b = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x @ self.w + self.b, -1)


def test_accumulation_invariance_compares_gradients_so_adam_noise_on_zero_gradients_passes() -> (
    None
):
    """Adam on a leaf with zero true gradient: gradients agree, so the default check passes.

    Adam scales that leaf's rounding noise up to about lr, which comparing the
    states after the optimizer (the old default) reported as a failure.
    """
    net = _SoftmaxBias()
    opts = {"m": optim.adamw(1e-2)}

    def loss(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        return ((ps.call(net, p["m"], b["x"]) - b["y"]) ** 2).mean(), {}

    gf = ps.value_and_grad(loss)
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(16, 4, generator=g), "y": torch.rand(16, 8, generator=g)}
    state = ps.init_state({"m": net}, opts, seed=0)
    testing.assert_accumulation_invariant(
        lambda k: ps.train_step(ps.accumulate(gf, k), opts), state, [batch] * 3
    )


@settings(max_examples=10, deadline=None)
@given(
    bad=st.sets(st.sampled_from(_PARAM_LEAVES), min_size=1),
    compare=st.sampled_from(["grads", "state"]),
)
def test_accumulation_invariance_lists_every_leaf_whose_gradient_depends_on_k(
    bad: set[str], compare: str
) -> None:
    """Gradients of the chosen leaves scaled by k: every one of them (and only those) is named."""
    _, opts, gf, state = _setup(optim.sgd(0.1))
    order = [n for n in _PARAM_LEAVES if n in bad]

    def make(k: int) -> StepFn:
        inner = ps.accumulate(gf, k)

        def grad_fn(params: Any, batch: Any, key: Any, **kw: Any) -> Any:
            grads, metrics = inner(params, batch, key, **kw)
            for n in order:
                path = ("m", *n.split("."))
                grads.set(path, grads.get(path) * k)
            return grads, metrics

        return ps.train_step(grad_fn, opts)

    # by state, a changed param changes every later gradient: one batch; by gradients, two
    seq = [_batch(0), _batch(1)] if compare == "grads" else [_batch(0)]
    with pytest.raises(AssertionError) as info:
        testing.assert_accumulation_invariant(make, state, seq, compare=compare)  # type: ignore[arg-type]
    msg = str(info.value)
    named = set(re.findall(r"m\.(\d\.(?:weight|bias))", msg))
    assert named == bad, msg
    assert "k=2 vs k=1" in msg and "k=4 vs k=1" in msg
    testing.assert_accumulation_invariant(
        lambda k: ps.train_step(ps.accumulate(gf, k), opts), state, [_batch(0), _batch(1)]
    )


def test_accumulation_invariance_by_gradients_refuses_a_step_it_cannot_read() -> None:
    """A plain function has no optimizers to record: TypeError pointing to compare='state'."""
    state = _setup()[3]
    with pytest.raises(TypeError, match="compare='state'"):
        testing.assert_accumulation_invariant(
            lambda k: lambda s, b: (s, TensorDict({}, [])), state, _batch(0)
        )


def test_accumulation_invariance_by_gradients_through_with_ema_and_skip_nonfinite() -> None:
    """Wrapped steps are read through their wrappers; a k-dependent loss is still caught."""
    net, opts, gf, state = _setup()

    def sum_loss(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        return ((ps.call(net, p["m"], b["x"]) - b["y"]) ** 2).sum(), {}

    def wrap(g: Any) -> Callable[[int], Any]:
        return lambda k: ps.with_ema(
            ps.skip_nonfinite(ps.train_step(ps.accumulate(g, k), opts)), 0.9, ["m"]
        )

    testing.assert_accumulation_invariant(wrap(gf), state, [_batch(0), _batch(1)])
    with pytest.raises(AssertionError, match=r"gradients at step 0 with k=2 vs k=1"):
        testing.assert_accumulation_invariant(
            wrap(ps.value_and_grad(sum_loss)), state, [_batch(0), _batch(1)]
        )


# --- assert_resume_exact: a lossy save/load pair ---------------------------------------------

_RESUME_LEAVES = [
    *(("params", "m", *n.split(".")) for n in _PARAM_LEAVES),
    ("opt_state", "m", "mu", "0", "weight"),
    ("opt_state", "m", "nu", "2", "bias"),
    ("step",),
]


@settings(max_examples=16, deadline=None)
@given(
    leaf=st.sampled_from(_RESUME_LEAVES),
    donate=st.booleans(),
    save_at=st.integers(1, 2),
)
def test_assert_resume_exact_catches_a_lossy_load_naming_the_leaf(
    leaf: tuple[str, ...], donate: bool, save_at: int
) -> None:
    """A load_fn that perturbs one leaf (params, moments, step) fails, naming that leaf.

    The checker must resume from what load_fn returned, not from the state it saved.
    (opt_state.lr is left out: it is recomputed at the next update, so a perturbed lr
    is legitimately invisible.)
    """
    _, opts, gf, state = _setup()
    step = ps.train_step(gf, opts, donate=donate)
    saved: dict[str, TensorDict] = {}

    def save(s: TensorDictBase, path: str) -> None:
        saved[path] = s.clone()

    def lossy_load(path: str, like: TensorDictBase) -> TensorDictBase:
        out = saved[path].clone()
        t = out.get(leaf)
        out.set(leaf, t + 1 if not t.is_floating_point() else t * 1.01 + 1e-3)
        return out

    def exact_load(path: str, like: TensorDictBase) -> TensorDictBase:
        return saved[path].clone()

    batches = [_batch(i) for i in range(3)]
    name = re.escape(".".join(leaf))
    with pytest.raises(
        AssertionError, match=rf"load_fn differs from the saved one at {name}: .* lossy"
    ):
        testing.assert_resume_exact(
            step, state, batches, save_at=save_at, save_fn=save, load_fn=lossy_load
        )
    testing.assert_resume_exact(
        step, state, batches, save_at=save_at, save_fn=save, load_fn=exact_load
    )


def _save_and_load_adding_a_key() -> tuple[
    Callable[[TensorDictBase, str], None], Callable[[str, TensorDictBase], TensorDictBase]
]:
    """An in-memory save_fn and a load_fn that returns the saved state plus a key ``extra``."""
    saved: dict[str, TensorDict] = {}

    def save(s: TensorDictBase, path: str) -> None:
        saved[path] = s.clone()

    def load(path: str, like: TensorDictBase) -> TensorDictBase:
        out = saved[path].clone()
        out["extra"] = torch.zeros(())
        return out

    return save, load


def test_assert_resume_exact_names_a_load_that_drops_a_key() -> None:
    """A load_fn that returns a different key structure is named as not the saved state."""
    _, opts, gf, state = _setup()
    save, load = _save_and_load_adding_a_key()

    with pytest.raises(AssertionError, match="not the saved one"):
        testing.assert_resume_exact(
            ps.train_step(gf, opts),
            state,
            [_batch(i) for i in range(3)],
            save_at=1,
            save_fn=save,
            load_fn=load,
        )


def test_assert_resume_exact_with_the_default_torch_save_round_trip_passes() -> None:
    """The default save/load (torch.save) is exact for a train_step."""
    _, opts, gf, state = _setup()
    testing.assert_resume_exact(ps.train_step(gf, opts), state, [_batch(i) for i in range(3)], 1)


# --- assert_cadence ------------------------------------------------------------------------


@settings(max_examples=6, deadline=None)
@given(every=st.integers(1, 3), wrong=st.integers(1, 3))
def test_assert_cadence_passes_the_right_every_and_fails_a_wrong_one(
    every: int, wrong: int
) -> None:
    """train_step(every={"m": e}) passes assert_cadence(e) and fails for any other cadence."""
    _, opts, gf, state = _setup()
    step = ps.train_step(gf, opts, every={"m": every})
    batches = [_batch(i) for i in range(4)]
    testing.assert_cadence(step, state, batches, "m", every)
    if wrong != every:
        with pytest.raises(
            AssertionError, match=r"cadence: role 'm' (should update|changed) at step"
        ):
            testing.assert_cadence(step, state, batches, "m", wrong)


def test_run_steps_threads_the_state_and_returns_every_metric() -> None:
    """run_steps calls the step once per batch in order, feeding each output state to the next."""
    seen: list[float] = []

    def step(s: TensorDictBase, b: Any) -> tuple[TensorDictBase, TensorDictBase]:
        seen.append(float(b["x"]))
        return s.apply(lambda t: t + b["x"]), TensorDict({"v": s["w"].clone()}, [])

    final, metrics = testing.run_steps(
        step,
        TensorDict({"w": torch.zeros(())}, []),
        [{"x": torch.tensor(float(i))} for i in (1, 2, 3)],
    )
    assert seen == [1.0, 2.0, 3.0]
    assert float(final["w"]) == 6.0
    assert [float(m["v"]) for m in metrics] == [0.0, 1.0, 3.0]


class _NeedsPrepare:
    """A step that needs a key its ``prepare`` adds (like with_ema's EMA or skip_nonfinite's counters)."""

    def prepare(self, state: TensorDictBase) -> TensorDictBase:
        out = state.clone()
        out["extra"] = torch.ones(())
        return out

    def __call__(self, s: TensorDictBase, b: Any) -> tuple[TensorDictBase, TensorDictBase]:
        out = s.clone()
        out["params", "m", "w"] = s["params", "m", "w"] * s["extra"] + 1
        out["step"] = s["step"] + 1
        return out, TensorDict({}, [])


def test_every_check_runs_the_steps_prepare_first() -> None:
    """Each check calls step.prepare(state) before the first step (the step fails without it)."""
    state = TensorDict(
        {"params": {"m": {"w": torch.zeros(2)}}, "step": torch.zeros((), dtype=torch.int64)}, []
    )
    step = _NeedsPrepare()
    batches = [{"x": torch.ones(1)}] * 3
    with pytest.raises(KeyError):
        step(state, batches[0])
    testing.assert_pure(step, state, batches[0])
    testing.assert_deterministic(step, state, batches)
    testing.assert_donation_safe(lambda d: step, state, batches)
    testing.assert_resume_exact(step, state, batches, save_at=1)
    testing.assert_cadence(step, state, batches, "m", 1)
    testing.assert_accumulation_invariant(lambda k: step, state, batches, compare="state")


# --- pinned by mutation testing (docs/testing.md, "Mutation testing") ------------------------


@settings(max_examples=10, deadline=None)
@given(
    what=st.text(st.sampled_from("abcxyz _"), min_size=1, max_size=12).map(str.strip).filter(bool),
    rtol=st.sampled_from([None, 0.0, 1e-6]),
)
def test_tree_comparisons_name_what_was_compared_and_the_tolerances(
    what: str, rtol: float | None
) -> None:
    """Every comparison message starts with the caller's ``what``; assert_trees_close's also
    states the tolerances it used (``rtol``, ``atol``), on a value and a structure mismatch."""
    atol = None if rtol is None else 0.0
    a = TensorDict({"w": torch.zeros(2)}, [])
    differ = TensorDict({"w": torch.ones(2)}, [])
    other = TensorDict({"v": torch.zeros(2)}, [])
    with pytest.raises(AssertionError) as info:
        testing.assert_trees_close(differ, a, rtol=rtol, atol=atol, what=what)
    first = str(info.value).splitlines()[0]
    assert first.startswith(f"{what}: first difference at w")
    assert first.endswith(f" (rtol={rtol}, atol={atol})")
    for check in (testing.assert_trees_equal, testing.assert_trees_close):
        with pytest.raises(AssertionError) as info:
            check(other, a, what=what)
        assert str(info.value).startswith(
            f"{what}: key structure differs; only in expected: ['w']; only in actual: ['v']"
        )


@settings(max_examples=12, deadline=None)
@given(how=st.sampled_from(["add", "remove", "write", "retype"]), direct=st.booleans())
def test_assert_pure_names_the_module_and_the_tensor_a_step_added_removed_or_changed(
    how: str, direct: bool
) -> None:
    """A step that registers a new buffer on a module it runs (or one in ``modules=``),
    deletes one, writes into one or swaps in one of another dtype fails with the message
    naming the module's class and the tensors (the whole message is pinned: it is the
    kit's advice to the user)."""
    net, _, _, state = _setup()
    net[0].register_buffer("kept", torch.zeros(1))
    net[2].register_buffer("scale", torch.ones(1))

    def bad(s: TensorDictBase, b: Any) -> tuple[TensorDictBase, TensorDictBase]:
        if not direct:
            ps.call(net, s["params", "m"], b["x"])
        if how == "add":
            net[2].register_buffer("extra", torch.zeros(1))
        elif how == "remove":
            del net[2].scale
        elif how == "write":
            net[2].scale.add_(1)
        else:
            net[2].scale = torch.ones(1, dtype=torch.float64)
        return s.clone(), TensorDict({}, [])

    if how in ("add", "remove"):
        added, removed = (["2.extra"], []) if how == "add" else ([], ["2.scale"])
        expected = (
            f"the step changed module Sequential's own parameters/buffers: added {added}, "
            f"removed {removed}"
        )
    else:
        expected = (
            "the step changed module Sequential's own tensor '2.scale'; a pure step leaves "
            "modules as they are (buffers a forward updates, such as BatchNorm statistics, "
            "belong in the state: init_state keeps them in state['buffers', role] and call "
            "swaps them in)"
        )
    with pytest.raises(AssertionError) as info:
        testing.assert_pure(bad, state, _batch(0), modules=[net, _net(1)] if direct else [])
    assert str(info.value) == expected


def _message(check: Callable[[], Any]) -> list[str]:
    with pytest.raises(AssertionError) as info:
        check()
    return str(info.value).splitlines()


class _PlainStep:
    """A step over ``{"a", "b"}`` that writes into its input, holds a counter or draws from
    torch's global RNG on one call, as ``how`` says; ``donate`` is its donation attribute."""

    def __init__(self, how: str, donate: bool | None = None, draw_at: int = -1) -> None:
        self.how, self.calls, self.draw_at = how, 0, draw_at
        if donate is not None:
            self.donate = donate

    def __call__(self, s: TensorDictBase, b: Any) -> tuple[TensorDictBase, TensorDictBase]:
        n, self.calls = self.calls, self.calls + 1
        bump = 0.0
        if n == self.draw_at:
            torch.rand(1)
            bump = 1.0
        if self.how == "state":
            s["a"].add_(1)
            s["b"].add_(1)
        if self.how == "batch":
            b["x"].add_(1)
        hidden = float(n) if self.how == "hidden" else (0.0 if self.how == "drawn metric" else bump)
        out = s.apply(lambda t: t + hidden)
        metric = (
            float(n) if self.how == "metrics" else (bump if self.how == "drawn metric" else 0.0)
        )
        return out, TensorDict({"n": torch.tensor(metric)}, [])


_DONATED_HINT = (
    ". The step donates its input (donate=True): a donated step reuses the input state's "
    "buffers by design, so it is not pure; check its donate=False build with assert_pure, "
    "and that both agree with assert_donation_safe"
)
_MAYBE_DONATED_HINT = (
    ". If the step donates its input (built with donate=True), that is by design: check its "
    "donate=False build with assert_pure"
)


@settings(max_examples=12, deadline=None)
@given(
    how=st.sampled_from(["state", "batch", "hidden", "metrics"]),
    donate=st.sampled_from([None, True, False]),
)
def test_assert_pure_messages_say_what_differs_then_list_every_leaf(
    how: str, donate: bool | None
) -> None:
    """assert_pure's first line says what differs (the input state, with the donation hint
    the step's ``donate`` attribute calls for; the batch; a second call's state or metrics)
    and where first; the leaves follow, one a line."""
    state = TensorDict({"a": torch.zeros(2), "b": torch.zeros(2)}, [])
    batch = TensorDict({"x": torch.zeros(2)}, [])
    lines = _message(lambda: testing.assert_pure(_PlainStep(how, donate), state, batch))
    detail = " (not bitwise equal): max abs diff 1, max rel diff 1e+30"
    if how == "state":
        hint = {None: _MAYBE_DONATED_HINT, True: _DONATED_HINT, False: ""}[donate]
        assert (
            lines[0]
            == f"input state after step (step mutated it): first difference at a{detail}{hint}"
        )
        assert lines[1:] == ["2 leaves differ:", f"  a{detail}", f"  b{detail}"]
    elif how == "batch":
        assert lines == [f"input batch after step (step mutated it): first difference at x{detail}"]
    elif how == "hidden":
        assert (
            lines[0]
            == f"second call on the same inputs (hidden state?): first difference at a{detail}"
        )
    else:
        assert lines == [
            f"metrics of a second call on the same inputs: first difference at n{detail}"
        ]


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 3), runs=st.integers(1, 3), single=st.booleans())
def test_assert_deterministic_runs_the_step_runs_times_over_every_batch(
    n: int, runs: int, single: bool
) -> None:
    """assert_deterministic calls the step ``runs`` times (default 2) per batch; a single batch
    (not in a list) is one batch, for it and for assert_donation_safe."""
    state = TensorDict({"a": torch.zeros(2), "b": torch.zeros(2)}, [])
    batches: Any = {"x": torch.zeros(2)} if single else [{"x": torch.zeros(2)}] * n
    count = 1 if single else n
    step = _PlainStep("none")
    testing.assert_deterministic(step, state, batches, runs=runs)
    assert step.calls == runs * count
    step = _PlainStep("none")
    testing.assert_deterministic(step, state, batches)
    assert step.calls == 2 * count
    step = _PlainStep("none")
    testing.assert_donation_safe(lambda d: step, state, batches)
    assert step.calls == 2 * count


@settings(max_examples=12, deadline=None)
@given(draw_at=st.integers(0, 5), metrics=st.booleans())
def test_assert_deterministic_names_the_run_and_step_that_drew_and_that_differ(
    draw_at: int, metrics: bool
) -> None:
    """Over 2 batches and 3 runs, a step that draws from the global RNG (and so differs) on
    one call: the message names the first run that differs from run 1 (its state, or its
    metrics when only they differ) and, as the likely cause, the step and run that drew."""
    state = TensorDict({"a": torch.zeros(2), "b": torch.zeros(2)}, [])
    batches = [{"x": torch.zeros(2)}] * 2
    step = _PlainStep("drawn metric" if metrics else "none", draw_at=draw_at)
    lines = _message(lambda: testing.assert_deterministic(step, state, batches, runs=3))
    bad_run = max(2, draw_at // 2 + 1)
    where = f"step {draw_at % 2} of run {draw_at // 2 + 1} (the cpu generator)"
    head = f"state of run {bad_run} vs run 1: first difference at a"
    if metrics:
        head = f"metrics of step {draw_at % 2} in run {bad_run} vs run 1: first difference at n"
    assert lines[0].startswith(head), lines[0]
    assert f"(its state changed during {where}), so repeated calls differ" in lines[0]


def _counter_step(update_every: int) -> StepFn:
    """A step that bumps ``params.m.w`` on steps that are multiples of ``update_every``
    (0: never) and counts ``step``."""

    def step(s: TensorDictBase, b: Any) -> tuple[TensorDictBase, TensorDictBase]:
        out = s.clone()
        n = int(s["step"])
        if update_every and n % update_every == 0:
            out["params", "m", "w"] = s["params", "m", "w"] + 1
        out["step"] = s["step"] + 1
        return out, TensorDict({}, [])

    return step


def _counter_state() -> TensorDict:
    return TensorDict(
        {"params": {"m": {"w": torch.zeros(2)}}, "step": torch.zeros((), dtype=torch.int64)}, []
    )


@settings(max_examples=10, deadline=None)
@given(every=st.integers(2, 4), start=st.integers(0, 3))
def test_assert_cadence_messages_name_the_role_the_step_and_every(every: int, start: int) -> None:
    """assert_cadence's messages are pinned: a role that never updates is named at the first
    update step, one updating on every step at the first step off the cadence, and an
    ``every`` below 1 is refused naming it."""
    state = _counter_state()
    state["step"] = torch.tensor(start)
    batches = [{"x": torch.zeros(1)}] * 5
    lines = _message(lambda: testing.assert_cadence(_counter_step(0), state, batches, "m", every))
    first_update = start + (-start) % every
    assert lines == [
        f"cadence: role 'm' should update at step {first_update} (every={every}) but its "
        "params did not change"
    ]
    lines = _message(lambda: testing.assert_cadence(_counter_step(1), state, batches, "m", every))
    off = start if start % every else start + 1
    assert lines[0].startswith(
        f"cadence: role 'm' changed at step {off}, which is not a multiple of every={every}: "
        f"role 'm' at step {off}: first difference at params.w (not bitwise equal)"
    ), lines[0]
    with pytest.raises(ValueError, match=r"^every must be >= 1, got 0$"):
        testing.assert_cadence(_counter_step(1), state, batches, "m", 0)


@dataclasses.dataclass
class _RunConfig:
    """A user's non-tensor state entry (torch.load's weights_only unpickler refuses it)."""

    name: str = "run"


def test_assert_resume_exact_default_round_trip_keeps_a_non_tensor_entry() -> None:
    """The default save/load (torch.save / torch.load) round-trips a state holding a user's
    picklable non-tensor value (a NonTensorData of a dataclass): the load is not weights-only."""
    state = _counter_state()
    state["config"] = NonTensorData(_RunConfig())
    testing.assert_resume_exact(_counter_step(1), state, [{"x": torch.zeros(1)}] * 3, save_at=1)


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 3), save_at=st.integers(-1, 4))
def test_assert_resume_exact_accepts_save_at_from_0_to_the_batch_count_only(
    n: int, save_at: int
) -> None:
    """save_at may be 0 (save before the first step) up to len(batches) (after the last);
    anything else is refused naming the value and the range."""
    batches = [{"x": torch.zeros(1)}] * n
    if 0 <= save_at <= n:
        testing.assert_resume_exact(_counter_step(1), _counter_state(), batches, save_at)
    else:
        with pytest.raises(ValueError, match=rf"^save_at={save_at} is outside \[0, {n}\]$"):
            testing.assert_resume_exact(_counter_step(1), _counter_state(), batches, save_at)


def test_assert_resume_exact_gives_save_fn_a_fresh_target_and_load_fn_the_saved_structure(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """save_fn gets a path ``<empty private temporary directory>/ckpt`` that does not exist
    yet, the directory removed afterwards (nothing is written to the working directory);
    load_fn gets the same path and ``like=`` the state that was saved."""
    monkeypatch.chdir(tmp_path)
    seen: dict[str, Any] = {}

    def save(s: TensorDictBase, path: str) -> None:
        assert not os.path.exists(path)
        assert os.path.basename(path) == "ckpt"
        assert os.path.dirname(os.path.dirname(path)) == tempfile.gettempdir()
        assert os.listdir(os.path.dirname(path)) == []
        seen["path"], seen["saved"] = path, s.clone()

    def load(path: str, like: TensorDictBase) -> TensorDictBase:
        assert path == seen["path"]
        testing.assert_trees_equal(like, seen["saved"])
        return seen["saved"].clone()

    batches = [{"x": torch.zeros(1)}] * 3
    testing.assert_resume_exact(
        _counter_step(1), _counter_state(), batches, 2, save_fn=save, load_fn=load
    )
    assert int(seen["saved"]["step"]) == 2
    assert not os.path.exists(os.path.dirname(seen["path"]))
    assert os.listdir(tmp_path) == []


@settings(max_examples=10, deadline=None)
@given(lossy=st.sets(st.sampled_from(["v", "w"])))
def test_assert_resume_exact_lists_every_leaf_the_load_changed(lossy: set[str]) -> None:
    """A lossy load_fn: the message lists every leaf it changed, in leaf order; an exact
    load_fn behind a step that keeps state outside the state adds nothing about the load
    (its call counter adds 1, 2 in the uninterrupted run, 3 before the save and 4 after:
    w is 3 + 4 = 7 resumed against 1 + 2 = 3)."""
    state = _counter_state()
    state["params", "m", "v"] = torch.zeros(2)
    saved: dict[str, TensorDict] = {}
    calls = [0]

    def save(s: TensorDictBase, path: str) -> None:
        saved[path] = s.clone()

    def load(path: str, like: TensorDictBase) -> TensorDictBase:
        out = saved[path].clone()
        for leaf in lossy:
            out["params", "m", leaf] += 1
        return out

    def hidden(s: TensorDictBase, b: Any) -> tuple[TensorDictBase, TensorDictBase]:
        calls[0] += 1
        out = s.clone()
        out["params", "m", "w"] = s["params", "m", "w"] + calls[0]
        out["step"] = s["step"] + 1
        return out, TensorDict({}, [])

    batches = [{"x": torch.zeros(1)}] * 2
    lines = _message(
        lambda: testing.assert_resume_exact(
            hidden if not lossy else _counter_step(1), state, batches, 1, save_fn=save, load_fn=load
        )
    )
    head = "state resumed after step 1 vs uninterrupted: first difference at params.m."
    assert lines[0].startswith(head)
    if lossy:
        listed = ", ".join(f"params.m.{leaf}" for leaf in ["w", "v"] if leaf in lossy)
        assert lines[0].endswith(
            f". The state returned by load_fn differs from the saved one at {listed}: the "
            "save/load round trip is lossy"
        ), lines[0]
    else:
        assert lines[0].endswith("max abs diff 4, max rel diff 1.33"), lines[0]


@settings(max_examples=12, deadline=None)
@given(save_at=st.integers(1, 2), draw_at=st.integers(0, 5))
def test_assert_resume_exact_names_the_run_and_step_that_drew(save_at: int, draw_at: int) -> None:
    """A step that draws from the global RNG (and so differs) on one call: the message names
    that call as the uninterrupted run's, the pre-save run's or the resumed run's step, with
    the resumed run's steps counted from the save."""
    state = TensorDict({"a": torch.zeros(2), "b": torch.zeros(2)}, [])
    batches = [{"x": torch.zeros(2)}] * 3
    if draw_at < 3:
        where = f"step {draw_at} of the uninterrupted run"
    elif draw_at < 3 + save_at:
        where = f"step {draw_at - 3} of the run before the save"
    else:
        where = f"step {draw_at - 3} of the resumed run"
    lines = _message(
        lambda: testing.assert_resume_exact(
            _PlainStep("none", draw_at=draw_at), state, batches, save_at
        )
    )
    assert f"(its state changed during {where} (the cpu generator)), so" in lines[0]


def test_assert_cadence_checks_the_roles_optimizer_state_too() -> None:
    """A role whose optimizer state changes off its cadence (its params do not) is named with
    the opt_state leaf; roles without optimizer state are checked on params alone."""

    def step(s: TensorDictBase, b: Any) -> tuple[TensorDictBase, TensorDictBase]:
        out, m = _counter_step(2)(s, b)
        out["opt_state", "m", "count"] = s["opt_state", "m", "count"] + 1
        return out, m

    state = _counter_state()
    state["opt_state", "m", "count"] = torch.zeros(())
    batches = [{"x": torch.zeros(1)}] * 3
    lines = _message(lambda: testing.assert_cadence(step, state, batches, "m", 2))
    assert lines[0].startswith(
        "cadence: role 'm' changed at step 1, which is not a multiple of every=2: role 'm' at "
        "step 1: first difference at opt_state.count (not bitwise equal)"
    ), lines[0]
    testing.assert_cadence(_counter_step(2), _counter_state(), batches, "m", 2)


@settings(max_examples=12, deadline=None)
@given(
    delta=st.sampled_from([1e-6, 1e-3]),
    rtol=st.sampled_from([0.0, 1e-4]),
    atol=st.sampled_from([0.0, 1e-4]),
)
def test_assert_donation_safe_compares_within_the_given_tolerances(
    delta: float, rtol: float, atol: float
) -> None:
    """With rtol = atol = 0 the two builds must agree bitwise; with either tolerance given
    they must agree within it (w is 1, so both tolerances accept a difference of 1e-6 and
    reject 1e-3), and the message names the state and states the tolerances."""
    state = _counter_state()
    state["params", "m", "w"] = torch.ones(2)

    def make(donate: bool) -> StepFn:
        def step(s: TensorDictBase, b: Any) -> tuple[TensorDictBase, TensorDictBase]:
            out, m = _counter_step(1)(s, b)
            out["params", "m", "w"] = out["params", "m", "w"] + (delta if donate else 0.0)
            return out, m

        return step

    batches = [{"x": torch.zeros(1)}]
    head = "state with donate=True vs donate=False: first difference at params.m.w"
    if rtol == 0.0 and atol == 0.0:
        lines = _message(lambda: testing.assert_donation_safe(make, state, batches))
        assert lines[0].startswith(f"{head} (not bitwise equal): max abs diff"), lines[0]
    elif delta < 1e-4:
        testing.assert_donation_safe(make, state, batches, rtol=rtol, atol=atol)
    else:
        lines = _message(
            lambda: testing.assert_donation_safe(make, state, batches, rtol=rtol, atol=atol)
        )
        assert lines[0].startswith(f"{head}: max abs diff"), lines[0]
        assert lines[0].endswith(f" (rtol={rtol}, atol={atol})"), lines[0]


def test_assert_donation_safe_names_the_build_that_drew_and_an_input_the_plain_build_wrote() -> (
    None
):
    """Only the donate=True build draws from the global RNG: the hint names its step; a
    donate=False build that writes into its input is named with the leaf."""
    state = TensorDict({"a": torch.zeros(2), "b": torch.zeros(2)}, [])
    batches = [{"x": torch.zeros(2)}] * 2
    plain, drawing = _PlainStep("none"), _PlainStep("none", draw_at=1)
    lines = _message(
        lambda: testing.assert_donation_safe(lambda d: drawing if d else plain, state, batches)
    )
    assert (
        "(its state changed during step 1 of the donate=True run (the cpu generator))" in (lines[0])
    )
    writer = _PlainStep("state")
    lines = _message(lambda: testing.assert_donation_safe(lambda d: writer, state, batches))
    assert lines[0].startswith(
        "input state of the donate=False run: first difference at a (not bitwise equal)"
    ), lines[0]


@pytest.mark.parametrize("noise", [0.0, 2e-6, 2e-5])
@pytest.mark.parametrize("gain", [0.25, 10.0])
def test_accumulation_invariance_allows_atol_times_the_largest_gradient_and_says_so(
    noise: float, gain: float
) -> None:
    """By gradients, a leaf may differ by ``atol * G`` (G: the role's largest reference
    gradient): noise on a zero-gradient leaf of up to that passes, more fails, with the
    message naming step, k, role and leaf and stating rtol, atol and G."""
    opts = {"m": optim.sgd(0.1)}
    params = TensorDict({"w": torch.zeros(3), "z": torch.zeros(2)}, [])
    state = _sgd_state(opts, {"m": params})
    target = torch.tensor([1.0, -2.0, 0.5]) * gain

    def make(k: int) -> StepFn:
        def grad_fn(params: Any, batch: Any, key: Any, **kw: Any) -> Any:
            g = TensorDict({"w": -target.clone(), "z": torch.full((2,), noise * (k - 1))}, [])
            return TensorDict({"m": g}, []), TensorDict({}, [])

        return ps.train_step(grad_fn, opts)

    G = 2.0 * gain  # the largest |gradient| of role m
    run = lambda: testing.assert_accumulation_invariant(  # noqa: E731
        make, state, [{"x": torch.zeros(1)}], ks=(1, 2)
    )
    if noise * 1.0 <= 1e-5 * G:
        run()
        return
    lines = _message(run)
    assert re.fullmatch(
        r"accumulation invariance: gradients at step 0 with k=2 vs k=1: role 'm': first "
        rf"difference at m\.z: max abs diff {noise:.3g}, max rel diff .+ \(allowed \|a - b\| <= "
        r"atol \* G \+ rtol \* \|b\| with rtol=1e-05, atol=1e-05, "
        rf"G={G:.3g} the largest reference gradient of role 'm'\)",
        lines[0],
    ), lines[0]


def test_accumulation_invariance_names_gradients_whose_keys_depend_on_k() -> None:
    """A k whose gradients lack a leaf the reference has (a parameter that got no
    gradient): the message names step, k, role and the missing key path."""
    opts = {"m": optim.sgd(0.1)}
    params = TensorDict({"w": torch.zeros(3), "z": torch.zeros(2)}, [])
    state = _sgd_state(opts, {"m": params})

    def make(k: int) -> StepFn:
        def grad_fn(params: Any, batch: Any, key: Any, **kw: Any) -> Any:
            g = TensorDict({"w": torch.ones(3)}, [])
            if k == 1:
                g["z"] = torch.ones(2)
            return TensorDict({"m": g}, []), TensorDict({}, [])

        return ps.train_step(grad_fn, opts)

    lines = _message(
        lambda: testing.assert_accumulation_invariant(
            make, state, [{"x": torch.zeros(1)}], ks=(1, 2), check_metrics=False
        )
    )
    assert lines == [
        "accumulation invariance: gradients at step 0 with k=2 vs k=1: role 'm': key "
        "structure differs; only in expected: ['m.z']; only in actual: -"
    ]


@settings(max_examples=8, deadline=None)
@given(bad=st.sets(st.sampled_from(["a", "b"]), min_size=1), dtype=st.booleans())
def test_assert_trees_close_equates_nans_and_names_every_shape_or_dtype_mismatch(
    bad: set[str], dtype: bool
) -> None:
    """NaN equals NaN in assert_trees_close; leaves whose shape (or dtype) differ are each
    named with both, after the first, by assert_trees_close and assert_trees_equal."""
    nan = torch.tensor([float("nan"), 1.0])
    testing.assert_trees_close({"a": nan, "b": nan.clone()}, {"a": nan.clone(), "b": nan})
    other = torch.zeros(2, dtype=torch.float64) if dtype else torch.zeros(3)
    actual = {n: other.clone() if n in bad else torch.zeros(2) for n in ("a", "b")}
    shown = "torch.float64(2,)" if dtype else "torch.float32(3,)"
    detail = f": actual {shown} vs expected torch.float32(2,)"
    order = [n for n in ("a", "b") if n in bad]
    expected = {"a": torch.zeros(2), "b": torch.zeros(2)}
    for check, suffix in (
        (testing.assert_trees_close, " (rtol=None, atol=None)"),
        (testing.assert_trees_equal, ""),
    ):
        lines = _message(lambda: check(actual, expected))  # noqa: B023
        assert lines[0] == f"trees: first difference at {order[0]}{detail}{suffix}"
        if len(order) > 1:
            assert lines[1:] == ["2 leaves differ:", *(f"  {n}{detail}" for n in order)]


def test_assert_resume_exact_names_a_load_that_adds_a_key_exactly() -> None:
    """The key-structure hint of a load_fn that returns an extra key is pinned."""
    save, load = _save_and_load_adding_a_key()

    lines = _message(
        lambda: testing.assert_resume_exact(
            _counter_step(1),
            _counter_state(),
            [{"x": torch.zeros(1)}] * 2,
            1,
            save_fn=save,
            load_fn=load,
        )
    )
    assert lines[0].endswith(
        ". The state returned by load_fn is not the saved one: trees: key structure differs; "
        "only in expected: -; only in actual: ['extra']"
    ), lines[0]


@pytest.mark.parametrize(
    ("actual", "expected", "diffs"),
    [
        (
            torch.tensor([1], dtype=torch.uint8),
            torch.tensor([3], dtype=torch.uint8),
            "2, max rel diff 0.667",
        ),
        (torch.tensor([5]), torch.tensor([-3]), "8, max rel diff 2.67"),
        (torch.tensor([True, False]), torch.tensor([True, True]), "1, max rel diff 1"),
        (
            torch.tensor([1.0, 2.0], dtype=torch.float16),
            torch.tensor([0.0, 2.0], dtype=torch.float16),
            "1, max rel diff 1e+30",
        ),
        (
            torch.tensor([float("inf")]),
            torch.tensor([1.0]),
            "nan, max rel diff nan; 1 of 1 entries differ by a non-finite amount (NaN or inf)",
        ),
    ],
)
def test_tree_comparisons_report_integer_and_non_finite_differences_exactly(
    actual: torch.Tensor, expected: torch.Tensor, diffs: str
) -> None:
    """The max abs/rel difference is computed in float64 (an unsigned difference does not
    wrap around, a bool leaf can be subtracted, the relative difference's denominator is
    clamped at 1e-30 even for a float16 zero, where 1e-30 underflows) and is NaN when no
    element's difference is finite."""
    lines = _message(lambda: testing.assert_trees_equal({"t": actual}, {"t": expected}))
    assert lines == [f"trees: first difference at t (not bitwise equal): max abs diff {diffs}"]


@settings(max_examples=20, deadline=None)
@given(
    re=st.floats(min_value=-1e3, max_value=1e3),
    im=st.floats(min_value=-1e3, max_value=1e3).filter(lambda v: abs(v) > 1e-3),
)
def test_tree_comparisons_report_the_imaginary_part_of_a_complex_difference(
    re: float, im: float
) -> None:
    """A complex leaf that differs only in its imaginary part is reported with that
    difference (|im|), not "max abs diff 0" from a cast that drops the imaginary part."""
    expected = torch.tensor([complex(re, 0.0), 1 + 1j], dtype=torch.complex128)
    actual = expected + torch.tensor([complex(0.0, im), 0j], dtype=torch.complex128)
    lines = _message(lambda: testing.assert_trees_equal({"z": actual}, {"z": expected}))
    rel = abs(im) / max(abs(re), 1e-30)
    assert lines == [
        f"trees: first difference at z (not bitwise equal): max abs diff {abs(im):.3g}, "
        f"max rel diff {rel:.3g}"
    ]


@settings(max_examples=20, deadline=None)
@given(
    big=st.floats(min_value=1.0, max_value=1e6),
    order=st.permutations(range(5)),
)
def test_gradient_scale_is_the_largest_finite_float_entry_over_every_leaf(
    big: float, order: list[int]
) -> None:
    """The scale G that accumulation invariance multiplies ``atol`` by is the largest finite
    ``|g|`` over all floating leaves, in any leaf order: empty leaves and integer leaves are
    skipped (not the end of the scan), one-element leaves count, NaN and inf are ignored."""
    from purestep.testing._accumulation import _scale

    leaves = [
        torch.zeros(0),  # empty: skipped
        torch.tensor([10 * int(big) + 7]),  # integer: never a gradient scale
        torch.tensor([-big]),  # one element: the largest finite |g|
        torch.tensor([float("nan"), float("inf"), big / 2]),  # non-finite entries ignored
        torch.tensor([[big / 4, -big / 3]], dtype=torch.float64),
    ]
    grads = TensorDict({f"l{i}": leaves[j] for i, j in enumerate(order)}, [])
    assert _scale(grads) == pytest.approx(big, rel=1e-6)
    assert _scale(TensorDict({}, [])) == 0.0


def _sgd_state(opts: dict[str, Any], params: dict[str, TensorDict]) -> TensorDict:
    return TensorDict(
        {
            "params": params,
            "opt_state": {r: opts[r].init(p) for r, p in params.items()},
            "step": torch.zeros((), dtype=torch.int64),
            "rng": torch.zeros((), dtype=torch.int64),
        },
        [],
    )


def test_accumulation_invariance_reports_every_role_after_a_structure_mismatch() -> None:
    """Two roles, the first with gradient keys that depend on k and the second with values
    that do: the message names both (a key-structure difference in one role does not end
    the comparison of the others)."""
    opts = {"a": optim.sgd(0.1), "b": optim.sgd(0.1)}
    state = _sgd_state(
        opts,
        {
            "a": TensorDict({"w": torch.zeros(2), "z": torch.zeros(2)}, []),
            "b": TensorDict({"v": torch.zeros(2)}, []),
        },
    )

    def make(k: int) -> StepFn:
        def grad_fn(params: Any, batch: Any, key: Any, **kw: Any) -> Any:
            a = {"w": torch.ones(2)} if k > 1 else {"w": torch.ones(2), "z": torch.ones(2)}
            grads = TensorDict({"a": a, "b": {"v": torch.full((2,), float(k))}}, [])
            return grads, TensorDict({}, [])

        return ps.train_step(grad_fn, opts)

    text = "\n".join(
        _message(
            lambda: testing.assert_accumulation_invariant(
                make, state, [{"x": torch.zeros(1)}], ks=(1, 2)
            )
        )
    )
    assert "role 'a'" in text and "a.z" in text, text
    assert "role 'b'" in text and "b.v" in text, text


def test_accumulation_invariance_names_the_update_when_a_role_steps_twice() -> None:
    """A step that updates one role twice (a wrapper running its train step twice): a
    gradient that depends on k is reported by update number, since the role alone would not
    say which of its two updates differs."""
    opts = {"m": optim.sgd(0.1)}
    state = _sgd_state(opts, {"m": TensorDict({"w": torch.zeros(2)}, [])})

    def make(k: int) -> StepFn:
        def grad_fn(params: Any, batch: Any, key: Any, **kw: Any) -> Any:
            return TensorDict({"m": {"w": torch.full((2,), float(k))}}, []), TensorDict({}, [])

        return _Twice(ps.train_step(grad_fn, opts))

    text = "\n".join(
        _message(
            lambda: testing.assert_accumulation_invariant(
                make, state, [{"x": torch.zeros(1)}], ks=(1, 2)
            )
        )
    )
    assert "update 0" in text and "update 1" in text, text
    assert "role 'm': first" not in text, text


def test_accumulation_invariance_records_non_finite_gradients_of_a_skipping_step() -> None:
    """A step wrapped in ``skip_nonfinite`` whose gradient is NaN for one k: the check still
    sees that k's gradients (its recording step does not skip) and names the leaf, saying the
    entry differs by a non-finite amount, not by 0."""
    opts = {"m": optim.sgd(0.1)}
    state = _sgd_state(opts, {"m": TensorDict({"w": torch.zeros(2)}, [])})

    def make(k: int) -> StepFn:
        def grad_fn(params: Any, batch: Any, key: Any, **kw: Any) -> Any:
            w = torch.ones(2)
            if k > 1:
                w[0] = float("nan")
            return TensorDict({"m": {"w": w}}, []), TensorDict({"loss": torch.tensor(1.0)}, [])

        return ps.skip_nonfinite(ps.train_step(grad_fn, opts), max_consecutive=0)

    lines = _message(
        lambda: testing.assert_accumulation_invariant(
            make, state, [{"x": torch.zeros(1)}], ks=(1, 2)
        )
    )
    assert lines[0].startswith(
        "accumulation invariance: gradients at step 0 with k=2 vs k=1: role 'm': first "
        "difference at m.w: max abs diff 0, max rel diff 0; 1 of 2 entries differ by a "
        "non-finite amount (NaN or inf)"
    ), lines[0]


@pytest.mark.parametrize(
    ("actual", "expected", "diffs"),
    [
        (
            [float("nan"), 1.0, 2.0],
            [1.0, 1.0, 2.0],
            "max abs diff 0, max rel diff 0; 1 of 3 entries differ by a non-finite amount "
            "(NaN or inf)",
        ),
        (
            [float("inf"), 1.0, float("nan")],
            [float("-inf"), 1.0, 5.0],
            "max abs diff 0, max rel diff 0; 2 of 3 entries differ by a non-finite amount "
            "(NaN or inf)",
        ),
        (
            [float("inf"), float("nan"), 3.0],
            [float("inf"), float("nan"), 2.0],
            "max abs diff 1, max rel diff 0.5",
        ),
    ],
)
def test_comparisons_count_entries_that_differ_by_a_non_finite_amount(
    actual: list[float], expected: list[float], diffs: str
) -> None:
    """A NaN or inf on one side only (or infinities of opposite sign) is counted in the
    message, so a leaf whose finite entries agree is not reported as differing by 0; equal
    infinities and NaN against NaN are not counted (nor used for the max differences)."""
    a = TensorDict({"w": torch.tensor(actual)}, [])
    b = TensorDict({"w": torch.tensor(expected)}, [])
    assert _message(lambda: testing.assert_trees_equal(a, b)) == [
        f"trees: first difference at w (not bitwise equal): {diffs}"
    ]
    assert _message(lambda: testing.assert_trees_close(a, b)) == [
        f"trees: first difference at w: {diffs} (rtol=None, atol=None)"
    ]


@attrs.frozen
class _Wrap:
    """A user wrapper around any step (for the recording depth limit)."""

    inner: Any

    def __call__(self, s: TensorDictBase, b: Any) -> tuple[TensorDictBase, TensorDictBase]:
        return self.inner(s, b)


@pytest.mark.parametrize("depth", [6, 7])
def test_accumulation_invariance_finds_a_train_step_under_at_most_six_wrappers(
    depth: int,
) -> None:
    """By gradients the check finds the TrainStep inside wrappers nested up to six deep;
    at seven it refuses the step with the TypeError that says to compare states instead."""
    opts = {"m": optim.sgd(0.1)}
    state = _sgd_state(opts, {"m": TensorDict({"w": torch.zeros(2)}, [])})

    def grad_fn(params: Any, batch: Any, key: Any, **kw: Any) -> Any:
        return TensorDict({"m": {"w": torch.ones(2)}}, []), TensorDict({}, [])

    def make(k: int) -> StepFn:
        step: Any = ps.train_step(grad_fn, opts)
        for _ in range(depth):
            step = _Wrap(step)
        return cast(StepFn, step)

    run = lambda: testing.assert_accumulation_invariant(  # noqa: E731
        make, state, [{"x": torch.zeros(1)}], ks=(1, 2)
    )
    if depth <= 6:
        run()
    else:
        with pytest.raises(TypeError, match="compare='state'"):
            run()


@attrs.frozen
class _Tagged:
    """A user wrapper whose first field is not an ``__init__`` argument (a derived tag)."""

    tag: str = attrs.field(init=False, default="tagged")
    inner: Any = attrs.field(default=None)

    def __call__(self, s: TensorDictBase, b: Any) -> tuple[TensorDictBase, TensorDictBase]:
        return self.inner(s, b)


def test_accumulation_invariance_looks_past_a_wrapper_field_that_is_not_an_init_argument() -> None:
    """A wrapper's non-``__init__`` field (declared before the step) is skipped, not the end
    of the search: the TrainStep after it is found, and its gradient mismatch is reported."""
    opts = {"m": optim.sgd(0.1)}
    state = _sgd_state(opts, {"m": TensorDict({"w": torch.zeros(2)}, [])})

    def make(scale_of_k: Callable[[int], float]) -> Callable[[int], StepFn]:
        def build(k: int) -> StepFn:
            def grad_fn(params: Any, batch: Any, key: Any, **kw: Any) -> Any:
                g = torch.full((2,), scale_of_k(k))
                return TensorDict({"m": {"w": g}}, []), TensorDict({}, [])

            return cast(StepFn, _Tagged(inner=ps.train_step(grad_fn, opts)))

        return build

    batches = [{"x": torch.zeros(1)}]
    testing.assert_accumulation_invariant(make(lambda k: 1.0), state, batches, ks=(1, 2))
    with pytest.raises(AssertionError, match=r"k=2 vs k=1: role 'm'.*\n.*w"):
        testing.assert_accumulation_invariant(make(float), state, batches, ks=(1, 2))


def test_accumulation_invariance_refuses_a_make_step_whose_optimizer_depends_on_k() -> None:
    """The gradient recorders keep each optimizer's init and name: when ``make_step(2)`` uses
    another optimizer than ``make_step(1)`` (whose state the check was given), k=2's step
    refuses the state with its own validation, naming the role and that optimizer."""
    net, _, grad_fn, _ = _setup()
    opts = {1: {"m": optim.adamw(1e-2)}, 2: {"m": optim.sgd(0.1, momentum=0.9)}}
    state = ps.init_state({"m": net}, opts[1], seed=0)
    with pytest.raises(
        ps.StateError,
        match=r"opt_state\.m was not built by this step's optimizer for role 'm' "
        r"\(gradient recorder of sgd\): opt_state\.m has keys \['count', 'lr', 'mu', 'nu', "
        r"'steps'\], its optimizer keeps \['count', 'lr', 'momentum_buffer'\]",
    ):
        testing.assert_accumulation_invariant(
            lambda k: ps.train_step(ps.accumulate(grad_fn, k), opts[k]),
            state,
            [_batch(0)],
            ks=(1, 2),
        )


# --- global generators on CUDA (faked on CPU), the comparisons' defaults, the default save -----


class _FakeCuda:
    """``torch.cuda``'s generator API on CPU: ``devices`` generators whose states a test sets.

    ``install`` patches ``is_available``/``is_initialized``/``device_count``/``get_rng_state``;
    ``get_rng_state(i)`` needs a device index (``None`` is refused, as an index of a list).
    """

    def __init__(self, devices: int, *, available: bool = True, initialised: bool = True) -> None:
        self.states = [torch.full((4,), 10 * i, dtype=torch.uint8) for i in range(devices)]
        self.available = available
        self.initialised = initialised

    def install(self, mp: pytest.MonkeyPatch) -> None:
        mp.setattr(torch.cuda, "is_available", lambda: self.available)
        mp.setattr(torch.cuda, "is_initialized", lambda: self.initialised)
        mp.setattr(torch.cuda, "device_count", lambda: len(self.states))
        mp.setattr(torch.cuda, "get_rng_state", lambda i: self.states[i].clone())

    def draw(self, i: int) -> None:
        self.states[i] = self.states[i] + 1


@pytest.mark.parametrize("available", [True, False])
@pytest.mark.parametrize("initialised", [True, False])
def test_global_rng_states_hold_every_cuda_generator_only_when_cuda_is_available_and_initialised(
    available: bool, initialised: bool
) -> None:
    """``global_rng_states()`` is ``{"cpu": ...}`` plus ``"cuda:i"`` -> device i's state for
    every device, exactly when CUDA is both available and initialised."""
    fake = _FakeCuda(2, available=available, initialised=initialised)
    with pytest.MonkeyPatch.context() as mp:
        fake.install(mp)
        states = global_rng_states()
    cuda = {"cuda:0": fake.states[0], "cuda:1": fake.states[1]}
    expected = {"cpu": torch.get_rng_state(), **(cuda if available and initialised else {})}
    assert list(states) == list(expected)
    for name, s in expected.items():
        assert torch.equal(states[name], s), name


@settings(max_examples=16, deadline=None)
@given(drawn=st.lists(st.sets(st.sampled_from(["cpu", "cuda:0", "cuda:1"])), max_size=4))
def test_rng_watch_names_every_generator_a_call_changed_cuda_ones_included(
    drawn: list[set[str]],
) -> None:
    """With two (fake) CUDA devices, each call that changed generators is noted as
    ``"<where> (the <g1> and <g2> generator)"`` (generators in cpu, cuda:0, cuda:1 order),
    calls that changed none are not, and the hint names the first and counts the others."""
    fake = _FakeCuda(2)
    order = ["cpu", "cuda:0", "cuda:1"]

    def body(names: set[str]) -> int:
        if "cpu" in names:
            torch.rand(1)
        for i in (0, 1):
            if f"cuda:{i}" in names:
                fake.draw(i)
        return len(names)

    w = RngWatch()
    with pytest.MonkeyPatch.context() as mp:
        fake.install(mp)
        outs = [w.call(f"call {j}", body, names) for j, names in enumerate(drawn)]
    assert outs == [len(names) for names in drawn]
    noted = [
        f"call {j} (the {' and '.join(g for g in order if g in names)} generator)"
        for j, names in enumerate(drawn)
        if names
    ]
    assert w.consumed == noted
    if not noted:
        assert w.hint() == ""
        return
    more = len(noted) - 1
    where = noted[0] + (f" and {more} more step call{'s' if more > 1 else ''}" if more else "")
    assert w.hint() == (
        ". Likely cause: the step drew from torch's global RNG (its state changed during "
        f"{where}), so repeated calls differ; {ADVICE}"
    )


def test_rng_watch_ignores_a_cuda_generator_initialised_during_the_call() -> None:
    """A generator that appears during a call (CUDA initialised by it) has no state before the
    call to compare with: the call is not noted, and one that then draws from it is."""
    fake = _FakeCuda(1, initialised=False)

    def init_cuda() -> None:
        fake.initialised = True

    w = RngWatch()
    with pytest.MonkeyPatch.context() as mp:
        fake.install(mp)
        w.call("init", init_cuda)
        w.call("draw", fake.draw, 0)
    assert w.consumed == ["draw (the cuda:0 generator)"]


@pytest.mark.parametrize("close", [False, True])
def test_failure_lists_call_the_compared_trees_trees_unless_told_what_they_are(
    close: bool,
) -> None:
    """``equal_failures``/``close_failures`` without ``what=`` name the compared trees "trees"
    in a key-structure error, which lists the paths only in each side."""
    a, b = {"w": torch.ones(1), "u": torch.ones(1)}, {"v": torch.ones(1), "u": torch.ones(1)}
    failures: Callable[[], Any] = (
        (lambda: testing_compare.close_failures(a, b, rtol=None, atol=None))
        if close
        else (lambda: testing_compare.equal_failures(a, b))
    )
    assert _message(failures) == [
        "trees: key structure differs; only in expected: ['v']; only in actual: ['w']"
    ]


def test_default_save_reuses_an_existing_directory_and_load_reads_the_last_save(
    tmp_path: Any,
) -> None:
    """assert_resume_exact's default ``save_fn`` creates the directory or writes into an
    existing one (a second save overwrites the first); its ``load_fn`` reads that back."""
    first = TensorDict({"w": torch.arange(3.0)}, [])
    target = str(tmp_path / "ckpt")
    testing_checks._torch_save(first, target)
    testing_checks._torch_save(first * 2, target)
    loaded = testing_checks._torch_load(target, like=first)
    testing.assert_trees_equal(loaded, first * 2)


# --- assert_accumulation_invariant: whole messages, tolerances, the gradient recorders --------


def _one_role_state(w: torch.Tensor | None = None) -> TensorDict:
    opts = {"m": optim.sgd(0.1)}
    return _sgd_state(opts, {"m": TensorDict({"w": torch.zeros(2) if w is None else w}, [])})


def _batches(*xs: float) -> list[dict[str, torch.Tensor]]:
    return [{"x": torch.tensor([x])} for x in xs]


def test_accumulation_invariance_refuses_empty_ks_and_an_unknown_mode_with_whole_messages() -> None:
    """No ks, or a ``compare`` other than 'grads'/'state': a ValueError whose whole message
    names the check and the argument (and, for ``compare``, the value given)."""
    state = _one_role_state()
    make = cast(Callable[[int], StepFn], lambda k: _PlainStep("state"))
    empty = "assert_accumulation_invariant: ks is empty"
    with pytest.raises(ValueError, match=f"^{re.escape(empty)}$"):
        testing.assert_accumulation_invariant(make, state, _batches(0.0), ks=())
    mode = "assert_accumulation_invariant: compare must be 'grads' or 'state', got 'params'"
    with pytest.raises(ValueError, match=f"^{re.escape(mode)}$"):
        testing.assert_accumulation_invariant(make, state, _batches(0.0), compare="params")  # type: ignore[arg-type]


def test_accumulation_invariance_by_gradients_names_the_k_and_the_type_it_cannot_read() -> None:
    """``make_step(2)`` returns a step of the user's own (no TrainStep inside) while
    ``make_step(1)`` is a train step: the TypeError says why, names ``make_step(2)`` and the
    type it returned, and points to ``compare='state'``."""
    opts = {"m": optim.sgd(0.1)}

    class OwnStep:
        def __call__(self, s: TensorDictBase, b: Any) -> tuple[TensorDictBase, TensorDictBase]:
            return s, TensorDict({}, [])

    def grad_fn(params: Any, batch: Any, key: Any, **kw: Any) -> Any:
        return TensorDict({"m": {"w": torch.ones(2)}}, []), TensorDict({}, [])

    def make(k: int) -> StepFn:
        return ps.train_step(grad_fn, opts) if k == 1 else OwnStep()

    with pytest.raises(TypeError) as info:
        testing.assert_accumulation_invariant(make, _one_role_state(), _batches(0.0), ks=(1, 2))
    assert str(info.value) == (
        "assert_accumulation_invariant(compare='grads') reads the gradients each optimizer is "
        "given, so it needs steps built by purestep (train_step, with_ema, skip_nonfinite, a "
        "method's make_step); make_step(2) returned OwnStep. Pass compare='state' to compare "
        "the states after the optimizer instead"
    )


_NOTHING_COMPARED = (
    "accumulation invariance: no optimizer was given gradients in any step, so nothing was "
    "compared (are the roles due at these steps?)"
)


@pytest.mark.parametrize(("start", "n"), [(0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (1, 3)])
def test_accumulation_invariance_by_gradients_fails_exactly_when_no_role_was_due(
    start: int, n: int
) -> None:
    """A role updated every 2nd step, over ``n`` batches from step ``start``: the check passes
    when any of those steps updates the role (updates are counted over all batches, not the
    last one alone) and otherwise fails with the whole 'nothing was compared' message."""
    opts = {"m": optim.sgd(0.1)}
    state = _one_role_state()
    state["step"] = torch.tensor(start, dtype=torch.int64)

    def grad_fn(params: Any, batch: Any, key: Any, **kw: Any) -> Any:
        return TensorDict({"m": {"w": torch.ones(2)}}, []), TensorDict({}, [])

    def run() -> None:
        testing.assert_accumulation_invariant(
            lambda k: ps.train_step(grad_fn, opts, every={"m": 2}),
            state,
            _batches(*[0.0] * n),
            ks=(1, 2),
        )

    if any((start + i) % 2 == 0 for i in range(n)):
        run()
        return
    assert _message(run) == [_NOTHING_COMPARED]


def _advice(where: str) -> str:
    return (
        f". Likely cause: the step drew from torch's global RNG (its state changed during "
        f"{where}), so repeated calls differ; {ADVICE}"
    )


@pytest.mark.parametrize("n", [1, 2, 3])
def test_accumulation_invariance_advances_the_reference_state_only_between_batches(n: int) -> None:
    """A grad_fn that draws from torch's global RNG and updates no role, over ``n`` batches
    with ks=(1, 2): the 'nothing was compared' failure counts the calls that drew: two
    recording calls per batch and the ``n - 1`` calls of the reference step that advance the
    state to the next batch (none after the last)."""
    opts = {"m": optim.sgd(0.1)}

    def grad_fn(params: Any, batch: Any, key: Any, **kw: Any) -> Any:
        torch.rand(1)
        return TensorDict({}, []), TensorDict({}, [])

    more = 2 * n + (n - 1) - 1
    lines = _message(
        lambda: testing.assert_accumulation_invariant(
            lambda k: ps.train_step(grad_fn, opts),
            _one_role_state(),
            _batches(*[0.0] * n),
            ks=(1, 2),
        )
    )
    calls = f"{more} more step call" + ("s" if more > 1 else "")
    assert lines == [
        _NOTHING_COMPARED + _advice(f"step 0 with k=1 (the cpu generator) and {calls}")
    ]


def test_accumulation_invariance_names_the_reference_step_that_ran_a_noisy_optimizer() -> None:
    """An optimizer drawing its noise from torch's global RNG is run only by the reference
    step (k=1) advancing the state between batches (the recorders replace it): a gradient
    that depends on k at step 1 is reported with that call, step 0 with k=1, as the cause."""
    sgd = optim.sgd(0.1)

    def noisy_step(
        grads: TensorDictBase,
        state: TensorDictBase,
        params: TensorDictBase,
        *,
        donate: bool = False,
    ) -> tuple[TensorDict, TensorDict]:
        torch.rand(1)  # the noise, from the global generator
        return sgd.step(grads, state, params)

    noisy = optim.Transform(
        init_fn=sgd.init_fn, update_fn=sgd.update_fn, step_fn=noisy_step, name="noisy sgd"
    )
    opts = {"m": noisy}

    def make(k: int) -> StepFn:
        def grad_fn(params: Any, batch: Any, key: Any, **kw: Any) -> Any:
            g = torch.ones(2) * (1 + batch["x"].sum() * (k - 1))
            return TensorDict({"m": {"w": g}}, []), TensorDict({}, [])

        return ps.train_step(grad_fn, opts)

    lines = _message(
        lambda: testing.assert_accumulation_invariant(
            make, _one_role_state(), _batches(0.0, 1.0), ks=(1, 2), check_metrics=False
        )
    )
    assert lines == [
        "accumulation invariance: gradients at step 1 with k=2 vs k=1: role 'm': first "
        "difference at m.w: max abs diff 1, max rel diff 1 (allowed |a - b| <= atol * G + "
        "rtol * |b| with rtol=1e-05, atol=1e-05, G=1 the largest reference gradient of role "
        "'m')" + _advice("step 0 with k=1 (the cpu generator)")
    ]


def test_accumulation_invariance_by_gradients_reports_every_k_whose_metrics_differ() -> None:
    """Equal gradients but a loss that depends on k, ks=(1, 2, 4): one line per k names the
    step, that k against the reference k=1, the metric and the tolerance; with
    ``check_metrics=False`` the same steps pass."""
    opts = {"m": optim.sgd(0.1)}

    def make(k: int) -> StepFn:
        def grad_fn(params: Any, batch: Any, key: Any, **kw: Any) -> Any:
            metrics = TensorDict({"loss": torch.tensor(float(k))}, [])
            return TensorDict({"m": {"w": torch.ones(2)}}, []), metrics

        return ps.train_step(grad_fn, opts)

    state, batches = _one_role_state(), _batches(0.0)
    lines = _message(lambda: testing.assert_accumulation_invariant(make, state, batches))
    assert lines == [
        "accumulation invariance: metrics of step 0 with k=2 vs k=1: first difference at loss: "
        "max abs diff 1, max rel diff 1 (rtol=1e-05, atol=1e-05)",
        "metrics of step 0 with k=4 vs k=1: first difference at loss: max abs diff 3, max rel "
        "diff 3 (rtol=1e-05, atol=1e-05)",
    ]
    testing.assert_accumulation_invariant(make, state, batches, check_metrics=False)


def _shift_step(k: int, *, scale: bool = True, extra: str = "", draw: bool = False) -> StepFn:
    """A step of the user's own: ``w += c * x``, loss ``c * x`` with ``c = k`` (1 unless
    ``scale``); ``extra`` names a tree ("state" or "metrics") that gets a key ``extra`` for
    k > 1; ``draw``: k > 1 draws from torch's global RNG."""
    c = k if scale else 1

    def step(s: TensorDictBase, b: Any) -> tuple[TensorDictBase, TensorDictBase]:
        x = b["x"].sum()
        if draw and k > 1:
            torch.rand(1)
        out = TensorDict({"w": s["w"] + c * x}, [])
        metrics = TensorDict({"loss": c * x}, [])
        if k > 1 and extra:
            (out if extra == "state" else metrics)["extra"] = torch.zeros(1)
        return out, metrics

    return step


@pytest.mark.parametrize(
    ("rtol", "atol", "shown"),
    [(None, None, "rtol=1e-05, atol=1e-06"), (1e-3, 0.5, "rtol=0.001, atol=0.5")],
    ids=["defaults", "given"],
)
def test_accumulation_invariance_by_state_reports_each_k_state_then_metrics_with_the_tolerance(
    rtol: float | None, atol: float | None, shown: str
) -> None:
    """compare='state', a step of the user's own whose update and loss scale with k, two
    batches, ks=(1, 2, 4): for each k its final state, then each step's metrics, every line
    naming k against the reference k=1 and the tolerance in force (defaults rtol=1e-5,
    atol=1e-6); with ``check_metrics=False`` only the states, still for every k."""
    state = TensorDict({"w": torch.zeros(())}, [])

    def run(check_metrics: bool) -> list[str]:
        return _message(
            lambda: testing.assert_accumulation_invariant(
                _shift_step,
                state,
                _batches(1.0, 2.0),
                rtol=rtol,
                atol=atol,
                check_metrics=check_metrics,
                compare="state",
            )
        )

    def line(what: str, abs_: int, rel: int) -> str:
        return f"{what}: first difference at {'w' if what.startswith('state') else 'loss'}: max abs diff {abs_}, max rel diff {rel} ({shown})"

    state_2 = line("state with k=2 vs k=1", 3, 1)
    state_4 = line("state with k=4 vs k=1", 9, 3)
    assert run(True) == [
        "accumulation invariance: " + state_2,
        line("metrics of step 0 with k=2 vs k=1", 1, 1),
        line("metrics of step 1 with k=2 vs k=1", 2, 1),
        state_4,
        line("metrics of step 0 with k=4 vs k=1", 3, 3),
        line("metrics of step 1 with k=4 vs k=1", 6, 3),
    ]
    assert run(False) == ["accumulation invariance: " + state_2, state_4]


@pytest.mark.parametrize(
    ("compare", "extra"), [("grads", "metrics"), ("state", "metrics"), ("state", "state")]
)
def test_accumulation_invariance_names_a_key_only_a_later_k_has(compare: str, extra: str) -> None:
    """k=2's step adds a key (a metric, or a state entry) the reference k=1 lacks: the
    failure, in the check's own form ("accumulation invariance: ..."), names the tree, the
    step (for metrics), both ks and the extra key path."""
    if compare == "grads":
        opts = {"m": optim.sgd(0.1)}

        def make(k: int) -> StepFn:
            def grad_fn(params: Any, batch: Any, key: Any, **kw: Any) -> Any:
                metrics = TensorDict({"loss": torch.tensor(1.0)}, [])
                if k > 1:
                    metrics["extra"] = torch.zeros(1)
                return TensorDict({"m": {"w": torch.ones(2)}}, []), metrics

            return ps.train_step(grad_fn, opts)

        state = _one_role_state()
    else:
        make = lambda k: _shift_step(k, scale=False, extra=extra)  # noqa: E731
        state = TensorDict({"w": torch.zeros(())}, [])
    what = "state with k=2 vs k=1" if extra == "state" else "metrics of step 0 with k=2 vs k=1"
    lines = _message(
        lambda: testing.assert_accumulation_invariant(
            make,
            state,
            _batches(1.0),
            ks=(1, 2),
            compare=compare,  # type: ignore[arg-type]
        )
    )
    assert lines == [
        f"accumulation invariance: {what}: key structure differs; only in expected: -; only "
        "in actual: ['extra']"
    ]


def test_accumulation_invariance_by_state_names_the_run_of_the_k_that_drew_from_the_rng() -> None:
    """compare='state' with a step whose k=2 build draws from torch's global RNG: the
    failure names that call, step 0 of k=2, as the likely cause."""
    state = TensorDict({"w": torch.zeros(())}, [])
    lines = _message(
        lambda: testing.assert_accumulation_invariant(
            lambda k: _shift_step(k, draw=True),
            state,
            _batches(1.0),
            ks=(1, 2),
            check_metrics=False,
            compare="state",
        )
    )
    assert lines == [
        "accumulation invariance: state with k=2 vs k=1: first difference at w: max abs diff 1, "
        "max rel diff 1 (rtol=1e-05, atol=1e-06)" + _advice("step 0 of k=2 (the cpu generator)")
    ]


@attrs.frozen
class _ByUpdate:
    """A user step that applies its TrainStep's optimizers through ``update`` and
    ``apply_updates`` (as a wrapper rescaling the updates would) and logs each optimizer's
    learning rate read from its ``hparams``."""

    inner: Any

    def __call__(self, s: TensorDictBase, b: Any) -> tuple[TensorDictBase, TensorDictBase]:
        grads, metrics = self.inner.grad_fn(s["params"], b, s["rng"])
        out = s.clone()
        for role, opt in self.inner.optimizers.items():
            params = s["params", role]
            updates, new_opt = opt.update(grads[role], s["opt_state", role], params)
            out["params", role] = optim.apply_updates(params, updates)
            out["opt_state", role] = new_opt
            metrics[f"{role}_lr"] = torch.tensor(float(opt.hparams.lr))
        out["step"] = s["step"] + 1
        return out, metrics


def test_accumulation_invariance_records_gradients_given_to_update_and_keeps_hparams() -> None:
    """By gradients, a user wrapper that hands the gradients to each optimizer's ``update``
    (not ``step``) and reads the optimizer's ``hparams`` runs under the recorders: equal
    gradients pass, and gradients scaled by k are named by role and leaf."""
    opts = {"m": optim.sgd(0.1)}

    def make(scale: Callable[[int], float]) -> Callable[[int], StepFn]:
        def build(k: int) -> StepFn:
            def grad_fn(params: Any, batch: Any, key: Any, **kw: Any) -> Any:
                g = torch.full((2,), scale(k))
                return TensorDict({"m": {"w": g}}, []), TensorDict({}, [])

            return cast(StepFn, _ByUpdate(ps.train_step(grad_fn, opts)))

        return build

    state, batches = _one_role_state(), _batches(0.0, 0.0)
    testing.assert_accumulation_invariant(make(lambda k: 1.0), state, batches, ks=(1, 2))
    lines = _message(
        lambda: testing.assert_accumulation_invariant(make(float), state, batches, ks=(1, 2))
    )
    assert lines == [
        "accumulation invariance: gradients at step 0 with k=2 vs k=1: role 'm': first "
        "difference at m.w: max abs diff 1, max rel diff 1 (allowed |a - b| <= atol * G + "
        "rtol * |b| with rtol=1e-05, atol=1e-05, G=1 the largest reference gradient of role "
        "'m')"
    ]


@attrs.frozen
class _Twice:
    """A user wrapper that runs its step twice on each batch (two updates of each role)."""

    inner: Any

    def __call__(self, s: TensorDictBase, b: Any) -> tuple[TensorDictBase, TensorDictBase]:
        s, _ = self.inner(s, b)
        return self.inner(s, b)


@pytest.mark.parametrize(("zero", "passes"), [(-0.0, True), (0.0, False)], ids=["neg", "pos"])
def test_accumulation_invariance_recorders_leave_params_bitwise_as_they_are(
    zero: float, passes: bool
) -> None:
    """The recorders return each role's params untouched, bitwise (a -0.0 stays -0.0): a
    step updating a role twice, whose gradient depends on k only where a param is +0.0,
    passes from params of -0.0 (both updates see -0.0) and fails from +0.0, naming both
    updates."""
    opts = {"m": optim.sgd(0.1)}

    def make(k: int) -> StepFn:
        def grad_fn(params: Any, batch: Any, key: Any, **kw: Any) -> Any:
            w = params["m", "w"]
            g = torch.where(torch.signbit(w), torch.ones(2), torch.full((2,), float(k)))
            return TensorDict({"m": {"w": g}}, []), TensorDict({}, [])

        return cast(StepFn, _Twice(ps.train_step(grad_fn, opts)))

    state = _one_role_state(torch.full((2,), zero))
    run = lambda: testing.assert_accumulation_invariant(  # noqa: E731
        make, state, _batches(0.0), ks=(1, 2), check_metrics=False
    )
    if passes:
        run()
        return
    text = "\n".join(_message(run))
    assert "update 0" in text and "update 1" in text, text


@attrs.frozen
class _Private:
    """A user wrapper keeping its step in a private attribute (``__init__`` argument ``inner``)."""

    _inner: Any

    def __call__(self, s: TensorDictBase, b: Any) -> tuple[TensorDictBase, TensorDictBase]:
        return self._inner(s, b)


def test_accumulation_invariance_finds_a_train_step_in_a_private_wrapper_attribute() -> None:
    """A wrapper attribute ``_inner`` (``__init__`` argument ``inner``) is rebuilt through its
    init name: the TrainStep in it is read, and its k-dependent gradient reported."""
    opts = {"m": optim.sgd(0.1)}

    def make(scale: Callable[[int], float]) -> Callable[[int], StepFn]:
        def build(k: int) -> StepFn:
            def grad_fn(params: Any, batch: Any, key: Any, **kw: Any) -> Any:
                return TensorDict({"m": {"w": torch.full((2,), scale(k))}}, []), TensorDict({}, [])

            return cast(StepFn, _Private(ps.train_step(grad_fn, opts)))

        return build

    state, batches = _one_role_state(), _batches(0.0)
    testing.assert_accumulation_invariant(make(lambda k: 1.0), state, batches, ks=(1, 2))
    with pytest.raises(AssertionError, match=r"^accumulation invariance: gradients at step 0 "):
        testing.assert_accumulation_invariant(make(float), state, batches, ks=(1, 2))


@pytest.mark.parametrize(
    "dtype",
    [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2],
    ids=lambda d: safe_id(str(d).removeprefix("torch.")),
)
def test_gradient_scale_reads_leaves_of_every_floating_dtype(dtype: torch.dtype) -> None:
    """G is read in float64, so a gradient leaf of any floating dtype counts, float8 (whose
    ``isfinite``/``max`` torch lacks) included: G of ``[0.5, -3]`` is 3."""
    from purestep.testing._accumulation import _scale

    leaf = torch.tensor([0.5, -3.0]).to(dtype)
    assert _scale(TensorDict({"g": leaf}, [])) == 3.0
