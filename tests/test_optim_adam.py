"""Adam / AdamW: parity with ``torch.optim``, donated == pure, fallback, update, schedules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from purestep import optim, tree
from purestep.optim import _adam, _kernels, schedules

STEPS = 50

shapes_st = st.lists(st.lists(st.integers(0, 5), max_size=3).map(tuple), min_size=1, max_size=4)


@st.composite
def adam_cases(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "shapes": draw(shapes_st),
        "lr": draw(st.floats(1e-4, 0.1)),
        "betas": (draw(st.floats(0.0, 0.99)), draw(st.floats(0.0, 0.9999))),
        "eps": draw(st.floats(1e-10, 1e-3)),
        "weight_decay": draw(st.floats(0.0, 0.1)),
        "amsgrad": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def as_tree(tensors: list[torch.Tensor]) -> TensorDict:
    """Nested layout like a module's: ``{"m0": {"w": t0}, "m1": {"w": t1}, ...}``."""
    return TensorDict({f"m{i}": {"w": t} for i, t in enumerate(tensors)}, batch_size=[])


def make_data(
    shapes: list[tuple[int, ...]], seed: int, dtype: torch.dtype, steps: int = STEPS
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(steps)]
    return init, grads


def run_torch(
    cls: type[torch.optim.Optimizer],
    init: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    **kw: Any,
) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    ps = [torch.nn.Parameter(t.clone()) for t in init]
    opt = cls(ps, **kw)
    for gs in grads:
        for p, g in zip(ps, gs, strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in ps], [opt.state[p] for p in ps]


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


TORCH_KEYS = {"mu": "exp_avg", "nu": "exp_avg_sq", "nu_max": "max_exp_avg_sq"}


def assert_matches_torch(
    params: TensorDict,
    state: TensorDict,
    ref_params: list[torch.Tensor],
    ref_state: list[dict[str, torch.Tensor]],
    check: Callable[[torch.Tensor, torch.Tensor], None] = torch.testing.assert_close,
) -> None:
    for i, p in enumerate(tree.leaves(params)):
        check(p, ref_params[i])
    for ours, theirs in TORCH_KEYS.items():
        if ours in state.keys():
            for i, m in enumerate(tree.leaves(state[ours])):
                check(m, ref_state[i][theirs])


def assert_trees_equal(a: TensorDict, b: TensorDict) -> None:
    assert tree.paths(a) == tree.paths(b)
    for path, x, y in zip(tree.paths(a), tree.leaves(a), tree.leaves(b), strict=True):
        assert x.dtype == y.dtype, path
        assert torch.equal(x, y), f"differs at {tree.format_path(path)}"


def factory(decoupled: bool) -> tuple[Callable[..., optim.Transform], type[torch.optim.Optimizer]]:
    return (optim.adamw, torch.optim.AdamW) if decoupled else (optim.adam, torch.optim.Adam)


def hparams(case: dict[str, Any]) -> dict[str, Any]:
    return {k: case[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad")}


@settings(max_examples=20, deadline=None)
@given(case=adam_cases(), decoupled=st.booleans())
def test_fp32_matches_torch_after_50_steps_on_both_paths(
    case: dict[str, Any], decoupled: bool
) -> None:
    """fp32: donated and pure paths match torch.optim.Adam(W) (default, foreach, fused)."""
    make, cls = factory(decoupled)
    hp = hparams(case)
    init, grads = make_data(case["shapes"], case["seed"], torch.float32)
    opt = make(**hp)
    donated = run_ours(opt, init, grads, donate=True)
    pure = run_ours(opt, init, grads, donate=False)
    assert int(donated[1]["count"]) == STEPS
    for kind in ({}, {"foreach": True}, {"fused": True}):
        ref = run_torch(cls, init, grads, **hp, **kind)
        for params, state in (donated, pure):
            assert_matches_torch(params, state, *ref)
    # Same fused kernel as torch's fused=True on the same inputs: bitwise equal.
    assert_matches_torch(*donated, *ref, check=assert_equal)


def assert_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@settings(max_examples=10, deadline=None)
@given(case=adam_cases(), decoupled=st.booleans())
def test_bf16_matches_torch_fused_within_bf16_tolerance(
    case: dict[str, Any], decoupled: bool
) -> None:
    """bf16 params: both paths match torch.optim.Adam(W)(fused=True) within bf16 tolerances.

    torch's default and foreach paths round every intermediate op to bf16
    (e.g. ``p *= 1 - lr * wd`` is a no-op in bf16), so they drift from the fused
    kernel by more than bf16 tolerance; the fused kernel (ours and torch's)
    computes in fp32 and rounds once.
    """
    make, cls = factory(decoupled)
    hp = hparams(case)
    init, grads = make_data(case["shapes"], case["seed"], torch.bfloat16)
    opt = make(**hp)
    ref = run_torch(cls, init, grads, **hp, fused=True)
    for donate in (True, False):
        params, state = run_ours(opt, init, grads, donate=donate)
        assert all(t.dtype == torch.bfloat16 for t in tree.leaves(state["mu"]))
        assert_matches_torch(params, state, *ref)


@settings(max_examples=15, deadline=None)
@given(
    case=adam_cases(),
    decoupled=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
)
def test_donated_equals_pure_bitwise(
    case: dict[str, Any], decoupled: bool, dtype: torch.dtype
) -> None:
    """step(donate=True) and step(donate=False) give bitwise equal params and state."""
    make, _ = factory(decoupled)
    init, grads = make_data(case["shapes"], case["seed"], dtype, steps=5)
    opt = make(**hparams(case))
    p1, s1 = run_ours(opt, init, grads, donate=True)
    p2, s2 = run_ours(opt, init, grads, donate=False)
    assert_trees_equal(p1, p2)
    assert_trees_equal(s1, s2)


def snapshot(*tds: TensorDict) -> list[TensorDict]:
    return [tree.clone(td) for td in tds]


@pytest.mark.parametrize("make", [optim.adam, optim.adamw])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_pure_paths_leave_inputs_bitwise_unchanged(
    make: Callable[..., optim.Transform], amsgrad: bool
) -> None:
    """step(donate=False) and update() never write params, grads or state, nor alias them."""
    init, grads = make_data([(3, 4), (5,)], 0, torch.float32, steps=3)
    opt = make(lr=0.1, weight_decay=0.1, amsgrad=amsgrad)
    params = as_tree(init)
    state = opt.init(params)
    for gs in grads:  # non-trivial moments first
        params, state = opt.step(as_tree(gs), state, params)
    g = as_tree(grads[0])
    before = snapshot(params, g, state)
    new_p, new_s = opt.step(g, state, params)
    upd, new_s2 = opt.update(g, state, params)
    for td, ref in zip((params, g, state), before, strict=True):
        assert_trees_equal(td, ref)
    inputs = {t.data_ptr() for td in (params, g, state) for t in tree.leaves(td) if t.numel()}
    for out in (new_p, new_s, upd, new_s2):
        assert not inputs & {t.data_ptr() for t in tree.leaves(out) if t.numel()}


@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_foreach_fallback_matches_torch(
    monkeypatch: pytest.MonkeyPatch, decoupled: bool, dtype: torch.dtype
) -> None:
    """Without fused kernels the foreach fallback follows torch's op order.

    fp32: torch's foreach=True and default paths. bf16: torch's default
    (per-tensor) path, which applies scalars like ``1 - lr * wd`` at full
    precision as the fallback does; CPU ``torch._foreach_mul_`` (foreach=True)
    first rounds them to bf16 (0.999 -> 1.0), so it is not a reference there.
    """
    monkeypatch.setattr(_adam, "fused_supported", lambda device, dtype, **kw: False)
    make, cls = factory(decoupled)
    kinds: list[dict[str, bool]] = (
        [{"foreach": True}, {"foreach": False}] if dtype == torch.float32 else [{"foreach": False}]
    )
    for amsgrad in (False, True):
        hp = {
            "lr": 0.01,
            "betas": (0.8, 0.99),
            "eps": 1e-6,
            "weight_decay": 0.05,
            "amsgrad": amsgrad,
        }
        init, grads = make_data([(4, 3), (7,), ()], 1, dtype)
        for kind in kinds:
            ref = run_torch(cls, init, grads, **hp, **kind)
            for donate in (True, False):
                params, state = run_ours(make(**hp), init, grads, donate=donate)
                assert_matches_torch(params, state, *ref)


def test_foreach_fallback_chunked_equals_unchunked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunking the fallback's temporaries (to bound memory) does not change results."""
    monkeypatch.setattr(_adam, "fused_supported", lambda device, dtype, **kw: False)
    init, grads = make_data([(4, 3), (7,), (2, 2), (9,)], 2, torch.float32, steps=5)
    opt = optim.adamw(lr=0.01, amsgrad=True)
    whole = run_ours(opt, init, grads, donate=True)
    monkeypatch.setattr(_kernels, "TEMP_CHUNK_ELEMENTS", 8)
    chunked = run_ours(opt, init, grads, donate=True)
    assert_trees_equal(whole[0], chunked[0])
    assert_trees_equal(whole[1], chunked[1])


@settings(max_examples=15, deadline=None)
@given(case=adam_cases(), decoupled=st.booleans())
def test_apply_updates_of_update_is_close_to_step(case: dict[str, Any], decoupled: bool) -> None:
    """params + update(...) (optax style, out of place) tracks step(...) over 50 steps (fp32).

    ``update`` runs foreach ops in torch's order, ``step`` the fused kernel: the
    rounding differs, and over 50 steps with e.g. beta2 = 0 (update ~ m / |g|)
    it compounds to ~1e-4 relative, so this check uses rtol 5e-4 / atol 1e-5.
    """
    make, _ = factory(decoupled)
    init, grads = make_data(case["shapes"], case["seed"], torch.float32)
    opt = make(**hparams(case))
    p_step, s_step = run_ours(opt, init, grads, donate=False)
    for donate in (False, True):
        params = as_tree([t.clone() for t in init])
        state = opt.init(params)
        for gs in grads:
            upd, state = opt.update(as_tree(gs), state, params, donate=donate)
            params = optim.apply_updates(params, upd)
        for a, b in zip(tree.leaves(params), tree.leaves(p_step), strict=True):
            torch.testing.assert_close(a, b, rtol=5e-4, atol=1e-5)
        for a, b in zip(tree.leaves(state), tree.leaves(s_step), strict=True):
            torch.testing.assert_close(a, b, rtol=5e-4, atol=1e-5)


def test_lr_schedule_is_used_like_torch_lambdalr() -> None:
    """adamw(lr=schedule) equals torch AdamW + LambdaLR stepped after each optimizer step."""
    sched = schedules.warmup_cosine(0.05, warmup_steps=5, total_steps=30, init=0.005, end=0.001)
    init, grads = make_data([(6, 3), (4,)], 3, torch.float32, steps=35)
    ps = [torch.nn.Parameter(t.clone()) for t in init]
    topt = torch.optim.AdamW(ps, lr=0.05, weight_decay=0.02)
    lam = torch.optim.lr_scheduler.LambdaLR(topt, lambda n: sched(n) / 0.05)
    opt = optim.adamw(lr=sched, weight_decay=0.02)
    params = as_tree([t.clone() for t in init])
    state = opt.init(params)
    assert float(optim.current_lr(state)) == sched(0)  # type: ignore[arg-type]
    for n, gs in enumerate(grads):
        torch_lr = topt.param_groups[0]["lr"]
        for p, g in zip(ps, gs, strict=True):
            p.grad = g.clone()
        topt.step()
        lam.step()
        params, state = opt.step(as_tree(gs), state, params, donate=n % 2 == 0)
        lr = optim.current_lr(state)
        assert lr is not None and lr.dtype == torch.float64 and lr.device.type == "cpu"
        assert float(lr) == pytest.approx(torch_lr, rel=1e-12)
        assert int(state["count"]) == n + 1
    for a, b in zip(tree.leaves(params), ps, strict=True):
        torch.testing.assert_close(a, b.detach())


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


def test_adamw_defaults_follow_torch() -> None:
    """adamw defaults to weight_decay=0.01, adam to 0, both betas (0.9, 0.999), eps 1e-8."""
    assert optim.adamw().hparams.weight_decay == 0.01
    assert optim.adam().hparams.weight_decay == 0.0
    hp = optim.adamw().hparams
    assert (hp.lr, hp.betas, hp.eps, hp.amsgrad) == (1e-3, (0.9, 0.999), 1e-8, False)


def test_mixed_dtypes_are_grouped() -> None:
    """A tree mixing fp32, bf16 and fp64 leaves steps each group like torch fused does."""
    dtypes = [torch.float32, torch.bfloat16, torch.float64, torch.float32]
    gen = torch.Generator().manual_seed(4)
    init = [torch.randn(3, generator=gen).to(dt) for dt in dtypes]
    grads = [[torch.randn(3, generator=gen).to(dt) for dt in dtypes] for _ in range(10)]
    hp = {"lr": 0.01, "weight_decay": 0.1}
    ref = run_torch(torch.optim.AdamW, init, grads, **hp, fused=True)
    params, state = run_ours(optim.adamw(**hp), init, grads, donate=True)
    assert_matches_torch(params, state, *ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decoupled", [False, True])
def test_half_precision_step_matches_float64_math_on_large_tensors(
    dtype: torch.dtype, decoupled: bool
) -> None:
    """One step on a tensor of many SIMD widths equals the float64 formula (half tolerance).

    An independent check of the fused kernel in bf16/fp16 (the bf16 parity test
    above compares with torch's own fused kernel).
    """
    gen = torch.Generator().manual_seed(0)
    n = 1000
    p, g, m = (torch.randn(n, generator=gen).to(dtype) for _ in range(3))
    v = torch.rand(n, generator=gen).to(dtype)
    make, _ = factory(decoupled)
    opt = make(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    params = TensorDict({"w": p}, [])
    state = opt.init(params)
    state["mu", "w"], state["nu", "w"], state["count"] = m.clone(), v.clone(), torch.tensor(2)
    state["steps", "w"] = torch.tensor(2.0)  # the parameter's own step count
    new_p, new_s = opt.step(TensorDict({"w": g}, []), state, params)
    P, G, M, V = (t.double() for t in (p, g, m, v))
    if decoupled:
        P = P * (1 - 0.01 * 0.1)
    else:
        G = G + 0.1 * P
    M, V = 0.9 * M + 0.1 * G, 0.99 * V + 0.01 * G * G
    P = P - 0.01 / (1 - 0.9**3) * M / ((V / (1 - 0.99**3)).sqrt() + 1e-8)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 2e-3, "atol": 2e-3}
    torch.testing.assert_close(new_s["mu", "w"].double(), M, **tol)
    torch.testing.assert_close(new_s["nu", "w"].double(), V, **tol)
    torch.testing.assert_close(new_p["w"].double(), P, **tol)


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
