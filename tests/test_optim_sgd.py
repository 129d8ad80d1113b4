"""SGD specifics (the shared checks are in test_optim_table.py): half precision against
float64 maths (torch's fused SGD bug), MultiStepLR, state layout."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from _optim import as_tree, make_data, masked_grads, run_ours_masked, run_torch_masked
from purestep import optim, tree
from purestep.optim import _sgd, schedules

TOL = {torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}, torch.float16: {"rtol": 2e-3, "atol": 2e-3}}


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


BOUNDARY_SHAPES = [(3, 2), (5,), (2, 2)]


@st.composite
def sgd_boundary_hparams(draw: st.DrawFn) -> dict[str, Any]:
    """SGD hyperparameters at and around the edges of their ranges (0, 1, above 1)."""
    momentum = draw(st.sampled_from([0.0, 0.5, 1.0, 1.25]))
    nesterov = draw(st.booleans()) and momentum > 0
    return {
        "lr": draw(st.sampled_from([0.0, 0.1, 1.0])),
        "momentum": momentum,
        "dampening": 0.0 if nesterov else draw(st.sampled_from([0.0, 0.25, 1.0])),
        "weight_decay": draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])),
        "nesterov": nesterov,
    }


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    hp=sgd_boundary_hparams(),
    path=st.sampled_from(["fused", "foreach", "bf16-foreach"]),
    donate=st.booleans(),
)
def test_matches_torch_sgd_at_boundary_hyperparameters_with_params_skipped(
    data: st.DataObject, hp: dict[str, Any], path: str, donate: bool
) -> None:
    """At the edges of every range (momentum, dampening and weight decay of 0 and 1, above 1;
    lr 0 and 1; Nesterov) and with params left without a gradient in some steps (a param's
    first update then starts its buffer late), params and momentum buffers equal torch.optim.SGD:
    bitwise its fused kind on the fused fp32 path when every param has a gradient, within fp32
    (bf16) tolerance its per-tensor kind on the fused and foreach paths."""
    dtype = torch.bfloat16 if path == "bf16-foreach" else torch.float32
    init, grads = masked_grads(data, BOUNDARY_SHAPES, dtype, steps=3)
    with pytest.MonkeyPatch.context() as mp:
        if path == "foreach":
            mp.setattr(_sgd, "fused_supported", lambda device, dtype, **kw: False)
        params, state = run_ours_masked(optim.sgd(**hp), init, grads, donate)
    kinds = [("default", {"foreach": False}, {})]
    if path == "fused" and all(g is not None for gs in grads for g in gs):
        kinds.append(("fused", {"fused": True}, {"rtol": 0.0, "atol": 0.0}))
    for kind, kw, tol in kinds:
        ref_p, ref_s = run_torch_masked(
            lambda ps, kw=kw: torch.optim.SGD(ps, **hp, **kw), init, grads
        )
        for i, (p, r) in enumerate(zip(tree.leaves(params), ref_p, strict=True)):
            torch.testing.assert_close(p, r, **tol, msg=f"torch {kind}, params {i}")
        if hp["momentum"] == 0:
            assert "momentum_buffer" not in state.keys()
            continue
        for i, s in enumerate(ref_s):
            ours = tree.leaves(state["momentum_buffer"])[i]
            theirs = s.get("momentum_buffer")
            if theirs is None:  # never had a gradient: the buffer is still zero
                assert not ours.any()
            else:
                torch.testing.assert_close(ours, theirs, **tol, msg=f"torch {kind}, buffer {i}")
    assert sorted(state.keys()) == sorted(
        ["count", "lr"]
        + (["momentum_buffer"] if hp["momentum"] else [])
        + (["steps"] if hp["momentum"] and hp["dampening"] else [])
    )
