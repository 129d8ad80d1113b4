"""train_step's less travelled paths: a donated forward that writes its weights, an optimizer
failing after another role was updated, the metrics each flag logs, the messages that name
the step."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, TensorDictBase
from torch import nn

import purestep as ps
from _tiny import WritesLater, without_donate
from purestep import errors, optim, testing

FAST = settings(max_examples=8, deadline=None)


def _x(i: int) -> torch.Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(i))


@FAST
@given(later=st.integers(1, 4), n=st.integers(1, 5))
def test_a_donated_step_whose_forward_writes_its_weights_on_some_calls_equals_the_loop(
    later: int, n: int
) -> None:
    """A forward that writes one weight every call and two more only from call ``later`` on:
    the donated train_step hands ``donate=True`` to value_and_grad, so the late write is
    allowed (not refused as a write into a caller's state), lands in the input's own param
    buffers (no copies), and the params equal the imperative loop's after ``n`` steps."""
    ref = WritesLater(later)
    torch_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(n):
        torch_opt.zero_grad()
        ref(_x(i)).backward()
        torch_opt.step()

    net = WritesLater(later)
    opt = {"m": optim.sgd(0.1)}
    step = ps.train_step(
        ps.value_and_grad(lambda p, b, k: (ps.call(net, p["m"], b["x"]), {})), opt, donate=True
    )
    state = step.prepare(ps.init_state({"m": net}, opt, seed=0))
    ptrs = {k: t.data_ptr() for k, t in state["params", "m"].items()}
    for i in range(n):
        state, _ = step(state, {"x": _x(i)})
    assert {k: t.data_ptr() for k, t in state["params", "m"].items()} == ptrs
    for name in ("a", "b", "c"):
        torch.testing.assert_close(
            state["params", "m", name], getattr(ref, name).detach(), rtol=1e-6, atol=1e-7
        )


def test_weights_a_forward_wrote_are_copied_into_a_donated_states_own_buffers() -> None:
    """Through a grad_fn without ``donate=`` the written weights come back beside the
    buffers; a donated step copies them into the input's param tensors (its buffers are
    reused), a step that does not donate leaves the input's params as they were."""
    for donate in (False, True):
        net = WritesLater(later=1)
        opt = {"m": optim.sgd(0.1)}
        gf = ps.value_and_grad(lambda p, b, k, net=net: (ps.call(net, p["m"], b["x"]), {}))
        step = ps.train_step(without_donate(gf), opt, donate=donate)
        state = step.prepare(ps.init_state({"m": net}, opt, seed=0))
        state["buffers"] = TensorDict({"m": {}}, [])
        before = testing.snapshot(state["params"])
        ptrs = {k: t.data_ptr() for k, t in state["params", "m"].items()}
        new, _ = step(state, {"x": _x(0)})
        reused = {k: t.data_ptr() for k, t in new["params", "m"].items()} == ptrs
        assert reused == donate, donate
        if not donate:
            testing.assert_trees_equal(state["params"], before, what="the input's params")
        assert not torch.equal(new["params", "m", "a"], before["m", "a"])


def _broken(message: str) -> optim.Transform:
    """sgd's state, and an update that raises (an optimizer failing at its role)."""

    def update(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(message)

    return optim.Transform(init_fn=optim.sgd(0.1).init_fn, update_fn=update, name="broken")


def _net(seed: int) -> nn.Module:
    net = nn.Linear(3, 2)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return net


@pytest.mark.parametrize("skip", [False, True], ids=["plain", "skip_nonfinite"])
@pytest.mark.parametrize("donate", [False, True], ids=["copy", "donate"])
def test_a_step_whose_second_optimizer_fails_raises_its_error_and_consumes_only_a_donated_input(
    donate: bool, skip: bool
) -> None:
    """Roles a (sgd) then b (an optimizer that raises): the optimizer's own error reaches the
    caller unchanged. A donated input had role a updated in place, so using it again raises
    DonatedStateError naming the failed step (also when skip_nonfinite's counters made the
    step work on a copy); an input that was not donated is unchanged and steps again."""
    nets = {"a": _net(0), "b": _net(1)}
    opts = {"a": optim.sgd(0.1), "b": _broken("broken update of role b")}

    def loss_fn(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        return sum((ps.call(nets[r], p[r], b["x"]) ** 2).mean() for r in "ab"), {}

    step: Any = ps.train_step(ps.value_and_grad(loss_fn), opts, donate=donate)
    if skip:
        step = ps.skip_nonfinite(step)
    state = ps.init_state(nets, opts, seed=0)
    before = testing.snapshot(state)
    batch = {"x": _x(0)}
    with pytest.raises(RuntimeError) as info:
        step(state, batch)
    assert str(info.value) == "broken update of role b"
    assert ps.step.is_donated(state) == donate
    if not donate:
        testing.assert_trees_equal(state, before, what="the input after the failed step")
        with pytest.raises(RuntimeError, match=r"^broken update of role b$"):
            step(state, batch)
        return
    with pytest.raises(errors.DonatedStateError) as used:
        step(state, batch)
    assert str(used.value).startswith(
        "train_step: this state was donated to a donated train_step that failed part-way at "
        "step 0 (donate=True)"
    ), str(used.value)


def _linear_step(**kw: Any) -> tuple[Any, TensorDict]:
    net = _net(0)
    opt = {"m": optim.adamw(1e-2)}

    def loss_fn(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        out = ps.call(net, p["m"], b["x"])
        return (out**2).mean() * b["scale"][0], {}

    skip = kw.pop("skip_nonfinite", False)
    step: Any = ps.train_step(ps.value_and_grad(loss_fn), opt, **kw)
    if skip:
        step = ps.skip_nonfinite(step)
    return step, step.prepare(ps.init_state({"m": net}, opt, seed=0))


@FAST
@given(grad_norm=st.booleans(), skip=st.booleans(), donate=st.booleans())
def test_the_metrics_hold_a_grad_norm_when_asked_or_computed_and_skipped_as_a_bool(
    grad_norm: bool, skip: bool, donate: bool
) -> None:
    """On an update, ``(role, "grad_norm")`` is logged exactly when ``grad_norm=True`` or
    skip_nonfinite (which computes the norms anyway), ``(role, "lr")`` always; a skipped
    step logs neither. With skip_nonfinite, ``"skipped"`` is a 0-dim bool tensor on finite and
    on skipped steps."""
    step, state = _linear_step(grad_norm=grad_norm, skip_nonfinite=skip, donate=donate)
    scales = [1.0, float("nan")] if skip else [1.0]
    for i, scale in enumerate(scales):
        state, metrics = step(state, {"x": _x(i), "scale": torch.full((4,), scale)})
        keys = set(metrics.keys(include_nested=True, leaves_only=True))
        finite = scale == 1.0
        assert (("m", "grad_norm") in keys) == ((grad_norm or skip) and finite), keys
        assert (("m", "lr") in keys) == finite, keys
        if skip:
            skipped = metrics["skipped"]
            assert skipped.dtype == torch.bool and skipped.shape == (), skipped
            assert bool(skipped) == (not finite)
        else:
            assert "skipped" not in keys


def test_a_donated_skipped_step_names_its_step_and_that_it_was_skipped() -> None:
    """Reusing the input of a donated step that skipped a NaN loss raises, naming the step
    number and '(skipped)'; after a finite step the message names the step alone."""
    step, state = _linear_step(skip_nonfinite=True, donate=True)
    for i, scale in enumerate([1.0, float("nan")]):
        entry = state
        state, _ = step(entry, {"x": _x(i), "scale": torch.full((4,), scale)})
        with pytest.raises(errors.DonatedStateError) as info:
            step(entry, {"x": _x(i), "scale": torch.ones(4)})
        tail = " (skipped)" if scale != 1.0 else ""
        assert str(info.value).startswith(
            f"train_step: this state was donated to a donated train_step at step {i}{tail} "
            "(donate=True)"
        ), str(info.value)


def test_a_param_replaced_after_its_check_fails_naming_train_step_and_the_key() -> None:
    """A donated step's output has its nodes registered as checked; a param replaced in place
    afterwards (of another shape) makes the forward fail. The step re-checks and raises the
    StateError that starts with 'train_step:' and names the key path."""
    step, state = _linear_step(donate=True)
    state, _ = step(state, {"x": _x(0), "scale": torch.ones(4)})
    state["params", "m", "bias"] = torch.zeros(3)
    with pytest.raises(errors.StateError) as info:
        step(state, {"x": _x(1), "scale": torch.ones(4)})
    assert str(info.value).startswith("train_step: "), str(info.value)
    assert "for params.m.bias" in str(info.value)
    assert info.value.path == ("opt_state", "m", "mu", "bias")


def test_remember_skips_a_state_without_params_or_without_opt_state() -> None:
    """``remember`` registers (params, opt_state) pairs; a state missing either has none and
    is left alone, without an error."""
    from purestep.step._validate import remember

    opts = {"m": optim.sgd(0.1, momentum=0.9)}
    state = ps.init_state({"m": _net(0)}, opts, seed=0)
    for missing in ("params", "opt_state"):
        remember(state.exclude(missing), opts)
    remember(state.exclude("params", "opt_state"), opts)
