"""How each role's optimizer runs inside a compiled step.

Two kinds of *plan*:

* :class:`FusedPlan` for ``adam``, ``adamw`` and ``sgd`` without dampening
  (also after ``clip_by_global_norm`` heads in a ``chain``), over dense params
  of one device: the eager step's fused kernel (``torch._fused_adam(w)_`` /
  ``_fused_sgd_``) called from inside the graph with the learning rate as a
  0-dim tensor input, which the host computes each call from the CPU ``count``
  exactly as the eager step does (``lr = schedule(count)``); Adam's
  per-parameter step counts are state tensors on the params' device. The
  kernels' tensor-lr overloads give the same bits as the float ones (checked
  by the tests), so the update equals the eager one. The clip heads' ``update``
  is traced as is (it has no host read). No Python runs per leaf, and with
  device scalars the kernels can be captured in a CUDA graph.
* :class:`OpaquePlan` for every other transform (``lion``,
  ``scale_by_schedule``, user transforms): the transform's own donated
  ``step`` inside the opaque op of ``_ops`` (Python work per leaf; not
  capturable in a CUDA graph).

A plan's ``host`` gives the per-call scalar inputs and the state leaves the
host replaces (``count``, ``lr``: new CPU tensors, as in eager); ``flags`` is
what the graph is specialised on (SGD's first update, which initialises the
momentum buffer); ``apply`` runs in the traced core.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import attrs
import torch
from tensordict import TensorDictBase

from purestep import tree
from purestep.optim import AdamHParams, ClipHParams, SGDHParams, Transform

__all__ = ["FusedPlan", "HostScalars", "OpaquePlan", "Plan", "plan_for"]

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_HALF = (torch.float16, torch.bfloat16)


@attrs.frozen
class HostScalars:
    """A plan's per-call host values.

    Attributes:
        inputs: 0-dim tensors passed to the graph (learning rate, Adam's step).
        replace: ``{opt-state leaf index: new tensor}`` that the host puts into
            the new optimizer state (the CPU ``count`` and ``lr``).
        flags: what the graph is specialised on (part of the variant key).
    """

    inputs: tuple[torch.Tensor, ...] = ()
    replace: tuple[tuple[int, torch.Tensor], ...] = ()
    flags: Hashable = ()


class Plan(Protocol):
    """How one role's optimizer runs in the graph (see the module docstring)."""

    @property
    def capturable(self) -> bool:
        """Whether the graph can be captured in a CUDA graph (no host reads at run time)."""

    def host(self, opt_leaves: Sequence[torch.Tensor]) -> HostScalars: ...

    def apply(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        opt: list[torch.Tensor],
        scalars: Sequence[torch.Tensor],
        flags: Hashable,
        donate: bool,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]: ...


@attrs.frozen
class OpaquePlan:
    """The transform's own donated ``step`` inside ``purestep::transform_step``."""

    handle: int
    capturable: bool = False

    def host(self, opt_leaves: Sequence[torch.Tensor]) -> HostScalars:
        """Nothing: the op reads the count itself."""
        return HostScalars()

    def apply(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        opt: list[torch.Tensor],
        scalars: Sequence[torch.Tensor],
        flags: Hashable,
        donate: bool,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Update fresh copies (pure) or the buffers (donated); 0-dim leaves are always new."""
        if not donate:
            params = [t.clone() for t in params]
            opt = [t.clone() for t in opt]
        else:  # replaced leaves (count, lr, a norm) are new tensors each step, as in eager
            opt = [t.clone() if t.dim() == 0 else t for t in opt]
        torch.ops.purestep.transform_step(self.handle, params, grads, opt)
        return params, opt


def _lr_at(lr: Any, count: int, who: str) -> float:
    """The learning rate of update ``count``, refused as the eager optimizers refuse it."""
    try:
        x = float(lr(count)) if callable(lr) else float(lr)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"{who}: the learning-rate schedule failed at update {count}: {e}") from e
    if not math.isfinite(x) or x < 0:
        raise ValueError(
            f"{who}: the learning rate at update {count} is {x!r}; it must be finite and >= 0 "
            "(check the schedule)"
        )
    return x


@attrs.frozen
class FusedPlan:
    """A fused Adam(W)/SGD step with a tensor learning rate, after optional clip heads.

    Attributes:
        hp: the last transform's hyperparameters (:class:`AdamHParams` / :class:`SGDHParams`).
        name: the last transform's name (errors).
        clips: ``(transform, norm leaf index)`` of each clip head, in order.
        count: index of the kernel's ``count`` leaf in the opt-state leaves.
        lr: index of its ``lr`` leaf.
        moments: ``{key: leaf indices}`` of its per-parameter trees (``mu``, ``nu``,
            ``nu_max``, ``steps``, ``momentum_buffer``).
        device: where the learning-rate input lives (the params' device).
    """

    hp: AdamHParams | SGDHParams
    name: str
    clips: tuple[tuple[Transform, int], ...]
    count: int
    lr: int
    moments: dict[str, tuple[int, ...]]
    device: torch.device

    @property
    def capturable(self) -> bool:
        """Yes: the learning rate and Adam's step counts are device tensors."""
        return True

    def host(self, opt_leaves: Sequence[torch.Tensor]) -> HostScalars:
        """``lr(count)`` as an input; the new ``count`` and ``lr`` leaves (SGD: first-update flag)."""
        n = int(opt_leaves[self.count])
        lr = _lr_at(self.hp.lr, n, self.name)
        replace = (
            (self.count, torch.tensor(n + 1, dtype=torch.int64)),
            (self.lr, torch.tensor(lr, dtype=torch.float64)),
        )
        lr_t = torch.tensor(lr, dtype=torch.float64, device=self.device)
        if isinstance(self.hp, AdamHParams):
            return HostScalars((lr_t,), replace, ())
        return HostScalars((lr_t,), replace, n == 0 and self.hp.momentum != 0)

    def apply(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        opt: list[torch.Tensor],
        scalars: Sequence[torch.Tensor],
        flags: Hashable,
        donate: bool,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Clip heads (traced as in eager), then the fused kernel on the buffers or fresh copies."""
        opt = list(opt)
        for clip, norm_at in self.clips:
            g_td = tree.plain_td({str(i): g for i, g in enumerate(grads)})
            g_td, new_state = clip.update(
                g_td, tree.plain_td({"norm": opt[norm_at]}), None, donate=False
            )
            grads = tree.leaves(g_td)
            opt[norm_at] = new_state.get("norm")
        if not donate:
            params = [t.clone() for t in params]
        moments: dict[str, list[torch.Tensor]] = {}
        for k, idx in self.moments.items():
            if k == "steps":  # per-parameter step counts, counting this update
                old = [opt[i] for i in idx]
                if donate:
                    torch._foreach_add_(old, 1.0)
                    ms = old
                else:
                    ms = list(torch._foreach_add(old, 1.0))
            else:
                ms = [opt[i] if donate else opt[i].clone() for i in idx]
            for i, m in zip(idx, ms, strict=True):
                opt[i] = m
            moments[k] = ms
        hp = self.hp
        if isinstance(hp, AdamHParams):
            torch.ops.purestep.fused_adam_(
                params,
                grads,
                moments["mu"],
                moments["nu"],
                moments.get("nu_max", []),
                moments["steps"],
                scalars[0],
                hp.betas[0],
                hp.betas[1],
                hp.weight_decay,
                hp.eps,
                hp.amsgrad,
                hp.decoupled_weight_decay,
            )
        else:
            torch.ops.purestep.fused_sgd_(
                params,
                grads,
                moments.get("momentum_buffer", []),
                scalars[0],
                hp.weight_decay,
                hp.momentum,
                hp.dampening,
                hp.nesterov,
                bool(flags),
            )
        return params, opt


def _is_dense(t: torch.Tensor) -> bool:
    """Elements fill the memory without gaps or overlaps (what fused kernels walk)."""
    if t.is_contiguous():
        return True
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape, strict=True) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _fusable(params: Sequence[torch.Tensor], kind: str) -> torch.device | None:
    devices = {t.device for t in params}
    if not params or len(devices) != 1:
        return None
    (device,) = devices
    if device.type not in ("cpu", "cuda"):
        return None
    for t in params:
        if type(t) is not torch.Tensor and not isinstance(t, torch._subclasses.FakeTensor):
            return None  # DTensor and other subclasses: the opaque op
        if t.dtype not in _FUSED_DTYPES or not _is_dense(t):
            return None  # the eager kernels take their foreach path there
        # torch <= 2.13's CPU _fused_sgd_ is wrong for fp16/bf16 (pytorch/pytorch#191763);
        # the eager sgd falls back to foreach there, and so does the opaque op
        if kind == "sgd" and device.type == "cpu" and t.dtype in _HALF:
            return None
    return device


def plan_for(
    transform: Transform, opt_state: TensorDictBase, params: Sequence[torch.Tensor], handle: int
) -> Plan:
    """The plan for ``transform`` over ``opt_state`` (its tree) and ``params`` (its leaves).

    Example:
        >>> from tensordict import TensorDict
        >>> from purestep import optim
        >>> p = TensorDict({"w": torch.ones(2)}, [])
        >>> t = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3))
        >>> type(plan_for(t, t.init(p), tree.leaves(p), 0)).__name__
        'FusedPlan'
        >>> type(plan_for(optim.lion(1e-4), optim.lion(1e-4).init(p), tree.leaves(p), 0)).__name__
        'OpaquePlan'
    """
    parts: tuple[Transform, ...] = (transform,)
    prefix: tuple[str, ...] = ()
    if isinstance(transform.hparams, tuple):  # chain: heads must be clips
        parts = transform.hparams
        prefix = (str(len(parts) - 1),)
    *heads, last = parts
    hp = last.hparams
    kind = "adam" if isinstance(hp, AdamHParams) else "sgd" if isinstance(hp, SGDHParams) else None
    if kind is None or any(not isinstance(h.hparams, ClipHParams) for h in heads):
        return OpaquePlan(handle)
    device = _fusable(params, kind)
    if device is None:
        return OpaquePlan(handle)
    index = {p: i for i, p in enumerate(tree.paths(opt_state))}
    try:
        clips = tuple((h, index[(str(j), "norm")]) for j, h in enumerate(heads))
        count, lr = index[(*prefix, "count")], index[(*prefix, "lr")]
    except KeyError:
        return OpaquePlan(handle)
    keys = ("mu", "nu", "nu_max", "steps") if kind == "adam" else ("momentum_buffer", "steps")
    n = len(prefix) + 1
    moments = {
        k: tuple(i for p, i in index.items() if p[:n] == (*prefix, k))
        for k in keys
        if any(p[:n] == (*prefix, k) for p in index)
    }
    if any(len(v) != len(params) for v in moments.values()):
        return OpaquePlan(handle)
    if (kind == "adam") != ("steps" in moments):
        return OpaquePlan(handle)  # Adam keeps step counts; SGD only with dampening (host reads)
    leaves = tree.leaves(opt_state)
    if kind == "adam" and any(leaves[i].device != device for i in moments["steps"]):
        return OpaquePlan(handle)  # step counts on the host: the foreach path
    return FusedPlan(hp, last.name, clips, count, lr, moments, device)


# ----------------------------------------------------------------------------- ops


def _groups(params: Sequence[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    return tree.group_by_device_dtype(list(params))


def _pick(items: Sequence[torch.Tensor], idx: list[int]) -> list[torch.Tensor]:
    return [items[i] for i in idx] if items else []


def _match_layout(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``g`` with ``p``'s strides and dtype (fused kernels pair elements by memory offset)."""
    if g.dtype != p.dtype:
        g = g.to(p.dtype)
    if g.stride() == p.stride() or (g.is_contiguous() and p.is_contiguous()):
        return g
    return torch.empty_like(p).copy_(g)


def fused_adam_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    lr: torch.Tensor,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    amsgrad: bool,
    decoupled: bool,
) -> None:
    """``torch._fused_adam(w)_`` per (device, dtype) group with a tensor ``lr``.

    ``steps`` are the per-parameter step counts (already counting this update).

    Example:
        >>> p, m, v = [torch.ones(2)], [torch.zeros(2)], [torch.zeros(2)]
        >>> fused_adam_(p, [torch.ones(2)], m, v, [], [torch.tensor(1.0)],
        ...             torch.tensor(0.1, dtype=torch.float64), 0.9, 0.999, 0.0, 1e-8, False, False)
        >>> p[0]
        tensor([0.9000, 0.9000])
    """
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    for (device, _), idx in _groups(params).items():
        ps = _pick(params, idx)
        fused(
            ps,
            [_match_layout(p, g) for p, g in zip(ps, _pick(grads, idx), strict=True)],
            _pick(exp_avgs, idx),
            _pick(exp_avg_sqs, idx),
            _pick(max_exp_avg_sqs, idx),
            _pick(steps, idx),
            lr=lr.to(device),
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=amsgrad,
            maximize=False,
        )


def fused_sgd_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    momentum_buffers: list[torch.Tensor],
    lr: torch.Tensor,
    weight_decay: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    is_first_step: bool,
) -> None:
    """``torch._fused_sgd_`` per (device, dtype) group with a tensor ``lr``.

    Example:
        >>> p = [torch.ones(2)]
        >>> fused_sgd_(p, [torch.ones(2)], [], torch.tensor(0.5, dtype=torch.float64),
        ...            0.0, 0.0, 0.0, False, False)
        >>> p[0]
        tensor([0.5000, 0.5000])
    """
    for (device, _), idx in _groups(params).items():
        ps = _pick(params, idx)
        torch._fused_sgd_(
            ps,
            [_match_layout(p, g) for p, g in zip(ps, _pick(grads, idx), strict=True)],
            _pick(momentum_buffers, idx),
            weight_decay=weight_decay,
            momentum=momentum,
            lr=lr.to(device),
            dampening=dampening,
            nesterov=nesterov,
            maximize=False,
            is_first_step=is_first_step and momentum != 0,
        )


_SCHEMAS: dict[str, tuple[str, Callable[..., None]]] = {
    "fused_adam_": (
        "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] max_exp_avg_sqs, Tensor[] steps, Tensor lr, float beta1, float beta2, "
        "float weight_decay, float eps, bool amsgrad, bool decoupled) -> ()",
        fused_adam_,
    ),
    "fused_sgd_": (
        "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, Tensor lr, "
        "float weight_decay, float momentum, float dampening, bool nesterov, "
        "bool is_first_step) -> ()",
        fused_sgd_,
    ),
}


def _nothing(*args: Any) -> None:
    return None


def _define() -> None:
    for name, (schema, impl) in _SCHEMAS.items():
        qualname = f"purestep::{name}"
        try:
            getattr(torch.ops.purestep, name)
            continue  # module re-imported: the op exists
        except (AttributeError, RuntimeError):
            pass
        torch.library.define(qualname, schema)
        torch.library.impl(qualname, "CompositeExplicitAutograd", impl)
        torch.library.register_fake(qualname, _nothing)


_define()
