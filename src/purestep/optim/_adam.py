"""Adam and AdamW: fused in-place ``step``, pure ``step`` and optax-style ``update``.

Numerics follow ``torch.optim.Adam`` / ``AdamW``: the step calls the same fused
kernels as ``fused=True`` (bitwise equal to it); the ``_foreach_*`` fallback (for
devices and dtypes without a fused kernel) follows the op order of
``foreach=True``, with scalars applied at full precision (see
:func:`~purestep.optim._kernels.foreach_mul_`). ``update`` is the same step,
returned as ``new_params - params`` (:func:`~purestep.optim._kernels.kernel_transform`).
"""

from __future__ import annotations

import torch

from purestep import _compat, tree
from purestep.optim._base import ScalarOrSchedule, Transform
from purestep.optim._hparams import AdamHParams
from purestep.optim._kernels import (
    Kernel,
    all_dense,
    chunks,
    foreach_mul_,
    fused_supported,
    kernel_transform,
    pick,
)
from purestep.optim._steps import steps_by_value

__all__ = ["adam", "adamw"]


def _foreach_inplace(
    p: list[torch.Tensor],
    g: list[torch.Tensor],
    mu: list[torch.Tensor],
    nu: list[torch.Tensor],
    nu_max: list[torch.Tensor],
    hp: AdamHParams,
    lr: float,
    step: int,
) -> None:
    """torch's ``foreach=True`` Adam(W) in place on p, mu, nu, nu_max (grads read only)."""
    b1, b2 = hp.betas
    wd = hp.weight_decay
    step_size = (lr / (1 - b1 ** float(step))) * -1
    bc2_sqrt = (1 - b2 ** float(step)) ** 0.5
    for sl in chunks(p):
        P, G, M, V = p[sl], g[sl], mu[sl], nu[sl]
        if wd != 0:
            if hp.decoupled_weight_decay:
                foreach_mul_(P, 1 - lr * wd)
            else:
                G = list(_compat.foreach_add(G, P, alpha=wd))
        _compat.foreach_lerp_(M, G, 1 - b1)
        foreach_mul_(V, b2)
        _compat.foreach_addcmul_(V, G, G, 1 - b2)
        del G
        if hp.amsgrad:
            X = nu_max[sl]
            _compat.foreach_maximum_(X, V)
            den = list(_compat.foreach_sqrt(X))
        else:
            den = list(_compat.foreach_sqrt(V))
        _compat.foreach_div_(den, bc2_sqrt)
        _compat.foreach_add_(den, hp.eps)
        _compat.foreach_addcdiv_(P, M, den, step_size)


def _kernel(hp: AdamHParams) -> Kernel:
    """Adam(W) on plain (local) tensors p, mu, nu, nu_max in place; ``g`` is never written.

    Grouped by (device, dtype): the fused kernel where :func:`fused_supported`
    (and the params are dense), else the ``_foreach_*`` path, one call per
    distinct step count. ``steps`` are the per-parameter 1-based steps.
    """
    b1, b2 = hp.betas
    fused = _compat.fused_adamw_ if hp.decoupled_weight_decay else _compat.fused_adam_

    def kernel(
        p: list[torch.Tensor],
        g: list[torch.Tensor],
        m: list[list[torch.Tensor]],
        lr: float,
        steps: list[torch.Tensor] | None,
        count: int,
    ) -> None:
        assert steps is not None
        mu, nu = m[0], m[1]
        nu_max = m[2] if hp.amsgrad else []
        n = len(p)
        for (device, dtype), idx in tree.group_by_device_dtype(p).items():
            if fused_supported(device, dtype) and all_dense(pick(p, idx, n)):
                P, G = pick(p, idx, n), pick(g, idx, n)
                G = [x if x.dtype == dtype else x.to(dtype) for x in G]
                # The fused kernels' schema marks grads mutable; they write them only
                # with grad_scale / maximize, which are never passed here.
                fused(
                    P,
                    G,
                    pick(mu, idx, n),
                    pick(nu, idx, n),
                    pick(nu_max, idx, n) if hp.amsgrad else [],
                    pick(steps, idx, n),
                    lr=lr,
                    beta1=b1,
                    beta2=b2,
                    weight_decay=hp.weight_decay,
                    eps=hp.eps,
                    amsgrad=hp.amsgrad,
                    maximize=False,
                )
                continue
            for value, sub in steps_by_value([steps[i] for i in idx]).items():
                ids = [idx[j] for j in sub]
                G = [g[i] if g[i].dtype == dtype else g[i].to(dtype) for i in ids]
                _foreach_inplace(
                    [p[i] for i in ids],
                    G,
                    [mu[i] for i in ids],
                    [nu[i] for i in ids],
                    [nu_max[i] for i in ids] if hp.amsgrad else [],
                    hp,
                    lr,
                    int(value),
                )

    return kernel


def _make(hp: AdamHParams, name: str) -> Transform:
    return kernel_transform(
        name=name,
        hparams=hp,
        lr=hp.lr,
        moments=("mu", "nu", "nu_max") if hp.amsgrad else ("mu", "nu"),
        kernel=_kernel(hp),
        steps=True,
        decays=hp.weight_decay != 0,
    )


def adam(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
) -> Transform:
    """Adam (``torch.optim.Adam``): L2 ``weight_decay`` is added to the gradient.

    State (a TensorDict): ``count`` (int64 0-dim CPU, updates done), ``lr``
    (float64 0-dim CPU, the lr of the last update; before the first, the lr it
    will use), ``mu`` and ``nu`` (first and second moments, trees like params in
    the params' dtype and device), with ``amsgrad`` ``nu_max``, and ``steps``
    (per-parameter float32 step counts, as ``torch.optim``'s ``state["step"]``).

    Update ``n`` (0-based) uses ``lr(n)``; each parameter's bias correction uses
    its own step count, which advances only when the parameter has a gradient
    (a parameter left out of ``grads`` is not touched, as in torch).
    ``step(..., donate=True)`` updates params and moments in their own buffers
    with ``torch._fused_adam_`` (``_foreach_*`` where no fused kernel exists for a
    device/dtype), bitwise equal to ``torch.optim.Adam(fused=True)``; with
    ``donate=False`` it runs the same kernel on fresh copies and mutates nothing.
    ``update`` returns ``new_params - params`` of the same step.

    Args:
        lr: learning rate >= 0, or a schedule ``count -> lr``.
        betas: ``(beta1, beta2)`` in [0, 1).
        eps: > 0, added to the denominator.
        weight_decay: >= 0 (L2, coupled).
        amsgrad: use the running maximum of ``nu``.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> opt = adam(lr=0.1)
        >>> p = TensorDict({"w": torch.ones(2)}, [])
        >>> p2, s = opt.step(TensorDict({"w": torch.ones(2)}, []), opt.init(p), p)
        >>> p2["w"], int(s["count"])
        (tensor([0.9000, 0.9000]), 1)
    """
    hp = AdamHParams(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
    return _make(hp, "adam")


def adamw(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    amsgrad: bool = False,
) -> Transform:
    """AdamW (``torch.optim.AdamW``): decoupled decay ``p -= lr * weight_decay * p``.

    Same state layout, paths and guarantees as :func:`adam` (fused kernel
    ``torch._fused_adamw_``); ``weight_decay`` defaults to 0.01 as in torch.

    Args:
        lr: learning rate >= 0, or a schedule ``count -> lr``.
        betas: ``(beta1, beta2)`` in [0, 1).
        eps: > 0, added to the denominator.
        weight_decay: >= 0 (decoupled).
        amsgrad: use the running maximum of ``nu``.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from purestep.optim import schedules
        >>> opt = adamw(lr=schedules.linear(1e-3, 0.0, 100))
        >>> p = TensorDict({"w": torch.ones(2)}, [])
        >>> s = opt.init(p)
        >>> sorted(s.keys())
        ['count', 'lr', 'mu', 'nu', 'steps']
    """
    hp = AdamHParams(
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        decoupled_weight_decay=True,
    )
    return _make(hp, "adamw")
