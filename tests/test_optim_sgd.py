"""SGD specifics (the shared checks are in test_optim_table.py): half precision against
float64 maths (torch's fused SGD bug), MultiStepLR, state layout."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from _optim import as_tree, make_data
from purestep import optim, tree
from purestep.optim import schedules

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
