"""Learning-rate schedules: pure callables ``count -> value`` of an optimizer's own count.

A schedule has no state: the optimizer keeps its update ``count`` (an int64
0-dim CPU tensor) and calls ``schedule(count)`` once per update, so resuming
from a checkpoint resumes the schedule too. ``count`` may be a Python int or an
integer tensor with one element; the result is a Python float. Update number
``n`` (0-based) uses ``schedule(n)``, as ``torch.optim`` does when
``scheduler.step()`` follows each ``optimizer.step()``.

Schedules are small frozen objects with readable reprs; they compose with
:func:`join`.

Example:
    >>> from purestep.optim import schedules
    >>> s = schedules.warmup_cosine(1.0, warmup_steps=2, total_steps=6)
    >>> [round(s(n), 3) for n in range(8)]
    [0.0, 0.5, 1.0, 0.854, 0.5, 0.146, 0.0, 0.0]
    >>> s
    warmup_cosine(peak=1.0, warmup_steps=2, total_steps=6, init=0.0, end=0.0)
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from purestep.optim._base import Schedule

__all__ = [
    "constant",
    "cosine_decay",
    "first_count_below",
    "in_steps",
    "join",
    "linear",
    "piecewise_constant",
    "warmup_cosine",
    "warmup_linear",
]


def _count(count: int | torch.Tensor) -> int:
    """``count`` as a non-negative Python int (a CPU tensor converts without a device sync)."""
    if isinstance(count, torch.Tensor):
        if count.is_floating_point() or count.is_complex() or count.numel() != 1:
            raise TypeError(
                f"schedule count must be an int or a one-element integer tensor, got a "
                f"{count.dtype} tensor of shape {tuple(count.shape)}"
            )
    elif isinstance(count, bool) or not isinstance(count, int):
        try:
            n = count.__index__()  # numpy integers
        except AttributeError:
            raise TypeError(f"schedule count must be an int, got {count!r}") from None
        count = n
    n = int(count)
    if n < 0:
        raise ValueError(f"schedule count must be >= 0, got {n}")
    return n


def _finite(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{attribute.name} must be a real number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be finite, got {value}")


def _check_int(minimum: int, _inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    # Module level, bound by _int_field: it runs when a schedule is built, not at import.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{attribute.name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{attribute.name} must be >= {minimum}, got {value}")


def _int_field(minimum: int) -> Any:
    return attrs.field(validator=functools.partial(_check_int, minimum))


def _float_field(default: Any = attrs.NOTHING) -> Any:
    return attrs.field(default=default, converter=_to_float, validator=_finite)


def _to_float(value: Any) -> Any:
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _repr(name: str, obj: Any) -> str:
    fields = ", ".join(f"{a.name}={getattr(obj, a.name)!r}" for a in attrs.fields(type(obj)))
    return f"{name}({fields})"


def _linear(start: float, end: float, steps: int, n: int) -> float:
    # Exactly ``start`` at 0 and exactly ``end`` from ``steps`` on.
    return end if n >= steps else start + (end - start) * (n / steps)


def _cosine(init: float, end: float, steps: int, n: int) -> float:
    # Exactly ``init`` at 0 and exactly ``end`` from ``steps`` on.
    if n >= steps:
        return end
    return init + (end - init) * (0.5 * (1.0 - math.cos(math.pi * n / steps)))


def _check_span(name: str, a: str, b: str, inst: Any) -> None:
    """``inst.b - inst.a`` must be finite, or every interpolated value is NaN or infinite."""
    if not math.isfinite(getattr(inst, b) - getattr(inst, a)):
        raise ValueError(
            f"{name}: {b} - {a} overflows ({a}={getattr(inst, a)!r}, {b}={getattr(inst, b)!r}); "
            "the values in between would not be finite"
        )


def _ramp_first_below(
    f: Callable[[int], float], a: float, b: float, steps: int, threshold: float
) -> int | None:
    """First count where a monotone ramp ``f`` (``a`` at 0, ``b`` from ``steps`` on) is < threshold.

    A ramp between two values >= threshold never goes below it (the
    interpolation rounds towards its end points), so only an end point below
    it needs a search: bisection over ``[0, steps]``.
    """
    if a < threshold:
        return 0
    if b >= threshold:
        return None
    lo, hi = 0, steps  # f(lo) >= threshold > f(hi) == b
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if f(mid) < threshold:
            hi = mid
        else:
            lo = mid
    return hi


@attrs.frozen(repr=False)
class _Constant:
    value: float = _float_field()

    def __call__(self, count: int | torch.Tensor, /) -> float:
        _count(count)
        return self.value

    def first_below(self, threshold: float) -> int | None:
        return 0 if self.value < threshold else None

    def __repr__(self) -> str:
        return _repr("constant", self)


@attrs.frozen(repr=False)
class _Linear:
    start: float = _float_field()
    end: float = _float_field()
    steps: int = _int_field(1)

    def __attrs_post_init__(self) -> None:
        _check_span("linear", "start", "end", self)

    def __call__(self, count: int | torch.Tensor, /) -> float:
        return _linear(self.start, self.end, self.steps, _count(count))

    def first_below(self, threshold: float) -> int | None:
        return _ramp_first_below(self, self.start, self.end, self.steps, threshold)

    def __repr__(self) -> str:
        return _repr("linear", self)


@attrs.frozen(repr=False)
class _CosineDecay:
    init: float = _float_field()
    steps: int = _int_field(1)
    end: float = _float_field(0.0)

    def __attrs_post_init__(self) -> None:
        _check_span("cosine_decay", "init", "end", self)

    def __call__(self, count: int | torch.Tensor, /) -> float:
        return _cosine(self.init, self.end, self.steps, _count(count))

    def first_below(self, threshold: float) -> int | None:
        return _ramp_first_below(self, self.init, self.end, self.steps, threshold)

    def __repr__(self) -> str:
        return _repr("cosine_decay", self)


@attrs.frozen(repr=False)
class _Warmup:
    """The arguments of a warmup schedule (validated); the schedule itself is a :class:`_Join`."""

    peak: float = _float_field()
    warmup_steps: int = _int_field(0)
    total_steps: int = _int_field(1)
    init: float = _float_field(0.0)
    end: float = _float_field(0.0)

    def __attrs_post_init__(self) -> None:
        if self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"total_steps must be > warmup_steps, got total_steps={self.total_steps}, "
                f"warmup_steps={self.warmup_steps}"
            )

    def join(self, name: str, decay: Schedule) -> _Join:
        """A linear warmup ``init -> peak`` over ``warmup_steps``, then ``decay`` (none if 0 steps)."""
        w = self.warmup_steps
        if w == 0:
            return _Join((decay,), (), label=_repr(name, self))
        return _Join((_Linear(self.init, self.peak, w), decay), (w,), label=_repr(name, self))


@attrs.frozen(repr=False)
class _Join:
    schedules: tuple[Schedule, ...]
    boundaries: tuple[int, ...]
    label: str | None = attrs.field(default=None, eq=False)  # the repr of a named composition

    def __call__(self, count: int | torch.Tensor, /) -> float:
        n = _count(count)
        i = bisect.bisect_right(self.boundaries, n)
        return float(self.schedules[i](n - self.boundaries[i - 1] if i else n))

    def first_below(self, threshold: float) -> int | None:
        starts = (0, *self.boundaries)
        for i, sched in enumerate(self.schedules):
            window = self.boundaries[i] - starts[i] if i < len(self.boundaries) else None
            if window == 0:
                continue  # never active
            n = first_count_below(sched, threshold)
            if n is not None and (window is None or n < window):
                return starts[i] + n
        return None

    def __repr__(self) -> str:
        if self.label is not None:
            return self.label
        return f"join(schedules={self.schedules!r}, boundaries={self.boundaries!r})"


@attrs.frozen(repr=False)
class _PiecewiseConstant:
    init: float = attrs.field(converter=_to_float, validator=_finite)
    boundaries_and_scales: tuple[tuple[int, float], ...]
    _bounds: tuple[int, ...] = attrs.field(init=False, eq=False)
    _values: tuple[float, ...] = attrs.field(init=False, eq=False)

    def __attrs_post_init__(self) -> None:
        values = [self.init]
        for _, scale in self.boundaries_and_scales:
            values.append(values[-1] * scale)
        for i, v in enumerate(values):
            if not math.isfinite(v):
                b = self.boundaries_and_scales[i - 1][0]
                raise ValueError(
                    f"piecewise_constant: the value from boundary {b} on is {v} (init times the "
                    "scales up to it overflows); every value must be finite"
                )
        object.__setattr__(self, "_bounds", tuple(b for b, _ in self.boundaries_and_scales))
        object.__setattr__(self, "_values", tuple(values))

    def __call__(self, count: int | torch.Tensor, /) -> float:
        return self._values[bisect.bisect_right(self._bounds, _count(count))]

    def first_below(self, threshold: float) -> int | None:
        for i, v in enumerate(self._values):
            if v < threshold:
                return self._bounds[i - 1] if i else 0
        return None

    def __repr__(self) -> str:
        pairs = dict(self.boundaries_and_scales)
        return f"piecewise_constant(init={self.init!r}, boundaries_and_scales={pairs!r})"


def constant(value: float) -> Schedule:
    """``count -> value``.

    Example:
        >>> constant(0.1)(1000)
        0.1
    """
    return _Constant(value)


def linear(start: float, end: float, steps: int) -> Schedule:
    """Linear from ``start`` (count 0) to ``end`` (count ``steps``), then constant ``end``.

    Matches ``torch.optim.lr_scheduler.LinearLR`` with base lr 1, ``start_factor=start``,
    ``end_factor=end``, ``total_iters=steps``.

    Args:
        start: value at count 0.
        end: value from count ``steps`` on.
        steps: length of the ramp, >= 1.

    Example:
        >>> [linear(1.0, 0.0, 4)(n) for n in (0, 1, 4, 9)]
        [1.0, 0.75, 0.0, 0.0]
    """
    return _Linear(start, end, steps)


def cosine_decay(init: float, steps: int, *, end: float = 0.0) -> Schedule:
    """Half a cosine from ``init`` (count 0) to ``end`` (count ``steps``), then constant ``end``.

    ``end + (init - end) * (1 + cos(pi * min(count, steps) / steps)) / 2``; equals
    ``torch.optim.lr_scheduler.CosineAnnealingLR(T_max=steps, eta_min=end)`` up to
    ``steps`` (torch's then rises again; this one stays at ``end``).

    Example:
        >>> [round(cosine_decay(1.0, 4)(n), 4) for n in (0, 2, 4, 5)]
        [1.0, 0.5, 0.0, 0.0]
    """
    return _CosineDecay(init, steps, end)


def warmup_cosine(
    peak: float,
    warmup_steps: int,
    total_steps: int,
    *,
    init: float = 0.0,
    end: float = 0.0,
) -> Schedule:
    """Linear warmup from ``init`` to ``peak``, then cosine decay to ``end``.

    Linear from ``init`` (count 0) to ``peak`` (count ``warmup_steps``), cosine
    from ``peak`` to ``end`` reached at count ``total_steps``, then constant
    ``end`` (optax's ``warmup_cosine_decay_schedule`` with ``decay_steps=total_steps``).

    Args:
        peak: value at count ``warmup_steps``.
        warmup_steps: length of the warmup, >= 0.
        total_steps: count where ``end`` is reached, > ``warmup_steps``.
        init: value at count 0.
        end: final value.

    Example:
        >>> s = warmup_cosine(1.0, 2, 4, init=0.5)
        >>> [s(n) for n in range(6)]
        [0.5, 0.75, 1.0, 0.5, 0.0, 0.0]
    """
    args = _Warmup(peak, warmup_steps, total_steps, init, end)
    return args.join("warmup_cosine", _CosineDecay(args.peak, total_steps - warmup_steps, args.end))


def warmup_linear(
    peak: float,
    warmup_steps: int,
    total_steps: int,
    *,
    init: float = 0.0,
    end: float = 0.0,
) -> Schedule:
    """Linear from ``init`` to ``peak`` over ``warmup_steps``, then linear to ``end`` at ``total_steps``.

    Constant ``end`` after ``total_steps``.

    Example:
        >>> s = warmup_linear(1.0, 2, 6)
        >>> [s(n) for n in (0, 1, 2, 4, 6, 7)]
        [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    args = _Warmup(peak, warmup_steps, total_steps, init, end)
    return args.join("warmup_linear", _Linear(args.peak, args.end, total_steps - warmup_steps))


def join(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Run ``schedules[i]`` from ``boundaries[i-1]`` to ``boundaries[i]`` (optax's ``join_schedules``).

    Each later schedule sees the count minus the boundary where it starts, so it
    starts at its own count 0.

    Args:
        schedules: ``k`` schedules (at least one).
        boundaries: ``k - 1`` non-decreasing counts >= 0.

    Example:
        >>> s = join([linear(0.0, 1.0, 2), constant(1.0), linear(1.0, 0.0, 2)], [2, 4])
        >>> [s(n) for n in range(7)]
        [0.0, 0.5, 1.0, 1.0, 1.0, 0.5, 0.0]
    """
    scheds = tuple(schedules)
    bounds = tuple(boundaries)
    if not scheds:
        raise ValueError("join: schedules must not be empty")
    for i, s in enumerate(scheds):
        if not callable(s):
            raise TypeError(f"join: schedules[{i}] is not callable: {s!r}")
    if len(bounds) != len(scheds) - 1:
        raise ValueError(
            f"join: boundaries must have len(schedules) - 1 = {len(scheds) - 1} entries, "
            f"got {len(bounds)}"
        )
    for i, b in enumerate(bounds):
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise ValueError(f"join: boundaries[{i}] must be an int >= 0, got {b!r}")
        if i and b < bounds[i - 1]:
            raise ValueError(f"join: boundaries must be non-decreasing, got {list(bounds)}")
    return _Join(scheds, bounds)


def piecewise_constant(
    init: float,
    boundaries_and_scales: Mapping[int, float] | Sequence[tuple[int, float]],
) -> Schedule:
    """``init`` times the product of every ``scale`` whose ``boundary <= count``.

    optax's ``piecewise_constant_schedule``; with every scale equal to ``gamma``
    it is ``torch.optim.lr_scheduler.MultiStepLR(milestones=boundaries, gamma=gamma)``.

    Args:
        init: value before the first boundary.
        boundaries_and_scales: ``{boundary: scale}`` (or pairs); boundaries are
            distinct ints >= 0, scales finite.

    Example:
        >>> s = piecewise_constant(1.0, {2: 0.5, 4: 0.1})
        >>> [s(n) for n in range(6)]
        [1.0, 1.0, 0.5, 0.5, 0.05, 0.05]
    """
    items = list(
        boundaries_and_scales.items()
        if isinstance(boundaries_and_scales, Mapping)
        else boundaries_and_scales
    )
    pairs: list[tuple[int, float]] = []
    for entry in items:
        if not (isinstance(entry, tuple | list) and len(entry) == 2):
            raise ValueError(
                f"piecewise_constant: boundaries_and_scales entries must be (boundary, scale) "
                f"pairs, got {entry!r}"
            )
        b, s = entry
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise ValueError(
                f"piecewise_constant: boundaries_and_scales boundary must be an int >= 0, got {b!r}"
            )
        if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s):
            raise ValueError(
                f"piecewise_constant: boundaries_and_scales scale at boundary {b} must be a "
                f"finite number, got {s!r}"
            )
        pairs.append((b, float(s)))
    pairs.sort()
    for (b0, _), (b1, _) in itertools.pairwise(pairs):
        if b0 == b1:
            raise ValueError(f"piecewise_constant: boundary {b0} appears twice")
    return _PiecewiseConstant(init, tuple(pairs))


@attrs.frozen(repr=False)
class _InSteps:
    schedule: Any
    every: int

    def __call__(self, count: int | torch.Tensor) -> float:
        return float(self.schedule(_count(count) * self.every))

    def first_below(self, threshold: float) -> int | None:
        # The first update n with schedule(n * every) < threshold: none before the
        # first update at or after the schedule's first count below it. If that
        # update is not below (a schedule that comes back up in between), the
        # per-update check covers it, as for an opaque callable.
        m = first_count_below(self.schedule, threshold)
        if m is None:
            return None
        n = -(-m // self.every)
        return n if self(n) < threshold else None

    def __repr__(self) -> str:
        return f"in_steps({self.schedule!r}, every={self.every})"


def in_steps(schedule: Schedule | Any, *, every: int) -> Schedule:
    """``schedule`` sized in the *method's* steps, for a role that updates every ``every`` steps.

    An optimizer's count advances once per update of its role, so with
    ``train_step(every={"student": 3})`` the student's schedule sees counts
    0, 1, 2, ... at method steps 0, 3, 6, ...: ``cosine_decay(lr, 1500)`` would
    end after 1500 *updates* (4500 steps). ``in_steps(s, every=3)`` evaluates
    ``s(3 * count)``, the schedule's value at the method step of that update,
    so ``in_steps(cosine_decay(lr, 4500), every=3)`` ends at step 4500.

    Example:
        >>> s = in_steps(linear(1.0, 0.0, 6), every=3)  # the role updates at steps 0, 3, 6
        >>> [s(n) for n in range(3)]
        [1.0, 0.5, 0.0]
        >>> s
        in_steps(linear(start=1.0, end=0.0, steps=6), every=3)
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"in_steps: every must be an int >= 1, got {every!r}")
    if not callable(schedule):
        raise TypeError(f"in_steps: schedule must be a callable count -> value, got {schedule!r}")
    return _InSteps(schedule, every)


def first_count_below(schedule: Callable[[int], float], threshold: float = 0.0) -> int | None:
    """The first count at which one of purestep's schedules is below ``threshold``, or None.

    purestep's schedules are piecewise monotone with known end points, so the
    answer covers every count ``0, 1, 2, ...`` (found by bisection, not by
    evaluating them all). Other callables cannot be seen into: they count as
    never below (an optimizer checks them at each update instead), also as
    parts of a :func:`join`. An :func:`in_steps` schedule answers in its role's
    updates (the first update whose method step is below).

    Optimizers use it to refuse, when they are built, a learning-rate schedule
    that goes negative at any count.

    Example:
        >>> first_count_below(linear(0.1, -0.1, 10))
        6
        >>> linear(0.1, -0.1, 10)(5), round(linear(0.1, -0.1, 10)(6), 6)
        (0.0, -0.02)
        >>> first_count_below(warmup_cosine(1.0, 2, 6)) is None
        True
        >>> first_count_below(in_steps(linear(0.1, -0.1, 10), every=4))  # step 8
        2
        >>> first_count_below(lambda n: -1.0) is None  # opaque
        True
    """
    if not isinstance(schedule, _SCHEDULE_TYPES):
        return None
    return schedule.first_below(threshold)


_SCHEDULE_TYPES = (_Constant, _Linear, _CosineDecay, _Join, _PiecewiseConstant, _InSteps)
