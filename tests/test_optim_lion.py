"""Lion: against a per-tensor reference of the paper/optax formula; donated == pure; update."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from purestep import optim, tree
from purestep.optim import _kernels

STEPS = 50


@st.composite
def lion_cases(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "shapes": draw(
            st.lists(st.lists(st.integers(0, 5), max_size=3).map(tuple), min_size=1, max_size=4)
        ),
        "hp": {
            "lr": draw(st.floats(1e-4, 0.1)),
            "betas": (draw(st.floats(0.0, 0.99)), draw(st.floats(0.0, 0.999))),
            "weight_decay": draw(st.floats(0.0, 0.1)),
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


def reference(
    init: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Lion, one tensor at a time (Chen et al. 2023, Alg. 2; optax.lion).

    ``c = b1*m + (1-b1)*g`` is written as ``m.lerp(g, 1-b1)``, the same value,
    so a sign of a near-zero ``c`` cannot flip on rounding alone.
    """
    b1, b2 = betas
    ps = [t.clone() for t in init]
    ms = [torch.zeros_like(t) for t in init]
    for gs in grads:
        for i, g in enumerate(gs):
            c = ms[i].lerp(g, 1 - b1)
            ps[i] = ps[i] * (1 - lr * weight_decay) - lr * torch.sign(c)
            ms[i] = ms[i].lerp(g, 1 - b2)
    return ps, ms


def run_ours(
    opt: optim.Transform, init: list[torch.Tensor], grads: list[list[torch.Tensor]], donate: bool
) -> tuple[TensorDict, TensorDict]:
    params = as_tree([t.clone() for t in init])
    state = opt.init(params)
    for gs in grads:
        params, state = opt.step(as_tree(gs), state, params, donate=donate)
    return params, state


def assert_trees_equal(a: TensorDict, b: TensorDict) -> None:
    assert tree.paths(a) == tree.paths(b)
    for x, y in zip(tree.leaves(a), tree.leaves(b), strict=True):
        assert torch.equal(x, y)


@settings(max_examples=20, deadline=None)
@given(case=lion_cases(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_matches_reference_after_50_steps_on_both_paths(
    case: dict[str, Any], dtype: torch.dtype
) -> None:
    """Donated and pure Lion match the per-tensor reference (fp32 and bf16 tolerances)."""
    init, grads = make_data(case["shapes"], case["seed"], dtype)
    ref_p, ref_m = reference(init, grads, **case["hp"])
    opt = optim.lion(**case["hp"])
    for donate in (True, False):
        params, state = run_ours(opt, init, grads, donate)
        for a, b in zip(tree.leaves(params), ref_p, strict=True):
            torch.testing.assert_close(a, b)
        for a, b in zip(tree.leaves(state["mu"]), ref_m, strict=True):
            torch.testing.assert_close(a, b)
        assert int(state["count"]) == STEPS


@settings(max_examples=10, deadline=None)
@given(case=lion_cases())
def test_donated_equals_pure_and_update_is_close(case: dict[str, Any]) -> None:
    """step(donate=True) == step(donate=False) bitwise; params + update(...) is close to both."""
    init, grads = make_data(case["shapes"], case["seed"], torch.float32, steps=10)
    opt = optim.lion(**case["hp"])
    p1, s1 = run_ours(opt, init, grads, True)
    p2, s2 = run_ours(opt, init, grads, False)
    assert_trees_equal(p1, p2)
    assert_trees_equal(s1, s2)
    params = as_tree([t.clone() for t in init])
    state = opt.init(params)
    for gs in grads:
        upd, state = opt.update(as_tree(gs), state, params)
        params = optim.apply_updates(params, upd)
    for a, b in zip(tree.leaves(params), tree.leaves(p1), strict=True):
        torch.testing.assert_close(a, b)


def test_chunked_temporaries_do_not_change_results(monkeypatch: Any) -> None:
    """Bounding the sign temporary per chunk gives bitwise the same step."""
    init, grads = make_data([(4, 3), (7,), (9,)], 3, torch.float32, steps=4)
    opt = optim.lion(lr=0.01)
    whole = run_ours(opt, init, grads, True)
    monkeypatch.setattr(_kernels, "TEMP_CHUNK_ELEMENTS", 5)
    chunked = run_ours(opt, init, grads, True)
    assert_trees_equal(whole[0], chunked[0])
    assert_trees_equal(whole[1], chunked[1])


def test_pure_step_leaves_inputs_unchanged() -> None:
    """step(donate=False) and update() do not write params, grads or state."""
    init, grads = make_data([(3, 2)], 0, torch.float32, steps=2)
    opt = optim.lion(lr=0.1)
    params = as_tree(init)
    params, state = opt.step(as_tree(grads[0]), opt.init(params), params)
    g = as_tree(grads[1])
    before = [tree.clone(td) for td in (params, g, state)]
    opt.step(g, state, params)
    opt.update(g, state, params)
    for td, ref in zip((params, g, state), before, strict=True):
        assert_trees_equal(td, ref)
