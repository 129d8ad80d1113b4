"""The optimizer table: one :class:`Row` per optimizer, run by tests/test_optim_table.py.

A row says how to build the optimizer, which hyperparameters are valid (a
hypothesis strategy), its ``torch.optim`` counterpart if one exists (how to
build it, how its per-parameter state maps onto ours, which of its kinds we
equal bitwise), plain per-tensor reference code if there is some, and a bad
value for every hyperparameter. A new optimizer joins every shared check with
one row here (imported as ``_optim_rows``; tests/ is on sys.path).

Tolerances, stated once:

* fp32 against torch's fused kind (``fused=True``): bitwise (the same kernels).
* fp32 against torch's default and foreach kinds, and against per-tensor
  references: ``torch.testing.assert_close``'s fp32 defaults (rtol 1.3e-6, atol 1e-5).
* bf16: ``assert_close``'s bf16 defaults (rtol 1.6e-2, atol 1e-5), against
  torch's fused kind (Adam), its default per-tensor kind (SGD, whose CPU bf16 path
  is the foreach fallback: pytorch/pytorch#191763) or the reference (Lion).
* ``apply_updates(update)`` against ``step``: the row's ``update_tol``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor, nn

from _optim import STEPS
from purestep import optim
from purestep.optim import _adam, _sgd, schedules

Hp = dict[str, Any]
Tol = dict[str, float]
State = list[dict[str, Any]]
CLOSE: Tol = {}  # assert_close's defaults for the dtype


@dataclasses.dataclass(frozen=True)
class Row:
    """One optimizer under test.

    Attributes:
        name: pytest id.
        make: the factory (keyword hyperparameters).
        hparams: valid hyperparameters (``lr`` a float), for property tests.
        example: one non-trivial set of hyperparameters, for example-based tests.
        more_examples: more sets the example parity test runs (variants the reference
            or torch covers only there).
        bad: ``(kwargs, exception, field regex)``: construction fails naming the field;
            every parameter of ``make`` needs at least one.
        no_decay: kwargs that turn every weight decay off.
        torch: ``(params, paths, hp, kind) -> optimizers``: the torch counterpart.
        torch_state: one param's torch state -> ours (key -> tensor).
        torch_shape: ``(path, param, hp) -> shape`` torch sees the param as.
        torch_applies: ``(hp, dtype) -> bool``: whether torch is a reference there.
        kinds: names of the torch kinds (:data:`TORCH_KINDS`) the fp32 run is compared with.
        exact_kind: the kind fp32 equals bitwise.
        bf16_kind: the kind bf16 is compared with, and its tolerance.
        fused: the module whose ``fused_supported`` the fallback tests turn off.
        fallback_kinds: kinds the foreach fallback is compared with, per dtype.
        reference: plain per-tensor code ``(init, grads, hp) -> (params, states) | None``
            (None where it does not define the variant drawn).
        reference_tol: ``(hp, dtype, steps) -> tolerance``, None where it is not compared.
        defaults_of: torch classes whose constructor defaults ours follow.
        update_tol: ``apply_updates(update)`` vs ``step`` over ``long_steps``.
        long_steps: steps of the update-vs-step run (fewer for an optimizer slow on CPU).
    """

    name: str
    make: Callable[..., optim.Transform]
    hparams: st.SearchStrategy[Hp]
    example: Hp
    bad: tuple[tuple[Hp, type[Exception], str], ...]
    no_decay: Hp
    more_examples: tuple[Hp, ...] = ()
    torch: Callable[[list[nn.Parameter], list[str], Hp, Hp], list[torch.optim.Optimizer]] | None = (
        None
    )
    torch_state: Callable[[dict[str, Any]], dict[str, Tensor]] = lambda s: {}
    torch_shape: Callable[[str, Tensor, Hp], tuple[int, ...]] | None = None
    torch_applies: Callable[[Hp, torch.dtype], bool] = lambda hp, dtype: True
    kinds: tuple[str, ...] = ()
    exact_kind: str | None = None
    bf16_kind: tuple[str, Tol] | None = None
    fused: ModuleType | None = None
    fallback_kinds: dict[torch.dtype, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    reference: (
        Callable[[list[Tensor], list[list[Tensor]], Hp], tuple[list[Tensor], State] | None] | None
    ) = None
    reference_tol: Callable[[Hp, torch.dtype, int], Tol | None] = lambda hp, dtype, steps: None
    defaults_of: tuple[type, ...] = ()
    update_tol: Tol = dataclasses.field(default_factory=dict)
    long_steps: int = STEPS


TORCH_KINDS = {
    "default": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}
FALLBACK_KINDS = {torch.float32: ("foreach", "default"), torch.bfloat16: ("default",)}
# params + update(...) tracks step(...) up to the rounding of new - old and back, which
# compounds through coupled decay and Adam's 1/sqrt(nu) (~1e-4 relative after 50 steps).
ADAM_UPDATE_TOL: Tol = {"rtol": 5e-4, "atol": 1e-5}


# Adam / AdamW --------------------------------------------------------------------------


def adam_hparams() -> st.SearchStrategy[Hp]:
    return st.fixed_dictionaries(
        {
            "lr": st.floats(1e-4, 0.1),
            "betas": st.tuples(st.floats(0.0, 0.99), st.floats(0.0, 0.9999)),
            "eps": st.floats(1e-10, 1e-3),
            "weight_decay": st.floats(0.0, 0.1),
            "amsgrad": st.booleans(),
        }
    )


def adam_state(s: dict[str, Any]) -> dict[str, Tensor]:
    keys = {"exp_avg": "mu", "exp_avg_sq": "nu", "max_exp_avg_sq": "nu_max", "step": "steps"}
    return {ours: s[theirs] for theirs, ours in keys.items() if theirs in s}


ADAM_BAD: tuple[tuple[Hp, type[Exception], str], ...] = (
    ({"lr": -1.0}, ValueError, "lr"),
    ({"lr": float("nan")}, ValueError, "lr"),
    ({"lr": "0.1"}, TypeError, "lr"),
    ({"lr": schedules.linear(-1.0, 0.0, 10)}, ValueError, "lr"),
    ({"betas": (1.0, 0.999)}, ValueError, r"betas\[0\]"),
    ({"betas": (0.9, -0.1)}, ValueError, r"betas\[1\]"),
    ({"betas": (0.9,)}, ValueError, "betas"),
    ({"eps": 0.0}, ValueError, "eps"),
    ({"eps": -1e-8}, ValueError, "eps"),
    ({"eps": None}, TypeError, "eps"),
    ({"weight_decay": -0.1}, ValueError, "weight_decay"),
    ({"amsgrad": 1}, TypeError, "amsgrad"),
)


def adam_row(name: str, make: Callable[..., optim.Transform], cls: type) -> Row:
    return Row(
        name=name,
        make=make,
        hparams=adam_hparams(),
        example={"lr": 0.05, "betas": (0.8, 0.99), "weight_decay": 0.1, "amsgrad": True},
        bad=ADAM_BAD,
        no_decay={"weight_decay": 0.0},
        torch=lambda ps, names, hp, kind: [cls(ps, **hp, **kind)],
        torch_state=adam_state,
        kinds=tuple(TORCH_KINDS),
        exact_kind="fused",
        # torch's default and foreach kinds round every intermediate to bf16 (``p *= 1 -
        # lr * wd`` is a no-op there); the fused kernel computes in fp32 and rounds once
        bf16_kind=("fused", CLOSE),
        fused=_adam,
        fallback_kinds=FALLBACK_KINDS,
        defaults_of=(cls,),
        update_tol=ADAM_UPDATE_TOL,
    )


# SGD -----------------------------------------------------------------------------------


@st.composite
def sgd_hparams(draw: st.DrawFn) -> Hp:
    nesterov = draw(st.booleans())
    momentum = draw(st.one_of(st.just(0.0), st.floats(0.0, 0.99)))
    dampening = draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0)))
    if nesterov:
        momentum, dampening = max(momentum, 0.1), 0.0
    return {
        "lr": draw(st.floats(1e-4, 0.1)),
        "momentum": momentum,
        "dampening": dampening,
        "weight_decay": draw(st.one_of(st.just(0.0), st.floats(0.0, 0.1))),
        "nesterov": nesterov,
    }


def sgd_state(s: dict[str, Any]) -> dict[str, Tensor]:
    buf = s.get("momentum_buffer")
    return {} if buf is None else {"momentum_buffer": buf}


SGD = Row(
    name="sgd",
    make=optim.sgd,
    hparams=sgd_hparams(),
    example={"lr": 0.05, "momentum": 0.5, "dampening": 0.3, "weight_decay": 0.1},
    bad=(
        ({"lr": -1.0}, ValueError, "lr"),
        ({"momentum": -0.5}, ValueError, "momentum"),
        ({"dampening": 1.5}, ValueError, "dampening"),
        ({"weight_decay": -1.0}, ValueError, "weight_decay"),
        ({"nesterov": True}, ValueError, "nesterov"),
        ({"nesterov": True, "momentum": 0.9, "dampening": 0.1}, ValueError, "nesterov"),
        ({"nesterov": 1}, TypeError, "nesterov"),
    ),
    no_decay={"weight_decay": 0.0},
    torch=lambda ps, names, hp, kind: [torch.optim.SGD(ps, **hp, **kind)],
    torch_state=sgd_state,
    kinds=tuple(TORCH_KINDS),
    exact_kind="fused",
    # CPU bf16 runs the foreach fallback (torch's fused SGD is wrong there), whose
    # scalars are applied at full precision as torch's per-tensor path does; CPU
    # ``torch._foreach_mul_`` (foreach=True) first rounds them to bf16
    bf16_kind=("default", CLOSE),
    fused=_sgd,
    fallback_kinds=FALLBACK_KINDS,
    defaults_of=(torch.optim.SGD,),
)


# Lion (no torch counterpart) -----------------------------------------------------------


def lion_reference(
    init: list[Tensor], grads: list[list[Tensor]], hp: Hp
) -> tuple[list[Tensor], State]:
    """Lion one tensor at a time (Chen et al. 2023, Alg. 2; optax.lion).

    ``c = b1*m + (1-b1)*g`` is written as ``m.lerp(g, 1-b1)``, the same value,
    so a sign of a near-zero ``c`` cannot flip on rounding alone.
    """
    b1, b2 = hp["betas"]
    lr, wd = hp["lr"], hp["weight_decay"]
    ps = [t.clone() for t in init]
    ms = [torch.zeros_like(t) for t in init]
    for gs in grads:
        for i, g in enumerate(gs):
            c = ms[i].lerp(g, 1 - b1)
            ps[i] = ps[i] * (1 - lr * wd) - lr * torch.sign(c)
            ms[i] = ms[i].lerp(g, 1 - b2)
    return ps, [{"mu": m} for m in ms]


LION = Row(
    name="lion",
    make=optim.lion,
    hparams=st.fixed_dictionaries(
        {
            "lr": st.floats(1e-4, 0.1),
            "betas": st.tuples(st.floats(0.0, 0.99), st.floats(0.0, 0.999)),
            "weight_decay": st.floats(0.0, 0.1),
        }
    ),
    example={"lr": 0.05, "betas": (0.8, 0.99), "weight_decay": 0.1},
    bad=(
        ({"lr": -1.0}, ValueError, "lr"),
        ({"betas": (0.9, 1.0)}, ValueError, r"betas\[1\]"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay"),
    ),
    no_decay={"weight_decay": 0.0},
    reference=lion_reference,
    reference_tol=lambda hp, dtype, steps: CLOSE,
)


ROWS = {
    r.name: r
    for r in (
        adam_row("adam", optim.adam, torch.optim.Adam),
        adam_row("adamw", optim.adamw, torch.optim.AdamW),
        SGD,
        LION,
    )
}
TORCH_ROWS = [n for n, r in ROWS.items() if r.torch is not None]
FUSED_ROWS = [n for n, r in ROWS.items() if r.fused is not None]
