"""The optimizer table: one :class:`Row` per optimizer, run by tests/test_optim_table.py.

A row says how to build the optimizer, which hyperparameters are valid (a
hypothesis strategy), its ``torch.optim`` counterpart if one exists (how to
build it, how its per-parameter state maps onto ours, which of its kinds we
equal bitwise), plain per-tensor reference code if there is some, and a bad
value for every hyperparameter. A new optimizer joins every shared check with
one row here (imported as ``_optim_rows``; tests/ is on sys.path).

Tolerances, stated once:

* fp32 against torch's fused kind (``fused=True``): bitwise (the same kernels);
  Muon also in bf16 (torch.optim.Muon's ops, AdamW's fused kernel).
* fp32 against torch's default and foreach kinds, and against per-tensor
  references: ``torch.testing.assert_close``'s fp32 defaults (rtol 1.3e-6, atol 1e-5).
* bf16: ``assert_close``'s bf16 defaults (rtol 1.6e-2, atol 1e-5), against
  torch's fused kind (Adam), its default per-tensor kind (SGD, whose CPU bf16 path
  is the foreach fallback: pytorch/pytorch#191763) or the reference (Lion).
* Muon against Keller Jordan's code: :func:`keller_tol`.
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

from _optim import EXACT, STEPS, paths
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


# Muon ----------------------------------------------------------------------------------


def not_head(path: str, p: Tensor) -> bool:
    """Matrices but the output head (the usual Muon setup)."""
    return p.ndim >= 2 and path != "head"


def two_dims(path: str, p: Tensor) -> bool:
    """2-D params only (as torch.optim.Muon and optax's contrib.muon take)."""
    return p.ndim == 2


def muon_torch(
    ps: list[nn.Parameter], names: list[str], hp: Hp, kind: Hp
) -> list[torch.optim.Optimizer]:
    """torch.optim.Muon on the selected params, torch.optim.AdamW (``kind``) on the others."""
    use = hp.get("use_muon", optim.is_matrix)
    chosen = [use(n, p) for n, p in zip(names, ps, strict=True)]
    mats = [p for p, c in zip(ps, chosen, strict=True) if c]
    rest = [p for p, c in zip(ps, chosen, strict=True) if not c]
    muon_kw = (
        "lr",
        "weight_decay",
        "momentum",
        "nesterov",
        "ns_coefficients",
        "eps",
        "ns_steps",
        "adjust_lr_fn",
    )
    opts: list[torch.optim.Optimizer] = []
    if mats:
        opts.append(torch.optim.Muon(mats, **{k: hp[k] for k in muon_kw if k in hp}))
    if rest:
        lr = hp.get("adam_lr") or hp.get("lr", 1e-3)
        adam = {"betas": hp.get("adam_betas", (0.9, 0.95)), "eps": hp.get("adam_eps", 1e-10)}
        opts.append(
            torch.optim.AdamW(
                rest, lr=lr, weight_decay=hp.get("adam_weight_decay", 0.0), **adam, **kind
            )
        )
    return opts


def muon_state(s: dict[str, Any]) -> dict[str, Tensor]:
    if "momentum_buffer" in s:
        return {"mu": s["momentum_buffer"]}
    return adam_state(s)


def muon_torch_shape(path: str, p: Tensor, hp: Hp) -> tuple[int, ...]:
    """A selected conv filter is orthogonalised as its ``(shape[0], -1)`` matrix."""
    if p.ndim > 2 and hp.get("use_muon", optim.is_matrix)(path, p):
        return (p.shape[0], -1)
    return tuple(p.shape)


def keller_reference(
    init: list[Tensor], grads: list[list[Tensor]], hp: Hp
) -> tuple[list[Tensor], State] | None:
    """Keller Jordan's ``SingleDeviceMuonWithAuxAdam.step`` (github.com/KellerJordan/Muon,
    muon.py), line by line, with ``hp``'s values for its constants and ``.bfloat16()``
    as ``.to(ns_dtype)``. None where it is not our variant: ``match_rms_adamw`` (not in
    it) and selected params with ndim != 2 (it batches 3-D tensors and scales 4-D
    filters by their last two dims).
    """
    names = paths(len(init))
    use = hp.get("use_muon", optim.is_matrix)
    is_muon = [use(n, t) for n, t in zip(names, init, strict=True)]
    if hp.get("adjust_lr_fn", "original") != "original" or any(
        m and t.ndim != 2 for m, t in zip(is_muon, init, strict=True)
    ):
        return None
    ns_a, ns_b, ns_c = hp.get("ns_coefficients", (3.4445, -4.7750, 2.0315))
    ns_dtype, ns_eps = hp.get("ns_dtype", torch.bfloat16), hp.get("eps", 1e-7)

    def zeropower_via_newtonschulz5(G: Tensor, steps: int) -> Tensor:
        assert G.ndim >= 2
        a, b, c = (ns_a, ns_b, ns_c)
        X = G.to(ns_dtype)
        if G.size(-2) > G.size(-1):
            X = X.mT
        X = X / (X.norm(dim=(-2, -1), keepdim=True) + ns_eps)
        for _ in range(steps):
            A = X @ X.mT
            B = b * A + c * A @ A
            X = a * X + B @ X
        if G.size(-2) > G.size(-1):
            X = X.mT
        return X

    def muon_update(
        grad: Tensor, momentum: Tensor, beta: float, ns_steps: int, nesterov: bool
    ) -> Tensor:
        momentum.lerp_(grad, 1 - beta)
        update = grad.lerp_(momentum, beta) if nesterov else momentum
        if update.ndim == 4:
            update = update.view(len(update), -1)
        update = zeropower_via_newtonschulz5(update, steps=ns_steps)
        update *= max(1, grad.size(-2) / grad.size(-1)) ** 0.5
        return update

    def adam_update(
        grad: Tensor, buf1: Tensor, buf2: Tensor, step: int, betas: tuple[float, float], eps: float
    ) -> Tensor:
        buf1.lerp_(grad, 1 - betas[0])
        buf2.lerp_(grad.square(), 1 - betas[1])
        buf1c = buf1 / (1 - betas[0] ** step)
        buf2c = buf2 / (1 - betas[1] ** step)
        return buf1c / (buf2c.sqrt() + eps)

    muon_group = {
        "lr": hp.get("lr", 1e-3),
        "momentum": hp.get("momentum", 0.95),
        "weight_decay": hp.get("weight_decay", 0.1),
    }
    adam_group = {
        "lr": hp.get("adam_lr") or muon_group["lr"],
        "betas": hp.get("adam_betas", (0.9, 0.95)),
        "eps": hp.get("adam_eps", 1e-10),
        "weight_decay": hp.get("adam_weight_decay", 0.0),
    }
    ps = [t.clone() for t in init]
    state: State = [{} for _ in init]
    for gs in grads:
        for i, p in enumerate(ps):
            grad = gs[i].clone()  # muon_update writes the grad (``grad.lerp_``)
            if p.numel() == 0:
                continue
            st_ = state[i]
            if is_muon[i]:
                group = muon_group
                if len(st_) == 0:
                    st_["momentum_buffer"] = torch.zeros_like(p)
                update = muon_update(
                    grad,
                    st_["momentum_buffer"],
                    beta=group["momentum"],
                    ns_steps=hp.get("ns_steps", 5),
                    nesterov=hp.get("nesterov", True),
                )
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update.reshape(p.shape), alpha=-group["lr"])
            else:
                group = adam_group
                if len(st_) == 0:
                    st_["exp_avg"] = torch.zeros_like(p)
                    st_["exp_avg_sq"] = torch.zeros_like(p)
                    st_["step"] = 0
                st_["step"] += 1
                update = adam_update(
                    grad,
                    st_["exp_avg"],
                    st_["exp_avg_sq"],
                    st_["step"],
                    group["betas"],
                    group["eps"],
                )
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
    out = []
    for s in state:
        if "momentum_buffer" in s:
            out.append({"mu": s["momentum_buffer"]})
        elif s:
            out.append({"mu": s["exp_avg"], "nu": s["exp_avg_sq"]})
        else:
            out.append({})
    return ps, out


def keller_tol(hp: Hp, dtype: torch.dtype, steps: int) -> Tol | None:
    """How far Keller Jordan's code may be from ours after ``steps`` steps (fp32 params).

    fp32 Newton–Schulz: fp32 roundings. bf16 Newton–Schulz: Keller's code rounds
    ``b*A``, ``c*A@A``, their sum, ``a*X`` and ``B@X`` (and the scaled update) to
    bf16 one by one where torch and we fuse them in ``addmm``: one step's update
    differs by up to ~0.12 * lr (a few bf16 ulps of O; 40 random cases), and the
    differences add like a random walk (measured 0.07 * lr * sqrt(steps) after 5
    and 50 steps); the bound is twice that (the moments agree to fp32 rounding).
    It catches a 20% error in the scale, not a 1% one: torch.optim.Muon is the
    bitwise reference in bf16. bf16 params: not compared (Keller's AdamW rounds
    every op to bf16, the fused kernel once).
    """
    if dtype != torch.float32:
        return None
    if hp.get("ns_dtype", torch.bfloat16) == torch.float32:
        return {"rtol": 1e-4, "atol": 1e-5}
    return {"rtol": 0.0, "atol": 0.15 * hp.get("lr", 1e-3) * steps**0.5}


@st.composite
def muon_hparams(draw: st.DrawFn) -> Hp:
    hp: Hp = {
        "lr": draw(st.floats(1e-4, 0.1)),
        "weight_decay": draw(st.floats(0.0, 0.2)),
        "momentum": draw(st.floats(0.0, 0.99)),
        "nesterov": draw(st.booleans()),
        "ns_coefficients": draw(
            st.sampled_from([(3.4445, -4.7750, 2.0315), (1.875, -1.25, 0.375)])
        ),
        "eps": draw(st.sampled_from([1e-7, 1e-5])),
        "ns_steps": draw(st.integers(1, 6)),
        "adjust_lr_fn": draw(st.sampled_from(["original", "match_rms_adamw"])),
        "ns_dtype": draw(st.sampled_from([torch.bfloat16, torch.float32])),
        # beta2 >= 0.5: near 0 the Adam denominator is |g_t| itself, and the reference's
        # and the fused kernel's (equally valid) operation orders drift apart over 50 steps
        # beyond the fp32 tolerance (hypothesis found beta2=1e-6: rel 4.8e-4 after 50 steps)
        "adam_betas": draw(st.tuples(st.floats(0.0, 0.99), st.floats(0.5, 0.9999))),
        "adam_eps": draw(st.floats(1e-10, 1e-3)),
        "adam_weight_decay": draw(st.floats(0.0, 0.1)),
    }
    use = draw(st.sampled_from([optim.is_matrix, not_head, two_dims]))
    if use is not optim.is_matrix:
        hp["use_muon"] = use
    if draw(st.booleans()):
        hp["adam_lr"] = draw(st.floats(1e-4, 0.1))
    return hp


def muon_torch_applies(hp: Hp, dtype: torch.dtype) -> bool:
    # torch.optim.Muon runs Newton–Schulz in bf16 only; with bf16 params and no Nesterov
    # torch 2.13 normalises the momentum buffer in place (pytorch/pytorch#194664)
    return hp.get("ns_dtype", torch.bfloat16) == torch.bfloat16 and (
        dtype != torch.bfloat16 or hp.get("nesterov", True)
    )


MUON = Row(
    name="muon",
    make=optim.muon,
    hparams=muon_hparams(),
    example={
        "lr": 0.02,
        "momentum": 0.9,
        "weight_decay": 0.1,
        "use_muon": not_head,
        "adam_weight_decay": 0.05,
    },
    bad=(
        ({"lr": -1.0}, ValueError, "lr"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay"),
        ({"momentum": 1.0}, ValueError, "momentum"),
        ({"nesterov": 1}, TypeError, "nesterov"),
        ({"ns_coefficients": (1.0, 2.0)}, ValueError, "ns_coefficients"),
        ({"ns_coefficients": (1.0, 2.0, "3")}, TypeError, r"ns_coefficients\[2\]"),
        ({"eps": 0.0}, ValueError, "eps"),
        ({"ns_steps": 0}, ValueError, "ns_steps"),
        ({"ns_steps": 2.0}, TypeError, "ns_steps"),
        ({"adjust_lr_fn": "rms"}, ValueError, "adjust_lr_fn"),
        ({"ns_dtype": torch.int64}, ValueError, "ns_dtype"),
        ({"use_muon": "ndim >= 2"}, TypeError, "use_muon"),
        ({"adam_lr": -1.0}, ValueError, "adam_lr"),
        ({"adam_betas": (0.9, 1.0)}, ValueError, r"adam_betas\[1\]"),
        ({"adam_eps": 0.0}, ValueError, "adam_eps"),
        ({"adam_weight_decay": -1.0}, ValueError, "adam_weight_decay"),
    ),
    no_decay={"weight_decay": 0.0, "adam_weight_decay": 0.0},
    more_examples=(
        {"lr": 0.02, "ns_dtype": torch.float32, "nesterov": False, "use_muon": two_dims},
        {"lr": 0.01, "adjust_lr_fn": "match_rms_adamw", "adam_lr": 0.003},
        {"lr": 0.02, "use_muon": two_dims},  # a 3-D param takes AdamW
    ),
    torch=muon_torch,
    torch_state=muon_state,
    torch_shape=muon_torch_shape,
    torch_applies=muon_torch_applies,
    # torch.optim.Muon has one kind; the AdamW part's foreach and default kinds are the
    # adam rows' (and the fallback test's) business, and each run pays bf16 Newton–Schulz
    kinds=("fused",),
    exact_kind="fused",
    bf16_kind=("fused", EXACT),
    fused=_adam,
    fallback_kinds=FALLBACK_KINDS,
    reference=keller_reference,
    reference_tol=keller_tol,
    defaults_of=(torch.optim.Muon,),
    update_tol=ADAM_UPDATE_TOL,
    long_steps=20,  # bf16 matmuls are ~25x slower than fp32 ones on CPUs without bf16 units
)


ROWS = {
    r.name: r
    for r in (
        adam_row("adam", optim.adam, torch.optim.Adam),
        adam_row("adamw", optim.adamw, torch.optim.AdamW),
        SGD,
        LION,
        MUON,
    )
}
TORCH_ROWS = [n for n, r in ROWS.items() if r.torch is not None]
FUSED_ROWS = [n for n, r in ROWS.items() if r.fused is not None]
