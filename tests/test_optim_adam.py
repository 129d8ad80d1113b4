"""Adam / AdamW specifics (the shared checks are in test_optim_table.py): state layout,
mixed-dtype grouping, half precision against float64 maths, stride-0 grads of fused size."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
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


def _unpacked(state: TensorDict) -> TensorDict:
    """``state`` with every step count in its own tensor (as after a checkpoint load)."""
    out = state.clone()  # every leaf its own copy
    assert all(s._base is None for s in tree.leaves(out["steps"]))
    return out


@settings(max_examples=25, deadline=None)
@given(
    donate=st.booleans(),
    masks=st.lists(
        st.lists(st.booleans(), min_size=4, max_size=4).filter(any), min_size=1, max_size=5
    ),
    unpack_at=st.integers(min_value=-1, max_value=4),
)
def test_step_counts_are_the_same_whether_they_share_one_buffer_or_not(
    donate: bool, masks: list[list[bool]], unpack_at: int
) -> None:
    """Per-parameter step counts kept as views of one buffer (init's layout; a donated step
    advances them with one ``add_``) give bitwise the same params, moments and counts as
    counts in separate tensors, for any pattern of params left without a gradient, with and
    without donation, and after the counts are split apart mid-run (a checkpoint load)."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(3, generator=gen) for _ in range(4)]
    opt = optim.adamw(lr=0.01, weight_decay=0.1)
    packed_p = as_tree([t.clone() for t in init])
    packed_s = opt.init(packed_p)
    steps0 = tree.leaves(packed_s["steps"])
    assert all(s._base is steps0[0]._base is not None for s in steps0)  # init packs them
    loose_p, loose_s = packed_p.clone(), _unpacked(packed_s)
    for i, mask in enumerate(masks):
        if i == unpack_at:
            packed_s = _unpacked(packed_s)
        drawn = [torch.randn(3, generator=gen) for _ in mask]
        grads = tree.unflatten(
            [(path, g) for path, g, m in zip(tree.paths(packed_p), drawn, mask, strict=True) if m]
        )
        packed_p, packed_s = opt.step(grads, packed_s, packed_p, donate=donate)
        loose_p, loose_s = opt.step(grads, loose_s, loose_p, donate=False)
    for a, b in zip(tree.leaves(packed_p), tree.leaves(loose_p), strict=True):
        assert torch.equal(a, b)
    for key in ("mu", "nu", "steps"):
        for a, b in zip(tree.leaves(packed_s[key]), tree.leaves(loose_s[key]), strict=True):
            assert torch.equal(a, b), key
    counts = [sum(m[j] for m in masks) for j in range(4)]
    assert [float(s) for s in tree.leaves(packed_s["steps"])] == counts


@pytest.mark.parametrize("how", ["replaced", "duplicated"])
def test_a_step_count_replaced_by_hand_is_still_counted(how: str) -> None:
    """A state whose step counts no longer are each element of one buffer exactly once (one
    replaced by a new tensor, or one set to another's view) is not advanced through the
    buffer: every count the state holds goes up by exactly one, in new tensors."""
    params = as_tree([torch.ones(2) for _ in range(3)])
    opt = optim.adam(lr=0.1)
    state = opt.init(params)
    steps = tree.leaves(state["steps"])
    key = tree.paths(state["steps"])[1]
    state["steps", *key] = torch.tensor(5.0) if how == "replaced" else steps[0]
    before = [float(s) for s in tree.leaves(state["steps"])]
    grads = as_tree([torch.ones(2) for _ in range(3)])
    _, new = opt.step(grads, state, params, donate=True)
    after = [float(s) for s in tree.leaves(new["steps"])]
    assert after == [b + 1 for b in before]
    if how == "duplicated":  # the shared tensor was not written through twice
        assert float(steps[0]) == 0.0
