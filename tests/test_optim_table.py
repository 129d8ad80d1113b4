"""The shared optimizer checks: every row of tests/_optim_rows.py runs through each test here.

The parity tests compare with each row's torch counterpart and reference code
(tolerances are stated in ``_optim_rows``); the others prove properties every
optimizer has: pure == donated bitwise, ``update`` tracks ``step``, inputs
untouched, schedules follow the optimizer's own count, every bad hyperparameter
names its field, params without a gradient are untouched, gradient layouts do
not matter, empty trees. The generic transform checks also run on the
combinators (clip, scale, chains).
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torch import Tensor, nn

from _ids import safe_id
from _optim import (
    EXACT,
    STEPS,
    as_tree,
    assert_trees_equal,
    laid_out,
    make_data,
    paths,
    ptrs,
    run_ours,
    run_torch,
    run_updates,
    shapes_st,
)
from _optim_rows import CLOSE, FUSED_ROWS, ROWS, TORCH_KINDS, TORCH_ROWS, Hp, Row, State, Tol
from purestep import errors, optim, tree
from purestep.optim import _hparams, _kernels, schedules

SCHED = schedules.warmup_cosine(0.05, 2, 8, init=0.01)

# Transforms that are not optimizers go through the generic checks as they are.
COMBINATORS: dict[str, Callable[[], optim.Transform]] = {
    "clip": lambda: optim.clip_by_global_norm(0.5),
    "scale": lambda: optim.scale_by_schedule(lambda n: -SCHED(n)),
    "chain-clip-adamw": lambda: optim.chain(
        optim.clip_by_global_norm(0.5), optim.adamw(lr=SCHED, weight_decay=0.1)
    ),
    "chain-clip-scale-sgd": lambda: optim.chain(
        optim.clip_by_global_norm(1.0), optim.scale_by_schedule(2.0), optim.sgd(lr=0.01)
    ),
    "chain-clip-muon": lambda: optim.chain(optim.clip_by_global_norm(0.5), optim.muon(lr=SCHED)),
}
ALL = sorted([*ROWS, *COMBINATORS])


@st.composite
def transforms(draw: st.DrawFn, name: str) -> optim.Transform:
    """``name``'s transform: a row with drawn hyperparameters (lr sometimes a schedule), or a combinator."""
    if name in COMBINATORS:
        return COMBINATORS[name]()
    row = ROWS[name]
    hp = draw(row.hparams)
    if draw(st.booleans()):
        hp["lr"] = SCHED
    return row.make(**hp)


def check(ours: Tensor, ref: Tensor, tol: Tol, what: str) -> None:
    torch.testing.assert_close(ours, ref, **tol, msg=lambda m: f"{what}: {m}")


def assert_matches(
    row: Row,
    params: TensorDict,
    state: TensorDict,
    ref: tuple[list[Tensor], State],
    tol: Tol,
    what: str,
) -> None:
    """Params, and every state entry the reference has, equal the reference's within ``tol``."""
    ref_p, ref_s = ref
    for i, (p, r) in enumerate(zip(tree.leaves(params), ref_p, strict=True)):
        check(p, r, tol, f"{what}: params {i}")
    for i, s in enumerate(ref_s):
        for key, r in s.items():
            ours = tree.leaves(state[key])[i]
            check(ours, r, tol, f"{what}: {key} {i}")


def check_reference(
    row: Row,
    hp: Hp,
    init: list[Tensor],
    grads: list[list[Tensor]],
    ours: list[tuple[TensorDict, TensorDict]],
    dtype: torch.dtype,
) -> bool:
    """Compare ``ours`` with the row's reference code where it applies; whether it did."""
    tol = row.reference_tol(hp, dtype, len(grads))
    ref = row.reference(init, grads, hp) if row.reference is not None and tol is not None else None
    if ref is None or tol is None:
        return False
    for params, state in ours:
        assert_matches(row, params, state, ref, tol, "reference")
    return True


def torch_run(
    row: Row, init: list[Tensor], grads: list[list[Tensor]], hp: Hp, kind: str
) -> tuple[list[Tensor], State]:
    assert row.torch is not None
    build = row.torch
    shape = row.torch_shape
    p, s = run_torch(
        lambda ps, names: build(ps, names, hp, TORCH_KINDS[kind]),
        init,
        grads,
        (lambda path, t: shape(path, t, hp))
        if shape is not None
        else (lambda path, t: tuple(t.shape)),
    )
    return p, [row.torch_state(x) for x in s]


# Parity --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ROWS))
@settings(max_examples=8, deadline=None)
@given(data=st.data(), shapes=shapes_st, seed=st.integers(0, 2**31 - 1))
def test_fp32_matches_torch_and_reference_after_50_steps_on_both_paths(
    name: str, data: st.DataObject, shapes: list[tuple[int, ...]], seed: int
) -> None:
    """fp32: donated and pure steps match every torch kind (close) and the reference (close),
    and the fused kind bitwise (the same kernel on the same inputs)."""
    row = ROWS[name]
    hp = data.draw(row.hparams)
    init, grads = make_data(shapes, seed, torch.float32)
    opt = row.make(**hp)
    ours = {d: run_ours(opt, init, grads, donate=d) for d in (True, False)}
    assert int(ours[True][1]["count"]) == STEPS
    if row.torch is not None and row.torch_applies(hp, torch.float32):
        for kind in row.kinds:
            ref = torch_run(row, init, grads, hp, kind)
            tol = EXACT if kind == row.exact_kind else CLOSE
            for donate, (params, state) in ours.items():
                assert_matches(row, params, state, ref, tol, f"torch {kind}, donate={donate}")
    check_reference(row, hp, init, grads, list(ours.values()), torch.float32)


@pytest.mark.parametrize("name", sorted(ROWS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_examples_match_torch_exactly_and_the_reference(name: str, dtype: torch.dtype) -> None:
    """The row's examples, deterministically: donated and pure steps equal the exact torch
    kind bitwise in fp32 (the bf16 kind within its tolerance in bf16) and the reference code
    within its tolerance, on matrices, vectors, a 3-D tensor and an empty one."""
    row = ROWS[name]
    init, grads = make_data([(6, 3), (4,), (2, 3, 2), (0, 3), (3, 5), (5, 5)], 7, dtype, steps=5)
    compared = 0
    for hp in (row.example, *row.more_examples):
        opt = row.make(**hp)
        ours = [run_ours(opt, init, grads, donate=d) for d in (True, False)]
        if row.torch is not None and row.torch_applies(hp, dtype):
            kind, tol = (row.exact_kind, EXACT) if dtype == torch.float32 else row.bf16_kind  # type: ignore[misc]
            ref = torch_run(row, init, grads, hp, kind)
            for params, state in ours:
                assert_matches(row, params, state, ref, tol, f"torch {kind} {hp}")
            compared += 1
        if dtype == torch.float32 or row.torch is None:
            compared += check_reference(row, hp, init, grads, ours, dtype)
    assert compared, "no reference applied to any example"


@pytest.mark.parametrize("name", sorted(ROWS))
@settings(max_examples=5, deadline=None)
@given(data=st.data(), shapes=shapes_st, seed=st.integers(0, 2**31 - 1))
def test_bf16_matches_torch_and_reference_within_stated_tolerance(
    name: str, data: st.DataObject, shapes: list[tuple[int, ...]], seed: int
) -> None:
    """bf16 params: both paths match the row's bf16 torch kind and its reference (module docstring)."""
    row = ROWS[name]
    hp = data.draw(row.hparams)
    init, grads = make_data(shapes, seed, torch.bfloat16)
    opt = row.make(**hp)
    ours = [run_ours(opt, init, grads, donate=d) for d in (True, False)]
    for _, state in ours:
        for key in state.keys():
            if isinstance(state[key], TensorDict) and key != "steps":
                assert all(t.dtype == torch.bfloat16 for t in tree.leaves(state[key])), key
    if row.bf16_kind is not None and row.torch_applies(hp, torch.bfloat16):
        kind, tol = row.bf16_kind
        ref = torch_run(row, init, grads, hp, kind)
        for params, state in ours:
            assert_matches(row, params, state, ref, tol, f"torch {kind}")
    check_reference(row, hp, init, grads, ours, torch.bfloat16)


def fused_off(mp: pytest.MonkeyPatch, row: Row) -> None:
    if row.fused is not None:
        mp.setattr(row.fused, "fused_supported", lambda device, dtype, **kw: False)


@pytest.mark.parametrize("name", FUSED_ROWS)
@settings(max_examples=5, deadline=None)
@given(
    data=st.data(),
    shapes=shapes_st,
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_foreach_fallback_matches_torch_foreach_and_default(
    name: str, data: st.DataObject, shapes: list[tuple[int, ...]], seed: int, dtype: torch.dtype
) -> None:
    """Without fused kernels the foreach fallback follows torch's op order.

    fp32: torch's foreach=True and default kinds. bf16: the default (per-tensor)
    kind, which applies scalars like ``1 - lr * wd`` at full precision as the
    fallback does; CPU ``torch._foreach_mul_`` (foreach=True) first rounds them to
    bf16 (0.999 -> 1.0), so it is not a reference there.
    """
    row = ROWS[name]
    hp = data.draw(row.hparams)
    init, grads = make_data(shapes, seed, dtype)
    if row.torch is None or not row.torch_applies(hp, dtype):
        return
    with pytest.MonkeyPatch.context() as mp:
        fused_off(mp, row)
        ours = [run_ours(row.make(**hp), init, grads, donate=d) for d in (True, False)]
    for kind in row.fallback_kinds[dtype]:
        ref = torch_run(row, init, grads, hp, kind)
        for params, state in ours:
            assert_matches(row, params, state, ref, CLOSE, f"torch {kind}")


@pytest.mark.parametrize("name", sorted(ROWS))
def test_fallback_with_chunked_temporaries_equals_unchunked_bitwise(name: str) -> None:
    """Chunking the foreach fallback's temporaries (to bound memory) does not change results."""
    row = ROWS[name]
    init, grads = make_data([(4, 3), (7,), (2, 2), (9,)], 2, torch.float32, steps=5)
    with pytest.MonkeyPatch.context() as mp:
        fused_off(mp, row)
        whole = run_ours(row.make(**row.example), init, grads, donate=True)
        mp.setattr(_kernels, "TEMP_CHUNK_ELEMENTS", 5)
        chunked = run_ours(row.make(**row.example), init, grads, donate=True)
    assert_trees_equal(whole[0], chunked[0])
    assert_trees_equal(whole[1], chunked[1])


@pytest.mark.parametrize("name", sorted(ROWS))
@settings(max_examples=5, deadline=None)
@given(data=st.data(), shapes=shapes_st, seed=st.integers(0, 2**31 - 1))
def test_apply_updates_of_update_tracks_step(
    name: str, data: st.DataObject, shapes: list[tuple[int, ...]], seed: int
) -> None:
    """params + update(...) (optax style, pure or donated state) tracks step(...) over the
    row's ``long_steps`` (fp32), within the row's ``update_tol``."""
    row = ROWS[name]
    opt = row.make(**data.draw(row.hparams))
    init, grads = make_data(shapes, seed, torch.float32, steps=row.long_steps)
    p_step, s_step = run_ours(opt, init, grads, donate=False)
    for donate in (False, True):
        params, state = run_updates(opt, init, grads, donate=donate)
        for a, b in zip(tree.leaves(params), tree.leaves(p_step), strict=True):
            torch.testing.assert_close(a, b, **row.update_tol)
        for a, b in zip(tree.leaves(state), tree.leaves(s_step), strict=True):
            torch.testing.assert_close(a, b, **row.update_tol)


# Schedules -----------------------------------------------------------------------------

SCHEDULES = {
    "warmup_cosine": schedules.warmup_cosine(
        0.05, warmup_steps=3, total_steps=8, init=0.005, end=0.001
    ),
    "piecewise_constant": schedules.piecewise_constant(0.1, {2: 0.5, 5: 0.5}),
}


@pytest.mark.parametrize("name", sorted(ROWS))
@settings(max_examples=3, deadline=None)
@given(data=st.data(), sched=st.sampled_from(sorted(SCHEDULES)), seed=st.integers(0, 2**16))
def test_schedule_is_the_constant_lr_of_each_count_bitwise(
    name: str, data: st.DataObject, sched: str, seed: int
) -> None:
    """Update n of make(lr=schedule) is bitwise make(lr=schedule(n)) on the same state,
    current_lr reports schedule(n) and count is n + 1."""
    row = ROWS[name]
    hp = data.draw(row.hparams)
    fn = SCHEDULES[sched]
    init, grads = make_data([(3, 2), (4,)], seed, torch.float32, steps=10)
    scheduled = row.make(**{**hp, "lr": fn})
    p1 = p2 = as_tree(init)
    s1 = s2 = scheduled.init(p1)
    assert float(optim.current_lr(s1)) == fn(0)  # type: ignore[arg-type]
    for n, gs in enumerate(grads):
        g = as_tree(gs)
        p1, s1 = scheduled.step(g, s1, p1, donate=n % 2 == 1)
        p2, s2 = row.make(**{**hp, "lr": fn(n)}).step(g, s2, p2)
        assert_trees_equal(p1, p2)
        assert_trees_equal(s1, s2)
        assert float(optim.current_lr(s1)) == fn(n) and int(s1["count"]) == n + 1  # type: ignore[arg-type]


@pytest.mark.parametrize("name", TORCH_ROWS)
def test_schedule_follows_the_count_like_torch_lambdalr(name: str) -> None:
    """make(lr=schedule) equals the torch counterpart + LambdaLR stepped after each
    optimizer step; current_lr is the lr torch used, as a float64 CPU scalar."""
    row = ROWS[name]
    assert row.torch is not None
    base = 0.05
    sched = schedules.warmup_cosine(base, warmup_steps=5, total_steps=30, init=0.005, end=0.001)
    hp = {**row.example, "lr": base}
    init, grads = make_data([(6, 3), (4,), (3, 5)], 3, torch.float32, steps=35)
    ps = [nn.Parameter(t.clone()) for t in init]
    topts = row.torch(ps, paths(len(ps)), hp, {})
    lams = [torch.optim.lr_scheduler.LambdaLR(o, lambda n: sched(n) / base) for o in topts]
    opt = row.make(**{**hp, "lr": sched})
    params = as_tree([t.clone() for t in init])
    state = opt.init(params)
    for n, gs in enumerate(grads):
        used = topts[0].param_groups[0]["lr"]
        for p, g in zip(ps, gs, strict=True):
            p.grad = g.clone()
        for o, lam in zip(topts, lams, strict=True):
            o.step()
            lam.step()
        params, state = opt.step(as_tree(gs), state, params, donate=n % 2 == 0)
        lr = optim.current_lr(state)
        assert lr is not None and lr.dtype == torch.float64 and lr.device.type == "cpu"
        assert float(lr) == pytest.approx(used, rel=1e-12)
        assert int(state["count"]) == n + 1
    for a, b in zip(tree.leaves(params), ps, strict=True):
        torch.testing.assert_close(a, b.detach())


# Hyperparameters -----------------------------------------------------------------------

BAD = [(name, kw, exc, field) for name, row in ROWS.items() for kw, exc, field in row.bad]


@pytest.mark.parametrize(
    ("name", "kwargs", "exc", "field"),
    BAD,
    ids=[safe_id(f"{b[0]}-{b[3]}-{i}") for i, b in enumerate(BAD)],
)
def test_bad_hyperparameter_fails_at_construction_naming_the_field(
    name: str, kwargs: Hp, exc: type[Exception], field: str
) -> None:
    """A bad or ill-typed hyperparameter raises at construction, the message starting with the field."""
    with pytest.raises(exc, match=rf"^{field}"):
        ROWS[name].make(**kwargs)


@pytest.mark.parametrize("name", sorted(ROWS))
def test_every_hyperparameter_has_a_bad_value_case(name: str) -> None:
    """The row's bad cases cover every parameter of the factory."""
    row = ROWS[name]
    covered = {k for kw, _, _ in row.bad for k in kw}
    assert set(inspect.signature(row.make).parameters) <= covered


@pytest.mark.parametrize("name", sorted(ROWS))
def test_zero_lr_and_a_schedule_are_valid_and_kept_in_hparams(name: str) -> None:
    """lr=0 and lr=schedule construct; hparams keep the schedule for inspection."""
    sched = schedules.cosine_decay(1e-3, 100)
    assert ROWS[name].make(lr=sched).hparams.lr is sched
    assert ROWS[name].make(lr=0.0).hparams.lr == 0.0


@pytest.mark.parametrize("name", [n for n, r in ROWS.items() if r.defaults_of])
def test_defaults_follow_torch(name: str) -> None:
    """Every default shared by name with the torch counterpart is torch's (lr, betas, eps, ...)."""
    row = ROWS[name]
    ours = {k: p.default for k, p in inspect.signature(row.make).parameters.items()}
    for cls in row.defaults_of:
        theirs = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()}
        shared = [k for k in ours if k in theirs and theirs[k] is not None]
        assert shared, cls
        for k in shared:
            assert ours[k] == theirs[k], (k, ours[k], theirs[k])


@pytest.mark.parametrize("name", sorted(ROWS))
def test_every_argument_reaches_the_hparams_with_its_documented_default(name: str) -> None:
    """``make()`` with no argument builds hyperparameters equal to the signature's defaults:
    every argument is passed on (none replaced by a value the signature does not show)."""
    make = ROWS[name].make
    hp = make().hparams
    defaults = {k: p.default for k, p in inspect.signature(make).parameters.items()}
    assert defaults and all(v is not inspect.Parameter.empty for v in defaults.values())
    for k, v in defaults.items():
        assert getattr(hp, k) == v, (k, getattr(hp, k), v)


@pytest.mark.parametrize("name", sorted(ROWS))
def test_each_optimizer_is_named_as_chain_reports_it(name: str) -> None:
    """An optimizer's Transform carries its own name (chains and reprs show it)."""
    row = ROWS[name]
    opt = row.make(**row.example)
    assert opt.name == name
    assert optim.chain(optim.clip_by_global_norm(1.0), opt).name == (
        f"chain(clip_by_global_norm, {name})"
    )


@pytest.mark.parametrize("name", sorted(ROWS))
@pytest.mark.parametrize(
    ("param_dtype", "grad_dtype"),
    [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
def test_grads_in_another_dtype_step_as_if_cast_to_the_params_dtype_first(
    name: str, param_dtype: torch.dtype, grad_dtype: torch.dtype
) -> None:
    """A gradient in another dtype than its param (bf16 grads of fp32 params, or fp32 grads
    of bf16 params) gives the step of that gradient cast to the param's dtype, bitwise."""
    row = ROWS[name]
    init, grads = make_data([(4, 3), (3,)], 7, param_dtype, steps=2)
    given_as = [[g.to(grad_dtype) for g in gs] for gs in grads]
    cast = [[g.to(param_dtype) for g in gs] for gs in given_as]
    for fused in (True, False):  # the fused kernels and the foreach fallback
        with pytest.MonkeyPatch.context() as mp:
            if not fused:
                fused_off(mp, row)
            for donate in (False, True):
                p1, s1 = run_ours(row.make(**row.example), init, given_as, donate=donate)
                p2, s2 = run_ours(row.make(**row.example), init, cast, donate=donate)
                assert all(t.dtype == param_dtype for t in tree.leaves(p1))
                assert_trees_equal(p1, p2)
                assert_trees_equal(s1, s2)


_DECAY_ALONE: dict[str, Callable[[float, float], optim.Transform]] = {
    "lion": lambda lr, wd: optim.lion(lr=lr, weight_decay=wd),
    "muon": lambda lr, wd: optim.muon(lr=lr, weight_decay=wd, use_muon=lambda path, p: True),
}


@pytest.mark.parametrize("name", sorted(_DECAY_ALONE))
@settings(max_examples=10, deadline=None)
@given(
    lr=st.floats(0.01, 1.0),
    weight_decay=st.floats(0.0, 1.0),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
@example(lr=0.5, weight_decay=1.0, dtype=torch.float32)
def test_a_zero_gradient_step_is_the_decoupled_decay_alone(
    name: str, lr: float, weight_decay: float, dtype: torch.dtype
) -> None:
    """Lion from zero momentum (sign 0) and Muon (a zero matrix orthogonalises to zero) turn a
    zero gradient into a zero update, so a step is ``p * (1 - lr * wd)`` alone, bitwise, for
    every decay (1.0 included)."""
    opt = _DECAY_ALONE[name](lr, weight_decay)
    p = torch.linspace(-2.0, 3.0, 12).reshape(4, 3).to(dtype)
    params = TensorDict({"w": p.clone()}, [])
    zeros = TensorDict({"w": torch.zeros(4, 3, dtype=dtype)}, [])
    new, _ = opt.step(zeros, opt.init(params), params)
    assert torch.equal(new["w"], p.mul(1 - lr * weight_decay))


@pytest.mark.parametrize("name", sorted(TORCH_ROWS))
def test_a_transform_built_without_arguments_uses_torchs_defaults(name: str) -> None:
    """Called with no arguments, the factory's hyperparameters are the torch counterpart's
    defaults (the values the function really uses, not only those its signature shows)."""
    row = ROWS[name]
    hp = row.make().hparams
    for cls in row.defaults_of:
        theirs = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()}
        shared = [k for k in theirs if hasattr(hp, k) and theirs[k] is not None]
        assert "lr" in shared, cls
        for k in shared:
            assert getattr(hp, k) == theirs[k], (k, getattr(hp, k), theirs[k])


# Hyperparameter validation at the exact boundaries ----------------------------------

_TINY = 5e-324  # the smallest positive float
_BELOW_ONE = math.nextafter(1.0, 0.0)


@pytest.mark.parametrize(
    ("make", "kwargs", "exc", "text"),
    [
        (optim.adam, {"lr": -_TINY}, ValueError, "lr must be >= 0, got -5e-324"),
        (optim.adam, {"lr": math.inf}, ValueError, "lr must be finite, got inf"),
        (optim.adam, {"lr": True}, TypeError, "lr must be a real number, got True"),
        (optim.adam, {"eps": 0.0}, ValueError, "eps must be > 0, got 0.0"),
        (optim.adam, {"eps": -math.inf}, ValueError, "eps must be finite, got -inf"),
        (optim.adam, {"eps": "1"}, TypeError, "eps must be a real number, got '1'"),
        (
            optim.adam,
            {"weight_decay": -_TINY},
            ValueError,
            "weight_decay must be >= 0, got -5e-324",
        ),
        (optim.adam, {"betas": (1.0, 0.5)}, ValueError, "betas[0] must be in [0, 1), got 1.0"),
        (
            optim.adam,
            {"betas": (0.5, -_TINY)},
            ValueError,
            "betas[1] must be in [0, 1), got -5e-324",
        ),
        (optim.adam, {"betas": (0.5, None)}, TypeError, "betas[1] must be a real number, got None"),
        (optim.adam, {"betas": "ab"}, ValueError, "betas must be a pair (beta1, beta2), got 'ab'"),
        (optim.adam, {"betas": 0.9}, ValueError, "betas must be a pair (beta1, beta2), got 0.9"),
        (
            optim.adam,
            {"betas": [0.1, 0.2, 0.3]},
            ValueError,
            "betas must be a pair (beta1, beta2), got (0.1, 0.2, 0.3)",
        ),
        (optim.adam, {"amsgrad": 0}, TypeError, "amsgrad must be a bool, got 0"),
        (optim.sgd, {"momentum": -_TINY}, ValueError, "momentum must be >= 0, got -5e-324"),
        (optim.sgd, {"dampening": -_TINY}, ValueError, "dampening must be in [0, 1], got -5e-324"),
        (
            optim.sgd,
            {"dampening": math.nextafter(1.0, 2.0)},
            ValueError,
            "dampening must be in [0, 1], got 1.0000000000000002",
        ),
        (optim.sgd, {"nesterov": None}, TypeError, "nesterov must be a bool, got None"),
        (optim.sgd, {"momentum": "0.9"}, TypeError, "momentum must be a real number, got '0.9'"),
        (optim.sgd, {"dampening": None}, TypeError, "dampening must be a real number, got None"),
        (
            optim.sgd,
            {"nesterov": True, "momentum": 0.0},
            ValueError,
            "nesterov=True requires momentum > 0 and dampening == 0, got momentum=0.0, dampening=0.0",
        ),
        (
            optim.sgd,
            {"nesterov": True, "momentum": 0.5, "dampening": _TINY},
            ValueError,
            "nesterov=True requires momentum > 0 and dampening == 0, "
            "got momentum=0.5, dampening=5e-324",
        ),
    ],
    ids=lambda v: safe_id(v.__name__ if callable(v) else str(v)),
)
def test_a_value_just_past_a_boundary_is_refused_with_the_whole_message(
    make: Callable[..., optim.Transform], kwargs: Hp, exc: type[Exception], text: str
) -> None:
    """The first value outside a hyperparameter's range (one ulp past the boundary, a wrong
    type, a non-pair) raises the field's exact message, naming the value it got."""
    with pytest.raises(exc, match="^" + re.escape(text) + "$"):
        make(**kwargs)


@settings(max_examples=30, deadline=None)
@given(
    lr=st.one_of(st.sampled_from([0.0, _TINY, 1.0, 1e300]), st.floats(0.0, 1e6)),
    beta=st.one_of(st.sampled_from([0.0, _BELOW_ONE]), st.floats(0.0, 1.0, exclude_max=True)),
    eps=st.one_of(st.sampled_from([_TINY, 1.0, 1e300]), st.floats(_TINY, 1e6)),
    decay=st.one_of(st.sampled_from([0.0, 1.0, 1e300]), st.floats(0.0, 1e6)),
    dampening=st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0)),
    momentum=st.one_of(st.sampled_from([_TINY, 1.0, 5.0]), st.floats(_TINY, 1e6)),
    as_int=st.booleans(),
)
def test_every_value_inside_the_ranges_including_their_boundaries_is_accepted_as_given(
    lr: float,
    beta: float,
    eps: float,
    decay: float,
    dampening: float,
    momentum: float,
    as_int: bool,
) -> None:
    """lr, weight_decay, momentum >= 0; eps > 0; betas in [0, 1); dampening in [0, 1]: any
    value in the closed side of its range constructs, kept unchanged in ``hparams`` (a list of
    betas as a tuple; an integer lr as given); Nesterov accepts the smallest positive momentum."""
    lr_in: float = int(lr) if as_int else lr
    a = optim.adam(lr=lr_in, betas=[beta, beta], eps=eps, weight_decay=decay, amsgrad=True)
    assert a.hparams == optim.AdamHParams(
        lr=lr_in, betas=(beta, beta), eps=eps, weight_decay=decay, amsgrad=True
    )
    assert a.hparams.betas == (beta, beta) and type(a.hparams.betas) is tuple
    assert a.hparams.lr == lr_in and type(a.hparams.lr) is type(lr_in)
    w = optim.adamw(lr=lr, betas=(0.0, beta), eps=eps, weight_decay=decay)
    assert w.hparams.decoupled_weight_decay is True and w.hparams.weight_decay == decay
    s = optim.sgd(lr=lr, momentum=momentum, dampening=dampening, weight_decay=decay)
    assert (s.hparams.momentum, s.hparams.dampening) == (momentum, dampening)
    n = optim.sgd(lr=lr, momentum=momentum, nesterov=True)
    assert n.hparams.nesterov is True and n.hparams.momentum == momentum


def _boom(n: int) -> float:
    raise RuntimeError("no lr here")


def _negative_at_zero_only(n: int) -> float:
    return -0.5 if n == 0 else 0.1


def _fails_at_zero_only(n: int) -> float:
    if n == 0:
        raise ZeroDivisionError("count 0")
    return 0.1


@pytest.mark.parametrize(
    ("lr", "exc", "text", "count"),
    [
        (
            schedules.linear(0.1, -0.1, 10),
            errors.ScheduleError,
            "lr: the schedule linear(start=0.1, end=-0.1, steps=10) goes negative at count 6 "
            "(lr(6) = -0.01999999999999999); a learning rate must be >= 0 at every count: fix "
            "its end points (a negative lr would ascend the loss)",
            6,
        ),
        (_boom, errors.ScheduleError, "lr: schedule {lr!r} failed at count 0: no lr here", 0),
        (
            _fails_at_zero_only,
            errors.ScheduleError,
            "lr: schedule {lr!r} failed at count 0: count 0",
            0,
        ),
        (lambda n: math.nan, errors.ScheduleError, "lr(0) must be finite, got nan", 0),
        (
            _negative_at_zero_only,
            errors.ScheduleError,
            "lr must be >= 0, but the schedule gives lr(0) = -0.5",
            0,
        ),
        (
            lambda n: -_TINY,
            errors.ScheduleError,
            "lr must be >= 0, but the schedule gives lr(0) = -5e-324",
            0,
        ),
        (lambda n: "0.1", TypeError, "lr(0) must be a real number, got '0.1'", None),
    ],
    ids=["linear", "raises", "raises-at-0", "nan", "negative-at-0", "tiny-negative", "a-string"],
)
def test_a_schedule_bad_at_construction_is_refused_naming_its_count_and_value(
    lr: Callable[[int], float], exc: type[Exception], text: str, count: int | None
) -> None:
    """A purestep schedule that goes negative at some count, or a callable that fails or is
    negative / not finite / not a number at count 0, is refused when the optimizer is built:
    the message names the schedule, the count and the value, and ``ScheduleError.count`` is
    that count."""
    with pytest.raises(exc, match="^" + re.escape(text.format(lr=lr)) + "$") as info:
        optim.sgd(lr=lr)
    if count is not None:
        assert info.value.count == count  # type: ignore[attr-defined]


@pytest.mark.parametrize("first", [0.0, 0.5, 1.0, 7.0])
def test_a_schedule_valid_at_count_zero_is_accepted_and_kept(first: float) -> None:
    """A user callable that is finite and >= 0 at count 0 (0 included, values above 1 too)
    constructs every optimizer and is kept as ``hparams.lr``; its first value is init's lr."""

    def sched(n: int) -> float:
        return first if n == 0 else -1.0  # later counts are checked by each update

    for make in (optim.adam, optim.sgd, optim.lion):
        opt = make(lr=sched)
        assert opt.hparams.lr is sched
        assert float(opt.init(as_tree([torch.ones(1)]))["lr"]) == first


def test_check_grads_without_params_compares_with_the_state_tree() -> None:
    """``check_grads(grads, None, state_tree)`` names the path and shapes, calling the other
    side the optimizer state; with params it compares with the params; with neither it passes."""
    w2, w3 = TensorDict({"w": torch.ones(2)}, []), TensorDict({"w": torch.ones(3)}, [])
    with pytest.raises(
        ValueError, match=re.escape("grads at w has shape (3,), but optimizer state has shape (2,)")
    ):
        _hparams.check_grads(w3, None, w2)
    with pytest.raises(
        ValueError, match=re.escape("grads at w has shape (3,), but params has shape (2,)")
    ):
        _hparams.check_grads(w3, w2, w3)
    _hparams.check_grads(w3, None, w3)
    _hparams.check_grads(w3, w3)
    _hparams.check_grads(w3, None)


# Params without a gradient, layouts ----------------------------------------------------


@pytest.mark.parametrize("name", sorted(ROWS))
@settings(max_examples=6, deadline=None)
@given(
    data=st.data(),
    shapes=shapes_st,
    masks=st.lists(st.lists(st.booleans(), min_size=3, max_size=3), min_size=1, max_size=4),
    donate=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_param_left_out_of_grads_is_untouched_and_keeps_its_own_step_count(
    name: str,
    data: st.DataObject,
    shapes: list[tuple[int, ...]],
    masks: list[list[bool]],
    donate: bool,
    seed: int,
) -> None:
    """With grads for a subset of params, every param evolves exactly as if it were optimised
    alone on the steps where it has a gradient (torch.optim's skip of ``.grad is None``):
    absent params, their moments and their step counts do not change at all.

    (A constant lr: a schedule follows the role's count, not the param's.)
    """
    row = ROWS[name]
    hp = data.draw(row.hparams)
    opt = row.make(**hp)
    init, gs = make_data(shapes, seed, torch.float32, steps=len(masks))
    names = paths(len(init))
    params = as_tree([t.clone() for t in init])
    state = opt.init(params)
    for g, mask in zip(gs, masks, strict=True):
        keep = [x if mask[i % 3] else None for i, x in enumerate(g)]
        params, state = opt.step(tree.select(as_tree(g), keep), state, params, donate=donate)
    assert int(state["count"]) == len(masks)
    for i, t in enumerate(init):  # each leaf alone (at its own path), on its own steps
        alone = tree.unflatten([(tuple(names[i].split(".")), t.clone())])
        s = opt.init(alone)
        for g, mask in zip(gs, masks, strict=True):
            if mask[i % 3]:
                alone, s = opt.step(tree.unflatten([(tuple(names[i].split(".")), g[i])]), s, alone)
        assert torch.equal(tree.leaves(params)[i], tree.leaves(alone)[0]), names[i]


@pytest.mark.parametrize("name", sorted(ROWS))
@settings(max_examples=6, deadline=None)
@given(
    data=st.data(),
    shape=st.tuples(*[st.integers(2, 4)] * 4),
    p_layout=st.sampled_from(["contiguous", "transposed", "channels_last", "sliced"]),
    g_layout=st.sampled_from(["contiguous", "transposed", "channels_last", "sliced", "expanded"]),
    donate=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_step_result_does_not_depend_on_memory_layout_of_params_or_grads(
    name: str,
    data: st.DataObject,
    shape: tuple[int, ...],
    p_layout: str,
    g_layout: str,
    donate: bool,
    seed: int,
) -> None:
    """Any layout of the grads (transposed, channels_last, sliced, stride-0 expanded) gives
    bitwise the result of grads stored like their params (what torch.optim gets in .grad,
    and what the fused kernel, which walks memory, needs), and any param layout gives the
    contiguous result up to the rounding of the vector kernels' tail elements."""
    row = ROWS[name]
    opt = row.make(**data.draw(row.hparams))
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(shape, generator=gen)
    gs = [torch.randn(shape, generator=gen) for _ in range(2)]
    if g_layout == "expanded":
        gs = [g.flatten()[:1].expand(shape).contiguous() for g in gs]

    def run(p: Tensor, grads: list[Tensor], d: bool) -> tuple[TensorDict, TensorDict]:
        params = TensorDict({"w": p}, [])
        state = opt.init(params)
        for g in grads:
            params, state = opt.step(TensorDict({"w": g}, []), state, params, donate=d)
        return params, state

    p = laid_out(p0, p_layout)
    like_p = [torch.empty_like(p).copy_(g) for g in gs] if p_layout != "sliced" else gs
    ref_p, ref_s = run(p.clone() if p_layout != "sliced" else laid_out(p0, p_layout), like_p, False)
    got_p, got_s = run(p, [laid_out(g, g_layout) for g in gs], donate)
    assert torch.equal(got_p["w"], ref_p["w"])
    for path, a, b in zip(tree.paths(ref_s), tree.leaves(ref_s), tree.leaves(got_s), strict=True):
        assert torch.equal(a, b), tree.format_path(path)
    contiguous, _ = run(p0.clone(), [g.clone() for g in gs], False)
    torch.testing.assert_close(got_p["w"], contiguous["w"], rtol=1e-5, atol=1e-6)


# The contract pieces: chain, updates over a subset of params, apply_updates -----------


def _td(**leaves: Tensor) -> TensorDict:
    return TensorDict(dict(leaves), batch_size=[])


def _decay_by_params(wd: float) -> optim.Transform:
    """A user transform whose update reads params: ``g + wd * p`` (fails without params)."""

    def update(
        grads: TensorDict, state: TensorDict, params: TensorDict | None, *, donate: bool = False
    ) -> tuple[TensorDict, TensorDict]:
        assert params is not None, "this transform needs params"
        new = [g + wd * p for g, p in zip(tree.leaves(grads), tree.leaves(params), strict=True)]
        return tree.rebuild(grads, new), state

    return optim.Transform(init_fn=lambda p: TensorDict({}, []), update_fn=update, name="decay")


def _grows_state() -> optim.Transform:
    """A user transform whose update adds a subtree to its (initially empty) state."""

    def update(
        grads: TensorDict, state: TensorDict, params: TensorDict | None, *, donate: bool = False
    ) -> tuple[TensorDict, TensorDict]:
        seen = tree.map_with_leaves(grads, torch.ones_like)[0]
        return grads, TensorDict({"seen": seen}, [])

    return optim.Transform(init_fn=lambda p: TensorDict({}, []), update_fn=update, name="grows")


def test_chain_refuses_an_empty_chain_and_a_non_transform_with_whole_messages() -> None:
    """chain() and chain(t, 3) fail at construction, naming the bad argument's index and type."""
    with pytest.raises(ValueError, match=f"^{re.escape('chain() needs at least one transform')}$"):
        optim.chain()
    with pytest.raises(TypeError, match=r"^chain: argument 1 is int, not a Transform$"):
        optim.chain(optim.sgd(lr=0.1), 3)  # type: ignore[arg-type]


def test_chain_keeps_its_parts_as_hparams_and_its_state_under_their_indices() -> None:
    """A chain's hparams are its parts (in order, for purestep.compile); its state holds one
    entry per part under "0", "1", ... after init, update and step alike."""
    clip, sgd = optim.clip_by_global_norm(1.0), optim.sgd(lr=0.1, momentum=0.9)
    t = optim.chain(clip, sgd)
    assert t.hparams == (clip, sgd) and t.name == "chain(clip_by_global_norm, sgd)"
    p, g = _td(w=torch.ones(3)), _td(w=torch.full((3,), 0.5))
    s0 = t.init(p)
    _, s1 = t.update(g, s0, p)
    _, s2 = t.step(g, s1, p)
    _, s3 = t.update(g, s2, p)  # the updated state feeds the next update
    for s in (s0, s1, s2, s3):
        assert sorted(s.keys()) == ["0", "1"]
    assert not torch.equal(s3["1"]["momentum_buffer", "w"], s1["1"]["momentum_buffer", "w"])


@pytest.mark.parametrize("method", ["update", "step"])
def test_chain_hands_params_to_every_part(method: str) -> None:
    """Every transform of a chain sees the params, not only the last: a user transform
    that reads them (``g + wd * p``) gives the same result inside a chain as alone."""
    t = optim.chain(_decay_by_params(0.5), optim.sgd(lr=1.0))
    p, g = _td(w=torch.tensor([2.0, 4.0])), _td(w=torch.tensor([1.0, 1.0]))
    out, _ = getattr(t, method)(g, t.init(p), p)
    want = torch.tensor([-2.0, -3.0]) if method == "update" else torch.tensor([0.0, 1.0])
    assert torch.equal(out["w"], want)


@pytest.mark.parametrize("donate", [False, True])
def test_step_of_a_transform_without_a_step_fn_hands_params_to_its_update(donate: bool) -> None:
    """A transform with no fused step (a user's) steps as ``update`` + ``apply_updates``, and
    its update sees the params: ``p + (g + wd * p)`` for the decay-by-params transform."""
    t = _decay_by_params(0.5)
    assert t.step_fn is None
    p, g = _td(w=torch.tensor([2.0, 4.0])), _td(w=torch.tensor([1.0, 1.0]))
    out, _ = t.step(g, t.init(p), p, donate=donate)
    assert torch.equal(out["w"], torch.tensor([4.0, 7.0]))


@pytest.mark.parametrize("which", ["params", "grads"])
def test_params_or_grads_in_a_tensordict_params_step_as_a_plain_tensordict(which: str) -> None:
    """A ``TensorDictParams`` (tensordict.nn's container of a module's parameters) as params or
    as grads steps and updates exactly as the same tree in a plain TensorDict."""
    from tensordict.nn import TensorDictParams

    opt = optim.sgd(lr=0.5, momentum=0.9)
    p = TensorDict({"w": torch.tensor([1.0, -2.0]), "b": {"c": torch.ones(3)}}, [])
    g = TensorDict({"w": torch.tensor([0.5, 0.25]), "b": {"c": torch.full((3,), 2.0)}}, [])
    want_p, want_s = opt.step(g, opt.init(p), p)
    want_u, _ = opt.update(g, opt.init(p), p)
    pp = TensorDictParams(p.clone()) if which == "params" else p
    gg = TensorDictParams(g.clone()) if which == "grads" else g
    got_p, got_s = opt.step(gg, opt.init(pp), pp)
    got_u, _ = opt.update(gg, opt.init(pp), pp)
    for got, want in ((got_p, want_p), (got_s, want_s), (got_u, want_u)):
        assert tree.paths(got) == tree.paths(want)
        for a, b in zip(tree.leaves(got), tree.leaves(want), strict=True):
            assert torch.equal(a.detach(), b)


def test_raw_chain_functions_are_pure_without_donate() -> None:
    """A chain's own ``update_fn``/``step_fn``, called without ``donate``, write no input:
    donation is opt-in at every level, not only through Transform.update/step."""
    t = optim.chain(optim.clip_by_global_norm(0.1), optim.adamw(lr=0.1, weight_decay=0.1))
    p, g = _td(w=torch.tensor([1.0, -2.0])), _td(w=torch.tensor([3.0, 4.0]))
    s = t.step(g, t.init(p), p)[1]  # moments that are non-zero
    before = [p.clone(), g.clone(), s.clone()]
    t.update_fn(g, s, p)
    assert t.step_fn is not None
    t.step_fn(g, s, p)
    for a, b in zip([p, g, s], before, strict=True):
        assert_trees_equal(a, b)


def test_update_with_grads_for_a_subset_updates_that_subset_and_keeps_the_rest() -> None:
    """Transform.update with grads for some params: updates for exactly those, the others'
    per-parameter state unchanged, as Transform.step does."""
    t = optim.sgd(lr=1.0, momentum=0.5)
    p = _td(a=torch.ones(2), b=torch.ones(3))
    s = t.step(_td(a=torch.ones(2), b=torch.ones(3)), t.init(p), p)[1]
    upd, s2 = t.update(_td(b=torch.full((3,), 2.0)), s, p)
    assert tree.paths(upd) == [("b",)]
    assert torch.equal(upd["b"], torch.full((3,), -2.5))  # -(0.5 * 1 + 2)
    assert torch.equal(s2["momentum_buffer", "a"], s["momentum_buffer", "a"])
    assert torch.equal(s2["momentum_buffer", "b"], torch.full((3,), 2.5))


def test_subset_update_keeps_state_entries_a_transform_adds() -> None:
    """A transform whose update adds a state subtree keeps it when grads cover a subset."""
    t = _grows_state()
    p = _td(a=torch.ones(2), b=torch.ones(3))
    for method in ("update", "step"):
        _, s = getattr(t, method)(_td(b=torch.ones(3)), t.init(p), p)
        assert tree.paths(s) == [("seen", "b")]


def test_apply_updates_is_pure_by_default_and_keeps_each_params_dtype() -> None:
    """apply_updates(params, updates) writes nothing and returns params in their own dtype
    (a float32 update is cast to the bfloat16 param, as torch.optim's in-place add does)."""
    p = _td(w=torch.tensor([1.0, 2.0], dtype=torch.bfloat16), v=torch.ones(2))
    u = _td(w=torch.tensor([0.25, 1e-3]), v=torch.full((2,), 0.5))
    before = p.clone()
    out = optim.apply_updates(p, u)
    assert_trees_equal(p, before)
    assert out["w"].dtype == torch.bfloat16 and out["v"].dtype == torch.float32
    assert torch.equal(out["w"], p["w"] + u["w"].to(torch.bfloat16))
    assert torch.equal(out["v"], torch.full((2,), 1.5))
    donated = optim.apply_updates(p, u, donate=True)
    assert donated["w"] is p["w"] and torch.equal(p["w"], out["w"])


def test_apply_updates_names_the_updates_that_do_not_match_the_params() -> None:
    """A structure mismatch names the updates and the path, in the whole message."""
    with pytest.raises(
        ValueError, match=r"^updates keys differ from params: missing w; unexpected v$"
    ):
        optim.apply_updates(_td(w=torch.ones(2)), _td(v=torch.ones(2)))


# Generic transform checks (optimizers and combinators) ---------------------------------


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=4, deadline=None)
@given(
    data=st.data(),
    shapes=shapes_st,
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_pure_step_and_update_leave_inputs_bitwise_unchanged(
    name: str, data: st.DataObject, shapes: list[tuple[int, ...]], seed: int, dtype: torch.dtype
) -> None:
    """donate=False never writes params, grads or state, and returns no buffer of theirs."""
    opt = data.draw(transforms(name))
    init, gs = make_data(shapes, seed, dtype, steps=3)
    params = as_tree(init)
    state = opt.init(params)
    for g in gs[:2]:  # non-zero moments first
        params, state = opt.step(as_tree(g), state, params)
    g = as_tree(gs[2])
    before = [tree.clone(td) for td in (params, g, state)]
    outs = [*opt.step(g, state, params), *opt.update(g, state, params)]
    for td, ref in zip((params, g, state), before, strict=True):
        assert_trees_equal(td, ref)
    inputs = ptrs(params, g, state)
    for out in outs:
        assert not inputs & ptrs(out)


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=5, deadline=None)
@given(
    data=st.data(),
    shapes=shapes_st,
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
)
def test_donated_step_equals_pure_step_bitwise(
    name: str, data: st.DataObject, shapes: list[tuple[int, ...]], seed: int, dtype: torch.dtype
) -> None:
    """Six steps with donate=True give bitwise the params and state of donate=False."""
    opt = data.draw(transforms(name))
    init, gs = make_data(shapes, seed, dtype, steps=6)
    p1, s1 = run_ours(opt, init, gs, donate=True)
    p2, s2 = run_ours(opt, init, gs, donate=False)
    assert_trees_equal(p1, p2)
    assert_trees_equal(s1, s2)


def example(name: str) -> optim.Transform:
    return COMBINATORS[name]() if name in COMBINATORS else ROWS[name].make(**ROWS[name].example)


@pytest.mark.parametrize("name", ALL)
def test_donated_step_updates_params_in_their_own_buffers(name: str) -> None:
    """With donate=True the returned params are the input buffers (no new param memory)."""
    opt = example(name)
    init, gs = make_data([(3, 2), (4,)], 0, torch.float32, steps=1)
    params = as_tree(init)
    before = [t.data_ptr() for t in tree.leaves(params)]
    new_p, _ = opt.step(as_tree(gs[0]), opt.init(params), params, donate=True)
    assert [t.data_ptr() for t in tree.leaves(new_p)] == before


@pytest.mark.parametrize("name", ALL)
def test_update_fn_and_step_fn_called_directly_are_pure_by_default(name: str) -> None:
    """The functions a Transform holds default to ``donate=False`` as the methods do: called
    directly without it they write no input and return no buffer of theirs."""
    opt = example(name)
    init, gs = make_data([(3, 2), (4,)], 1, torch.float32, steps=2)
    params = as_tree(init)
    state = opt.init(params)
    params, state = opt.step(as_tree(gs[0]), state, params)  # non-zero moments first
    g = as_tree(gs[1])
    before = [tree.clone(td) for td in (params, g, state)]
    fns = [opt.update_fn] + ([opt.step_fn] if opt.step_fn is not None else [])
    outs = [out for fn in fns for out in fn(g, state, params)]
    for td, ref in zip((params, g, state), before, strict=True):
        assert_trees_equal(td, ref)
    inputs = ptrs(params, g, state)
    for out in outs:
        assert not inputs & ptrs(out)


@pytest.mark.parametrize("name", sorted(ROWS))
def test_state_dtypes_and_devices_do_not_follow_the_default_dtype_or_device(name: str) -> None:
    """init of CPU params under another default device (meta) or dtype (float64) gives the
    state of a plain init: every leaf on the params' device, scalars and step counts in
    their own dtypes (float32 step counts, not the default float64)."""
    row = ROWS[name]
    opt = row.make(**row.example)
    params = TensorDict({"w": torch.ones(4, 3), "b": torch.ones(3)}, [])
    ref = opt.init(params)
    with torch.device("meta"):
        on_meta = opt.init(params)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        in_fp64 = opt.init(params)
    finally:
        torch.set_default_dtype(default)
    assert_trees_equal(on_meta, ref)
    assert_trees_equal(in_fp64, ref)


@pytest.mark.parametrize("name", ALL)
def test_donated_step_with_grads_for_a_subset_updates_params_in_their_own_buffers(
    name: str,
) -> None:
    """With grads for some of the params only, donate=True still updates the stepped params in
    their own buffers (no new param memory), and returns the others as they are."""
    opt = example(name)
    init, gs = make_data([(3, 2), (4,), (2, 2)], 0, torch.float32, steps=1)
    params = as_tree(init)
    before = ptrs(params)
    sub = tree.select(as_tree(gs[0]), [gs[0][0], None, gs[0][2]])
    new_p, _ = opt.step(sub, opt.init(params), params, donate=True)
    assert ptrs(new_p) == before
    assert tree.leaves(new_p)[1] is init[1]


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("donate", [False, True])
def test_empty_tree_is_a_no_op(name: str, donate: bool) -> None:
    """A params tree with no leaves steps and updates without error and stays empty."""
    opt = example(name)
    empty = TensorDict({}, batch_size=[])
    new_p, _ = opt.step(empty, opt.init(empty), empty, donate=donate)
    upd, _ = opt.update(empty, opt.init(empty), empty, donate=donate)
    assert tree.leaves(new_p) == [] and tree.leaves(upd) == []


def error_params() -> TensorDict:
    return TensorDict({"enc": {"fc": {"weight": torch.ones(3, 2)}}, "head": torch.ones(4)}, [])


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("method", ["step", "update"])
def test_grads_with_wrong_shape_name_path_and_both_shapes(name: str, method: str) -> None:
    """A grad whose shape differs from its param fails with the key path and both shapes."""
    opt = example(name)
    p = error_params()
    g = TensorDict({"enc": {"fc": {"weight": torch.ones(2, 3)}}, "head": torch.ones(4)}, [])
    with pytest.raises(ValueError, match=re.escape("enc.fc.weight")) as info:
        getattr(opt, method)(g, opt.init(p), p)
    assert "(2, 3)" in str(info.value) and "(3, 2)" in str(info.value)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("method", ["step", "update"])
def test_grads_with_missing_or_extra_keys_name_them(name: str, method: str) -> None:
    """Missing and unexpected grad keys are named by key path."""
    opt = example(name)
    p = error_params()
    g = TensorDict({"enc": {"fc": {"bias": torch.ones(3)}}, "head": torch.ones(4)}, [])
    with pytest.raises(ValueError, match=r"missing enc\.fc\.weight.*unexpected enc\.fc\.bias"):
        getattr(opt, method)(g, opt.init(p), p)


@pytest.mark.parametrize("method", ["step", "update"])
def test_unknown_grad_keys_are_refused_with_the_whole_message(method: str) -> None:
    """Grads with keys the params lack are refused naming every missing param path (sorted)
    and every unexpected grad path, each list comma-separated; without missing params only
    the unexpected ones are named."""
    opt = optim.sgd(lr=0.1)
    one = torch.ones(2)
    p = TensorDict({"a": one, "b": {"c": one, "d": one}, "e": one}, [])
    cases = [
        (
            TensorDict({"b": {"x": one}, "y": one, "e": one}, []),
            "missing a, b.c, b.d; unexpected b.x, y",
        ),
        (TensorDict({"a": one, "z": one, "w": one}, []), "missing b.c, b.d, e; unexpected z, w"),
        (TensorDict({"a": one, "b": {"c": one, "d": one}, "e": one, "z": one}, []), "unexpected z"),
    ]
    for g, text in cases:
        whole = re.escape("grads keys differ from params: " + text)
        with pytest.raises(ValueError, match=f"^{whole}$"):
            getattr(opt, method)(g, opt.init(p), p)


@pytest.mark.parametrize("method", ["step", "update"])
def test_grads_for_a_subset_with_a_wrong_shape_are_refused_with_the_whole_message(
    method: str,
) -> None:
    """Grads for some of the params only, one of them of another shape than its param, are
    refused naming that grad's path and both shapes."""
    opt = optim.sgd(lr=0.1)
    p = TensorDict({"a": torch.ones(2), "b": {"c": torch.ones(3, 2)}, "e": torch.ones(4)}, [])
    g = TensorDict({"b": {"c": torch.ones(2, 3)}, "e": torch.ones(4)}, [])
    whole = re.escape("grads at b.c has shape (2, 3), but params has shape (3, 2)")
    with pytest.raises(ValueError, match=f"^{whole}$"):
        getattr(opt, method)(g, opt.init(p), p)


@pytest.mark.parametrize("name", sorted(ROWS))
def test_update_without_params_checks_grads_and_equals_update_with_params(name: str) -> None:
    """Without weight decay, update(grads, state) names a mismatching key path, and on good
    grads equals update(grads, state, params) up to the rounding of ``(p + u) - p`` (the
    updates do not depend on params)."""
    row = ROWS[name]
    opt = row.make(**{**row.example, **row.no_decay})
    p = error_params()
    state = opt.init(p)
    bad = TensorDict({"enc": {"fc": {"weight": torch.ones(3, 2)}}, "head": torch.ones(5)}, [])
    with pytest.raises(ValueError, match=r"head.*\(5,\).*\(4,\)"):
        opt.update(bad, state)
    g = p.apply(lambda t: torch.linspace(-1, 1, t.numel()).reshape(t.shape))
    without, with_ = opt.update(g, state)[0], opt.update(g, state, p)[0]
    for a, b in zip(tree.leaves(without), tree.leaves(with_), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", sorted(ROWS))
def test_update_with_weight_decay_needs_params(name: str) -> None:
    """Weight decay needs params; update without them says so."""
    opt = ROWS[name].make(lr=0.1, weight_decay=0.1)
    p = error_params()
    with pytest.raises(ValueError, match="needs params"):
        opt.update(p, opt.init(p))


@pytest.mark.parametrize("name", sorted(ROWS))
def test_non_floating_params_fail_at_init_naming_the_path(name: str) -> None:
    """Integer params cannot be optimized: init names the optimizer and the offending leaf,
    in the whole message."""
    p = TensorDict({"a": {"steps": torch.zeros(2, 2, dtype=torch.int64)}}, [])
    with pytest.raises(
        TypeError,
        match=f"^{name}: params at a\\.steps has dtype torch\\.int64; "
        "only floating-point params are supported$",
    ):
        ROWS[name].make().init(p)


@pytest.mark.parametrize("name", sorted(ROWS))
def test_state_count_and_lr_are_cpu_scalars_and_moments_follow_params(name: str) -> None:
    """count: int64 0-dim CPU (0, then 1); lr: float64 0-dim CPU = lr(0); every param-shaped
    state leaf is zero at init, in its param's dtype and device."""
    opt = ROWS[name].make(lr=schedules.constant(0.5))
    params = as_tree([torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.float64)])
    state = opt.init(params)
    assert (
        state["count"].dtype == torch.int64
        and state["count"].shape == ()
        and int(state["count"]) == 0
    )
    assert state["lr"].dtype == torch.float64 and float(state["lr"]) == 0.5
    for key in state.keys():
        value = state[key]
        if isinstance(value, TensorDict):
            for m, p in zip(tree.leaves(value), tree.leaves(params), strict=True):
                if m.shape == p.shape:
                    assert m.dtype == p.dtype and m.device == p.device and not m.any(), key
    _, state = opt.step(params.apply(torch.ones_like), state, params)
    assert int(state["count"]) == 1 and state["count"].device.type == "cpu"


@pytest.mark.parametrize("name", sorted(ROWS))
def test_counters_and_lr_are_cpu_scalars_even_under_a_meta_default_device(name: str) -> None:
    """Meta-device initialization (``with torch.device("meta")``, as before ``fully_shard``)
    still gives the state's scalars (``count``, ``lr``, per-param step counts) on the CPU,
    where DESIGN puts them, and every moment on the params' device: a meta count could
    never be read, saved or advanced."""
    row = ROWS[name]
    with torch.device("meta"):
        params = TensorDict({"w": torch.empty(4, 3), "b": torch.empty(3)}, [])
        transform = optim.chain(row.make(**row.example), optim.scale_by_schedule(0.5))
        state = transform.init(params)
    leaves = dict(state.items(include_nested=True, leaves_only=True))
    assert {k[-1] for k in leaves} >= {"count"}, sorted(leaves)
    for key, value in leaves.items():
        # Scalars (count, lr, per-param step counts) on the CPU, moments like the params.
        assert value.device.type == ("cpu" if value.dim() == 0 else "meta"), (key, value.device)


@pytest.mark.parametrize("name", sorted(ROWS))
@pytest.mark.parametrize(
    ("p_dtype", "g_dtype"),
    [
        (torch.float32, torch.float64),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float16),
    ],
)
@pytest.mark.parametrize("donate", [False, True])
def test_grads_of_another_dtype_are_cast_to_each_params_dtype(
    name: str, p_dtype: torch.dtype, g_dtype: torch.dtype, donate: bool
) -> None:
    """Grads in another floating dtype than their params (float64 grads, fp32 grads of bf16
    params: the fused fp32 and the foreach bf16 paths) step exactly as the grads cast to the
    params' dtype first, as torch.optim does with a .grad of another dtype."""
    row = ROWS[name]
    opt = row.make(**row.example)
    gen = torch.Generator().manual_seed(5)
    shapes = [(6, 3), (4,)]
    p0 = [torch.randn(s, generator=gen).to(p_dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(g_dtype) for s in shapes] for _ in range(3)]

    def run(cast: bool) -> tuple[TensorDict, TensorDict]:
        params = as_tree([t.clone() for t in p0])
        state = opt.init(params)
        for gs in grads:
            g = as_tree([x.to(p_dtype) if cast else x.clone() for x in gs])
            params, state = opt.step(g, state, params, donate=donate)
        return params, state

    got_p, got_s = run(cast=False)
    want_p, want_s = run(cast=True)
    assert_trees_equal(got_p, want_p)
    assert_trees_equal(got_s, want_s)


@pytest.mark.parametrize("name", sorted(ROWS))
@pytest.mark.parametrize("donate", [False, True])
def test_params_of_several_dtypes_step_each_as_its_own_tree(name: str, donate: bool) -> None:
    """A tree mixing float32, float64 and bfloat16 params (three kernel groups: fused and
    foreach) updates every param exactly as a tree holding that param alone does."""
    row = ROWS[name]
    opt = row.make(**row.example)
    gen = torch.Generator().manual_seed(11)
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float32]
    p0 = [torch.randn(5, 3, generator=gen).to(dt) for dt in dtypes]
    grads = [[torch.randn(5, 3, generator=gen).to(dt) for dt in dtypes] for _ in range(3)]

    names = [tuple(n.split(".")) for n in paths(len(dtypes))]  # each param keeps its path

    def run(idx: list[int]) -> list[Tensor]:
        params = tree.unflatten([(names[i], p0[i].clone()) for i in idx])
        state = opt.init(params)
        for gs in grads:
            g = tree.unflatten([(names[i], gs[i].clone()) for i in idx])
            params, state = opt.step(g, state, params, donate=donate)
        return tree.leaves(params)

    together = run(list(range(len(dtypes))))
    for i in range(len(dtypes)):
        assert torch.equal(together[i], run([i])[0]), f"param {i} ({dtypes[i]})"


# Kernel plumbing (optim._kernels) ----------------------------------------------------------


def test_checked_lr_refuses_a_bad_rate_with_the_whole_message_and_its_count() -> None:
    """A negative, NaN or infinite rate, and a schedule that raises, are refused with a
    message naming the optimizer, the update and the value, and carry that count."""
    for lr, shown in [(-0.25, "-0.25"), (math.nan, "nan"), (math.inf, "inf")]:
        with pytest.raises(errors.ScheduleError) as info:
            _kernels.checked_lr(lambda n, lr=lr: lr if n == 3 else 0.1, 3, "adamw")
        assert str(info.value) == (
            f"adamw: the learning rate at update 3 is {shown}; it must be finite and >= 0 "
            "(check the schedule)"
        )
        assert info.value.count == 3

    def broken(n: int) -> float:
        raise ValueError(f"no value at {n}")

    with pytest.raises(errors.ScheduleError) as info:
        _kernels.checked_lr(broken, 7, "lion")
    assert str(info.value) == "lion: the learning-rate schedule failed at update 7: no value at 7"
    assert info.value.count == 7
    assert isinstance(info.value.__cause__, ValueError)


@settings(max_examples=20, deadline=None)
@given(rate=st.floats(0.0, 1e300), count=st.integers(0, 10**6))
def test_checked_lr_accepts_every_finite_non_negative_rate_at_its_count(
    rate: float, count: int
) -> None:
    """Every finite rate >= 0 (0 and rates above 1 included) is returned as the schedule
    gives it at ``count``, and a constant as it is."""
    assert _kernels.checked_lr(rate, count, "sgd") == rate
    assert _kernels.checked_lr(lambda n: rate if n == count else -1.0, count, "sgd") == rate
    assert _kernels.checked_lr(0.0, count, "sgd") == 0.0


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str
)
def test_check_lr_fits_refuses_a_rate_past_the_dtype_max_with_the_whole_message(
    dtype: torch.dtype,
) -> None:
    """A rate just above a param dtype's largest value is refused, naming the optimizer,
    the update, the rate and the dtype with its largest value; exactly the largest value
    (and float16's, for every dtype) is accepted. Integer params never count."""
    top = float(torch.finfo(dtype).max)
    past = math.nextafter(top, math.inf)
    ints = torch.zeros(2, dtype=torch.int64)
    _kernels.check_lr_fits(top, [ints, torch.zeros(2, dtype=dtype)], 4, "sgd")
    _kernels.check_lr_fits(
        float(torch.finfo(torch.float16).max), [torch.zeros(1, dtype=dtype)], 4, "sgd"
    )
    with pytest.raises(errors.ScheduleError) as info:
        _kernels.check_lr_fits(past, [ints, torch.zeros(1, dtype=dtype)], 4, "sgd")
    assert str(info.value) == (
        f"sgd: the learning rate at update 4 is {past!r}, which overflows {dtype} (the params' "
        f"dtype, largest value {top!r}); the update would make the params inf or NaN"
    )
    assert info.value.count == 4


def test_check_lr_fits_looks_at_no_dtype_up_to_float16_max() -> None:
    """Up to float16's largest value the check is free: it does not look at the params,
    not even float8 ones whose largest value is smaller (a documented approximation)."""
    f8 = torch.zeros(1, dtype=torch.float8_e4m3fn)
    assert float(torch.finfo(f8.dtype).max) < float(torch.finfo(torch.float16).max)
    _kernels.check_lr_fits(float(torch.finfo(torch.float16).max), [f8], 0, "sgd")


@pytest.mark.parametrize("lr", [None, 0.25])
def test_scalar_state_holds_count_and_lr_as_cpu_scalars_under_any_default_device(
    lr: float | None,
) -> None:
    """``count`` int64 and ``lr`` float64 (only when given), 0-dim, on the CPU even under a
    meta default device."""
    with torch.device("meta"):
        s = _kernels.scalar_state(5, lr)
    assert sorted(s) == (["count"] if lr is None else ["count", "lr"])
    assert s["count"].dtype == torch.int64 and s["count"].device.type == "cpu"
    assert s["count"].shape == () and int(s["count"]) == 5
    if lr is not None:
        assert s["lr"].dtype == torch.float64 and s["lr"].device.type == "cpu"
        assert s["lr"].shape == () and float(s["lr"]) == lr


_FUSED_TABLE_DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.complex64,
    torch.int32,
]


@pytest.mark.parametrize("device", ["cpu", "cuda", "xpu", "hpu", "meta", "mps"])
@pytest.mark.parametrize("dtype", _FUSED_TABLE_DTYPES, ids=str)
def test_fused_supported_follows_the_documented_table(device: str, dtype: torch.dtype) -> None:
    """Fused kernels on CPU, CUDA, XPU and HPU for fp16/bf16/fp32/fp64 only, Adam by
    default; SGD also there except CPU fp16/bf16 (pytorch/pytorch#191763). Only the device
    type matters (no device needs to exist)."""
    listed = device in {"cpu", "cuda", "xpu", "hpu"} and dtype in {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    }
    half_on_cpu = device == "cpu" and dtype in {torch.float16, torch.bfloat16}
    dev = torch.device(device)
    assert _kernels.fused_supported(dev, dtype) is listed
    assert _kernels.fused_supported(dev, dtype, kernel="adam") is listed
    assert _kernels.fused_supported(dev, dtype, kernel="sgd") is (listed and not half_on_cpu)


@pytest.mark.parametrize("as_tensor", [False, True])
@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str
)
@settings(max_examples=10, deadline=None)
@given(
    factor=st.one_of(st.sampled_from([1 - 1e-4, 1 - 1e-9, 0.0]), st.floats(-4.0, 4.0)),
    sizes=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_foreach_mul_equals_the_per_tensor_mul_bitwise_on_every_device(
    as_tensor: bool,
    dtype: torch.dtype,
    factor: float,
    sizes: list[int],
    seed: int,
) -> None:
    """``foreach_mul_`` multiplies every tensor in place exactly as ``t.mul_(factor)`` does:
    the factor is applied in the op's math type, not first rounded to the tensors' dtype
    (CPU ``_foreach_mul_`` would round ``1 - 1e-4`` to bf16's 1.0), and a float64 factor
    keeps its precision on float64 tensors. Tensors on several devices (here CPU and meta)
    each get the factor, a tensor factor moved to their device."""
    g = torch.Generator().manual_seed(seed)
    cpu = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    meta = [torch.empty(n, dtype=dtype, device="meta") for n in sizes]
    want = [t.clone().mul_(factor) for t in cpu]
    mixed = [x for pair in zip(cpu, meta, strict=True) for x in pair]
    f = torch.tensor(factor, dtype=torch.float64) if as_tensor else factor
    _kernels.foreach_mul_(mixed, f)
    for t, w in zip(cpu, want, strict=True):
        assert t.dtype == dtype and torch.equal(t, w), (t, w)
    _kernels.foreach_mul_([], f)  # nothing to do


def test_foreach_mul_keeps_a_float64_factor_exact_and_a_bf16_factor_unrounded() -> None:
    """The documented cases: ``1 - 1e-9`` scales float64 tensors (float32 would round it
    to 1.0), and ``0.99756`` scales bf16 ones by itself, not by bf16(0.99756) = 0.99609."""
    x = torch.full((3,), 1.5, dtype=torch.float64)
    _kernels.foreach_mul_([x], 1 - 1e-9)
    assert torch.equal(x, torch.full((3,), 1.5 * (1 - 1e-9), dtype=torch.float64))
    y = torch.tensor([3.0, -1.5, 7.0], dtype=torch.bfloat16)
    want = (y.float() * 0.99756).to(torch.bfloat16)  # one rounding, at the end
    _kernels.foreach_mul_([y], 0.99756)
    assert torch.equal(y, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
def test_foreach_mul_scales_cpu_tensors_under_a_meta_default_device(dtype: torch.dtype) -> None:
    """A float factor is applied to CPU tensors also inside ``with torch.device("meta")``
    (or any other default device): the 0-dim factor is made on the tensors' device, not
    the default one (a meta factor left them unscaled)."""
    x = torch.tensor([3.0, -1.5, 7.0], dtype=dtype)
    want = x.clone().mul_(0.99756)
    with torch.device("meta"):
        _kernels.foreach_mul_([x], 0.99756)
    assert torch.equal(x, want)


@st.composite
def _numels(draw: st.DrawFn) -> tuple[list[torch.Tensor], int]:
    budget = draw(st.integers(1, 12))
    sizes = draw(st.lists(st.integers(0, 2 * budget), max_size=8))
    return [torch.empty(n) for n in sizes], budget


@settings(max_examples=20, deadline=None)
@given(case=_numels())
def test_chunks_partition_the_list_greedily_within_the_budget(
    case: tuple[list[torch.Tensor], int],
) -> None:
    """The slices cover the tensors in order, each once; no slice is empty; a slice holds at
    most ``budget`` elements unless it is one tensor that alone exceeds it; and each slice is
    as long as the budget allows (adding the next tensor would exceed it)."""
    tensors, budget = case
    out = _kernels.chunks(tensors, budget=budget)
    covered = [i for sl in out for i in range(len(tensors))[sl]]
    assert covered == list(range(len(tensors)))
    sizes = [sum(t.numel() for t in tensors[sl]) for sl in out]
    for k, sl in enumerate(out):
        n = len(range(len(tensors))[sl])
        assert n >= 1
        assert sizes[k] <= budget or n == 1, (out, sizes)
        if k + 1 < len(out):
            assert sizes[k] + tensors[sl.stop].numel() > budget, (out, sizes)


def test_chunks_slices_and_default_budget() -> None:
    """The documented example's slices exactly, an empty list gives none, and without a
    budget ``TEMP_CHUNK_ELEMENTS`` is read at call time."""
    z = torch.zeros
    assert _kernels.chunks([z(3), z(3), z(5)], budget=6) == [slice(0, 2), slice(2, 3)]
    assert _kernels.chunks([z(6), z(6)], budget=6) == [slice(0, 1), slice(1, 2)]
    assert _kernels.chunks([], budget=6) == []
    assert _kernels.chunks([z(4), z(4)]) == [slice(0, 2)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_kernels, "TEMP_CHUNK_ELEMENTS", 4)
        assert _kernels.chunks([z(4), z(4)]) == [slice(0, 1), slice(1, 2)]


def _dense_reference(t: torch.Tensor) -> bool:
    """Whether the memory offsets of ``t``'s elements are ``numel`` distinct consecutive ones."""
    if t.numel() == 0:
        return True
    offsets = torch.zeros((), dtype=torch.int64)
    for dim, (n, s) in enumerate(zip(t.shape, t.stride(), strict=True)):
        shape = [1] * t.dim()
        shape[dim] = n
        offsets = offsets + (torch.arange(n) * s).reshape(shape)
    flat = offsets.expand(t.shape).reshape(-1).sort().values
    return bool(torch.equal(flat - flat[0], torch.arange(t.numel())))


@st.composite
def _layouts(draw: st.DrawFn, overlaps: bool = True) -> torch.Tensor:
    """A tensor with a drawn layout: permuted, sliced (gaps), expanded (overlaps, unless
    ``overlaps=False``: params never overlap), size-1 dims with any stride."""
    shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    t = t.permute(draw(st.permutations(range(len(shape)))))
    hows = ["plain", "slice", "step", "strided1", *(["expand"] if overlaps else [])]
    how = draw(st.sampled_from(hows))
    dim = draw(st.integers(0, t.dim() - 1))
    if how == "slice" and t.shape[dim] > 1:
        t = t.narrow(dim, 0, t.shape[dim] - 1)
    elif how == "step" and t.shape[dim] > 2:
        t = t[(slice(None),) * dim + (slice(None, None, 2),)]
    elif how == "expand":
        t = t.unsqueeze(dim).expand(*t.shape[:dim], 3, *t.shape[dim:])
    elif how == "strided1":
        # A size-1 dim may have any stride without changing the layout.
        t = t.unsqueeze(dim)
        t = t.as_strided(t.shape, [*t.stride()[:dim], 7, *t.stride()[dim + 1 :]])
    return t


@settings(max_examples=20, deadline=None)
@given(ts=st.lists(_layouts(), min_size=1, max_size=3))
def test_is_dense_is_true_exactly_when_elements_fill_their_memory(ts: list[torch.Tensor]) -> None:
    """``is_dense`` agrees with a direct count of the elements' memory offsets (any dim
    order; gaps and overlaps are not dense), and ``all_dense`` with ``is_dense`` of each."""
    for t in ts:
        assert _kernels.is_dense(t) is _dense_reference(t), (t.shape, t.stride())
    assert _kernels.all_dense(ts) is all(_dense_reference(t) for t in ts)


def _real_strides(t: torch.Tensor) -> list[int]:
    """The strides of the dims longer than 1 (a size-1 dim's stride does not move anything)."""
    return [s for s, n in zip(t.stride(), t.shape, strict=True) if n != 1]


@settings(max_examples=20, deadline=None)
@given(
    pairs=st.lists(
        st.tuples(_layouts(overlaps=False), st.sampled_from(["same", "contiguous", "expanded"])),
        min_size=1,
        max_size=4,
    ),
    grad_dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_match_layout_gives_each_gradient_its_params_strides_copying_only_when_needed(
    pairs: list[tuple[torch.Tensor, str]], grad_dtype: torch.dtype
) -> None:
    """Each result holds its gradient's values and dtype, laid out like its param where the
    param is dense, contiguous where it is not; a gradient already laid out so is passed on
    as it is (the list itself when every gradient has its param's strides), and the
    gradients given are never written."""
    params = [p for p, _ in pairs]
    grads = []
    for p, how in pairs:
        values = torch.randn(p.shape, dtype=torch.float64).to(grad_dtype)
        if how == "same":
            g = torch.empty_strided(p.shape, p.stride(), dtype=grad_dtype).copy_(values)
        elif how == "expanded" and p.numel():
            g = values.flatten()[:1].reshape([1] * p.dim()).expand(p.shape)
        else:
            g = values
        grads.append(g)
    before = [g.clone() for g in grads]
    out = _kernels.match_layout(params, grads)
    assert len(out) == len(grads)
    for p, g, b, o in zip(params, grads, before, out, strict=True):
        assert torch.equal(g, b) and torch.equal(o, b) and o.dtype == grad_dtype
        dense = _dense_reference(p)
        want = _real_strides(p if dense else torch.empty(p.shape))
        if g.stride() == p.stride() or (g.is_contiguous() and (p.is_contiguous() or not dense)):
            assert o is g
        else:
            assert _real_strides(o) == want, (p.stride(), g.stride(), o.stride())
    if all(g.stride() == p.stride() for p, g in zip(params, grads, strict=True)):
        assert out is grads


@pytest.mark.parametrize("name", sorted(ROWS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_pure_step_of_sliced_params_keeps_dtype_device_and_strides_under_any_default_device(
    name: str, dtype: torch.dtype
) -> None:
    """The pure step copies a sliced (not dense) param with its strides, dtype and device,
    whatever the default device (here meta) and dtype: its result equals the donated step's
    bitwise, in the param's dtype, on the param's device, with the param's strides."""
    row = ROWS[name]
    big = torch.randn(4, 9, generator=torch.Generator().manual_seed(5)).to(dtype)
    grad = torch.randn(4, 6, generator=torch.Generator().manual_seed(6)).to(dtype)

    def params() -> TensorDict:
        return TensorDict({"w": big.clone()[:, 2:8]}, [])

    opt = row.make(**row.example)
    donated, _ = opt.step(
        TensorDict({"w": grad.clone()}, []), opt.init(params()), params(), donate=True
    )
    p = params()
    state = opt.init(p)
    with torch.device("meta"):
        pure, _ = opt.step(TensorDict({"w": grad.clone()}, []), state, p)
    w = pure["w"]
    assert w.dtype == dtype and w.device.type == "cpu" and w.stride() == p["w"].stride()
    assert torch.equal(w, donated["w"])


@pytest.mark.parametrize("name", sorted(ROWS))
def test_non_floating_params_are_refused_at_init_with_the_whole_message(name: str) -> None:
    """The message names the optimizer, the path of the first non-floating leaf and its dtype."""
    opt = ROWS[name].make()
    p = TensorDict({"a": {"w": torch.zeros(2), "steps": torch.zeros(2, dtype=torch.int32)}}, [])
    with pytest.raises(TypeError) as info:
        opt.init(p)
    assert str(info.value) == (
        f"{opt.name}: params at a.steps has dtype torch.int32; "
        "only floating-point params are supported"
    )


def _add_kernel(
    p: list[Tensor],
    g: list[Tensor],
    moments: list[list[Tensor]],
    lr: float,
    steps: list[Tensor] | None,
    count: int,
) -> None:
    torch._foreach_add_(p, g, alpha=-lr)


def test_kernel_transform_defaults_keep_no_step_counts_and_need_no_params_for_update() -> None:
    """By default a kernel transform keeps no per-parameter ``steps`` (only ``count``, ``lr``
    and its moments), its kernel is handed ``steps=None``, and ``update`` works without
    params (no weight decay), giving ``-lr * g``."""
    seen: list[object] = []

    def kernel(p, g, moments, lr, steps, count):  # type: ignore[no-untyped-def]
        seen.append(steps)
        _add_kernel(p, g, moments, lr, steps, count)

    t = _kernels.kernel_transform(name="plain", hparams=None, lr=0.5, moments=("m",), kernel=kernel)
    params = TensorDict({"w": torch.ones(3)}, [])
    state = t.init(params)
    assert sorted(state.keys()) == ["count", "lr", "m"]
    grads = TensorDict({"w": torch.full((3,), 2.0)}, [])
    upd, new_state = t.update(grads, state)
    assert torch.equal(upd["w"], torch.full((3,), -1.0))
    assert sorted(new_state.keys()) == ["count", "lr", "m"] and seen == [None]


@pytest.mark.parametrize("name", sorted(ROWS))
def test_init_refuses_the_first_lr_with_the_whole_message_when_it_went_bad_after_construction(
    name: str,
) -> None:
    """``init`` evaluates the learning rate of update 0 again (a user callable may read
    state that changed since construction): a negative one, or one that overflows the
    params' dtype, is refused there, naming the optimizer and update 0."""
    value = [0.1]
    opt = ROWS[name].make(lr=lambda n: value[0])
    params = TensorDict({"w": torch.ones(2, dtype=torch.float16)}, [])
    value[0] = -1.0
    with pytest.raises(errors.ScheduleError) as info:
        opt.init(params)
    assert str(info.value) == (
        f"{opt.name}: the learning rate at update 0 is -1.0; it must be finite and >= 0 "
        "(check the schedule)"
    )
    value[0] = 1e6
    with pytest.raises(errors.ScheduleError) as info:
        opt.init(params)
    assert str(info.value) == (
        f"{opt.name}: the learning rate at update 0 is 1000000.0, which overflows "
        "torch.float16 (the params' dtype, largest value 65504.0); the update would make "
        "the params inf or NaN"
    )
    assert info.value.count == 0


@pytest.mark.parametrize("name", sorted(ROWS))
def test_step_counts_are_float32_whatever_the_default_dtype(name: str) -> None:
    """Per-parameter step counts (where an optimizer keeps them) are float32 0-dim tensors,
    as torch.optim's fused kernels take them, also under a float64 default dtype; and a
    step with them equals the step made under the float32 default, bitwise."""
    row = ROWS[name]
    params = TensorDict({"w": torch.ones(3, 2), "b": torch.ones(2, dtype=torch.float64)}, [])
    grads = params.apply(lambda t: torch.full_like(t, 0.5))
    opt = row.make(**row.example)
    want = opt.step(grads, opt.init(params), params)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        state = opt.init(params)
    finally:
        torch.set_default_dtype(old)
    if "steps" in state.keys():
        for s in tree.leaves(state["steps"]):
            assert s.dtype == torch.float32 and s.shape == ()
    got = opt.step(grads, state, params)
    assert_trees_equal(got[0], want[0])
    assert_trees_equal(got[1], want[1])


@pytest.mark.parametrize("name", sorted(ROWS))
def test_donated_step_updates_moments_and_step_counts_in_their_own_buffers(name: str) -> None:
    """With donate=True every per-parameter state leaf (moments, step counts) of the
    returned state is the input state's buffer, advanced in place, step after step."""
    row = ROWS[name]
    opt = row.make(**row.example)
    init, gs = make_data([(3, 2), (4,)], 0, torch.float32, steps=2)
    params = as_tree(init)
    state = opt.init(params)
    per_param = [k for k in state.keys() if k not in ("count", "lr")]
    before = {k: [t.data_ptr() for t in tree.leaves(state[k])] for k in per_param}
    for g in gs:
        params, state = opt.step(as_tree(g), state, params, donate=True)
        assert {k: [t.data_ptr() for t in tree.leaves(state[k])] for k in per_param} == before
    if "steps" in per_param:
        assert [float(s) for s in tree.leaves(state["steps"])] == [2.0, 2.0]


@settings(max_examples=20, deadline=None)
@given(data=st.data(), total=st.integers(0, 6))
def test_pick_selects_the_indexed_items_in_order_and_the_list_itself_for_all(
    data: st.DataObject, total: int
) -> None:
    """``pick`` gives exactly ``items[i]`` for each index (the same tensors, in order), and
    ``items`` itself when the indices are all ``total`` of them (one group of one device and
    dtype: no new list)."""
    items = [torch.full((1,), float(i)) for i in range(total)]
    idx = sorted(data.draw(st.sets(st.integers(0, max(total - 1, 0)), max_size=total)))
    out = _kernels.pick(items, idx, total)
    assert len(out) == len(idx) and all(o is items[i] for o, i in zip(out, idx, strict=True))
    assert _kernels.pick(items, list(range(total)), total) is items


@pytest.mark.parametrize("name", ["adam", "adamw", "lion", "sgd"])
def test_a_schedule_overflowing_the_params_dtype_later_is_refused_naming_the_optimizer(
    name: str,
) -> None:
    """A schedule valid at update 0 that later returns a rate above float16's largest value
    is refused at that update, before anything changes, naming the optimizer, the update,
    the rate and the params' dtype."""
    opt = getattr(optim, name)(lr=lambda n: 1e-3 if n == 0 else 1e6)
    params = TensorDict({"w": torch.ones(3, dtype=torch.float16)}, [])
    grads = params.apply(torch.ones_like)
    params, state = opt.step(grads, opt.init(params), params)
    before = tree.clone(params)
    with pytest.raises(errors.ScheduleError) as info:
        opt.step(grads, state, params)
    assert str(info.value).startswith(
        f"{name}: the learning rate at update 1 is 1000000.0, which overflows torch.float16"
    )
    assert info.value.count == 1
    assert_trees_equal(params, before)


@pytest.mark.parametrize("name", ["adam", "sgd", "lion"])
def test_update_fn_without_params_refuses_grads_unlike_the_state_naming_it(name: str) -> None:
    """The raw ``update_fn`` without params (no weight decay; SGD with momentum, so with a
    moment) checks the grads against the optimizer state's tree, naming the missing and unexpected keys and the state."""
    kwargs: dict[str, Any] = {"lr": 0.1}
    kwargs.update({"momentum": 0.9} if name == "sgd" else {"weight_decay": 0.0})
    opt = getattr(optim, name)(**kwargs)
    params = TensorDict({"w": torch.ones(2), "b": torch.ones(3)}, [])
    state = opt.init(params)
    for grads, msg in (
        ({"w": torch.ones(2), "c": torch.ones(3)}, "missing b; unexpected c"),
        ({"w": torch.ones(2), "b": torch.ones(3), "c": torch.ones(1)}, "unexpected c"),
    ):
        with pytest.raises(ValueError, match=r"^grads keys differ") as info:
            opt.update_fn(TensorDict(grads, []), state, None)
        assert str(info.value) == f"grads keys differ from optimizer state: {msg}"
