"""Adam / AdamW specifics (the shared checks are in test_optim_table.py): state layout,
mixed-dtype grouping, half precision against float64 maths, stride-0 grads of fused size."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from _optim import (
    EXACT,
    as_tree,
    masked_grads,
    run_ours,
    run_ours_masked,
    run_torch,
    run_torch_masked,
)
from _optim_rows import adam_state
from purestep import optim, tree
from purestep.optim import _adam, _steps, schedules


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


def _steps_in(layout: str, values: list[float]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """0-dim step counts holding ``values``, laid out as ``layout``; and the buffer they view."""
    n = len(values)
    v = torch.tensor(values)
    if layout == "packed":  # init's layout: each element of one new 1-D buffer once
        steps = _steps.pack_steps([x.clone() for x in v.unbind()])
        return steps, steps[0]._base
    if layout == "separate":  # as after a checkpoint load
        return [x.clone() for x in v.unbind()], None
    if layout == "subset":  # the first n elements of a longer buffer
        buf = torch.cat([v, torch.tensor([-7.0])])
    elif layout == "column":  # the elements of an (n, 1) buffer
        buf = torch.zeros(n, 1)
        buf.copy_(v.reshape(n, 1))
    elif layout == "strided":  # a 1-D buffer with a gap after each element
        buf = torch.empty_strided((n,), (2,))
        buf.copy_(v)
    elif layout == "offset":  # a 1-D buffer starting one element into its storage
        storage = torch.cat([torch.tensor([-7.0]), v]).untyped_storage()
        buf = torch.tensor([]).set_(storage, 1, (n,), (1,))
    elif layout == "duplicated":  # the first element listed twice, the last one missing
        buf = v.clone()
        return [buf[0], *[buf[i] for i in range(n - 1)]][:n], buf
    elif layout == "one-mixed-in":  # all but the last from one buffer
        buf = v.clone()
        return [*[buf[i] for i in range(n - 1)], v[-1].clone()], buf
    else:
        raise AssertionError(layout)
    return [buf.flatten()[i] if layout != "strided" else buf[i] for i in range(n)], buf


def _is_own_buffer(steps: list[torch.Tensor]) -> bool:
    """Whether ``steps`` are, in order, the elements of one contiguous 1-D buffer of their own."""
    base = steps[0]._base
    return (
        base is not None
        and base.dim() == 1
        and base.shape[0] == len(steps)
        and base.stride() == (1,)
        and base.storage_offset() == 0
        and all(s._base is base and s.dim() == 0 for s in steps)
        and [s.storage_offset() for s in steps] == list(range(len(steps)))
    )


LAYOUTS = [
    "packed",
    "separate",
    "subset",
    "column",
    "strided",
    "offset",
    "duplicated",
    "one-mixed-in",
]


@settings(max_examples=20, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    donate=st.booleans(),
    values=st.lists(st.integers(0, 1000).map(float), min_size=2, max_size=5),
)
def test_bump_steps_adds_one_to_every_count_and_writes_only_a_buffer_it_owns(
    layout: str, donate: bool, values: list[float]
) -> None:
    """``bump_steps`` gives every count plus one, whatever the counts' layout. Only donated
    counts that are exactly the elements of one contiguous 1-D buffer are advanced in place
    (the same list back, the buffer advanced by one); any other layout, and every pure call,
    leaves the counts' memory untouched (other elements of a shared storage included) and
    returns counts packed into a buffer of their own, so the next donated step is in place."""
    steps, buf = _steps_in(layout, values)
    before = [float(s) for s in steps]
    storage = steps[0].untyped_storage()
    snapshot = bytes(storage)
    out = _steps.bump_steps(steps, donate=donate)
    assert [float(s) for s in out] == [b + 1 for b in before]
    assert _is_own_buffer(out)
    if donate and layout == "packed":
        assert out is steps and buf is not None and out[0]._base is buf
        assert buf.tolist() == [b + 1 for b in before]
    else:
        assert out is not steps and out[0].untyped_storage().data_ptr() != storage.data_ptr()
        assert bytes(storage) == snapshot, "counts it does not own were written"
        assert [float(s) for s in steps] == before


@pytest.mark.parametrize("donate", [True, False])
@pytest.mark.parametrize("mix", ["dtypes", "a-1-d-count", "a-parameter"])
def test_bump_steps_of_counts_that_cannot_share_a_buffer_adds_one_to_each(
    donate: bool, mix: str
) -> None:
    """Counts of several dtypes, a 1-D count or a tensor subclass cannot be stacked: each is
    advanced by one on its own, in place when donated (the same list and tensors back), into
    new tensors otherwise (the inputs untouched); ``pack_steps`` returns such lists as they are."""
    steps = [torch.tensor(3.0), torch.tensor(5.0)]
    if mix == "dtypes":
        steps.append(torch.tensor(2.0, dtype=torch.float64))
    elif mix == "a-1-d-count":
        steps.append(torch.tensor([2.0]))
    else:
        steps.insert(0, torch.nn.Parameter(torch.tensor(2.0), requires_grad=False))
    assert _steps.pack_steps(steps) is steps
    before = [float(s) for s in steps]
    out = _steps.bump_steps(steps, donate=donate)
    assert [float(s) for s in out] == [b + 1 for b in before]
    assert [s.dtype for s in out] == [s.dtype for s in steps]
    if donate:
        assert out is steps
    else:
        assert [float(s) for s in steps] == before
        assert all(a is not b for a, b in zip(out, steps, strict=True))


@pytest.mark.parametrize("n", [1, 2, 5])
def test_pack_steps_makes_views_of_one_new_buffer_with_the_same_values(n: int) -> None:
    """Plain 0-dim counts of one dtype and device (one alone too) become, in order, the elements
    of one new buffer with their values; the inputs are not changed; an empty list stays empty."""
    counts = [torch.tensor(float(3 * i + 1)) for i in range(n)]
    packed = _steps.pack_steps(counts)
    assert [float(s) for s in packed] == [float(3 * i + 1) for i in range(n)]
    assert _is_own_buffer(packed) and all(c._base is None for c in counts)
    assert _steps.pack_steps([]) == []


def test_steps_by_value_groups_indices_in_order_of_first_appearance() -> None:
    """Indices of equal counts are grouped under that count, each group in index order."""
    steps = [torch.tensor(v) for v in (2.0, 1.0, 2.0, 7.0, 1.0)]
    assert _steps.steps_by_value(steps) == {2.0: [0, 2], 1.0: [1, 4], 7.0: [3]}
    assert list(_steps.steps_by_value(steps)) == [2.0, 1.0, 7.0]
    assert _steps.steps_by_value([]) == {}


@st.composite
def adam_boundary_hparams(draw: st.DrawFn) -> dict[str, Any]:
    """Adam hyperparameters at and around the edges of their ranges."""
    edge = st.sampled_from([0.0, 0.5, 0.9, 0.999])
    return {
        "lr": draw(st.sampled_from([0.0, 0.01, 1.0])),
        "betas": (draw(edge), draw(edge)),
        "eps": draw(st.sampled_from([1e-8, 0.5, 1.0, 2.0])),
        "weight_decay": draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])),
        "amsgrad": draw(st.booleans()),
    }


@pytest.mark.parametrize("make", ["adam", "adamw"])
@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    hp=adam_boundary_hparams(),
    path=st.sampled_from(["fused", "foreach", "bf16-fused"]),
    donate=st.booleans(),
)
def test_matches_torch_at_boundary_hyperparameters_with_params_skipped(
    make: str, data: st.DataObject, hp: dict[str, Any], path: str, donate: bool
) -> None:
    """At the edges of every range (betas 0 and near 1, eps and weight decay of 0, 1 and above,
    lr 0 and 1, amsgrad) and with params left without a gradient in some steps (their own step
    counts then differ), params, moments and step counts equal torch.optim.Adam / AdamW: bitwise
    its fused kind on the fused paths (fp32 and bf16), within fp32 tolerance its foreach kind on
    the foreach path (one call per distinct step count)."""
    dtype = torch.bfloat16 if path.startswith("bf16") else torch.float32
    init, grads = masked_grads(data, [(3, 2), (5,), (2, 2)], dtype, steps=4)
    opt, cls = (
        (optim.adam, torch.optim.Adam) if make == "adam" else (optim.adamw, torch.optim.AdamW)
    )
    with pytest.MonkeyPatch.context() as mp:
        if path == "foreach":
            mp.setattr(_adam, "fused_supported", lambda device, dtype, **kw: False)
        params, state = run_ours_masked(opt(**hp), init, grads, donate)
    kind, tol = ({"foreach": True}, {}) if path == "foreach" else ({"fused": True}, EXACT)
    ref_p, ref_s = run_torch_masked(lambda ps: cls(ps, **hp, **kind), init, grads)
    for i, (p, r) in enumerate(zip(tree.leaves(params), ref_p, strict=True)):
        torch.testing.assert_close(p, r, **tol, msg=f"params {i}")
    for i, s in enumerate(ref_s):
        for key, theirs in adam_state(s).items():
            ours = tree.leaves(state[key])[i]
            torch.testing.assert_close(ours, theirs.to(ours.device), **tol, msg=f"{key} {i}")
        if not s:  # never had a gradient: moments zero, step count 0
            assert float(tree.leaves(state["steps"])[i]) == 0.0
            assert not tree.leaves(state["mu"])[i].any()
    if hp["weight_decay"]:
        with pytest.raises(ValueError, match="needs params"):
            opt(**hp).update(params, state)
