"""Properties of step composition: grads, accumulation, cadence, EMA, non-finite skips, donation."""

from __future__ import annotations

import contextlib
import gc
import re
import sys
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, TensorDictBase
from torch import nn

import purestep as ps
from _ids import safe_id
from _tiny import WritesLater, without_donate
from purestep import _norms, errors, optim, rng, testing, tree

FAST = settings(max_examples=15, deadline=None)


def _mlp(seed: int = 0, d_in: int = 3, d_out: int = 2) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    net = nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, d_out))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return net


def _batch(seed: int, b: int, d_in: int = 3, d_out: int = 2) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {"x": torch.randn(b, d_in, generator=g), "y": torch.randn(b, d_out, generator=g)}, [b]
    )


def _noisy_loss(net: nn.Module, role: str = "student") -> ps.step.LossFn:
    """MSE on inputs perturbed by per-sample noise drawn from the step key."""

    def loss_fn(
        params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        noise = rng.normal(key, tuple(batch["x"].shape), index=batch["index"])
        pred = ps.call(net, params[role], batch["x"] + 0.1 * noise)
        loss = ((pred - batch["y"]) ** 2).mean()
        return loss, {"abs_err": (pred - batch["y"]).abs().mean()}

    return loss_fn


OPTIMIZERS: dict[str, Callable[[], optim.Transform]] = {
    "sgd": lambda: optim.sgd(lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda: optim.adam(lr=1e-2, amsgrad=True),
    "adamw": lambda: optim.adamw(lr=1e-2, weight_decay=0.1),
    "lion": lambda: optim.lion(lr=1e-3),
    "clip+adamw": lambda: optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(lr=1e-2)),
    "adamw+schedule": lambda: optim.adamw(lr=optim.schedules.warmup_cosine(1e-2, 2, 10)),
}


# --- value_and_grad and call ---------------------------------------------------------------


@FAST
@given(seed=st.integers(0, 2**16), b=st.integers(1, 9))
def test_value_and_grad_equals_module_backward(seed: int, b: int) -> None:
    """grad_fn's grads equal loss.backward() on a module holding the same weights."""
    net = _mlp(seed)
    params = TensorDict({"student": ps.params_of("student", net)}, [])
    batch = _batch(seed, b)

    def loss_fn(p: TensorDictBase, bt: TensorDictBase, key: torch.Tensor) -> Any:
        return ((ps.call(net, p["student"], bt["x"]) - bt["y"]) ** 2).mean(), None

    grads, metrics = ps.value_and_grad(loss_fn)(params, batch, rng.key(0))
    ref = _mlp(seed)
    loss = ((ref(batch["x"]) - batch["y"]) ** 2).mean()
    loss.backward()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads["student", *name.split(".")], p.grad)
    torch.testing.assert_close(metrics["loss"], loss.detach())
    assert not metrics["loss"].requires_grad


def test_call_never_uses_the_modules_own_weights() -> None:
    """A module full of NaNs, called with finite params, gives finite outputs and is restored."""
    net = _mlp(0)
    params = ps.params_of("m", net)
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(float("nan"))
    out = ps.call(net, params, torch.ones(2, 3))
    assert torch.isfinite(out).all()
    assert torch.isnan(net[0].weight).all()


def test_each_role_is_differentiated_only_by_its_own_loss() -> None:
    """With {role: loss}, a role's grads come from its loss alone; a role absent gets none."""
    a, b = _mlp(1), _mlp(2)
    params = TensorDict(
        {"a": ps.params_of("a", a), "b": ps.params_of("b", b), "c": ps.params_of("c", _mlp(3))}, []
    )
    batch = _batch(0, 4)

    def loss_fn(p: TensorDictBase, bt: TensorDictBase, key: torch.Tensor) -> Any:
        ya = ps.call(a, p["a"], bt["x"])
        yb = ps.call(b, p["b"], bt["x"])
        # a's loss depends on b's output too, but only a is differentiated by it
        return {"a": (ya * yb).mean(), "b": yb.pow(2).mean()}, {}

    grads, metrics = ps.value_and_grad(loss_fn)(params, batch, rng.key(0))
    assert set(grads.keys()) == {"a", "b"}
    ref_b = _mlp(2)
    ref_b(batch["x"]).pow(2).mean().backward()
    for name, p in ref_b.named_parameters():
        torch.testing.assert_close(grads["b", *name.split(".")], p.grad)
    assert set(metrics.keys()) == {"a", "b"}


def test_roles_not_requested_build_no_graph_and_get_no_grads() -> None:
    """grad_fn(roles=[...]) differentiates only those roles; live_roles() tells the loss."""
    seen: list[frozenset[str] | None] = []
    a, b = _mlp(1), _mlp(2)
    params = TensorDict({"a": ps.params_of("a", a), "b": ps.params_of("b", b)}, [])

    def loss_fn(p: TensorDictBase, bt: TensorDictBase, key: torch.Tensor) -> Any:
        seen.append(ps.live_roles())
        assert not p["b", "0", "weight"].requires_grad
        return ps.call(a, p["a"], bt["x"]).mean() + ps.call(b, p["b"], bt["x"]).mean(), {}

    grads, _ = ps.value_and_grad(loss_fn)(params, _batch(0, 3), rng.key(0), roles=["a"])
    assert list(grads.keys()) == ["a"]
    assert seen == [frozenset({"a"})]
    assert ps.live_roles() is None


def test_a_loss_metric_the_loss_fn_returns_is_kept_not_replaced_by_the_loss() -> None:
    """metrics["loss"] is the scalar loss unless loss_fn reports its own "loss" metric (say the
    unregularised part), which is kept as given."""
    net = _mlp(0)
    params = TensorDict({"student": ps.params_of("student", net)}, [])
    batch = _batch(0, 3)

    def loss_fn(p: TensorDictBase, bt: TensorDictBase, key: torch.Tensor) -> Any:
        mse = ((ps.call(net, p["student"], bt["x"]) - bt["y"]) ** 2).mean()
        return mse + 1.0, {"loss": mse}

    _, metrics = ps.value_and_grad(loss_fn)(params, batch, rng.key(0))
    ref = ((net(batch["x"]) - batch["y"]) ** 2).mean().detach()
    assert list(metrics.keys()) == ["loss"]
    torch.testing.assert_close(metrics["loss"], ref)


def test_non_scalar_loss_is_an_error_naming_the_role() -> None:
    """A vector loss names the role and shape."""
    net = _mlp(0)
    params = TensorDict({"student": ps.params_of("student", net)}, [])
    gf = ps.value_and_grad(lambda p, b, k: (ps.call(net, p["student"], b["x"]), {}))
    with pytest.raises(ValueError, match=r"student.*\(4, 2\)"):
        gf(params, _batch(0, 4), rng.key(0))


# --- accumulation ---------------------------------------------------------------------------


@FAST
@given(seed=st.integers(0, 2**16), b=st.integers(1, 12), k=st.integers(1, 6))
def test_accumulated_grads_equal_full_batch_grads(seed: int, b: int, k: int) -> None:
    """accumulate(k) gives the full-batch mean gradient, also for B not divisible by k."""
    if k > b:
        k = b
    net = _mlp(seed)
    params = TensorDict({"student": ps.params_of("student", net)}, [])
    gf = ps.value_and_grad(_noisy_loss(net))
    batch = _batch(seed, b)
    key = rng.key(seed)
    full_g, full_m = ps.accumulate(gf, 1)(params, batch, key)
    acc_g, acc_m = ps.accumulate(gf, k)(params, batch, key)
    testing.assert_trees_close(acc_g, full_g, rtol=1e-5, atol=1e-6)
    testing.assert_trees_close(acc_m, full_m, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_grad_fn_nested_in_an_accumulated_loss_leaves_the_accumulated_grads_alone(k: int) -> None:
    """Only the outer ``grad_fn`` of a microbatch takes the accumulation sink: a ``grad_fn``
    called inside its ``loss_fn`` (a penalty computed from another loss's gradients) gets
    its own gradients, and the accumulated ones equal ``torch.autograd.grad`` of the
    outer loss alone (the inner value enters it as a constant)."""
    net = _mlp(0)
    params = TensorDict({"s": ps.params_of("s", net)}, [])
    batch = _batch(0, 6)

    def inner_loss(p: TensorDictBase, bt: TensorDictBase, key: torch.Tensor) -> Any:
        return (ps.call(net, p["s"], bt["x"]) ** 2).sum(), {}

    inner = ps.value_and_grad(inner_loss)
    inner_norms: list[torch.Tensor] = []

    def outer_loss(p: TensorDictBase, bt: TensorDictBase, key: torch.Tensor) -> Any:
        g, _ = inner(p, bt, key)
        norm = sum((t**2).sum() for t in g["s"].values(include_nested=True, leaves_only=True))
        inner_norms.append(norm)
        mse = ((ps.call(net, p["s"], bt["x"]) - bt["y"]) ** 2).mean()
        return mse + norm, {}

    got, _ = ps.accumulate(ps.value_and_grad(outer_loss), k)(params, batch, rng.key(0))
    mse = ((net(batch["x"]) - batch["y"]) ** 2).mean()
    want = torch.autograd.grad(mse, [p for _, p in net.named_parameters()])
    for (name, _), w in zip(net.named_parameters(), want, strict=True):
        torch.testing.assert_close(got["s", *name.split(".")], w, rtol=1e-5, atol=1e-6)
    # each inner call saw its own microbatch's gradients, not a running sum
    assert len(inner_norms) == k and all(bool(torch.isfinite(n)) for n in inner_norms)


def test_a_sink_serves_the_first_grad_fn_call_of_a_microbatch_only() -> None:
    """``take_sink`` hands the sink in scope to its first caller and ``None`` after, until
    the next microbatch's scope."""
    from purestep.step._sink import MicrobatchGrads, sink_scope, take_sink

    s = MicrobatchGrads()
    assert take_sink() is None
    with sink_scope(s, 0.5):
        assert take_sink() is s
        assert s.taken is True
        assert take_sink() is None
        assert take_sink() is None
    with sink_scope(s, 0.25):
        assert take_sink() is s and s.weight == 0.25
    assert take_sink() is None


def test_accumulate_assigns_index_before_splitting() -> None:
    """Without batch['index'], microbatches still see global ids 0..B-1."""
    seen: list[torch.Tensor] = []
    net = _mlp(0)

    def loss_fn(p: TensorDictBase, bt: TensorDictBase, key: torch.Tensor) -> Any:
        seen.append(bt["index"].clone())
        return ps.call(net, p["s"], bt["x"]).mean(), {}

    params = TensorDict({"s": ps.params_of("s", net)}, [])
    ps.accumulate(ps.value_and_grad(loss_fn), 3)(params, _batch(0, 7), rng.key(0))
    assert torch.equal(torch.cat(seen), torch.arange(7))
    assert [len(s) for s in seen] == [3, 2, 2]


def test_accumulate_with_more_microbatches_than_samples_is_an_error() -> None:
    """B < k names both numbers."""
    net = _mlp(0)
    gf = ps.accumulate(ps.value_and_grad(_noisy_loss(net)), 5)
    params = TensorDict({"student": ps.params_of("student", net)}, [])
    with pytest.raises(ValueError, match=r"3 samples.*k=5"):
        gf(params, _batch(0, 3), rng.key(0))


def _recording_grad_fn(calls: list[dict[str, Any]]) -> Any:
    """A list-grads grad_fn (not value_and_grad): g = sum(x) per leaf, metrics of the microbatch."""

    def grad_fn(
        params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor, **kw: Any
    ) -> tuple[TensorDict, TensorDict]:
        mb = ps.current_microbatch()
        calls.append({**kw, "mb": (mb.index, mb.count, mb.weight), "n": batch.batch_size[0]})
        s = batch["x"].sum()
        g = TensorDict(
            {"s": {"w": torch.full((2,), float(s)), "v": torch.tensor(2.0 * float(s))}}, []
        )
        m = TensorDict(
            {
                "loss": batch["x"].mean(),
                "f64": batch["x"].to(torch.float64).mean(),
                "count": torch.tensor(batch.batch_size[0]),
            },
            [],
        )
        return g, m

    return grad_fn


def test_accumulate_passes_roles_buffers_donate_and_the_microbatch_context() -> None:
    """Every microbatch call gets roles, buffers and donate (only when set) and its Microbatch."""
    params = TensorDict({"s": {"w": torch.zeros(2), "v": torch.zeros(())}}, [])
    buffers = TensorDict({"s": {"b": torch.zeros(1)}}, [])
    batch = TensorDict({"x": torch.arange(7.0)}, [7])
    for k in (1, 3):
        for donate in (False, True):
            calls: list[dict[str, Any]] = []
            gf = ps.accumulate(_recording_grad_fn(calls), k)
            kw: dict[str, Any] = {"donate": True} if donate else {}
            gf(params, batch, rng.key(0), roles=["s"], buffers=buffers, **kw)
            sizes = [7] if k == 1 else [3, 2, 2]
            assert [c["n"] for c in calls] == sizes
            for c in calls:
                assert c["roles"] == ["s"]
                assert c["buffers"] is buffers
                assert c.get("donate", "absent") == (True if donate else "absent")
            if k == 3:
                assert [c["mb"] for c in calls] == [(i, 3, n / 7) for i, n in enumerate(sizes)]


def test_accumulated_list_grads_and_metrics_are_the_size_weighted_means() -> None:
    """Uneven microbatches (3, 2, 2 of B=7): grads and every metric are weighted by n_i / B;
    float64 metrics keep their dtype, integer ones become float32 means."""
    params = TensorDict({"s": {"w": torch.zeros(2), "v": torch.zeros(())}}, [])
    x = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0])
    batch = TensorDict({"x": x}, [7])
    g, m = ps.accumulate(_recording_grad_fn([]), 3)(params, batch, rng.key(0))
    # microbatch sums 7, 24, 96 weighted 3/7, 2/7, 2/7
    want = (7 * 3 + 24 * 2 + 96 * 2) / 7
    torch.testing.assert_close(g["s", "w"], torch.full((2,), want))
    torch.testing.assert_close(g["s", "v"], torch.tensor(2 * want))
    torch.testing.assert_close(m["loss"], x.mean())
    assert m["f64"].dtype == torch.float64
    torch.testing.assert_close(m["f64"], x.to(torch.float64).mean())
    assert m["count"].dtype == torch.float32
    torch.testing.assert_close(m["count"], torch.tensor((3 * 3 + 2 * 2 + 2 * 2) / 7))


def test_accumulated_integer_metrics_are_float32_under_a_float64_default_dtype() -> None:
    """An integer metric is averaged in float32, whatever the default dtype."""
    params = TensorDict({"s": {"w": torch.zeros(2), "v": torch.zeros(())}}, [])
    batch = TensorDict({"x": torch.arange(4.0)}, [4])
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        _, m = ps.accumulate(_recording_grad_fn([]), 2)(params, batch, rng.key(0))
    finally:
        torch.set_default_dtype(old)
    assert m["count"].dtype == torch.float32
    torch.testing.assert_close(m["count"], torch.tensor(2.0))


def test_accumulate_argument_errors_have_whole_messages() -> None:
    """A non-callable grad_fn, k = 0 and microbatch_sizes(b, 0) are refused with their messages."""
    with pytest.raises(
        TypeError,
        match=r"^accumulate: grad_fn is a int, not callable; pass value_and_grad\(loss_fn\)$",
    ):
        ps.accumulate(3, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^accumulate: k must be a positive int, got 0$"):
        ps.accumulate(_recording_grad_fn([]), 0)
    with pytest.raises(ValueError, match=r"^accumulate: k must be >= 1, got 0$"):
        ps.step.microbatch_sizes(5, 0)
    with pytest.raises(
        errors.BatchError,
        match=r"^accumulate: batch of 3 samples cannot be split into k=4 microbatches$",
    ):
        ps.step.microbatch_sizes(3, 4)


_CHANGED = (
    r"^accumulate: the grads of role 's' are not the ones value_and_grad accumulated \(a wrapper "
    r"between accumulate and value_and_grad changed them per microbatch\); transform gradients "
    r"after accumulate, e.g. in the optimizer chain$"
)


def test_accumulate_refuses_value_and_grad_grads_a_wrapper_dropped_a_leaf_of() -> None:
    """A wrapper that drops a leaf of value_and_grad's grads per microbatch is named, not summed."""
    net = nn.Linear(2, 1)
    params = TensorDict({"s": ps.params_of("s", net)}, [])
    inner = ps.value_and_grad(lambda p, b, k: (ps.call(net, p["s"], b["x"]).mean(), {}))

    def dropping(p: TensorDictBase, b: TensorDictBase, k: torch.Tensor, **kw: Any) -> Any:
        g, m = inner(p, b, k, **kw)
        return g.exclude(tree.paths(g)[-1]), m

    batch = TensorDict({"x": torch.randn(4, 2)}, [4])
    with pytest.raises(RuntimeError, match=_CHANGED):
        ps.accumulate(dropping, 2)(params, batch, rng.key(0))


def test_accumulate_refuses_a_role_summed_both_in_grad_and_as_lists() -> None:
    """A role whose grads come from value_and_grad on one microbatch and elsewhere on another."""
    net = nn.Linear(2, 1)
    params = TensorDict({"s": ps.params_of("s", net)}, [])
    inner = ps.value_and_grad(lambda p, b, k: (ps.call(net, p["s"], b["x"]).mean(), {}))

    def switching(p: TensorDictBase, b: TensorDictBase, k: torch.Tensor, **kw: Any) -> Any:
        if ps.current_microbatch().index == 0:
            return TensorDict({"s": p["s"].apply(torch.ones_like)}, []), TensorDict({}, [])
        return inner(p, b, k, **kw)

    batch = TensorDict({"x": torch.randn(4, 2)}, [4])
    with pytest.raises(
        RuntimeError,
        match=r"^accumulate: role 's' got gradients both through value_and_grad's accumulation "
        r"and from another grad_fn$",
    ):
        ps.accumulate(switching, 2)(params, batch, rng.key(0))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_train_step_is_accumulation_invariant_for_every_optimizer(name: str) -> None:
    """Three train steps with accumulate(k) match k=1 for k in 2, 3, 4 (B=12)."""
    net = _mlp(0)
    opt = {"student": OPTIMIZERS[name]()}
    gf = ps.value_and_grad(_noisy_loss(net))
    state = ps.init_state({"student": net}, opt, seed=1)
    batches = [_batch(i, 12) for i in range(3)]
    # lion's sign() amplifies tiny summation-order differences of near-zero moments
    tol = {"rtol": 1e-4, "atol": 1e-4} if name == "lion" else {"rtol": 1e-5, "atol": 1e-6}
    testing.assert_accumulation_invariant(
        lambda k: ps.train_step(ps.accumulate(gf, k), opt), state, batches, ks=(1, 2, 3, 4), **tol
    )


# --- train_step: purity, donation, determinism, resume ---------------------------------------


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_train_step_is_pure_deterministic_and_donation_safe(name: str) -> None:
    """For every optimizer: inputs unchanged, bitwise repeatable, donate=True == donate=False."""
    net = _mlp(0)
    opt = {"student": OPTIMIZERS[name]()}
    gf = ps.value_and_grad(_noisy_loss(net))
    state = ps.init_state({"student": net}, opt, seed=3)
    batches = [_batch(i, 6) for i in range(3)]
    testing.assert_pure(ps.train_step(gf, opt), state, batches[0])
    testing.assert_deterministic(ps.train_step(gf, opt), state, batches)
    testing.assert_donation_safe(lambda d: ps.train_step(gf, opt, donate=d), state, batches)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_train_step_resumes_exactly_from_a_saved_state(name: str) -> None:
    """Save after 2 of 4 steps, load, continue with a freshly built step: bitwise equal."""
    net = _mlp(0)
    opt = {"student": OPTIMIZERS[name]()}
    state = ps.init_state({"student": net}, opt, seed=4)
    step = ps.train_step(ps.value_and_grad(_noisy_loss(net)), opt)
    fresh = ps.train_step(ps.value_and_grad(_noisy_loss(net)), {"student": OPTIMIZERS[name]()})
    testing.assert_resume_exact(
        step, state, [_batch(i, 5) for i in range(4)], save_at=2, restart_step=fresh
    )


def test_step_key_is_rng_folded_with_step_and_step_increments() -> None:
    """The loss sees fold_in(state['rng'], state['step']); step goes up by one per call."""
    keys: list[torch.Tensor] = []
    net = _mlp(0)

    def loss_fn(p: TensorDictBase, bt: TensorDictBase, key: torch.Tensor) -> Any:
        keys.append(key.clone())
        return ps.call(net, p["s"], bt["x"]).mean(), {}

    opt = {"s": optim.sgd(0.1)}
    step = ps.train_step(ps.value_and_grad(loss_fn), opt)
    state = ps.init_state({"s": net}, opt, seed=11)
    for i in range(3):
        state, metrics = step(state, _batch(i, 2))
        assert int(state["step"]) == i + 1
        assert torch.equal(keys[-1], rng.fold_in(rng.key(11), i))
        assert float(metrics["s", "lr"]) == pytest.approx(0.1)
        assert float(metrics["s", "grad_norm"]) > 0


def test_batch_dict_is_converted_and_never_mutated() -> None:
    """A plain dict batch works; the caller's dict gains no 'index' key."""
    net = _mlp(0)
    opt = {"student": optim.adamw(1e-3)}
    step = ps.train_step(ps.value_and_grad(_noisy_loss(net)), opt)
    state = ps.init_state({"student": net}, opt, seed=0)
    batch = {"x": torch.ones(3, 3), "y": torch.zeros(3, 2)}
    step(state, batch)
    assert set(batch) == {"x", "y"}


def test_inconsistent_batch_dimension_is_an_error_naming_the_keys() -> None:
    """Leaves that disagree on B are named."""
    net = _mlp(0)
    opt = {"student": optim.adamw(1e-3)}
    step = ps.train_step(ps.value_and_grad(_noisy_loss(net)), opt)
    state = ps.init_state({"student": net}, opt, seed=0)
    with pytest.raises(ValueError, match=r"3: x.*4: y"):
        step(state, {"x": torch.ones(3, 3), "y": torch.zeros(4, 2)})


# --- cadence ----------------------------------------------------------------------------------


def _two_role_setup(
    every: int, calls: list[frozenset[str] | None]
) -> tuple[ps.TrainStep, TensorDict]:
    gen, critic = _mlp(1), _mlp(2, d_in=2)

    def loss_fn(p: TensorDictBase, bt: TensorDictBase, key: torch.Tensor) -> Any:
        live = ps.live_roles()
        calls.append(live)
        out: dict[str, torch.Tensor] = {}
        fake = ps.call(gen, p["gen"], bt["x"])
        if live is not None and "gen" in live:
            out["gen"] = -ps.call(critic, p["critic"], fake).mean()
        out["critic"] = ps.call(critic, p["critic"], fake.detach()).pow(2).mean()
        return out, {}

    opt = {
        "gen": optim.adamw(optim.schedules.linear(1e-2, 0.0, 10)),
        "critic": optim.adam(1e-2, betas=(0.0, 0.999)),
    }
    step = ps.train_step(ps.value_and_grad(loss_fn), opt, every={"gen": every})
    return step, ps.init_state({"gen": gen, "critic": critic}, opt, seed=0)


@settings(max_examples=6, deadline=None)
@given(every=st.integers(1, 4))
def test_role_with_every_n_changes_only_on_multiples_of_n(every: int) -> None:
    """every={'gen': N}: gen's params and opt_state change exactly when step % N == 0."""
    calls: list[frozenset[str] | None] = []
    step, state = _two_role_setup(every, calls)
    batches = [_batch(i, 4) for i in range(2 * every + 1)]
    testing.assert_cadence(step, state, batches, "gen", every)
    testing.assert_cadence(step, state, batches, "critic", 1)


def test_cadenced_role_count_and_schedule_advance_only_when_it_updates() -> None:
    """The student's optimizer count (and so its lr) follows its own updates, not the step."""
    calls: list[frozenset[str] | None] = []
    step, state = _two_role_setup(3, calls)
    for i in range(7):
        state, metrics = step(state, _batch(i, 4))
        if i % 3 == 0:
            n_updates = i // 3 + 1
            assert float(metrics["gen", "lr"]) == pytest.approx(1e-2 * (1 - (n_updates - 1) / 10))
        else:
            assert "gen" not in metrics.keys()
    assert int(state["opt_state", "gen", "count"]) == 3
    assert int(state["opt_state", "critic", "count"]) == 7
    assert calls == [
        frozenset({"gen", "critic"}) if i % 3 == 0 else frozenset({"critic"}) for i in range(7)
    ]


def test_every_for_unknown_role_is_an_error() -> None:
    """every names a role without an optimizer."""
    with pytest.raises(KeyError, match="teacher"):
        ps.train_step(lambda *a, **k: None, {"s": optim.sgd(0.1)}, every={"teacher": 2})  # type: ignore[arg-type,return-value]


# --- EMA -----------------------------------------------------------------------------------------


@settings(max_examples=8, deadline=None)
@given(decay=st.floats(0.0, 1.0), start=st.integers(0, 3))
def test_ema_follows_the_lerp_formula_from_start_step(decay: float, start: int) -> None:
    """ema_s = params_s for s < start, then ema += (1 - decay) * (params - ema) after each step."""
    net = _mlp(0)
    opt = {"student": optim.sgd(0.1)}
    inner = ps.train_step(ps.value_and_grad(_noisy_loss(net)), opt)
    step = ps.with_ema(inner, decay, ["student"], start_step=start)
    state = step.prepare(ps.init_state({"student": net}, opt, seed=0))
    expected = [t.clone() for t in tree.leaves(state["params", "student"])]
    for i in range(5):
        state, _ = step(state, _batch(i, 4))
        p = tree.leaves(state["params", "student"])
        if i < start:
            expected = [t.clone() for t in p]
        else:
            expected = [e + (1 - decay) * (q - e) for e, q in zip(expected, p, strict=True)]
        for e, got in zip(expected, tree.leaves(state["ema", "student"]), strict=True):
            torch.testing.assert_close(got, e, rtol=1e-6, atol=1e-7)


def test_ema_step_is_pure_and_donation_safe() -> None:
    """with_ema keeps purity and donate=True == donate=False."""
    net = _mlp(0)
    opt = {"student": optim.adamw(1e-2)}
    gf = ps.value_and_grad(_noisy_loss(net))

    def make(d: bool) -> ps.EMAStep:
        return ps.with_ema(ps.train_step(gf, opt, donate=d), 0.9, ["student"], start_step=1)

    state = ps.init_state({"student": net}, opt, seed=0)
    batches = [_batch(i, 4) for i in range(3)]
    testing.assert_pure(make(False), state, batches[0])
    testing.assert_donation_safe(make, state, batches)


# --- skip_nonfinite ---------------------------------------------------------------------------


def _nan_when(flag_key: str = "bad") -> Callable[[nn.Module], ps.step.LossFn]:
    def factory(net: nn.Module) -> ps.step.LossFn:
        def loss_fn(p: TensorDictBase, bt: TensorDictBase, key: torch.Tensor) -> Any:
            loss = ((ps.call(net, p["student"], bt["x"]) - bt["y"]) ** 2).mean()
            return loss * bt[flag_key].mean(), {}

        return loss_fn

    return factory


@settings(max_examples=10, deadline=None)
@given(pattern=st.lists(st.sampled_from([1.0, float("nan"), float("inf")]), min_size=1, max_size=6))
def test_nonfinite_steps_leave_params_opt_state_and_ema_unchanged(pattern: list[float]) -> None:
    """A non-finite loss or grad is a no-op on params/opt_state/ema; step advances; skips are counted."""
    net = _mlp(0)
    opt = {"student": optim.adamw(1e-2)}
    gf = ps.value_and_grad(_nan_when()(net))
    for order in ("ema_outside", "skip_outside"):
        base = ps.train_step(gf, opt)
        step: ps.TrainStep | ps.EMAStep
        if order == "ema_outside":
            step = ps.with_ema(ps.skip_nonfinite(base), 0.5, ["student"])
        else:
            step = ps.skip_nonfinite(ps.with_ema(base, 0.5, ["student"]))
        state = step.prepare(ps.init_state({"student": net}, opt, seed=0))
        total = consecutive = 0
        for i, flag in enumerate(pattern):
            b = _batch(i, 4)
            b["bad"] = torch.full((4,), flag)
            before = testing.snapshot(state.exclude("step", "skip"))
            state, metrics = step(state, b)
            assert int(state["step"]) == i + 1
            if flag != 1.0:
                total, consecutive = total + 1, consecutive + 1
                testing.assert_trees_equal(state.exclude("step", "skip"), before)
                assert bool(metrics["skipped"])
            else:
                consecutive = 0
                assert not bool(metrics["skipped"])
            assert int(state["skip", "total"]) == total
            assert int(state["skip", "consecutive"]) == consecutive


@pytest.mark.parametrize("donate", [False, True])
def test_too_many_consecutive_nonfinite_steps_raise_naming_the_count(donate: bool) -> None:
    """max_consecutive=2: the third consecutive skip raises NonFiniteError, donated or not."""
    net = _mlp(0)
    opt = {"student": optim.sgd(0.1)}
    step = ps.skip_nonfinite(
        ps.train_step(ps.value_and_grad(_nan_when()(net)), opt, donate=donate), max_consecutive=2
    )
    state = step.prepare(ps.init_state({"student": net}, opt, seed=0))
    b = _batch(0, 4)
    b["bad"] = torch.full((4,), float("nan"))
    state, _ = step(state, b)
    state, _ = step(state, b)
    with pytest.raises(ps.NonFiniteError) as info:
        step(state, b)
    assert str(info.value) == (
        "3 consecutive steps with a non-finite loss or gradient (max_consecutive=2), last at step 2"
    )


def test_skip_nonfinite_is_donation_safe() -> None:
    """donate=True == donate=False through finite and skipped steps."""
    net = _mlp(0)
    opt = {"student": optim.adamw(1e-2)}
    gf = ps.value_and_grad(_nan_when()(net))
    batches = []
    for i, flag in enumerate([1.0, float("nan"), 1.0]):
        b = _batch(i, 4)
        b["bad"] = torch.full((4,), flag)
        batches.append(b)
    testing.assert_donation_safe(
        lambda d: ps.with_ema(
            ps.skip_nonfinite(ps.train_step(gf, opt, donate=d)), 0.9, ["student"]
        ),
        ps.init_state({"student": net}, opt, seed=0),
        batches,
    )


def _nonfinite_from(net: nn.Module) -> ps.step.LossFn:
    """MSE, plus where the batch says: a constant offset (non-finite loss, finite gradients) and
    a term of value 0 whose gradient is NaN when ``bt["g"]`` is 0 (finite loss, NaN gradients)."""

    def loss_fn(p: TensorDictBase, bt: TensorDictBase, key: torch.Tensor) -> Any:
        loss = ((ps.call(net, p["student"], bt["x"]) - bt["y"]) ** 2).mean()
        w = p["student", "0", "bias"]
        nan_grad = ((w * 0 + bt["g"].mean()).sqrt() * 0).sum() * 0  # d/dw = 0 * inf * 0
        return loss * bt["scale"].mean() + bt["offset"].mean() + nan_grad, {}

    return loss_fn


@settings(max_examples=24, deadline=None)
@given(
    where=st.lists(st.sampled_from(["none", "loss", "grad", "both"]), min_size=1, max_size=4),
    value=st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    donate=st.booleans(),
)
def test_a_nonfinite_loss_or_gradient_alone_is_skipped(
    where: list[str], value: float, donate: bool
) -> None:
    """A step is skipped when only the loss is non-finite (a constant NaN offset: finite grads),
    when only a gradient is (the loss is finite), or both; params, opt_state and EMA stay."""
    net = _mlp(0)
    opt = {"student": optim.adamw(1e-2)}
    step = ps.with_ema(
        ps.skip_nonfinite(
            ps.train_step(ps.value_and_grad(_nonfinite_from(net)), opt, donate=donate)
        ),
        0.9,
        ["student"],
    )
    state = step.prepare(ps.init_state({"student": net}, opt, seed=0))
    skipped = 0
    for i, w in enumerate(where):
        b = _batch(i, 4)
        b["offset"] = torch.full((4,), value if w == "loss" else 0.0)
        b["scale"] = torch.full((4,), value if w == "both" else 1.0)
        b["g"] = torch.full((4,), 0.0 if w == "grad" else 1.0)
        before = testing.snapshot(state.exclude("step", "skip"))
        state, metrics = step(state, b)
        after = state.exclude("step", "skip")
        if w == "none":
            assert not bool(metrics["skipped"])
            assert not torch.equal(
                after["params", "student", "2", "bias"], before["params", "student", "2", "bias"]
            )
        else:
            skipped += 1
            assert bool(metrics["skipped"]), f"step {i} with a non-finite {w} was not skipped"
            testing.assert_trees_equal(after, before, what=f"state after a non-finite {w}")
        assert int(state["skip", "total"]) == skipped


@pytest.mark.parametrize("donate", [False, True])
def test_clipping_reuses_the_grad_norm_metric_norm_and_results_are_unchanged(
    donate: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With clip + grad_norm metric one step takes the grads' norm once; states equal the unshared run.

    The clip's logged norm equals the metric, and the result is bitwise equal to
    a step whose norms are computed separately (memo disabled).
    """
    net = _mlp(3)

    def make() -> tuple[ps.TrainStep, TensorDict]:
        opt = {"student": optim.chain(optim.clip_by_global_norm(0.05), optim.adamw(lr=1e-2))}
        step = ps.train_step(ps.value_and_grad(_noisy_loss(net)), opt, donate=donate)
        return step, ps.init_state({"student": net}, opt, seed=4)

    calls = []
    inner = _norms._global_norm

    def counting(tensors: Any) -> torch.Tensor:
        calls.append(len(tensors))
        return inner(tensors)

    step, state = make()
    with monkeypatch.context() as mp:
        mp.setattr(_norms, "_global_norm", counting)
        for i in range(3):
            state, metrics = step(state, _batch(i, 8))
    assert calls == [len(tree.leaves(state["params", "student"]))] * 3
    clip_norm = state["opt_state", "student", "0", "norm"]
    assert torch.equal(clip_norm, metrics["student", "grad_norm"])
    assert clip_norm.data_ptr() != metrics["student", "grad_norm"].data_ptr()

    step2, state2 = make()
    with monkeypatch.context() as mp:
        mp.setattr(tree, "norm_memo", contextlib.nullcontext)
        for i in range(3):
            state2, metrics2 = step2(state2, _batch(i, 8))
    testing.assert_trees_equal(state, state2)
    testing.assert_trees_equal(metrics, metrics2)


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 5),
    shapes=st.lists(st.lists(st.integers(0, 3), max_size=2), min_size=1, max_size=4),
    give_index=st.booleans(),
    mismatch=st.booleans(),
)
def test_prepare_batch_equals_with_index_of_as_batch(
    b: int, shapes: list[list[int]], give_index: bool, mismatch: bool
) -> None:
    """The direct path for dicts gives what with_index(as_batch(d)) gives (or the same error)."""
    from purestep.step._batch import prepare_batch

    d: dict[str, torch.Tensor] = {
        f"k{i}": torch.zeros(b + (1 if mismatch and i == 1 else 0), *s)
        for i, s in enumerate(shapes)
    }
    if give_index:
        d["index"] = torch.arange(b) + 10
    before = dict(d)
    try:
        expected = ps.step.with_index(ps.step.as_batch(d))
    except ValueError as e:
        with pytest.raises(ValueError, match=str(e)[:30].replace("(", r"\(").replace(")", r"\)")):
            prepare_batch(d)
        return
    got = prepare_batch(d)
    assert got.batch_size == expected.batch_size
    assert list(got.keys()) == list(expected.keys())
    for k in expected.keys():
        assert torch.equal(got[k], expected[k]), k
    assert d.keys() == before.keys() and all(d[k] is before[k] for k in d), "caller's dict changed"


def test_prepare_batch_builds_a_flat_dict_of_tensors_in_one_construction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plain dict of str keys to tensors of >= 1 dim agreeing on B and device (the usual
    data-loader output) takes the direct path: the general as_batch/with_index path is not
    run, and the result holds the caller's tensors and an arange index."""
    from purestep.step import _batch

    def general(*_: Any) -> Any:
        raise AssertionError("the general path ran for a flat dict of tensors")

    monkeypatch.setattr(_batch, "as_batch", general)
    monkeypatch.setattr(_batch, "with_index", general)
    x, y = torch.zeros(3, 2), torch.ones(3)
    got = _batch.prepare_batch({"x": x, "y": y})
    assert got.batch_size == torch.Size([3])
    assert got["x"] is x and got["y"] is y
    assert torch.equal(got["index"], torch.arange(3))


@pytest.mark.parametrize("value", [3, 2.5], ids=["int", "float"])
def test_prepare_batch_refuses_a_python_number_first_like_as_batch(value: float) -> None:
    """A dict whose first entry is a Python number (not a tensor: no ndim) takes the general
    path and gets as_batch's error naming the key, not an AttributeError."""
    from purestep.step._batch import prepare_batch

    with pytest.raises(errors.BatchError) as info:
        prepare_batch({"x": value, "y": torch.zeros(2)})
    assert str(info.value) == (
        "batch key 'x' is a 0-dim tensor; every batch entry needs a leading batch dimension"
    )


@pytest.mark.parametrize("where", ["default_meta", "batch_meta"])
def test_prepare_batch_puts_the_index_on_the_batchs_device_not_the_default_one(
    where: str,
) -> None:
    """The index a step assigns lives on the batch's device, whatever the default device
    (a meta default device, as set for deferred model init, with a CPU batch; or a meta
    batch under the CPU default)."""
    from purestep.step._batch import prepare_batch

    if where == "default_meta":
        x, ctx = torch.zeros(3, 2), torch.device("meta")
    else:
        x, ctx = torch.zeros(3, 2, device="meta"), contextlib.nullcontext()
    with ctx:
        got = prepare_batch({"x": x})
    assert got["index"].device == x.device
    assert got["index"].dtype == torch.int64 and got["index"].shape == (3,)


# --- batches at the step boundary: as_batch, check_index, with_index ------------------------

EMPTY_BATCH = (
    "batch has no samples (B=0): a step on it would average the loss over nothing (NaN) and "
    "still apply the optimizer; skip empty batches before the step (e.g. drop_last=True in the "
    "data loader, or `if len(batch['x']): step(...)`)"
)

BAD_BATCHES: list[tuple[str, Any, type[Exception], str, str | None]] = [
    (
        "a list",
        [torch.zeros(2)],
        TypeError,
        "batch is list; expected a TensorDict or a dict of tensors",
        None,
    ),
    (
        "a 0-dim entry",
        {"x": torch.zeros(3), "t": torch.tensor(1.0)},
        errors.BatchError,
        "batch key 't' is a 0-dim tensor; every batch entry needs a leading batch dimension",
        "t",
    ),
    (
        "a nested 0-dim entry",
        TensorDict({"a": {"b": torch.tensor(1.0)}}, []),
        errors.BatchError,
        "batch key 'a.b' is a 0-dim tensor",
        "a.b",
    ),
    ("an empty dict", {}, errors.BatchError, "batch is empty: it has no tensors", None),
    ("an empty TensorDict", TensorDict({}, []), errors.BatchError, "batch is empty", None),
    (
        "entries that disagree on B",
        {"y": torch.zeros(4), "x": torch.zeros(3, 2), "z": torch.zeros(3)},
        errors.BatchError,
        "batch entries disagree on the leading (batch) dimension: 3: x, z; 4: y",
        None,
    ),
    ("B=0 dict", {"x": torch.zeros(0, 2)}, errors.BatchError, EMPTY_BATCH, None),
    (
        "B=0 TensorDict",
        TensorDict({"x": torch.zeros(0)}, [0]),
        errors.BatchError,
        EMPTY_BATCH,
        None,
    ),
]


@pytest.mark.parametrize(
    ("name", "batch", "exc", "message", "key"),
    BAD_BATCHES,
    ids=[safe_id(c[0]) for c in BAD_BATCHES],
)
def test_as_batch_refuses_what_has_no_batch_dimension_naming_the_entries(
    name: str, batch: Any, exc: type[Exception], message: str, key: str | None
) -> None:
    """as_batch (and so every step) refuses a batch it cannot use, with the message naming the
    entries at fault (and .key the one entry, where there is one)."""
    with pytest.raises(exc) as info:
        ps.step.as_batch(batch)
    assert message in str(info.value), str(info.value)
    if exc is errors.BatchError:
        assert info.value.key == key  # type: ignore[attr-defined]


def test_as_batch_takes_b_from_the_leaves_from_one_sample_up() -> None:
    """B = 1 is a batch; a TensorDict without batch dims gets B on a copy (the input keeps its
    batch_size); one with batch dims is used as it is."""
    assert ps.step.as_batch({"x": torch.zeros(1, 2)}).batch_size == torch.Size([1])
    td = TensorDict({"x": torch.zeros(3, 2), "y": {"z": torch.zeros(3)}}, [])
    out = ps.step.as_batch(td)
    assert out.batch_size == torch.Size([3]) and td.batch_size == torch.Size([])
    assert out["x"] is td["x"]
    batched = TensorDict({"x": torch.zeros(2, 2)}, [2])
    assert ps.step.as_batch(batched) is batched


BAD_INDEXES = [
    ("int32", torch.arange(3, dtype=torch.int32), "got dtype torch.int32 and shape (3,)"),
    ("2-D", torch.zeros(2, 2, dtype=torch.int64), "got dtype torch.int64 and shape (2, 2)"),
    ("0-dim", torch.tensor(0), "got dtype torch.int64 and shape ()"),
    ("a list", [0, 1], "got a list"),
]


@pytest.mark.parametrize(
    ("name", "idx", "got"), BAD_INDEXES, ids=[safe_id(c[0]) for c in BAD_INDEXES]
)
def test_check_index_refuses_other_dtypes_and_shapes_saying_what_it_got(
    name: str, idx: Any, got: str
) -> None:
    """Only a 1-D int64 tensor is an index; the message says what was given instead."""
    with pytest.raises(errors.BatchError) as info:
        ps.step.check_index(idx)
    assert str(info.value) == (f"batch['index'] must be a 1-D int64 tensor of sample ids; {got}"), (
        str(info.value)
    )
    assert info.value.key == "index"


@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.integers(0, 5), min_size=1, max_size=8))
def test_check_index_refuses_exactly_repeated_ids_naming_the_smallest_and_its_positions(
    ids: list[int],
) -> None:
    """An index with distinct ids passes (returned as is); otherwise the smallest repeated id is
    named with all its positions, and the total of repeats when other ids repeat too."""
    idx = torch.tensor(ids, dtype=torch.int64)
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if not repeated:
        assert ps.step.check_index(idx) is idx
        return
    with pytest.raises(errors.BatchError) as info:
        ps.step.check_index(idx)
    first = repeated[0]
    where = [p for p, i in enumerate(ids) if i == first]
    n_dup = len(ids) - len(set(ids))
    more = f" ({n_dup} repeated ids in all)" if n_dup > len(where) - 1 else ""
    assert str(info.value) == (
        f"batch['index'] has duplicate sample ids: {first} at positions {where}{more}; "
        "per-sample noise is drawn from fold_in(key, index[i]), so these samples would get "
        "the same noise. Give every sample of a step its own id (e.g. its position in the "
        "stream of samples, not its dataset index when sampling with replacement), or leave "
        "'index' out (it defaults to arange(B))"
    ), str(info.value)
    assert info.value.key == "index"


def test_check_index_checks_an_index_again_after_it_was_written_to() -> None:
    """A checked index is remembered by identity and version: written in place, it is checked
    again; a new tensor with the same values is checked too."""
    idx = torch.tensor([0, 1, 2])
    assert ps.step.check_index(idx) is idx
    assert ps.step.check_index(idx) is idx
    idx[1] = 0
    with pytest.raises(errors.BatchError, match="0 at positions"):
        ps.step.check_index(idx)
    with pytest.raises(errors.BatchError, match="0 at positions"):
        ps.step.check_index(idx.clone())


def test_check_index_sorts_an_index_once_and_only_when_ids_could_repeat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check's cost (a sort of B ids) is paid once per index: a checked index, or one that
    with_index assigned, is not sorted again until it is written to; B = 1 needs no sort."""
    sorts: list[list[int]] = []
    real_sort = torch.sort

    def counting_sort(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sorts.append(t.tolist())
        return real_sort(t, *args, **kwargs)

    monkeypatch.setattr(torch, "sort", counting_sort)
    idx = torch.tensor([4, 1, 2])
    for _ in range(3):
        assert ps.step.check_index(idx) is idx
    assert sorts == [[4, 1, 2]]
    idx[0] = 3
    assert ps.step.check_index(idx) is idx and ps.step.check_index(idx) is idx
    assert sorts == [[4, 1, 2], [3, 1, 2]]
    other = torch.tensor([4, 1, 2])
    assert ps.step.check_index(other) is other
    assert sorts == [[4, 1, 2], [3, 1, 2], [4, 1, 2]]
    sorts.clear()
    single = torch.tensor([5])
    assert ps.step.check_index(single) is single
    assigned = ps.step.with_index(TensorDict({"x": torch.zeros(4)}, [4]))["index"]
    assert ps.step.check_index(assigned) is assigned
    assert sorts == []


def test_the_distinct_index_cache_forgets_an_index_when_it_dies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An index tensor's entry in the checked-index cache goes away with the tensor (its
    weak reference's callback), so dead indexes never push live ones out of the bounded
    cache; an index whose entry was evicted first dies without an error (none reaches
    sys.unraisablehook)."""
    from purestep.step import _batch

    errs: list[Any] = []
    monkeypatch.setattr(_batch, "_DISTINCT", {})
    monkeypatch.setattr(sys, "unraisablehook", errs.append)
    idx = torch.tensor([4, 1, 2])
    key = id(idx)
    assert ps.step.check_index(idx) is idx and _batch._known_distinct(idx)
    del idx
    gc.collect()
    assert key not in _batch._DISTINCT and _batch._DISTINCT == {}
    live = [torch.arange(3) + i for i in range(65)]
    for t in live:
        ps.step.check_index(t)
    assert len(_batch._DISTINCT) == 64 and id(live[0]) not in _batch._DISTINCT
    del live[0]  # its entry was evicted: its callback finds nothing to remove
    gc.collect()
    assert [e.exc_value for e in errs] == []
    assert len(_batch._DISTINCT) == 64 and all(_batch._known_distinct(t) for t in live)


@pytest.mark.parametrize("how", ["emptied", "resized", "deleted"])
def test_remembering_a_checked_index_survives_a_concurrent_change_of_the_full_cache(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checked-index cache is shared by threads: evicting its oldest entry when it is
    full while another thread empties it, resizes it or evicts the same entry is not an
    error, and the new index is remembered all the same."""
    from purestep.step import _batch

    cache = _RacingCache(how, size=64)
    monkeypatch.setattr(_batch, "_DISTINCT", cache)
    idx = torch.tensor([4, 1, 2])
    assert ps.step.check_index(idx) is idx
    assert _batch._known_distinct(idx)


def test_check_index_does_not_read_the_values_of_a_traced_index() -> None:
    """Under tracing (a fake tensor: shape and dtype, no values) the index is returned
    unchecked, not read (which would fail); its values are checked on the host."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        idx = torch.tensor([0, 0, 1])
        assert ps.step.check_index(idx) is idx
        with pytest.raises(errors.BatchError, match=r"got dtype torch\.int32 and shape \(3,\)$"):
            ps.step.check_index(idx.int())


def test_with_index_adds_arange_b_or_checks_the_given_index() -> None:
    """with_index adds an int64 arange(B) (also to a batch without leaves) on a copy, and keeps
    (after checking) an index the batch has; B comes from the batch dimension only."""
    batch = TensorDict({"x": torch.zeros(3, 2)}, [3])
    out = ps.step.with_index(batch)
    assert "index" not in batch.keys() and out["x"] is batch["x"]
    assert out["index"].dtype == torch.int64 and out["index"].tolist() == [0, 1, 2]
    assert ps.step.check_index(out["index"]) is out["index"]
    assert ps.step.with_index(TensorDict({}, [2]))["index"].tolist() == [0, 1]
    given_ = TensorDict({"x": torch.zeros(2), "index": torch.tensor([7, 3])}, [2])
    assert ps.step.with_index(given_) is given_
    with pytest.raises(errors.BatchError, match="7 at positions"):
        ps.step.with_index(TensorDict({"x": torch.zeros(2), "index": torch.tensor([7, 7])}, [2]))
    with pytest.raises(
        ValueError, match=r"^batch has no batch dimension; build it with batch_size"
    ):
        ps.step.with_index(TensorDict({"x": torch.zeros(2)}, []))
    assert ps.step.batch_size(TensorDict({"x": torch.zeros(1, 4)}, [1, 4])) == 1


# --- a forward that writes its weights; donated buffers; the state-check cache ---------------


class _Renorm(nn.Module):
    """``nn.Embedding(max_norm=0.5)`` renormalises the rows it looks up, in place, in forward."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(10, 4, max_norm=0.5, _weight=3.0 * torch.randn(10, 4, generator=g))
        self.head = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.emb(ids))
        return out


def test_weights_written_by_the_forward_reach_the_state_donated_or_not() -> None:
    """Embedding(max_norm) writes the looked-up rows during forward. Through a grad_fn that does
    not take ``donate=`` (the written values come back in ``buffers``), donate=True and False
    give the same states, bitwise, as value_and_grad's own donated path (writes in place), and
    a state without buffers gets none."""
    net = _Renorm()

    def loss_fn(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        return ((ps.call(net, p["m"], b["ids"]) - b["y"]) ** 2).mean(), {}

    opt = {"m": optim.sgd(0.1)}
    gf = ps.value_and_grad(loss_fn)
    g = torch.Generator().manual_seed(1)
    batches = [
        {"ids": torch.randint(0, 10, (4,), generator=g), "y": torch.randn(4, 2, generator=g)}
        for _ in range(3)
    ]
    init = ps.init_state({"m": net}, opt, seed=0)
    runs = {}
    for name, fn, donate in (
        ("custom, donate=False", without_donate(gf), False),
        ("custom, donate=True", without_donate(gf), True),
        ("value_and_grad, donate=True", gf, True),
    ):
        step = ps.train_step(fn, opt, donate=donate)
        state = init.clone()
        for b in batches:
            state, _ = step(state, b)
        runs[name] = state
    first = batches[0]["ids"]
    w0 = init["params", "m", "emb", "weight"]
    assert bool((w0[first].norm(dim=-1) > 0.5).all()), "the rows start above max_norm"
    ref = runs["value_and_grad, donate=True"]
    for name, state in runs.items():
        testing.assert_trees_equal(state, ref, what=name)
        assert sorted(state.keys()) == sorted(init.keys()), f"{name}: the state's keys changed"


class _RenormBN(_Renorm):
    """``_Renorm`` with a BatchNorm between lookup and head: buffers and written params."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.norm(self.emb(ids)))
        return out


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("custom", [False, True])
def test_written_weights_and_buffers_of_several_roles_equal_the_imperative_loop(
    donate: bool, custom: bool
) -> None:
    """Roles with buffers only (BatchNorm, named first), written weights only
    (Embedding(max_norm)) and both (Embedding(max_norm) + BatchNorm): params and
    buffers after three SGD steps equal torch's loop on the modules themselves, through
    value_and_grad or a grad_fn without ``donate=``, donated or not."""
    import copy

    nets = {
        "a": nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)),
        "e": _Renorm(),
        "m": _RenormBN(),
    }
    ref = copy.deepcopy(nets)

    def loss_of(mods: Any, p: TensorDictBase | None, b: TensorDictBase) -> torch.Tensor:
        run = (
            (lambda r, *a: mods[r](*a)) if p is None else (lambda r, *a: ps.call(mods[r], p[r], *a))
        )
        fit = ((run("m", b["ids"]) - b["y"]) ** 2).mean() + run("a", b["x"]).pow(2).mean()
        return fit + (run("e", b["ids"]) - b["y"]).abs().mean()

    opt = {r: optim.sgd(0.1) for r in nets}
    gf = ps.value_and_grad(lambda p, b, key: (loss_of(nets, p, b), {}))
    step = ps.train_step(without_donate(gf) if custom else gf, opt, donate=donate)
    g = torch.Generator().manual_seed(1)
    batches = [
        TensorDict(
            {
                "ids": torch.randint(0, 10, (4,), generator=g),
                "y": torch.randn(4, 2, generator=g),
                "x": torch.randn(4, 3, generator=g),
            },
            [4],
        )
        for _ in range(3)
    ]
    state = ps.init_state(nets, opt, seed=0)
    torch_opt = torch.optim.SGD([p for m in ref.values() for p in m.parameters()], lr=0.1)
    for b in batches:
        state, _ = step(state, b)
        torch_opt.zero_grad()
        loss_of(ref, None, b).backward()
        torch_opt.step()
    assert sorted(state["buffers"].keys()) == ["a", "m"]
    for role, mod in ref.items():
        testing.assert_trees_close(
            state["params", role], ps.params_of(role, mod), rtol=1e-6, atol=1e-7, what=role
        )
        if role != "e":
            testing.assert_trees_close(
                state["buffers", role], ps.buffers_of(role, mod), rtol=1e-6, atol=1e-7, what=role
            )


def _nan_steps(donate: bool, ema: bool = False) -> tuple[Any, TensorDict, list[TensorDict]]:
    net = _mlp(0)
    opt = {"student": optim.adamw(1e-2)}
    step: Any = ps.skip_nonfinite(
        ps.train_step(ps.value_and_grad(_nan_when()(net)), opt, donate=donate)
    )
    if ema:
        step = ps.with_ema(step, 0.9, ["student"])
    batches = []
    for i, flag in enumerate([1.0, float("nan"), float("nan"), 1.0, 1.0]):
        b = _batch(i, 4)
        b["bad"] = torch.full((4,), flag)
        batches.append(b)
    return step, ps.init_state({"student": net}, opt, seed=0), batches


def test_a_donated_step_advances_its_counters_in_their_own_buffers() -> None:
    """donate=True reuses the input's buffers: ``step`` and the skip counters are updated in
    place on finite and skipped steps alike (and params too on a skipped step, where nothing
    else changes); donate=False leaves every input counter as it was."""
    for donate in (False, True):
        step, state, batches = _nan_steps(donate)
        state = step.prepare(state)
        for b in batches:
            counters = [("step",), ("skip", "total"), ("skip", "consecutive")]
            before = {k: (state.get(k).data_ptr(), int(state.get(k))) for k in counters}
            params = {k: t.data_ptr() for k, t in state["params"].items(True, True)}
            new, metrics = step(state, b)
            for k in counters:
                reused = new.get(k).data_ptr() == before[k][0]
                assert reused == donate, (donate, k)
                if not donate:
                    assert int(state.get(k)) == before[k][1], k
            if donate and bool(metrics["skipped"]):
                assert all(new["params"].get(k).data_ptr() == p for k, p in params.items())
            state = new


def test_a_donated_step_on_an_unprepared_state_marks_its_input_when_skipped() -> None:
    """``prepare`` inside the step adds the skip counters to a copy; the caller's state is the
    one donated, so using it again raises, on a finite and on a skipped (NaN) step, with or
    without with_ema around."""
    for ema in (False, True):
        step, state, batches = _nan_steps(True, ema=ema)
        for b in batches[:2]:
            entry = state.clone()
            assert "skip" not in entry.keys()
            new, _ = step(entry, b)
            with pytest.raises(ps.DonatedStateError, match="donated"):
                step(entry, b)
            assert int(new["step"]) == int(state["step"]) + 1


def test_the_state_checks_run_once_per_structure() -> None:
    """A state a step returned is registered as checked: the next step's checks of its
    (params, opt_state) pairs and EMA trees are cache hits, after finite and skipped steps.
    A step whose state is new (the first) checks in full."""
    from purestep.step import _validate

    for donate in (False, True):
        step, state, batches = _nan_steps(donate, ema=True)
        state = step.prepare(state)
        misses: list[object] = []
        known = _validate._known

        def spy(
            a: object, b: object, tag: object, known: Any = known, misses: Any = misses
        ) -> bool:
            hit: bool = known(a, b, tag)
            if not hit:
                misses.append(tag)
            return hit

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_validate, "_known", spy)
            for i, b in enumerate(batches):
                misses.clear()
                state, _ = step(state, b)
                after_skip = i > 0 and bool(torch.isnan(batches[i - 1]["bad"]).any())
                if i == 0:
                    assert misses, "the first step checks its state"
                elif after_skip and not donate:
                    # a skipped step copies the EMA nodes without registering them
                    assert all(isinstance(t, str) for t in misses), misses
                else:
                    assert misses == [], (donate, i, misses)


# --- bound (FSDP2) roles on one rank ------------------------------------------------------------
# One gloo rank in this process (tests/_optim.one_rank_mesh): the bound path (grads from
# backward() into .grad, FSDP's sync hooks, the harvest) runs without spawning workers.


def _two_bound_losses(
    student: nn.Module, critic: nn.Module, kind: str, *, detach: bool = True
) -> ps.step.LossFn:
    """The critic scores the student's output; ``kind``: one loss for both, or one per role."""

    def loss_fn(
        params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        pred = ps.call(student, params["student"], batch["x"])
        seen = pred.detach() if detach else pred
        score = ps.call(critic, params["critic"], seen)
        fit = ((pred - batch["y"]) ** 2).mean()
        if kind == "one":
            return fit + 0.5 * ps.call(critic, params["critic"], pred).pow(2).mean(), {}
        return {"student": fit, "critic": (score - 1.0).pow(2).mean()}, {}

    return loss_fn


def _two_role_run(
    mesh: Any, *, bound: bool, kind: str, k: int, b: int, every: int, steps: int
) -> tuple[TensorDict, list[TensorDict], list[nn.Module]]:
    from purestep.distributed import fsdp

    student, critic = _mlp(0), _mlp(1, d_in=2, d_out=1)
    opt = {"student": optim.adam(1e-2), "critic": optim.sgd(0.1, momentum=0.9)}
    roles: dict[str, Any] = {"student": student, "critic": critic}
    if bound:
        roles = {r: fsdp.bind(m, mesh=mesh) for r, m in roles.items()}
    state = ps.init_state(roles, opt, seed=3)
    grad_fn = ps.accumulate(ps.value_and_grad(_two_bound_losses(student, critic, kind)), k)
    step = ps.train_step(grad_fn, opt, every={"critic": every}, donate=bound)
    metrics = []
    for s in range(steps):
        state, m = step(state, _batch(10 + s, b))
        metrics.append(m)
        if bound:
            stale = [n for n, p in student.named_parameters() if p.grad is not None]
            stale += [n for n, p in critic.named_parameters() if p.grad is not None]
            assert not stale, f"step {s}: bound params kept a .grad after the step: {stale}"
    if bound:
        state = fsdp.gather(state)
    return state, metrics, [student, critic]


def test_bound_roles_on_one_rank_train_exactly_like_functional_roles() -> None:
    """A state bound to FSDP2 modules (one rank) trains like the functional state.

    Over one loss for both roles and one loss per role, accumulation over ``k``
    microbatches of uneven size, and a critic updated every other step (idle on the
    others): params, optimizer state, counters and metrics equal the functional run's,
    and no bound param keeps a ``.grad`` after a step.
    """
    from _optim import one_rank_mesh

    with one_rank_mesh() as mesh:

        @FAST
        @given(
            kind=st.sampled_from(["one", "per_role"]),
            k=st.integers(1, 3),
            b=st.integers(3, 7),
            every=st.integers(1, 2),
        )
        def check(kind: str, k: int, b: int, every: int) -> None:
            k = min(k, b)
            run = {"kind": kind, "k": k, "b": b, "every": every, "steps": 3}
            want, want_m, _ = _two_role_run(mesh, bound=False, **run)
            got, got_m, _ = _two_role_run(mesh, bound=True, **run)
            testing.assert_trees_close(got, want, rtol=1e-5, atol=1e-6, what="state")
            for s, (g, w) in enumerate(zip(got_m, want_m, strict=True)):
                testing.assert_trees_close(g, w, rtol=1e-5, atol=1e-6, what=f"metrics {s}")

        check()


def test_a_bound_roles_loss_reaching_another_bound_role_with_its_own_loss_is_refused() -> None:
    """One backward() serves all bound roles, so a per-role loss that reaches another bound
    role's params (the critic scoring the student's output without detach) would add to that
    role's gradient: the step refuses it, naming both roles, and leaves the state untouched."""
    from _optim import one_rank_mesh
    from purestep.distributed import fsdp

    with one_rank_mesh() as mesh:
        student, critic = _mlp(0), _mlp(1, d_in=2, d_out=1)
        opt = {"student": optim.sgd(0.1), "critic": optim.sgd(0.1)}
        state = ps.init_state(
            {"student": fsdp.bind(student, mesh=mesh), "critic": fsdp.bind(critic, mesh=mesh)},
            opt,
            seed=0,
        )
        before = tree.clone(fsdp.gather(state["params"]))
        loss_fn = _two_bound_losses(student, critic, "per_role", detach=False)
        step = ps.train_step(ps.value_and_grad(loss_fn), opt, donate=True)
        with pytest.raises(ValueError, match="reaches the params of bound role") as info:
            step(state, _batch(0, 4))
        assert str(info.value) == (
            "the loss of bound role 'critic' reaches the params of bound role 'student', "
            "which has a loss of its own: bound (FSDP) roles run one backward() over all "
            "their losses, so the gradient of 'student' would include the loss of 'critic'. "
            "Detach what the loss of 'critic' reads from the modules of 'student' (e.g. "
            "critic(student_out.detach())), or return one loss for both"
        ), str(info.value)
        testing.assert_trees_equal(fsdp.gather(state["params"]), before)


# --- state and batch checks: whole messages, caches, custom grad_fns (mutation survivors) ------


@pytest.mark.parametrize("leaf", ["weight", "bias"])
def test_a_donated_step_refuses_a_user_key_viewing_a_param_with_the_whole_message(
    leaf: str,
) -> None:
    """A user key that views a param's memory would change with every donated update: the
    donated step refuses it with the whole message (both paths, why, what to do) and the
    error's path is the written leaf listed first; the plain step trains it and leaves the
    user key as it was."""
    net = nn.Linear(2, 1)
    opt = {"m": optim.sgd(1e-2)}

    def loss_fn(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        return (ps.call(net, p["m"], b["x"]) ** 2).mean(), {}

    state = ps.init_state({"m": net}, opt, seed=0)
    state["extra"] = state["params", "m", leaf][0]
    before = state["extra"].clone()
    batch = {"x": torch.ones(4, 2)}
    with pytest.raises(errors.StateError) as info:
        ps.train_step(ps.value_and_grad(loss_fn), opt, donate=True)(state, batch)
    assert str(info.value) == (
        f"train_step: params.m.{leaf} shares memory with extra, so a donated step would update "
        "that memory twice. Give each role (and each leaf) its own tensors: init_state copies "
        "modules and keeps one leaf per tied parameter; pass a TensorDict as .clone() when "
        "another role (or another key) uses the same tensors. extra is not written by the "
        "step, so a donated update of the leaf it shares would change it too"
    )
    assert info.value.path == ("params", "m", leaf)
    new, _ = ps.train_step(ps.value_and_grad(loss_fn), opt)(state, batch)
    assert torch.equal(state["extra"], before) and torch.equal(new["extra"], before)


def test_an_opt_state_leaf_both_reshaped_and_out_of_order_is_named_as_the_mismatch_only() -> None:
    """When a per-param optimizer leaf has the wrong shape, the error names that leaf; the
    order of the leaves is not reported on top of it (the mismatch is the fault to fix)."""
    net = nn.Linear(2, 1)
    opt = {"m": optim.sgd(1e-2, momentum=0.9)}
    state = ps.init_state({"m": net}, opt, seed=0)
    state["opt_state", "m", "momentum_buffer"] = TensorDict(
        {"bias": torch.zeros(1), "weight": torch.zeros(2, 1)}, []
    )
    with pytest.raises(errors.StateError) as info:
        ps.step.check_state(state, opt, who="train_step")
    assert str(info.value) == (
        "train_step: opt_state.m does not fit params.m (optimizer sgd): "
        "opt_state.m.momentum_buffer.weight is a torch.float32 tensor of shape (2, 1), "
        "expected a torch.float32 tensor of shape (1, 2) for params.m.weight. params and "
        "opt_state must describe the same parameters: change them together, or rebuild the "
        "state with init_state"
    )
    assert info.value.path == ("opt_state", "m", "momentum_buffer", "weight")


class _RacingCache(dict[int, int]):
    """A cache another thread changes while the oldest entry is dropped: ``how`` says how."""

    def __init__(self, how: str, size: int = 2) -> None:
        super().__init__({i: i for i in range(1, size + 1)})
        self.how = how

    def __iter__(self) -> Any:
        if self.how == "emptied":  # another thread removed every entry after the size check
            return iter(())
        if self.how == "resized":  # ... or resized the dict while it is iterated
            raise RuntimeError("dictionary changed size during iteration")
        return super().__iter__()

    def __delitem__(self, key: int) -> None:
        if self.how == "deleted":  # ... or dropped the same oldest entry first
            raise KeyError(key)
        super().__delitem__(key)


@pytest.mark.parametrize("how", ["emptied", "resized", "deleted"])
def test_dropping_the_oldest_check_cache_entry_survives_a_concurrent_change(how: str) -> None:
    """The state-check caches are shared by threads (a data-parallel trainer per thread):
    evicting their oldest entry while another thread empties, resizes or evicts the same
    entry is not an error (the entry is gone either way)."""
    from purestep.step import _validate

    cache = _RacingCache(how)
    _validate._drop_oldest(cache)
    cache.how = "none"
    assert list(cache) == [1, 2]
    _validate._drop_oldest(cache)
    assert list(cache) == [2]


class _Node:
    """A weakly referenceable node, standing for a (params, opt_state) subtree."""


def test_remembering_a_known_pair_again_evicts_nothing_from_the_full_check_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Registering a pair that is already registered (the same two nodes and tag) is a no-op:
    with the check cache full it does not drop the oldest entry to make room, so every pair
    stays known and the cache stays at its bound."""
    from purestep.step import _validate

    monkeypatch.setattr(_validate, "_CHECKED", {})
    tag = "ema"
    pairs = [(_Node(), _Node()) for _ in range(_validate._CACHE_SIZE)]
    for a, b in pairs:
        _validate._remember(a, b, tag)
    for a, b in (pairs[-1], pairs[0], pairs[len(pairs) // 2]):
        _validate._remember(a, b, tag)
    assert len(_validate._CHECKED) == _validate._CACHE_SIZE
    assert all(_validate._known(a, b, tag) for a, b in pairs)


@pytest.mark.parametrize("dead", ["first", "second", "both"])
def test_a_check_cache_entry_left_by_a_reused_id_is_replaced_when_the_pair_is_registered(
    dead: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check cache is keyed by ids, which a new object may reuse after the old one dies:
    an entry whose key matches but whose weak reference(s) point at dead objects does not
    make a new pair count as registered, and registering the new pair replaces it."""
    from purestep.step import _validate

    tag = "ema"
    a, b = _Node(), _Node()
    gone = _Node()
    ref_gone = weakref.ref(gone)
    del gone
    assert ref_gone() is None
    ref_a = ref_gone if dead in ("first", "both") else weakref.ref(a)
    ref_b = ref_gone if dead in ("second", "both") else weakref.ref(b)
    monkeypatch.setattr(_validate, "_CHECKED", {(id(a), id(b), id(tag)): (ref_a, ref_b, tag)})
    assert not _validate._known(a, b, tag)
    _validate._remember(a, b, tag)
    assert _validate._known(a, b, tag)
    assert len(_validate._CHECKED) == 1


def test_a_pair_without_weak_references_is_checked_every_time_not_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Registering nodes of a type without weak references (the cache could not tell when
    they die) is not an error: nothing is kept, so the pair is not known and is checked in
    full every time."""
    from purestep.step import _validate

    monkeypatch.setattr(_validate, "_CHECKED", {})
    a, b = object(), _Node()
    _validate._remember(a, b, "ema")
    _validate._remember(b, a, "ema")
    assert _validate._CHECKED == {}
    assert not _validate._known(a, b, "ema") and not _validate._known(b, a, "ema")


def _linear_sgd_setup() -> tuple[nn.Module, dict[str, optim.Transform], Any]:
    net = _mlp(0)
    opt = {"m": optim.sgd(0.1, momentum=0.9)}

    def loss_fn(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        return ((ps.call(net, p["m"], b["x"]) - b["y"]) ** 2).mean(), {}

    return net, opt, loss_fn


def test_donated_apply_gradients_checks_sharing_once_per_structure() -> None:
    """apply_gradients(donate=True) registers its output as checked for donation: the next
    donated call on it re-checks no (params, opt_state) pair; the first call checks in full.
    The results equal torch.optim.SGD's on the same gradients."""
    from purestep.step import _validate

    net, opt, loss_fn = _linear_sgd_setup()
    ref = _mlp(0)
    torch_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    state = ps.init_state({"m": net}, opt, seed=0)
    misses: list[object] = []
    known = _validate._known

    def spy(a: object, b: object, tag: object) -> bool:
        hit: bool = known(a, b, tag)
        if not hit:
            misses.append(tag)
        return hit

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_validate, "_known", spy)
        for i in range(3):
            b = _batch(i, 4)
            grads, _ = ps.value_and_grad(loss_fn)(state["params"], b, rng.key(0))
            misses.clear()
            state = ps.apply_gradients(state, grads, opt, donate=True)
            assert bool(misses) == (i == 0), (i, misses)
            torch_opt.zero_grad()
            ((ref(b["x"]) - b["y"]) ** 2).mean().backward()
            torch_opt.step()
    testing.assert_trees_close(state["params", "m"], ps.params_of("m", ref), rtol=1e-6, atol=1e-7)


def test_a_donated_step_on_its_own_output_rechecks_only_the_top_level_leaves() -> None:
    """The donated sharing check walks every leaf of a new state, and only the top-level
    leaves (step, rng, user tensors) of a state a donated step returned (its subtrees were
    built from checked ones)."""
    from purestep.step import _validate

    net, opt, loss_fn = _linear_sgd_setup()
    step = ps.train_step(ps.value_and_grad(loss_fn), opt, donate=True)
    state = ps.init_state({"m": net}, opt, seed=0)
    walked: list[list[tuple[str, ...]]] = []
    real = _validate.shared_memory

    def spy(items: Any) -> Any:
        items = list(items)
        walked.append([path for path, _ in items])
        return real(items)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_validate, "shared_memory", spy)
        for i in range(3):
            walked.clear()
            state, _ = step(state, _batch(i, 4))
            assert len(walked) == 1, walked
            if i == 0:
                assert ("params", "m", "0", "weight") in walked[0]
            else:
                assert sorted(walked[0]) == [("rng",), ("step",)], walked


class _SlotsGradFn:
    """A grad_fn object without weak references (``__slots__``), taking only ``roles=``."""

    __slots__ = ("gf",)

    def __init__(self, gf: ps.step.GradFn) -> None:
        self.gf = gf

    def __call__(
        self, params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor, *, roles: Any
    ) -> tuple[TensorDict, TensorDict]:
        return self.gf(params, batch, key, roles=roles)


class _UnreadableGradFn(_SlotsGradFn):
    """A grad_fn whose signature cannot be read: it is called with the step's arguments only."""

    __slots__ = ("__weakref__",)
    __signature__ = "not a signature"


def _custom_grad_fn(kind: str, gf: ps.step.GradFn) -> Any:
    if kind == "slots":
        return _SlotsGradFn(gf)
    if kind == "unreadable":
        return _UnreadableGradFn(gf)
    if kind == "kwargs":

        def with_kwargs(
            params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor, **kw: Any
        ) -> Any:
            return gf(params, batch, key, **kw)

        return with_kwargs

    def roles_only(
        params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor, *, roles: Any
    ) -> Any:
        return gf(params, batch, key, roles=roles)

    return roles_only


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("kind", ["roles_only", "slots", "unreadable", "kwargs"])
def test_a_custom_grad_fn_without_buffers_trains_like_the_imperative_loop(
    kind: str, donate: bool
) -> None:
    """On a state without buffers, a custom grad_fn that takes only ``roles=`` (a function, an
    object without weak references, one whose signature cannot be read) or ``**kwargs`` is
    called without ``buffers=``/``donate=`` where it cannot take them, and trains like
    torch's SGD loop, twice over (its signature is read once and kept)."""
    net, opt, loss_fn = _linear_sgd_setup()
    ref = _mlp(0)
    torch_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    fn = _custom_grad_fn(kind, ps.value_and_grad(loss_fn))
    for _ in range(2):
        step = ps.train_step(fn, opt, donate=donate)
        state = ps.init_state({"m": net}, opt, seed=0)
        for i in range(3):
            state, _ = step(state, _batch(i, 4))
    for i in range(3):
        b = _batch(i, 4)
        torch_opt.zero_grad()
        ((ref(b["x"]) - b["y"]) ** 2).mean().backward()
        torch_opt.step()
    testing.assert_trees_close(state["params", "m"], ps.params_of("m", ref), rtol=1e-6, atol=1e-7)


def _bn_setup() -> tuple[nn.Module, dict[str, optim.Transform], Any]:
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt = {"m": optim.sgd(0.1)}

    def loss_fn(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        return ((ps.call(net, p["m"], b["x"]) - b["y"]) ** 2).mean(), {}

    return net, opt, loss_fn


def test_a_custom_grad_fn_taking_kwargs_gets_the_buffers_and_updates_them_like_torch() -> None:
    """A grad_fn with ``**kwargs`` accepts ``buffers=``: a BatchNorm role's running stats
    and params after three steps equal torch's loop on the module itself."""
    import copy

    net, opt, loss_fn = _bn_setup()
    ref = copy.deepcopy(net)
    step = ps.train_step(_custom_grad_fn("kwargs", ps.value_and_grad(loss_fn)), opt)
    state = ps.init_state({"m": net}, opt, seed=0)
    torch_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(3):
        b = _batch(i, 4, d_in=3)
        state, _ = step(state, b)
        torch_opt.zero_grad()
        ((ref(b["x"]) - b["y"]) ** 2).mean().backward()
        torch_opt.step()
    testing.assert_trees_close(state["params", "m"], ps.params_of("m", ref), rtol=1e-6, atol=1e-7)
    testing.assert_trees_close(state["buffers", "m"], ps.buffers_of("m", ref), rtol=1e-6, atol=1e-7)


def test_a_bound_roles_buffers_are_the_modules_own_updated_like_the_functional_run() -> None:
    """A role bound to an FSDP2 module (one rank) with a BatchNorm: the step's forward runs
    the module as it is, so the state's buffers after each step are the module's own buffer
    tensors, holding running stats equal to the functional run's (not copies left at the
    values before the step)."""
    import copy

    from _optim import one_rank_mesh
    from purestep.distributed import fsdp

    net, opt, _ = _bn_setup()
    ref = copy.deepcopy(net)

    def loss_of(mod: nn.Module) -> Any:
        def loss_fn(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
            return ((ps.call(mod, p["m"], b["x"]) - b["y"]) ** 2).mean(), {}

        return loss_fn

    with one_rank_mesh() as mesh:
        bound = ps.init_state({"m": fsdp.bind(net, mesh=mesh)}, opt, seed=0)
        plain = ps.init_state({"m": ref}, opt, seed=0)
        bound_step = ps.train_step(ps.value_and_grad(loss_of(net)), opt, donate=True)
        plain_step = ps.train_step(ps.value_and_grad(loss_of(ref)), opt)
        for i in range(3):
            b = _batch(i, 4, d_in=3)
            bound, _ = bound_step(bound, b)
            plain, _ = plain_step(plain, b)
            own = dict(net.named_buffers())
            assert all(bound["buffers", "m", *k.split(".")] is t for k, t in own.items()), i
            testing.assert_trees_close(
                bound["buffers", "m"], plain["buffers", "m"], rtol=1e-6, atol=1e-7, what=str(i)
            )
        assert int(bound["buffers", "m", "1", "num_batches_tracked"]) == 3


@pytest.mark.parametrize("kind", ["roles_only", "slots", "unreadable"])
def test_a_custom_grad_fn_without_buffers_on_a_state_with_buffers_is_refused(kind: str) -> None:
    """A state with buffers needs a grad_fn that takes ``buffers=``: one that cannot is
    refused with the whole message, naming the roles with buffers."""
    net, opt, loss_fn = _bn_setup()
    step = ps.train_step(_custom_grad_fn(kind, ps.value_and_grad(loss_fn)), opt)
    state = ps.init_state({"m": net}, opt, seed=0)
    with pytest.raises(TypeError) as info:
        step(state, _batch(0, 4, d_in=3))
    assert str(info.value) == (
        "train_step: the state has buffers for roles ['m'], but grad_fn does not accept "
        "buffers=; build it with purestep.value_and_grad (and accumulate), or give a custom "
        "grad_fn the keyword arguments buffers= and donate="
    )


def test_a_custom_grad_fns_signature_is_read_once_per_function() -> None:
    """train_step reads which keywords a custom grad_fn takes (``buffers=``, ``donate=``) from
    its signature once per function object, not on every step."""
    import inspect

    net, opt, loss_fn = _linear_sgd_setup()
    gf = ps.value_and_grad(loss_fn)

    def grad_fn(
        params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor, *, roles: Any
    ) -> Any:
        return gf(params, batch, key, roles=roles)

    reads: list[object] = []
    real = inspect.signature

    def spy(fn: Any, *args: Any, **kwargs: Any) -> inspect.Signature:
        if fn is grad_fn:
            reads.append(fn)
        return real(fn, *args, **kwargs)

    step = ps.train_step(grad_fn, opt, donate=True)
    state = ps.init_state({"m": net}, opt, seed=0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(inspect, "signature", spy)
        for i in range(3):
            state, _ = step(state, _batch(i, 4))
    assert len(reads) == 1, reads


def test_batch_errors_without_tensors_or_batch_dimension_have_whole_messages() -> None:
    """A batch with no tensors, and a TensorDict without a batch dimension asked for its
    size, are refused with the whole message."""
    with pytest.raises(errors.BatchError) as info:
        ps.step.as_batch({"nested": TensorDict({}, [])})
    assert str(info.value) == "batch is empty: it has no tensors"
    whole = "batch has no batch dimension; build it with batch_size=[B]"
    with pytest.raises(ValueError, match=re.escape(whole) + "$"):
        ps.step.batch_size(TensorDict({"x": torch.zeros(3)}, []))


def test_with_index_puts_the_index_on_the_batchs_device() -> None:
    """The index with_index adds lives on the device of the batch's tensors (here ``meta``,
    not the default device), as int64 ids."""
    batch = TensorDict({"x": torch.empty(3, 2, device="meta")}, [3])
    index = ps.step.with_index(batch)["index"]
    assert index.device.type == "meta" and index.dtype == torch.int64
    assert tuple(index.shape) == (3,)


# --- value_and_grad: metric forms, losses, leaves (mutation survivors, sixth run) --------------


def _scaled_sum_loss(
    metrics: Any,
) -> Callable[[TensorDictBase, TensorDictBase, torch.Tensor], Any]:
    def loss_fn(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        return (p["m", "w"] * b["x"]).sum(), metrics

    return loss_fn


@pytest.mark.parametrize("form", ["none", "empty dict", "empty td", "dict", "td"])
def test_every_metrics_form_gives_the_detached_values_plus_the_loss(form: str) -> None:
    """loss_fn may return its metrics as None, {}, an empty TensorDict, a dict of numbers,
    tensors and nested dicts, or a TensorDict: each gives a TensorDict of the same values,
    detached, plus the scalar loss under "loss"."""
    w = torch.tensor([1.0, -2.0])
    x = torch.tensor([[3.0, 0.5], [1.0, 4.0]])
    params = TensorDict({"m": {"w": w}}, [])
    leaf = params["m", "w"].clone().requires_grad_(True).sum()
    values: dict[str, Any] = {"acc": 0.5, "w_sum": leaf, "parts": {"a": torch.tensor(1.5)}}
    metrics: Any = {
        "none": None,
        "empty dict": {},
        "empty td": TensorDict({}, []),
        "dict": values,
        "td": TensorDict({**values, "acc": torch.tensor(0.5)}, []),
    }[form]
    _, got = ps.value_and_grad(_scaled_sum_loss(metrics))(
        params, TensorDict({"x": x}, [2]), rng.key(0)
    )
    want = {"loss": (w * x).sum()}
    if form in ("dict", "td"):
        want |= {"acc": torch.tensor(0.5), "w_sum": w.sum(), "parts.a": torch.tensor(1.5)}
    flat = got.flatten_keys(".")
    assert sorted(flat.keys()) == sorted(want), list(flat.keys())
    for k, v in want.items():
        torch.testing.assert_close(flat[k], v, rtol=0, atol=0)
        assert not flat[k].requires_grad, k


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (
            lambda loss: (loss, [1.0]),
            "loss_fn returned metrics of type list; expected a mapping or TensorDict of "
            "scalars, or None",
        ),
        (
            lambda loss: (loss, {}, {}),
            "loss_fn must return (loss, metrics), got a tuple of 3; return `loss, {}` when "
            "there are no metrics",
        ),
        (
            lambda loss: [loss, {}],
            "loss_fn must return (loss, metrics), got a list; return `loss, {}` when there are "
            "no metrics",
        ),
        (
            lambda loss: ([loss], {}),
            "loss_fn returned a loss of type list; expected a scalar tensor or a mapping "
            "{role: scalar tensor}",
        ),
        (lambda loss: ({"m": 1.0}, {}), "loss for role 'm' must be a scalar tensor; got float"),
        (
            lambda loss: ({"m": torch.ones(2)}, {}),
            "loss for role 'm' must be a scalar tensor; got (2,)",
        ),
    ],
    ids=["metrics_list", "three_tuple", "list", "loss_list", "role_loss_float", "role_loss_2"],
)
def test_a_loss_fn_returning_the_wrong_shape_gets_the_whole_message(
    returned: Callable[[torch.Tensor], Any], message: str
) -> None:
    """What loss_fn returned is named in the error: metrics or a loss of another type, a tuple
    of another length (with that length) or another container, a role's loss that is not a
    scalar tensor (its type or shape), and the fix."""
    params = TensorDict({"m": {"w": torch.ones(2)}}, [])
    grad_fn = ps.value_and_grad(lambda p, b, k: returned((p["m", "w"] * 2.0).sum()))
    # a loss of the wrong kind is a TypeError, a role's loss of the wrong value a ValueError
    with pytest.raises(ValueError if message.startswith("loss for role") else TypeError) as info:
        grad_fn(params, TensorDict({}, []), rng.key(0))
    assert str(info.value) == message


def test_per_role_losses_are_reported_detached_under_role_loss() -> None:
    """With a loss per role, metrics hold each role's own scalar loss under (role, "loss"),
    detached, also for a role the call does not differentiate."""
    params = TensorDict({"a": {"w": torch.tensor([1.0, 2.0])}, "b": {"w": torch.tensor(3.0)}}, [])

    def loss_fn(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        return {"a": (p["a", "w"] ** 2).sum(), "b": p["b", "w"] * 5.0}, {}

    for roles in (None, ["a"]):
        grads, metrics = ps.value_and_grad(loss_fn)(
            params, TensorDict({}, []), rng.key(0), roles=roles
        )
        assert sorted(metrics.keys(include_nested=True, leaves_only=True)) == [
            ("a", "loss"),
            ("b", "loss"),
        ]
        torch.testing.assert_close(metrics["a", "loss"], torch.tensor(5.0), rtol=0, atol=0)
        torch.testing.assert_close(metrics["b", "loss"], torch.tensor(15.0), rtol=0, atol=0)
        assert not metrics["a", "loss"].requires_grad and not metrics["b", "loss"].requires_grad
        assert list(grads.keys()) == (["a", "b"] if roles is None else ["a"])


def test_a_forward_writing_its_weight_on_every_call_never_changes_the_input_params() -> None:
    """nn.Embedding(max_norm=...) renormalises the rows it reads, in place, on every call. With
    donate=False the input params stay as given on the first call (learning) and on every call
    after it (the written param is computed on a copy); the new values land in buffers."""
    torch.manual_seed(0)
    emb = nn.Embedding(4, 3, max_norm=0.5)
    with torch.no_grad():
        emb.weight.mul_(4.0)
    params = TensorDict({"e": ps.params_of("e", emb)}, [])
    before = params.clone()
    ids = torch.tensor([0, 2])

    def loss_fn(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        return ps.call(emb, p["e"], b["ids"]).sum(), {}

    grad_fn = ps.value_and_grad(loss_fn)
    for _ in range(3):
        buffers = TensorDict({"e": {}}, [])
        grad_fn(params, TensorDict({"ids": ids}, [2]), rng.key(0), buffers=buffers)
        testing.assert_trees_equal(params, before, what="params after a pure call")
        new = buffers["e", "weight"]
        torch.testing.assert_close(new[ids].norm(dim=1), torch.full((2,), 0.5))
        torch.testing.assert_close(new[[1, 3]], before["e", "weight"][[1, 3]], rtol=0, atol=0)


def test_a_write_into_a_param_not_learned_as_written_raises_naming_it() -> None:
    """The first pure call learns that the forward writes ``a``; from then on only ``a`` runs
    on a copy. Later writes into ``b`` and ``c`` (shared with the input) raise, naming both
    and the two ways out, instead of being lost."""
    net = WritesLater(later=3)
    params = TensorDict({"m": ps.params_of("m", net)}, [])
    grad_fn = ps.value_and_grad(lambda p, b, k: (ps.call(net, p["m"], b["x"]), {}))
    batch = TensorDict({"x": torch.ones(3)}, [])
    for _ in range(2):
        grad_fn(params, batch, rng.key(0), buffers=TensorDict({"m": {}}, []))
    with pytest.raises(RuntimeError) as info:
        grad_fn(params, batch, rng.key(0), buffers=TensorDict({"m": {}}, []))
    assert str(info.value) == (
        "the forward wrote in place into 'm.b', 'm.c' of the input state although the step "
        "does not donate it (donate=False), so the input has been modified. The module writes "
        "into its weights only on some calls; build the step with donate=True, or keep such "
        "writes out of the forward"
    ), str(info.value)


def test_a_forward_writing_its_weights_without_buffers_to_receive_them_raises_naming_them() -> None:
    """A pure grad_fn call whose forward writes weights in place (here three, under no_grad)
    has nowhere to put the new values without ``buffers=``: it raises naming every weight
    written and both ways out, and the caller's params are unchanged."""
    net = WritesLater(later=1)
    params = TensorDict({"m": ps.params_of("m", net)}, [])
    before = params.clone()
    grad_fn = ps.value_and_grad(lambda p, b, k: (ps.call(net, p["m"], b["x"]), {}))
    with pytest.raises(RuntimeError) as info:
        grad_fn(params, TensorDict({"x": torch.ones(3)}, []), rng.key(0))
    assert str(info.value) == (
        "the forward writes in place into 'm.a', 'm.b', 'm.c' (e.g. nn.Embedding(max_norm=...)); "
        "pass buffers= (a TensorDict that receives the new values) to grad_fn, or use "
        "purestep.train_step, which hands them to the optimizer"
    ), str(info.value)
    testing.assert_trees_equal(params, before, what="params after the refused call")


class _Counting(nn.Module):
    """A linear layer counting its calls in a buffer it reassigns (not updates in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n = self.n + 1
        out: torch.Tensor = self.lin(x)
        return out


def test_buffers_of_a_role_without_params_are_kept_and_later_roles_still_collected() -> None:
    """``value_and_grad(..., buffers=)`` with a buffer role the params lack, named first: its
    buffers are left as given, and the buffers the roles after it reassign in the forward are
    still collected (as torch's own forward reassigns them)."""
    net = _Counting()
    params = TensorDict({"m": ps.params_of("m", net)}, [])
    ghost = torch.arange(3.0)
    buffers = TensorDict({"ghost": {"x": ghost.clone()}, "m": {"n": torch.zeros(())}}, [])
    assert list(buffers.keys()) == ["ghost", "m"]
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))

    def loss_fn(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        return ps.call(net, p["m"], b["x"]).square().mean(), {}

    grad_fn = ps.value_and_grad(loss_fn)
    for calls in (1, 2):
        grad_fn(params, TensorDict({"x": x}, [5]), rng.key(0), buffers=buffers)
        assert float(buffers["m", "n"]) == calls
    assert torch.equal(buffers["ghost", "x"], ghost)
    assert float(net.n) == 0.0, "the module keeps its own buffer"
