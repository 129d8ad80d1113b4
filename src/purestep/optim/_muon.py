"""Muon: Newton–Schulz-orthogonalised Nesterov momentum for matrices, AdamW for the rest.

The variant is ``torch.optim.Muon`` (torch >= 2.9, itself a port of Keller
Jordan's reference ``muon.py``), op for op, so it is bitwise equal to it, plus
the AdamW fallback of Keller Jordan's ``MuonWithAuxAdam`` for the params Muon
does not take. For a selected param ``p`` with gradient ``g``::

    mu = mu.lerp(g, 1 - momentum)                              # momentum buffer
    u = g.lerp(mu, momentum) if nesterov else mu               # Nesterov
    X = u.reshape(rows, cols).to(ns_dtype)  # a copy; rows = p.shape[0], cols = p.numel() / rows
    X = X.T if rows > cols else X
    X = X / max(||X||_F, eps)
    ns_steps times:  A = X @ X.T;  B = b*A + c*A@A;  X = a*X + B@X   # (a, b, c) = ns_coefficients
    O = X.T if rows > cols else X
    p = p * (1 - lr * weight_decay) - lr * ratio * O.reshape(p.shape)

with ``ratio = max(1, rows / cols) ** 0.5`` (``adjust_lr_fn="original"``,
Keller Jordan's) or ``0.2 * max(rows, cols) ** 0.5`` (``"match_rms_adamw"``,
Moonshot's, as in torch). ``b*A + c*A@A`` and ``a*X + B@X`` are ``torch.addmm``
calls as in torch. Defaults: 5 iterations with (3.4445, -4.7750, 2.0315) in
bf16, eps 1e-7. The other params take the fused AdamW step of
:func:`~purestep.optim.adamw` (bitwise ``torch.optim.AdamW(fused=True)``).

Differences from the references: Keller Jordan's code computes ``b*A + c*A@A``
and ``a*X + B@X`` op by op in bf16, multiplies the bf16 update by ``ratio``
(torch and we scale the lr), divides by ``||X|| + eps`` and, for a 4-D conv
filter, takes ``ratio`` from its last two dims (we from the flattened matrix);
torch 2.13 normalises a bf16 momentum buffer in place when ``nesterov=False``
(pytorch/pytorch#194664), which the copy above avoids; torch takes 2-D params
only. optax's ``contrib.muon`` bias-corrects the momentum, iterates in the
params' dtype with eps 1e-8 and takes only 2-D params; we share its AdamW-lr
default (Muon's ``lr``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import attrs
import torch
from tensordict import TensorDict, TensorDictBase

from purestep import tree
from purestep.optim._adam import _kernel as adamw_kernel
from purestep.optim._base import ScalarOrSchedule, Transform
from purestep.optim._hparams import (
    AdamHParams,
    _is_bool,
    _non_negative,
    _number,
    _positive,
    _to_betas,
    _validate_betas,
    _validate_lr,
)
from purestep.optim._kernels import (
    Kernel,
    check_floating,
    check_lr_fits,
    checked_lr,
    kernel_transform,
    lr_at,
    pick,
    scalar_state,
    step_device,
)
from purestep.optim._steps import pack_steps

__all__ = ["MuonHParams", "is_matrix", "muon"]

UseMuon = Callable[[str, torch.Tensor], bool]
"""``use_muon(path, param) -> bool``: whether a param is orthogonalised (``path`` is dotted)."""

_NS_DTYPES = (torch.bfloat16, torch.float32, torch.float64)


def is_matrix(path: str, param: torch.Tensor) -> bool:
    """The default ``use_muon``: every param with ``ndim >= 2`` (biases and gains take AdamW).

    Example:
        >>> is_matrix("fc.weight", torch.zeros(3, 4)), is_matrix("fc.bias", torch.zeros(3))
        (True, False)
    """
    return param.ndim >= 2


def _momentum(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    x = _number(attribute.name, value)
    if not 0.0 <= x < 1.0:
        raise ValueError(f"{attribute.name} must be in [0, 1), got {x}")


def _coefficients(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, tuple) or len(value) != 3:
        raise ValueError(f"{attribute.name} must be three numbers (a, b, c), got {value!r}")
    for i, x in enumerate(value):
        _number(f"{attribute.name}[{i}]", x)


def _ns_steps(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{attribute.name} must be an int, got {value!r}")
    if not 1 <= value < 100:
        raise ValueError(f"{attribute.name} must be in [1, 100), got {value}")


def _adjust(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in ("original", "match_rms_adamw"):
        raise ValueError(f"{attribute.name} must be 'original' or 'match_rms_adamw', got {value!r}")


def _ns_dtype(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in _NS_DTYPES:
        raise ValueError(
            f"{attribute.name} must be torch.bfloat16, torch.float32 or torch.float64, "
            f"got {value!r}"
        )


def _callable(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not callable(value):
        raise TypeError(f"{attribute.name} must be a callable (path, param) -> bool, got {value!r}")


def _optional_lr(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        _validate_lr(inst, attribute, value)


@attrs.frozen
class MuonHParams:
    """Hyperparameters of :func:`~purestep.optim.muon` (Muon's as ``torch.optim.Muon`` names them).

    Attributes:
        lr: learning rate (>= 0) or schedule ``count -> lr``.
        weight_decay: >= 0, decoupled (``p *= 1 - lr * weight_decay``) on the Muon params.
        momentum: in [0, 1).
        nesterov: Nesterov momentum.
        ns_coefficients: ``(a, b, c)`` of the quintic Newton–Schulz iteration.
        eps: > 0, the floor of the Frobenius norm the matrix is divided by.
        ns_steps: Newton–Schulz iterations, in [1, 100).
        adjust_lr_fn: ``"original"`` or ``"match_rms_adamw"``.
        ns_dtype: dtype the iteration runs in (bf16, fp32 or fp64).
        use_muon: ``(path, param) -> bool``, which params are orthogonalised.
        adam_lr: the AdamW params' lr (or schedule); None: ``lr``.
        adam_betas: AdamW's ``(beta1, beta2)``, each in [0, 1).
        adam_eps: > 0, AdamW's denominator term.
        adam_weight_decay: >= 0, AdamW's decoupled weight decay.

    Example:
        >>> MuonHParams(lr=0.02).ns_coefficients
        (3.4445, -4.775, 2.0315)
    """

    lr: ScalarOrSchedule = attrs.field(default=1e-3, validator=_validate_lr)
    weight_decay: float = attrs.field(default=0.1, validator=_non_negative)
    momentum: float = attrs.field(default=0.95, validator=_momentum)
    nesterov: bool = attrs.field(default=True, validator=_is_bool)
    ns_coefficients: tuple[float, float, float] = attrs.field(
        default=(3.4445, -4.7750, 2.0315), converter=_to_betas, validator=_coefficients
    )
    eps: float = attrs.field(default=1e-7, validator=_positive)
    ns_steps: int = attrs.field(default=5, validator=_ns_steps)
    adjust_lr_fn: Literal["original", "match_rms_adamw"] = attrs.field(
        default="original", validator=_adjust
    )
    ns_dtype: torch.dtype = attrs.field(default=torch.bfloat16, validator=_ns_dtype)
    use_muon: UseMuon = attrs.field(default=is_matrix, validator=_callable)
    adam_lr: ScalarOrSchedule | None = attrs.field(default=None, validator=_optional_lr)
    adam_betas: tuple[float, float] = attrs.field(
        default=(0.9, 0.95), converter=_to_betas, validator=_validate_betas
    )
    adam_eps: float = attrs.field(default=1e-10, validator=_positive)
    adam_weight_decay: float = attrs.field(default=0.0, validator=_non_negative)


def _newton_schulz(x: torch.Tensor, hp: MuonHParams) -> torch.Tensor:
    """torch's ``_zeropower_via_newtonschulz`` on a copy of the matrix ``x`` (never written).

    torch 2.13 divides ``x.bfloat16()`` in place, which *is* the momentum buffer
    for bf16 params without Nesterov (pytorch/pytorch#194664); the copy avoids that.
    """
    a, b, c = hp.ns_coefficients
    o = x.to(hp.ns_dtype, copy=True)
    transposed = x.size(0) > x.size(1)
    if transposed:
        o = o.T
    o.div_(o.norm().clamp(min=hp.eps))
    for _ in range(hp.ns_steps):
        gram = o @ o.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        o = torch.addmm(o, gram_update, o, beta=a)
    return o.T if transposed else o


def _lr_ratio(how: str, rows: int, cols: int) -> float:
    if how == "original":
        return math.sqrt(max(1, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


def _muon_step(
    p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, hp: MuonHParams, lr: float
) -> None:
    """One Muon step of one (local, plain) param in place; ``g`` is never written."""
    if p.numel() == 0:
        return
    if g.dtype != p.dtype:
        g = g.to(p.dtype)
    buf.lerp_(g, 1 - hp.momentum)
    update = g.lerp(buf, hp.momentum) if hp.nesterov else buf
    rows = p.shape[0]
    cols = p.numel() // rows
    o = _newton_schulz(update.reshape(rows, cols), hp)
    if hp.weight_decay != 0:
        p.mul_(1 - lr * hp.weight_decay)
    p.add_(o.reshape(p.shape), alpha=-(lr * _lr_ratio(hp.adjust_lr_fn, rows, cols)))


def _kernel(hp: MuonHParams) -> Kernel:
    """Muon on the params whose ``nu`` is a placeholder, the AdamW kernel on the others."""
    adamw = adamw_kernel(
        AdamHParams(
            lr=hp.lr if hp.adam_lr is None else hp.adam_lr,
            betas=hp.adam_betas,
            eps=hp.adam_eps,
            weight_decay=hp.adam_weight_decay,
            decoupled_weight_decay=True,
        )
    )

    def kernel(
        p: list[torch.Tensor],
        g: list[torch.Tensor],
        m: list[list[torch.Tensor]],
        lr: float,
        steps: list[torch.Tensor] | None,
        count: int,
    ) -> None:
        assert steps is not None
        mu, nu = m
        n = len(p)
        rest = [i for i in range(n) if nu[i].shape == p[i].shape]
        if rest:
            rate = lr if hp.adam_lr is None else lr_at(hp.adam_lr, count)
            pk = [pick(x, rest, n) for x in (p, g, mu, nu, steps)]
            adamw(pk[0], pk[1], [pk[2], pk[3]], rate, pk[4], count)
        if len(rest) < n:
            adam = set(rest)
            for i in range(n):
                if i not in adam:
                    _muon_step(p[i], g[i], mu[i], hp, lr)

    return kernel


def _is_sharded(t: torch.Tensor) -> bool:
    """A DTensor whose local shard is not the whole tensor (any placement but Replicate)."""
    placements = getattr(t, "placements", None)
    return placements is not None and not all(pl.is_replicate() for pl in placements)


def _refuse_sharded(path: str, t: torch.Tensor) -> None:
    raise ValueError(
        f"muon: params at {path} is a DTensor placed as {tuple(t.placements)}; "  # type: ignore[attr-defined]
        "Newton–Schulz needs the whole matrix on each rank, which this implementation does "
        "not gather: leave it to the AdamW fallback (use_muon=...) or replicate it"
    )


def _selected(hp: MuonHParams, path: str, p: torch.Tensor) -> bool:
    chosen = hp.use_muon(path, p)
    if not isinstance(chosen, bool):
        raise TypeError(f"muon: use_muon({path!r}, param) returned {chosen!r}, not a bool")
    if chosen and p.ndim < 2:
        raise ValueError(
            f"muon: use_muon selected params at {path} of shape {tuple(p.shape)}; "
            "Muon orthogonalises matrices (ndim >= 2)"
        )
    if chosen and _is_sharded(p):
        _refuse_sharded(path, p)
    return chosen


def muon(
    lr: ScalarOrSchedule = 1e-3,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
    eps: float = 1e-7,
    ns_steps: int = 5,
    adjust_lr_fn: Literal["original", "match_rms_adamw"] = "original",
    *,
    ns_dtype: torch.dtype = torch.bfloat16,
    use_muon: UseMuon = is_matrix,
    adam_lr: ScalarOrSchedule | None = None,
    adam_betas: tuple[float, float] = (0.9, 0.95),
    adam_eps: float = 1e-10,
    adam_weight_decay: float = 0.0,
) -> Transform:
    """Muon (``torch.optim.Muon``) for the params ``use_muon`` selects, AdamW for the others.

    The arithmetic is in the module docstring: ``torch.optim.Muon``'s, bitwise
    (Keller Jordan's ``muon.py`` up to bf16 rounding: torch fuses ``b*A + c*A@A``
    and ``a*X + B@X`` into ``addmm`` and scales the lr, not the bf16 update).
    Which params are orthogonalised is explicit: ``use_muon(path, param)``
    (``path`` dotted, e.g. ``"blocks.0.attn.weight"``) is asked once per param
    by ``init``; the default :func:`is_matrix` takes every param with ``ndim >= 2``.
    Muon is meant for hidden layers: exclude embeddings and the output head, e.g.
    ``use_muon=lambda path, p: p.ndim >= 2 and "embed" not in path and "head" not in path``.
    A param with more than two dims (a conv filter) is orthogonalised as the
    ``(shape[0], prod(shape[1:]))`` matrix, and ``rows, cols`` are that matrix's
    (Keller Jordan's reference flattens 4-D filters alike, but takes its scale from
    the filter's last two dims). The others take AdamW: the fused kernel of
    :func:`~purestep.optim.adamw` with ``adam_betas``, ``adam_eps`` and
    ``adam_weight_decay`` (defaults: Keller Jordan's ``MuonWithAuxAdam``) and
    ``adam_lr`` (default: ``lr``, as optax's ``contrib.muon``).

    State (a TensorDict): ``count`` (int64 0-dim CPU), ``lr`` (float64 0-dim CPU,
    Muon's lr of the last update), ``mu`` (a tree like params: the momentum
    buffer of Muon params, AdamW's first moment of the others), ``nu`` (AdamW's
    second moment; for a Muon param an empty ``(0,)`` tensor, which marks it) and
    ``steps`` (per-parameter float32 step counts). A param left out of ``grads``
    is not touched. ``step(..., donate=True)`` updates params and moments in their
    own buffers; ``donate=False`` runs the same kernel on fresh copies; ``update``
    returns ``new_params - params``. Sharded DTensor (FSDP) params cannot be
    orthogonalised shard by shard: selecting one raises.

    Args:
        lr: learning rate >= 0, or a schedule ``count -> lr``.
        weight_decay: >= 0, decoupled, for the Muon params.
        momentum: in [0, 1).
        nesterov: Nesterov momentum.
        ns_coefficients: ``(a, b, c)`` of the quintic Newton–Schulz iteration.
        eps: > 0, floor of the norm the matrix is divided by.
        ns_steps: Newton–Schulz iterations, in [1, 100).
        adjust_lr_fn: ``"original"`` (``max(1, rows/cols)**0.5``) or ``"match_rms_adamw"``
            (``0.2 * max(rows, cols)**0.5``).
        ns_dtype: the dtype of the iteration: ``torch.bfloat16`` (torch, Keller
            Jordan), ``torch.float32`` or ``torch.float64``.
        use_muon: ``(path, param) -> bool``: which params are orthogonalised.
        adam_lr: lr (or schedule) of the AdamW params; None: ``lr``.
        adam_betas: AdamW's ``(beta1, beta2)``.
        adam_eps: AdamW's ``eps``.
        adam_weight_decay: AdamW's decoupled weight decay.

    Example:
        >>> from tensordict import TensorDict
        >>> opt = muon(lr=0.02, weight_decay=0.0)
        >>> p = TensorDict({"w": torch.zeros(2, 2), "b": torch.zeros(2)}, [])
        >>> g = TensorDict({"w": torch.eye(2), "b": torch.ones(2)}, [])
        >>> p2, s = opt.step(g, opt.init(p), p)
        >>> p2["w"].diagonal(), tuple(s["nu", "w"].shape), tuple(s["nu", "b"].shape)
        (tensor([-0.0225, -0.0225]), (0,), (2,))
    """
    hp = MuonHParams(
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        nesterov=nesterov,
        ns_coefficients=ns_coefficients,
        eps=eps,
        ns_steps=ns_steps,
        adjust_lr_fn=adjust_lr_fn,
        ns_dtype=ns_dtype,
        use_muon=use_muon,
        adam_lr=adam_lr,
        adam_betas=adam_betas,
        adam_eps=adam_eps,
        adam_weight_decay=adam_weight_decay,
    )
    name = "muon"
    base = kernel_transform(
        name=name,
        hparams=hp,
        lr=hp.lr,
        moments=("mu", "nu"),
        kernel=_kernel(hp),
        steps=True,
        decays=hp.weight_decay != 0 or hp.adam_weight_decay != 0,
    )
    assert base.step_fn is not None

    def init(params: TensorDictBase) -> TensorDict:
        check_floating(params, name)
        leaves = tree.leaves(params)
        chosen = [
            _selected(hp, tree.format_path(path), p)
            for path, p in zip(tree.paths(params), leaves, strict=True)
        ]
        nu = [
            torch.zeros(0, dtype=p.dtype, device=tree.local(p).device) if c else torch.zeros_like(p)
            for p, c in zip(leaves, chosen, strict=True)
        ]
        steps = pack_steps(
            [torch.zeros((), dtype=torch.float32, device=step_device(p, True)) for p in leaves]
        )
        first = checked_lr(hp.lr, 0, name)
        check_lr_fits(first, leaves, 0, name)
        state: dict[str, object] = dict(scalar_state(0, first))
        state["mu"] = tree.zeros_like(params)
        state["nu"] = tree.rebuild(params, nu)
        state["steps"] = tree.rebuild(params, steps)
        return TensorDict(state, batch_size=[])

    def check(state: TensorDictBase, params: TensorDictBase | None) -> None:
        """Before anything changes: the AdamW lr at this count; no sharded Muon param."""
        if hp.adam_lr is not None:
            checked_lr(hp.adam_lr, int(state["count"]), f"{name} (adam_lr)")
        if params is None:
            return
        leaves = tree.leaves(params)
        if all(type(t) is torch.Tensor for t in leaves):
            return
        nu = tree.leaves(state["nu"])
        for path, p, v in zip(tree.paths(params), leaves, nu, strict=True):
            if v.shape != p.shape and _is_sharded(p):
                _refuse_sharded(tree.format_path(path), p)

    def step(
        grads: TensorDictBase,
        state: TensorDictBase,
        params: TensorDictBase,
        *,
        donate: bool = False,
    ) -> tuple[TensorDict, TensorDict]:
        check(state, params)
        assert base.step_fn is not None
        return base.step_fn(grads, state, params, donate=donate)

    def update(
        grads: TensorDictBase,
        state: TensorDictBase,
        params: TensorDictBase | None,
        *,
        donate: bool = False,
    ) -> tuple[TensorDict, TensorDict]:
        check(state, params)
        return base.update_fn(grads, state, params, donate=donate)

    return Transform(init_fn=init, update_fn=update, step_fn=step, name=name, hparams=hp)
