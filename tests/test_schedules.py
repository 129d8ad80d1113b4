"""Schedules: closed forms, torch.optim.lr_scheduler equivalents, int vs tensor count, errors."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _ids import safe_id
from purestep.optim import Schedule, schedules

value_st = st.floats(-10.0, 10.0)
pos_st = st.floats(1e-3, 10.0)
steps_st = st.integers(1, 200)
count_st = st.integers(0, 500)


def torch_lrs(base: float, make: Callable[[torch.optim.Optimizer], Any], n: int) -> list[float]:
    """The lr torch uses for updates 0..n-1 when ``scheduler.step()`` follows ``optimizer.step()``."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    sched = make(opt)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def assert_seq_close(ours: Schedule, ref: list[float], *, rel: float = 1e-9) -> None:
    for n, r in enumerate(ref):
        assert ours(n) == pytest.approx(r, rel=rel, abs=1e-12), f"count {n}"


# --- closed forms -----------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(value=value_st, n=count_st)
def test_constant_is_its_value(value: float, n: int) -> None:
    """constant(v)(n) == v for every count."""
    assert schedules.constant(value)(n) == value


@settings(max_examples=50, deadline=None)
@given(start=value_st, end=value_st, steps=steps_st, n=count_st)
def test_linear_closed_form(start: float, end: float, steps: int, n: int) -> None:
    """linear: start + (end - start) * min(n, steps) / steps; exact at both ends."""
    s = schedules.linear(start, end, steps)
    assert s(n) == pytest.approx(start + (end - start) * min(n, steps) / steps, abs=1e-12)
    assert s(0) == start and s(steps) == end and s(steps + n) == end


@settings(max_examples=50, deadline=None)
@given(init=value_st, end=value_st, steps=steps_st, n=count_st)
def test_cosine_decay_closed_form(init: float, end: float, steps: int, n: int) -> None:
    """cosine_decay: end + (init - end) * (1 + cos(pi * min(n, steps) / steps)) / 2."""
    s = schedules.cosine_decay(init, steps, end=end)
    expect = end + (init - end) * 0.5 * (1 + math.cos(math.pi * min(n, steps) / steps))
    assert s(n) == pytest.approx(expect, abs=1e-12)
    assert s(0) == init and s(steps + n) == pytest.approx(end, abs=1e-12)


@st.composite
def warmup_args(draw: st.DrawFn) -> dict[str, Any]:
    w = draw(st.integers(0, 50))
    return {
        "peak": draw(pos_st),
        "warmup_steps": w,
        "total_steps": w + draw(st.integers(1, 100)),
        "init": draw(st.floats(0.0, 1.0)),
        "end": draw(st.floats(0.0, 1e-2)),
    }


@settings(max_examples=50, deadline=None)
@given(args=warmup_args(), n=count_st)
def test_warmup_cosine_closed_form(args: dict[str, Any], n: int) -> None:
    """Linear init -> peak over warmup, cosine peak -> end at total_steps, then end."""
    s = schedules.warmup_cosine(**args)
    w, t = args["warmup_steps"], args["total_steps"]
    peak, init, end = args["peak"], args["init"], args["end"]
    if n < w:
        expect = init + (peak - init) * n / w
    else:
        expect = end + (peak - end) * 0.5 * (1 + math.cos(math.pi * min(n - w, t - w) / (t - w)))
    assert s(n) == pytest.approx(expect, rel=1e-12, abs=1e-12)
    assert s(w) == pytest.approx(peak) and s(t + n) == pytest.approx(end, abs=1e-12)


@settings(max_examples=50, deadline=None)
@given(args=warmup_args(), n=count_st)
def test_warmup_linear_closed_form(args: dict[str, Any], n: int) -> None:
    """Linear init -> peak over warmup, linear peak -> end at total_steps, then end."""
    s = schedules.warmup_linear(**args)
    w, t = args["warmup_steps"], args["total_steps"]
    peak, init, end = args["peak"], args["init"], args["end"]
    if n < w:
        expect = init + (peak - init) * n / w
    else:
        expect = peak + (end - peak) * min(n - w, t - w) / (t - w)
    assert s(n) == pytest.approx(expect, rel=1e-12, abs=1e-12)


@settings(max_examples=50, deadline=None)
@given(
    values=st.lists(value_st, min_size=1, max_size=4),
    gaps=st.lists(st.integers(0, 30), min_size=3, max_size=3),
    n=count_st,
)
def test_join_shifts_each_later_schedule_by_its_boundary(
    values: list[float], gaps: list[int], n: int
) -> None:
    """join: schedule i sees count - boundaries[i-1] between its boundaries (optax semantics)."""
    parts = [schedules.linear(v, v + 1.0, 10) for v in values]
    bounds = [sum(gaps[: i + 1]) for i in range(len(parts) - 1)]
    s = schedules.join(parts, bounds)
    i = sum(1 for b in bounds if n >= b)
    start = bounds[i - 1] if i else 0
    assert s(n) == parts[i](n - start)


@settings(max_examples=50, deadline=None)
@given(
    init=pos_st,
    pairs=st.dictionaries(st.integers(0, 100), st.floats(0.0, 2.0), max_size=4),
    n=count_st,
)
def test_piecewise_constant_closed_form(init: float, pairs: dict[int, float], n: int) -> None:
    """init times the product of the scales of all boundaries <= count."""
    expect = init
    for b in sorted(pairs):
        if n >= b:
            expect *= pairs[b]
    assert schedules.piecewise_constant(init, pairs)(n) == pytest.approx(expect, rel=1e-12)


# --- torch.optim.lr_scheduler equivalents -------------------------------------------


@settings(max_examples=20, deadline=None)
@given(
    base=pos_st,
    start=st.floats(0.01, 1.0),
    end=st.floats(0.0, 1.0),
    steps=st.integers(1, 40),
)
def test_linear_matches_torch_linearlr(base: float, start: float, end: float, steps: int) -> None:
    """linear(base*start, base*end, steps) == LinearLR(start_factor, end_factor, total_iters)."""
    ref = torch_lrs(
        base,
        lambda o: torch.optim.lr_scheduler.LinearLR(o, start, end, total_iters=steps),
        steps + 10,
    )
    assert_seq_close(schedules.linear(base * start, base * end, steps), ref)


@settings(max_examples=20, deadline=None)
@given(base=pos_st, eta_min=st.floats(0.0, 1e-3), steps=st.integers(1, 60))
def test_cosine_decay_matches_torch_cosineannealinglr(
    base: float, eta_min: float, steps: int
) -> None:
    """cosine_decay(base, T, end=eta_min) == CosineAnnealingLR(T_max=T, eta_min) up to T."""
    ref = torch_lrs(
        base,
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=steps, eta_min=eta_min),
        steps + 1,
    )
    assert_seq_close(schedules.cosine_decay(base, steps, end=eta_min), ref, rel=1e-6)


@settings(max_examples=15, deadline=None)
@given(
    peak=pos_st,
    init_frac=st.floats(0.01, 1.0),
    warmup=st.integers(1, 20),
    decay=st.integers(1, 40),
    end=st.floats(0.0, 1e-3),
)
def test_warmup_cosine_matches_torch_sequentiallr(
    peak: float, init_frac: float, warmup: int, decay: int, end: float
) -> None:
    """warmup_cosine == SequentialLR([LinearLR, CosineAnnealingLR], milestones=[warmup]).

    Also checks ``join(linear, cosine_decay)``, which is the same composition.
    """

    def make(o: torch.optim.Optimizer) -> Any:
        lin = torch.optim.lr_scheduler.LinearLR(o, init_frac, 1.0, total_iters=warmup)
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=decay, eta_min=end)
        return torch.optim.lr_scheduler.SequentialLR(o, [lin, cos], milestones=[warmup])

    ref = torch_lrs(peak, make, warmup + decay + 1)
    s = schedules.warmup_cosine(peak, warmup, warmup + decay, init=peak * init_frac, end=end)
    assert_seq_close(s, ref, rel=1e-6)
    joined = schedules.join(
        [
            schedules.linear(peak * init_frac, peak, warmup),
            schedules.cosine_decay(peak, decay, end=end),
        ],
        [warmup],
    )
    assert_seq_close(joined, ref, rel=1e-6)


@settings(max_examples=20, deadline=None)
@given(
    base=pos_st,
    milestones=st.lists(st.integers(1, 50), min_size=1, max_size=4, unique=True),
    gamma=st.floats(0.05, 1.0),
)
def test_piecewise_constant_matches_torch_multisteplr(
    base: float, milestones: list[int], gamma: float
) -> None:
    """piecewise_constant(base, {m: gamma}) == MultiStepLR(milestones, gamma)."""
    ms = sorted(milestones)
    ref = torch_lrs(
        base, lambda o: torch.optim.lr_scheduler.MultiStepLR(o, ms, gamma=gamma), ms[-1] + 5
    )
    assert_seq_close(schedules.piecewise_constant(base, {m: gamma for m in ms}), ref)


def test_warmup_linear_matches_torch_lambdalr_of_its_closed_form() -> None:
    """warmup_linear == LambdaLR with the hand-written warmup/decay factor (no torch builtin)."""

    def factor(n: int) -> float:
        return 0.1 + 0.9 * n / 5 if n < 5 else max(0.0, 1 - (n - 5) / 15)

    ref = torch_lrs(2.0, lambda o: torch.optim.lr_scheduler.LambdaLR(o, factor), 25)
    assert_seq_close(schedules.warmup_linear(2.0, 5, 20, init=0.2), ref)


# --- count types, reprs, errors -----------------------------------------------------


ALL_SCHEDULES: list[Schedule] = [
    schedules.constant(0.3),
    schedules.linear(1.0, 0.1, 17),
    schedules.cosine_decay(1.0, 23, end=0.01),
    schedules.warmup_cosine(1.0, 5, 40, init=0.1, end=0.01),
    schedules.warmup_linear(1.0, 5, 40),
    schedules.join([schedules.constant(1.0), schedules.cosine_decay(1.0, 10)], [7]),
    schedules.piecewise_constant(1.0, {3: 0.5, 9: 0.1}),
]


@settings(max_examples=50, deadline=None)
@given(i=st.integers(0, len(ALL_SCHEDULES) - 1), n=count_st)
def test_int_and_int64_tensor_counts_give_equal_floats(i: int, n: int) -> None:
    """schedule(n) == schedule(tensor(n)) exactly, and the result is a Python float."""
    s = ALL_SCHEDULES[i]
    a, b = s(n), s(torch.tensor(n, dtype=torch.int64))
    assert type(a) is float and type(b) is float and a == b


@pytest.mark.parametrize("s", ALL_SCHEDULES, ids=lambda s: safe_id(repr(s)))
def test_repr_names_the_constructor(s: Schedule) -> None:
    """A schedule's repr reads like the call that built it."""
    name = repr(s).split("(")[0]
    assert hasattr(schedules, name)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: schedules.linear(1.0, 0.0, 0), "steps"),
        (lambda: schedules.cosine_decay(1.0, -3), "steps"),
        (lambda: schedules.constant(float("inf")), "value"),
        (lambda: schedules.warmup_cosine(1.0, 10, 10), "total_steps"),
        (lambda: schedules.warmup_cosine(1.0, -1, 10), "warmup_steps"),
        (lambda: schedules.warmup_linear(1.0, 5, 3), "total_steps"),
        (lambda: schedules.join([schedules.constant(1.0)], [3]), "boundaries"),
        (lambda: schedules.join([schedules.constant(1.0)] * 3, [5, 2]), "boundaries"),
        (lambda: schedules.join([], []), "schedules"),
        (lambda: schedules.piecewise_constant(1.0, [(3, 0.5), (3, 0.1)]), "boundary 3"),
        (lambda: schedules.piecewise_constant(1.0, {-1: 0.5}), "boundary"),
        (lambda: schedules.piecewise_constant(1.0, {2: float("nan")}), "scale"),
    ],
)
def test_bad_arguments_fail_naming_the_field(make: Callable[[], Schedule], field: str) -> None:
    """Invalid schedule arguments raise ValueError mentioning the argument at fault."""
    with pytest.raises(ValueError, match=field):
        make()


def test_bad_counts_are_rejected() -> None:
    """Negative counts, float tensors and non-integers are errors, not silent truncation."""
    s = schedules.linear(1.0, 0.0, 10)
    with pytest.raises(ValueError, match=">= 0"):
        s(-1)
    with pytest.raises(TypeError, match="float"):
        s(torch.tensor(1.5))
    with pytest.raises(TypeError):
        s(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="int"):
        schedules.linear(1.0, 0.0, 2.5)  # type: ignore[arg-type]


# --- exact messages, reprs, defaults, first_count_below edges ------------------------

S = schedules


@pytest.mark.parametrize(
    ("make", "exc", "message"),
    [
        (
            lambda: S.linear(1e308, -1e308, 3),
            ValueError,
            "linear: end - start overflows (start=1e+308, end=-1e+308); "
            "the values in between would not be finite",
        ),
        (
            lambda: S.cosine_decay(-1e308, 3, end=1e308),
            ValueError,
            "cosine_decay: end - init overflows (init=-1e+308, end=1e+308); "
            "the values in between would not be finite",
        ),
        (lambda: S.constant("a"), TypeError, "value must be a real number, got 'a'"),
        (lambda: S.constant(True), TypeError, "value must be a real number, got True"),
        (lambda: S.constant(float("nan")), ValueError, "value must be finite, got nan"),
        (lambda: S.linear(1.0, 0.0, True), TypeError, "steps must be an int, got True"),
        (lambda: S.linear(1.0, 0.0, 2.0), TypeError, "steps must be an int, got 2.0"),
        (lambda: S.linear(1.0, 0.0, 0), ValueError, "steps must be >= 1, got 0"),
        (
            lambda: S.warmup_linear(1.0, -1, 3),
            ValueError,
            "warmup_steps must be >= 0, got -1",
        ),
        (
            lambda: S.warmup_cosine(1.0, 4, 4),
            ValueError,
            "total_steps must be > warmup_steps, got total_steps=4, warmup_steps=4",
        ),
        (lambda: S.join([], []), ValueError, "join: schedules must not be empty"),
        (
            lambda: S.join([S.constant(1.0), 3], [1]),
            TypeError,
            "join: schedules[1] is not callable: 3",
        ),
        (
            lambda: S.join([S.constant(1.0)], [1]),
            ValueError,
            "join: boundaries must have len(schedules) - 1 = 0 entries, got 1",
        ),
        (
            lambda: S.join([S.constant(1.0)] * 3, [1]),
            ValueError,
            "join: boundaries must have len(schedules) - 1 = 2 entries, got 1",
        ),
        *[
            (
                lambda b=b: S.join([S.constant(1.0)] * 2, [b]),
                ValueError,
                f"join: boundaries[0] must be an int >= 0, got {b!r}",
            )
            for b in (-1, True, 2.5)
        ],
        (
            lambda: S.join([S.constant(1.0)] * 3, [4, 2]),
            ValueError,
            "join: boundaries must be non-decreasing, got [4, 2]",
        ),
        *[
            (
                lambda e=e: S.piecewise_constant(1.0, [e]),
                ValueError,
                "piecewise_constant: boundaries_and_scales entries must be (boundary, scale) "
                f"pairs, got {e!r}",
            )
            for e in (5, [1, 0.5, 2], (1,))
        ],
        *[
            (
                lambda b=b: S.piecewise_constant(1.0, [(b, 0.5)]),
                ValueError,
                "piecewise_constant: boundaries_and_scales boundary must be an int >= 0, "
                f"got {b!r}",
            )
            for b in (-1, True, 1.0)
        ],
        *[
            (
                lambda s=s: S.piecewise_constant(1.0, {2: s}),
                ValueError,
                "piecewise_constant: boundaries_and_scales scale at boundary 2 must be a "
                f"finite number, got {s!r}",
            )
            for s in (float("nan"), float("inf"), True, "0.5")
        ],
        (
            lambda: S.piecewise_constant(1.0, [(3, 0.5), (3, 0.1)]),
            ValueError,
            "piecewise_constant: boundary 3 appears twice",
        ),
        (
            lambda: S.piecewise_constant(1e300, {1: 2.0, 5: 1e308}),
            ValueError,
            "piecewise_constant: the value from boundary 5 on is inf (init times the "
            "scales up to it overflows); every value must be finite",
        ),
        *[
            (
                lambda e=e: S.in_steps(S.constant(1.0), every=e),
                ValueError,
                f"in_steps: every must be an int >= 1, got {e!r}",
            )
            for e in (0, -2, True, 2.0)
        ],
        (
            lambda: S.in_steps(42, every=1),
            TypeError,
            "in_steps: schedule must be a callable count -> value, got 42",
        ),
    ],
    ids=lambda v: safe_id(str(v)) if isinstance(v, str) else None,
)
def test_bad_arguments_raise_the_exact_documented_message(
    make: Callable[[], Schedule], exc: type[Exception], message: str
) -> None:
    """Each invalid schedule argument raises its own exception type with the full message
    (the argument, its value and the rule it breaks), not a side effect of later code."""
    with pytest.raises(exc) as info:
        make()
    assert type(info.value) is exc and str(info.value) == message


def test_bad_counts_raise_the_exact_message() -> None:
    """A count that is not a non-negative integer scalar is refused with the full message."""
    s = S.linear(1.0, 0.0, 10)
    cases: list[tuple[Any, type[Exception], str]] = [
        (
            torch.tensor([1, 2]),
            TypeError,
            "schedule count must be an int or a one-element integer tensor, got a "
            "torch.int64 tensor of shape (2,)",
        ),
        (
            torch.tensor(1.0),
            TypeError,
            "schedule count must be an int or a one-element integer tensor, got a "
            "torch.float32 tensor of shape ()",
        ),
        (1.5, TypeError, "schedule count must be an int, got 1.5"),
        (-3, ValueError, "schedule count must be >= 0, got -3"),
    ]
    for count, exc, message in cases:
        with pytest.raises(exc) as info:
            s(count)
        assert type(info.value) is exc and str(info.value) == message, count


def test_index_counts_and_one_element_tensors_evaluate_like_ints() -> None:
    """A numpy integer or a one-element (any shape) int tensor is the count it holds."""
    np = pytest.importorskip("numpy")
    s = S.linear(1.0, 0.0, 10)
    assert s(np.int64(3)) == s(3) == 0.7
    assert s(torch.tensor([[4]], dtype=torch.int32)) == s(4)
    with pytest.raises(ValueError, match=re.escape("schedule count must be >= 0, got -1")):
        s(np.int64(-1))


@pytest.mark.parametrize(
    ("make", "text"),
    [
        (lambda: S.constant(1), "constant(value=1.0)"),
        (lambda: S.linear(1, 0, 4), "linear(start=1.0, end=0.0, steps=4)"),
        (lambda: S.cosine_decay(2, 5), "cosine_decay(init=2.0, steps=5, end=0.0)"),
        (
            lambda: S.warmup_cosine(1, 2, 6),
            "warmup_cosine(peak=1.0, warmup_steps=2, total_steps=6, init=0.0, end=0.0)",
        ),
        (
            lambda: S.warmup_cosine(1, 0, 6),
            "warmup_cosine(peak=1.0, warmup_steps=0, total_steps=6, init=0.0, end=0.0)",
        ),
        (
            lambda: S.warmup_linear(1, 2, 6, init=0.5, end=0.25),
            "warmup_linear(peak=1.0, warmup_steps=2, total_steps=6, init=0.5, end=0.25)",
        ),
        (
            lambda: S.warmup_linear(1, 0, 6),
            "warmup_linear(peak=1.0, warmup_steps=0, total_steps=6, init=0.0, end=0.0)",
        ),
        (
            lambda: S.join([S.constant(1.0), S.linear(1.0, 0.0, 2)], [3]),
            "join(schedules=(constant(value=1.0), linear(start=1.0, end=0.0, steps=2)), "
            "boundaries=(3,))",
        ),
        (
            lambda: S.piecewise_constant(1, {4: 0.1, 2: 0.5}),
            "piecewise_constant(init=1.0, boundaries_and_scales={2: 0.5, 4: 0.1})",
        ),
        (
            lambda: S.in_steps(S.constant(2), every=3),
            "in_steps(constant(value=2.0), every=3)",
        ),
    ],
    ids=lambda v: safe_id(v) if isinstance(v, str) else None,
)
def test_repr_is_the_exact_call_with_every_field(make: Callable[[], Schedule], text: str) -> None:
    """repr(schedule) is the constructor call with every field (ints shown as floats)."""
    assert repr(make()) == text


def test_int_arguments_become_floats_and_values_are_floats() -> None:
    """Integer values are stored and returned as Python floats."""
    for s in (
        S.constant(2),
        S.linear(2, 0, 4),
        S.cosine_decay(2, 4),
        S.piecewise_constant(2, {1: 1}),
    ):
        assert type(s(0)) is float and s(0) == 2.0
        for field in attrs.fields(type(s)):
            if field.name in ("value", "start", "init", "end"):
                assert type(getattr(s, field.name)) is float


def test_defaults_are_the_documented_ones() -> None:
    """cosine_decay ends at 0.0, warmups start and end at 0.0, a one-step ramp and a boundary
    at count 0 are allowed;
    the schedule classes take the same defaults as their constructors."""
    assert S.cosine_decay(2.0, 4)(4) == 0.0
    assert S.warmup_cosine(1.0, 2, 4)(4) == 0.0 and S.warmup_cosine(1.0, 2, 4)(0) == 0.0
    assert S.warmup_linear(1.0, 2, 4)(0) == 0.0 and S.warmup_linear(1.0, 2, 4)(4) == 0.0
    assert [S.linear(1.0, 0.0, 1)(n) for n in range(3)] == [1.0, 0.0, 0.0]
    assert S.warmup_linear(1.0, 0, 1)(0) == 1.0
    assert [S.piecewise_constant(1.0, {0: 0.5})(n) for n in range(2)] == [0.5, 0.5]
    assert type(S.cosine_decay(2.0, 4))(2.0, 4) == S.cosine_decay(2.0, 4)
    with pytest.raises(TypeError):
        type(S.constant(1.0))()  # type: ignore[call-arg]


def test_first_count_below_respects_the_threshold_and_the_join_windows() -> None:
    """first_count_below uses the given threshold, counts a join part only inside its
    window, and an in_steps schedule only at the counts its updates see."""
    lin = S.linear(1.0, 0.0, 10)  # 0.5 at 5, 0.4 at 6
    assert S.first_count_below(S.join([lin], []), 0.5) == 6
    assert S.first_count_below(S.in_steps(lin, every=2), 0.5) == 3
    dip = S.linear(1.0, -1.0, 4)  # first below 0 at count 3
    assert S.first_count_below(S.join([dip, S.constant(1.0)], [2])) is None
    assert S.first_count_below(S.join([dip, S.constant(1.0)], [3])) is None
    assert S.first_count_below(S.join([dip, S.constant(1.0)], [4])) == 3
    mid = S.join([S.constant(1.0), dip, S.constant(1.0)], [2, 4])
    assert S.first_count_below(mid) is None and min(mid(n) for n in range(10)) >= 0.0
    assert S.first_count_below(S.join([S.constant(1.0), dip, S.constant(1.0)], [2, 6])) == 5
    # values 1, -1, 1: below 0 only at count 1, which every=2 never sees
    back_up = S.piecewise_constant(1.0, {1: -1.0, 2: -1.0})
    assert S.first_count_below(back_up) == 1
    assert S.first_count_below(S.in_steps(back_up, every=2)) is None
    # values 1, -1, -0.0: at count 2 (update 1) the value equals the threshold
    to_zero = S.piecewise_constant(1.0, {1: -1.0, 2: 0.0})
    assert S.first_count_below(S.in_steps(to_zero, every=2)) is None
    assert S.first_count_below(S.piecewise_constant(1.0, {2: 0.5, 5: -1.0})) == 5
    assert S.first_count_below(S.piecewise_constant(1.0, {2: 0.5, 5: -1.0}), 0.75) == 2
