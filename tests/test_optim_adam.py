"""Adam / AdamW specifics (the shared checks are in test_optim_table.py): state layout,
mixed-dtype grouping, half precision against float64 maths, stride-0 grads of fused size."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from tensordict import TensorDict

from _optim import as_tree, run_ours, run_torch
from _optim_rows import adam_state
from purestep import optim, tree
from purestep.optim import schedules


def test_state_layout_and_dtypes() -> None:
    """init: count int64 0-dim CPU = 0, lr float64 = lr(0), moments zero in the params' dtype,
    a float32 0-dim step count per parameter (torch.optim's per-parameter ``state["step"]``)."""
    params = as_tree([torch.ones(2, dtype=torch.bfloat16), torch.ones(3, dtype=torch.float64)])
    state = optim.adam(lr=schedules.constant(0.5), amsgrad=True).init(params)
    assert sorted(state.keys()) == ["count", "lr", "mu", "nu", "nu_max", "steps"]
    for s in tree.leaves(state["steps"]):
        assert s.dtype == torch.float32 and s.shape == () and float(s) == 0.0
    assert state["count"].dtype == torch.int64 and state["count"].shape == ()
    assert state["lr"].dtype == torch.float64 and float(state["lr"]) == 0.5
    for key in ("mu", "nu", "nu_max"):
        for m, p in zip(tree.leaves(state[key]), tree.leaves(params), strict=True):
            assert m.dtype == p.dtype and m.shape == p.shape and not m.any()


def test_mixed_dtypes_are_grouped_like_torch_fused() -> None:
    """A tree mixing fp32, bf16 and fp64 leaves steps each group as torch's fused AdamW does."""
    dtypes = [torch.float32, torch.bfloat16, torch.float64, torch.float32]
    gen = torch.Generator().manual_seed(4)
    init = [torch.randn(3, generator=gen).to(dt) for dt in dtypes]
    grads = [[torch.randn(3, generator=gen).to(dt) for dt in dtypes] for _ in range(10)]
    hp = {"lr": 0.01, "weight_decay": 0.1}
    ref_p, ref_s = run_torch(lambda ps, _: [torch.optim.AdamW(ps, **hp, fused=True)], init, grads)
    params, state = run_ours(optim.adamw(**hp), init, grads, donate=True)
    for i, (p, r) in enumerate(zip(tree.leaves(params), ref_p, strict=True)):
        torch.testing.assert_close(p, r)
        for key, m in adam_state(ref_s[i]).items():
            torch.testing.assert_close(tree.leaves(state[key])[i], m)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("make", [optim.adam, optim.adamw])
def test_half_precision_step_matches_float64_math_on_large_tensors(
    dtype: torch.dtype, make: Callable[..., optim.Transform]
) -> None:
    """One step on a tensor of many SIMD widths equals the float64 formula (half tolerance).

    An independent check of the fused kernel in bf16/fp16 (the table's bf16 parity
    test compares with torch's own fused kernel).
    """
    gen = torch.Generator().manual_seed(0)
    n = 1000
    p, g, m = (torch.randn(n, generator=gen).to(dtype) for _ in range(3))
    v = torch.rand(n, generator=gen).to(dtype)
    opt = make(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    params = TensorDict({"w": p}, [])
    state = opt.init(params)
    state["mu", "w"], state["nu", "w"], state["count"] = m.clone(), v.clone(), torch.tensor(2)
    state["steps", "w"] = torch.tensor(2.0)  # the parameter's own step count
    new_p, new_s = opt.step(TensorDict({"w": g}, []), state, params)
    P, G, M, V = (t.double() for t in (p, g, m, v))
    if make is optim.adamw:
        P = P * (1 - 0.01 * 0.1)
    else:
        G = G + 0.1 * P
    M, V = 0.9 * M + 0.1 * G, 0.99 * V + 0.01 * G * G
    P = P - 0.01 / (1 - 0.9**3) * M / ((V / (1 - 0.99**3)).sqrt() + 1e-8)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 2e-3, "atol": 2e-3}
    torch.testing.assert_close(new_s["mu", "w"].double(), M, **tol)
    torch.testing.assert_close(new_s["nu", "w"].double(), V, **tol)
    torch.testing.assert_close(new_p["w"].double(), P, **tol)


def test_a_stride_zero_gradient_of_a_million_elements_updates_every_element() -> None:
    """The case that crashed the fused kernel (it read an expanded grad as 1e6 elements)."""
    n = 1 << 20
    opt = optim.adamw(lr=0.1)
    params = TensorDict({"w": torch.zeros(n)}, [])
    new, _ = opt.step(TensorDict({"w": torch.ones(()).expand(n)}, []), opt.init(params), params)
    ref, _ = opt.step(TensorDict({"w": torch.ones(n)}, []), opt.init(params), params)
    assert torch.equal(new["w"], ref["w"]) and bool((ref["w"] < -0.09).all())


def test_donated_equals_pure_bitwise_on_a_gapped_param() -> None:
    """Regression: the pure step copied a sliced (gapped) param with ``clone()``, which is
    contiguous, so the copy took the fused kernel and the donated original the foreach
    fallback, ~3e-8 apart; the copy now keeps the original's strides."""
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(2, 2, 2, 2, generator=gen)
    grads = [torch.randn(2, 2, 2, 2, generator=gen) for _ in range(2)]
    opt = optim.adamw(lr=0.05)

    def run(donate: bool) -> torch.Tensor:
        big = torch.zeros(2, 2, 2, 5)
        big[..., 1:3] = p0
        params = TensorDict({"w": big[..., 1:3]}, [])  # a view with gaps between rows
        state = opt.init(params)
        for g in grads:
            params, state = opt.step(TensorDict({"w": g.clone()}, []), state, params, donate=donate)
        return params["w"]

    assert torch.equal(run(True), run(False))
