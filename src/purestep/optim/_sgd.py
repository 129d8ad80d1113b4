"""SGD with momentum, dampening, Nesterov and weight decay (``torch.optim.SGD``).

The donated step calls ``torch._fused_sgd_`` (as ``SGD(fused=True)``); the
``_foreach_*`` fallback and ``update`` follow torch's op order, with scalars
applied at full precision (as the default per-tensor path does).
"""

from __future__ import annotations

from typing import cast

import torch
from tensordict import TensorDict, TensorDictBase

from purestep import tree
from purestep.optim._base import ScalarOrSchedule, Transform
from purestep.optim._hparams import (
    SGDHParams,
    check_floating,
    check_grads,
    chunks,
    foreach_mul_,
    fused_supported,
    in_place_step,
    locals_,
    lr_at,
    pick,
    scalar_state,
    wrap_like,
)

__all__ = ["sgd"]


def _direction(
    p: list[torch.Tensor],
    g: list[torch.Tensor],
    buf: list[torch.Tensor],
    hp: SGDHParams,
    first: bool,
) -> list[torch.Tensor]:
    """The descent direction (to be scaled by ``-lr``); updates ``buf`` in place; ``g`` read only.

    The result may alias ``buf`` (plain momentum) or ``g`` (no momentum, no decay).
    """
    d = g
    if hp.weight_decay != 0:
        d = list(torch._foreach_add(g, p, alpha=hp.weight_decay))
    if hp.momentum == 0:
        return d
    if first:
        torch._foreach_copy_(buf, d)
    else:
        foreach_mul_(buf, hp.momentum)
        torch._foreach_add_(buf, d, alpha=1 - hp.dampening)
    if not hp.nesterov:
        return buf
    if d is g:
        return list(torch._foreach_add(g, buf, alpha=hp.momentum))
    torch._foreach_add_(d, buf, alpha=hp.momentum)
    return d


def _kernel(
    p: list[torch.Tensor],
    g: list[torch.Tensor],
    buf: list[torch.Tensor],
    hp: SGDHParams,
    lr: float,
    first: bool,
) -> None:
    """Update plain (local) tensors ``p`` and ``buf`` in place; ``g`` is never written."""
    n = len(p)
    if n == 0:
        return
    has_buf = hp.momentum != 0
    for (device, dtype), idx in tree.group_by_device_dtype(p).items():
        P, G = pick(p, idx, n), pick(g, idx, n)
        B = pick(buf, idx, n) if has_buf else []
        G = [x if x.dtype == dtype else x.to(dtype) for x in G]
        if fused_supported(device, dtype, kernel="sgd"):
            # Grads are written by the kernel only with grad_scale / maximize (never passed).
            torch._fused_sgd_(
                P,
                G,
                B,
                weight_decay=hp.weight_decay,
                momentum=hp.momentum,
                lr=lr,
                dampening=hp.dampening,
                nesterov=hp.nesterov,
                maximize=False,
                is_first_step=first and has_buf,
            )
            continue
        for sl in chunks(P):
            d = _direction(P[sl], G[sl], B[sl] if has_buf else [], hp, first)
            torch._foreach_add_(P[sl], d, alpha=-lr)


def sgd(
    lr: ScalarOrSchedule = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
) -> Transform:
    """Stochastic gradient descent as ``torch.optim.SGD``.

    ``d = g + weight_decay * p``; with momentum, ``buf = d`` on the first update,
    then ``buf = momentum * buf + (1 - dampening) * d``, and ``d = buf`` (or
    ``d + momentum * buf`` with Nesterov); ``p -= lr * d``.

    State (a TensorDict): ``count`` (int64 0-dim CPU, updates done), ``lr``
    (float64 0-dim CPU, the lr of the last update; before the first, the lr it
    will use) and, when ``momentum != 0``, ``momentum_buffer`` (a tree like
    params, in their dtype and device). Update ``n`` (0-based) uses ``lr(n)``.
    ``step(..., donate=True)`` updates params and buffers in place with
    ``torch._fused_sgd_`` (``_foreach_*`` where no fused kernel exists, and for
    fp16/bf16 on CPU, where torch 2.13's fused SGD is wrong: pytorch/pytorch#191763);
    ``donate=False`` runs it on fresh copies. ``update`` returns ``-lr * d``.

    Args:
        lr: learning rate >= 0, or a schedule ``count -> lr``.
        momentum: >= 0.
        dampening: in [0, 1].
        weight_decay: >= 0 (L2, added to the gradient).
        nesterov: Nesterov momentum (needs ``momentum > 0``, ``dampening == 0``).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> opt = sgd(lr=0.1, momentum=0.9)
        >>> p = TensorDict({"w": torch.ones(2)}, [])
        >>> p2, s = opt.step(TensorDict({"w": torch.ones(2)}, []), opt.init(p), p)
        >>> p2["w"], s["momentum_buffer", "w"]
        (tensor([0.9000, 0.9000]), tensor([1., 1.]))
    """
    hp = SGDHParams(
        lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov
    )
    has_buf = hp.momentum != 0

    def init(params: TensorDictBase) -> TensorDict:
        check_floating(params, "sgd")
        state: dict[str, object] = dict(scalar_state(0, lr_at(hp.lr, 0)))
        if has_buf:
            state["momentum_buffer"] = tree.zeros_like(params)
        return TensorDict(state, batch_size=[])

    step = in_place_step(
        hp.lr,
        ("momentum_buffer",) if has_buf else (),
        lambda p, g, m, lr, count: _kernel(p, g, m[0] if has_buf else [], hp, lr, count == 0),
    )

    def update(
        grads: TensorDictBase,
        state: TensorDictBase,
        params: TensorDictBase | None,
        *,
        donate: bool = False,
    ) -> tuple[TensorDict, TensorDict]:
        check_grads(grads, params, state["momentum_buffer"] if has_buf else None)
        if params is None and hp.weight_decay != 0:
            raise ValueError("sgd.update needs params when weight_decay != 0")
        n = int(state["count"])
        lr = lr_at(hp.lr, n)
        g_leaves = tree.leaves(grads)
        if not g_leaves:  # nothing to optimize (foreach ops reject empty lists)
            empty: dict[str, object] = dict(scalar_state(n + 1, lr))
            if has_buf:
                empty["momentum_buffer"] = state["momentum_buffer"].clone()
            return cast(TensorDict, grads.clone()), TensorDict(empty, batch_size=[])
        p = locals_(tree.leaves(params)) if params is not None else []
        mb = state["momentum_buffer"] if has_buf else None
        mb_leaves = tree.leaves(mb) if mb is not None else []
        buf = locals_(mb_leaves)
        if not donate:
            buf = [t.clone() for t in buf]
        d = _direction(p, locals_(g_leaves), buf, hp, n == 0)
        upd = list(torch._foreach_mul(d, -lr))
        new_state: dict[str, object] = dict(scalar_state(n + 1, lr))
        if mb is not None:
            new_state["momentum_buffer"] = (
                mb if donate else tree.rebuild(mb, wrap_like(mb_leaves, buf))
            )
        return tree.rebuild(grads, wrap_like(g_leaves, upd)), TensorDict(new_state, batch_size=[])

    return Transform(init_fn=init, update_fn=update, step_fn=step, name="sgd", hparams=hp)
