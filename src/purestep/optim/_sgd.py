"""SGD with momentum, dampening, Nesterov and weight decay (``torch.optim.SGD``).

The step calls ``torch._fused_sgd_`` (as ``SGD(fused=True)``); the
``_foreach_*`` fallback follows torch's op order, with scalars applied at full
precision (as the default per-tensor path does); ``update`` is the same step,
returned as ``new_params - params``.
"""

from __future__ import annotations

import torch

from purestep import _compat, tree
from purestep.optim._base import ScalarOrSchedule, Transform
from purestep.optim._hparams import SGDHParams
from purestep.optim._kernels import (
    Kernel,
    all_dense,
    chunks,
    foreach_mul_,
    fused_supported,
    kernel_transform,
    pick,
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
        d = list(_compat.foreach_add(g, p, alpha=hp.weight_decay))
    if hp.momentum == 0:
        return d
    if first:
        _compat.foreach_copy_(buf, d)
    else:
        foreach_mul_(buf, hp.momentum)
        _compat.foreach_add_(buf, d, alpha=1 - hp.dampening)
    if not hp.nesterov:
        return buf
    if d is g:
        return list(_compat.foreach_add(g, buf, alpha=hp.momentum))
    _compat.foreach_add_(d, buf, alpha=hp.momentum)
    return d


def _group(
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
        if fused_supported(device, dtype, kernel="sgd") and all_dense(P):
            # Grads are written by the kernel only with grad_scale / maximize (never passed).
            _compat.fused_sgd_(
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
            _compat.foreach_add_(P[sl], d, alpha=-lr)


def _kernel(hp: SGDHParams) -> Kernel:
    """SGD over the leaves; with dampening, each leaf's first update starts its buffer."""
    has_buf = hp.momentum != 0

    def kernel(
        p: list[torch.Tensor],
        g: list[torch.Tensor],
        m: list[list[torch.Tensor]],
        lr: float,
        steps: list[torch.Tensor] | None,
        count: int,
    ) -> None:
        buf = m[0] if has_buf else []
        if steps is None:
            # buffers start at zero, so momentum * 0 + d == d: a leaf's first update
            # needs no flag of its own (only the role's very first uses the fused flag)
            _group(p, g, buf, hp, lr, count == 0)
            return
        first = {i for i, s in enumerate(steps) if float(s) == 1.0}
        if len(first) in (0, len(p)):
            _group(p, g, buf, hp, lr, bool(first))
            return
        for is_first in (True, False):
            ids = [i for i in range(len(p)) if (i in first) == is_first]
            _group(
                [p[i] for i in ids], [g[i] for i in ids], [buf[i] for i in ids], hp, lr, is_first
            )

    return kernel


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
    will use), when ``momentum != 0`` ``momentum_buffer`` (a tree like params,
    in their dtype and device), and with momentum and ``dampening != 0``
    ``steps`` (per-parameter update counts: a parameter's first update sets its
    buffer to ``d``, as torch does when ``momentum_buffer`` is None). Update
    ``n`` (0-based) uses ``lr(n)``; a parameter left out of ``grads`` is not
    touched.
    ``step(..., donate=True)`` updates params and buffers in place with
    ``torch._fused_sgd_`` (``_foreach_*`` where no fused kernel exists, and for
    fp16/bf16 on CPU, where torch 2.13's fused SGD is wrong: pytorch/pytorch#191763);
    ``donate=False`` runs it on fresh copies. ``update`` returns ``new_params - params`` of the same step.

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
    return kernel_transform(
        name="sgd",
        hparams=hp,
        lr=hp.lr,
        moments=("momentum_buffer",) if hp.momentum != 0 else (),
        kernel=_kernel(hp),
        steps=hp.momentum != 0 and hp.dampening != 0,
        fused_steps=False,
        decays=hp.weight_decay != 0,
    )
