"""SGD: parity with ``torch.optim.SGD``, donated == pure, fallback, update, schedules."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from purestep import optim, tree
from purestep.optim import _sgd, schedules

STEPS = 50

shapes_st = st.lists(st.lists(st.integers(0, 5), max_size=3).map(tuple), min_size=1, max_size=4)


@st.composite
def sgd_cases(draw: st.DrawFn) -> dict[str, Any]:
    nesterov = draw(st.booleans())
    momentum = draw(st.one_of(st.just(0.0), st.floats(0.0, 0.99)))
    dampening = draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0)))
    if nesterov:
        momentum, dampening = max(momentum, 0.1), 0.0
    return {
        "shapes": draw(shapes_st),
        "hp": {
            "lr": draw(st.floats(1e-4, 0.1)),
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": draw(st.one_of(st.just(0.0), st.floats(0.0, 0.1))),
            "nesterov": nesterov,
        },
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def as_tree(tensors: list[torch.Tensor]) -> TensorDict:
    return TensorDict({f"m{i}": {"w": t} for i, t in enumerate(tensors)}, batch_size=[])


def make_data(
    shapes: list[tuple[int, ...]], seed: int, dtype: torch.dtype, steps: int = STEPS
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(steps)]
    return init, grads


def run_torch(
    init: list[torch.Tensor], grads: list[list[torch.Tensor]], **kw: Any
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    ps = [torch.nn.Parameter(t.clone()) for t in init]
    opt = torch.optim.SGD(ps, **kw)
    for gs in grads:
        for p, g in zip(ps, gs, strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in ps], [opt.state[p].get("momentum_buffer") for p in ps]


def run_ours(
    opt: optim.Transform,
    init: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    *,
    donate: bool,
) -> tuple[TensorDict, TensorDict]:
    params = as_tree([t.clone() for t in init])
    state = opt.init(params)
    for gs in grads:
        params, state = opt.step(as_tree(gs), state, params, donate=donate)
    return params, state


def assert_matches(
    params: TensorDict,
    state: TensorDict,
    ref_params: list[torch.Tensor],
    ref_bufs: list[torch.Tensor | None],
    **tol: float,
) -> None:
    for p, r in zip(tree.leaves(params), ref_params, strict=True):
        torch.testing.assert_close(p, r, **tol)
    if "momentum_buffer" in state.keys():
        for b, r in zip(tree.leaves(state["momentum_buffer"]), ref_bufs, strict=True):
            assert r is not None
            torch.testing.assert_close(b, r, **tol)
    else:
        assert all(r is None for r in ref_bufs)


def assert_trees_equal(a: TensorDict, b: TensorDict) -> None:
    assert tree.paths(a) == tree.paths(b)
    for path, x, y in zip(tree.paths(a), tree.leaves(a), tree.leaves(b), strict=True):
        assert torch.equal(x, y), f"differs at {tree.format_path(path)}"


@settings(max_examples=20, deadline=None)
@given(case=sgd_cases())
def test_fp32_matches_torch_sgd_after_50_steps_on_both_paths(case: dict[str, Any]) -> None:
    """fp32: donated and pure paths match torch.optim.SGD (default, foreach, fused)."""
    init, grads = make_data(case["shapes"], case["seed"], torch.float32)
    opt = optim.sgd(**case["hp"])
    ours = [run_ours(opt, init, grads, donate=d) for d in (True, False)]
    for kind in ({}, {"foreach": True}, {"fused": True}):
        ref = run_torch(init, grads, **case["hp"], **kind)
        for params, state in ours:
            assert_matches(params, state, *ref)
    assert_matches(*ours[0], *ref, rtol=0, atol=0)  # same fused kernel: bitwise
    assert int(ours[0][1]["count"]) == STEPS


@settings(max_examples=10, deadline=None)
@given(case=sgd_cases())
def test_bf16_matches_torch_sgd_within_bf16_tolerance(case: dict[str, Any]) -> None:
    """bf16 params: both paths match torch.optim.SGD's default path within bf16 tolerances.

    On CPU, sgd does not use ``_fused_sgd_`` for bf16/fp16 (pytorch/pytorch#191763,
    see the next test) but its foreach fallback, whose op order is torch's; torch's
    default (per-tensor) path applies ``momentum`` at full precision as ours does,
    while CPU ``torch._foreach_mul_`` (foreach=True) first rounds it to bf16.
    """
    init, grads = make_data(case["shapes"], case["seed"], torch.bfloat16)
    ref = run_torch(init, grads, **case["hp"], foreach=False)
    for donate in (True, False):
        assert_matches(*run_ours(optim.sgd(**case["hp"]), init, grads, donate=donate), *ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_half_precision_step_matches_float64_math_on_large_tensors(
    dtype: torch.dtype, momentum: float
) -> None:
    """One step on tensors of many SIMD widths equals the float64 formula rounded once.

    Regression test: torch 2.13's CPU ``_fused_sgd_`` leaves whole vector blocks of
    fp16/bf16 tensors with >= 16 elements un-updated or corrupt (pytorch/pytorch#191763).
    """
    gen = torch.Generator().manual_seed(0)
    n = 1000
    p, g, b = (torch.randn(n, generator=gen).to(dtype) for _ in range(3))
    opt = optim.sgd(lr=0.1, momentum=momentum, dampening=0.2, weight_decay=0.1)
    params = TensorDict({"w": p}, [])
    state = opt.init(params)
    if momentum:
        state["momentum_buffer", "w"] = b.clone()
        state["count"] = torch.tensor(1)  # not the first step: buffer is used
        state["steps", "w"] = torch.tensor(1.0)  # (with dampening, counted per parameter)
    new_p, new_s = opt.step(TensorDict({"w": g}, []), state, params)
    d = g.double() + 0.1 * p.double()
    if momentum:
        buf = 0.9 * b.double() + 0.8 * d
        torch.testing.assert_close(new_s["momentum_buffer", "w"].double(), buf, **TOL[dtype])
        d = buf
    torch.testing.assert_close(new_p["w"].double(), p.double() - 0.1 * d, **TOL[dtype])


TOL = {torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}, torch.float16: {"rtol": 2e-3, "atol": 2e-3}}


@settings(max_examples=10, deadline=None)
@given(case=sgd_cases(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_donated_equals_pure_bitwise(case: dict[str, Any], dtype: torch.dtype) -> None:
    """step(donate=True) and step(donate=False) give bitwise equal params and state."""
    init, grads = make_data(case["shapes"], case["seed"], dtype, steps=5)
    opt = optim.sgd(**case["hp"])
    p1, s1 = run_ours(opt, init, grads, donate=True)
    p2, s2 = run_ours(opt, init, grads, donate=False)
    assert_trees_equal(p1, p2)
    assert_trees_equal(s1, s2)


@pytest.mark.parametrize(
    "hp",
    [
        {"lr": 0.05},
        {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
        {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
        {"lr": 0.05, "momentum": 0.9, "nesterov": True},
    ],
)
def test_foreach_fallback_matches_torch_foreach(
    monkeypatch: pytest.MonkeyPatch, hp: dict[str, Any]
) -> None:
    """Without fused kernels the foreach fallback matches torch (fp32: foreach and default; bf16: default)."""
    monkeypatch.setattr(_sgd, "fused_supported", lambda device, dtype, **kw: False)
    for dtype, kinds in (
        (torch.float32, ({"foreach": True}, {"foreach": False})),
        (torch.bfloat16, ({"foreach": False},)),
    ):
        init, grads = make_data([(4, 3), (7,), ()], 1, dtype)
        for kind in kinds:
            ref = run_torch(init, grads, **hp, **kind)
            for donate in (True, False):
                assert_matches(*run_ours(optim.sgd(**hp), init, grads, donate=donate), *ref)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_pure_paths_leave_inputs_bitwise_unchanged(momentum: float) -> None:
    """step(donate=False) and update() never write params, grads or state, nor alias them."""
    init, grads = make_data([(3, 4), (5,)], 0, torch.float32, steps=3)
    opt = optim.sgd(lr=0.1, momentum=momentum, weight_decay=0.1)
    params = as_tree(init)
    state = opt.init(params)
    for gs in grads[:2]:
        params, state = opt.step(as_tree(gs), state, params)
    g = as_tree(grads[2])
    before = [tree.clone(td) for td in (params, g, state)]
    outs = [*opt.step(g, state, params), *opt.update(g, state, params)]
    for td, ref in zip((params, g, state), before, strict=True):
        assert_trees_equal(td, ref)
    inputs = {t.data_ptr() for td in (params, g, state) for t in tree.leaves(td) if t.numel()}
    for out in outs:
        assert not inputs & {t.data_ptr() for t in tree.leaves(out) if t.numel()}


@settings(max_examples=15, deadline=None)
@given(case=sgd_cases())
def test_apply_updates_of_update_is_close_to_step(case: dict[str, Any]) -> None:
    """params + update(...) tracks step(...) over 50 steps (fp32), donated update too."""
    init, grads = make_data(case["shapes"], case["seed"], torch.float32)
    opt = optim.sgd(**case["hp"])
    p_step, s_step = run_ours(opt, init, grads, donate=False)
    for donate in (False, True):
        params = as_tree([t.clone() for t in init])
        state = opt.init(params)
        for gs in grads:
            upd, state = opt.update(as_tree(gs), state, params, donate=donate)
            params = optim.apply_updates(params, upd)
        for a, b in zip(tree.leaves(params), tree.leaves(p_step), strict=True):
            torch.testing.assert_close(a, b)
        for a, b in zip(tree.leaves(state), tree.leaves(s_step), strict=True):
            torch.testing.assert_close(a, b)


def test_lr_schedule_matches_torch_multisteplr() -> None:
    """sgd(lr=piecewise_constant) equals torch SGD + MultiStepLR, and current_lr follows it."""
    sched = schedules.piecewise_constant(0.1, {5: 0.5, 12: 0.5})
    init, grads = make_data([(5, 2), (3,)], 5, torch.float32, steps=20)
    ps = [torch.nn.Parameter(t.clone()) for t in init]
    topt = torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    ms = torch.optim.lr_scheduler.MultiStepLR(topt, milestones=[5, 12], gamma=0.5)
    opt = optim.sgd(lr=sched, momentum=0.9)
    params = as_tree([t.clone() for t in init])
    state = opt.init(params)
    for gs in grads:
        used = topt.param_groups[0]["lr"]
        for p, g in zip(ps, gs, strict=True):
            p.grad = g.clone()
        topt.step()
        ms.step()
        params, state = opt.step(as_tree(gs), state, params, donate=True)
        assert float(optim.current_lr(state)) == pytest.approx(used, rel=1e-12)  # type: ignore[arg-type]
    for a, b in zip(tree.leaves(params), ps, strict=True):
        torch.testing.assert_close(a, b.detach())


def test_state_layout() -> None:
    """Momentum buffer only when momentum != 0; count and lr as CPU scalars."""
    params = as_tree([torch.ones(2)])
    assert sorted(optim.sgd(lr=0.1).init(params).keys()) == ["count", "lr"]
    s = optim.sgd(lr=0.1, momentum=0.5).init(params)
    assert sorted(s.keys()) == ["count", "lr", "momentum_buffer"]
    assert s["count"].dtype == torch.int64 and s["lr"].dtype == torch.float64
