"""Adam and AdamW: fused in-place ``step``, pure ``step`` and optax-style ``update``.

Numerics follow ``torch.optim.Adam`` / ``AdamW``: the donated step calls the
same fused kernels as ``fused=True`` (bitwise equal to it); the ``_foreach_*``
fallback and ``update`` follow the op order of ``foreach=True``, with scalars
applied at full precision (see :func:`~purestep.optim._hparams.foreach_mul_`).
"""

from __future__ import annotations

from typing import cast

import torch
from tensordict import TensorDict, TensorDictBase

from purestep import tree
from purestep.optim._base import ScalarOrSchedule, Transform
from purestep.optim._hparams import (
    AdamHParams,
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
                G = list(torch._foreach_add(G, P, alpha=wd))
        torch._foreach_lerp_(M, G, 1 - b1)
        foreach_mul_(V, b2)
        torch._foreach_addcmul_(V, G, G, 1 - b2)
        del G
        if hp.amsgrad:
            X = nu_max[sl]
            torch._foreach_maximum_(X, V)
            den = list(torch._foreach_sqrt(X))
        else:
            den = list(torch._foreach_sqrt(V))
        torch._foreach_div_(den, bc2_sqrt)
        torch._foreach_add_(den, hp.eps)
        torch._foreach_addcdiv_(P, M, den, step_size)


def _kernel(
    p: list[torch.Tensor],
    g: list[torch.Tensor],
    mu: list[torch.Tensor],
    nu: list[torch.Tensor],
    nu_max: list[torch.Tensor],
    hp: AdamHParams,
    lr: float,
    step: int,
) -> None:
    """Update plain (local) tensors p, mu, nu, nu_max in place; ``g`` is never written.

    Grouped by (device, dtype); fused kernels where :func:`fused_supported`, else foreach.
    ``step`` is the 1-based step used for bias correction.
    """
    n = len(p)
    if n == 0:
        return
    b1, b2 = hp.betas
    fused = torch._fused_adamw_ if hp.decoupled_weight_decay else torch._fused_adam_
    for (device, dtype), idx in tree.group_by_device_dtype(p).items():
        P, G, M, V = pick(p, idx, n), pick(g, idx, n), pick(mu, idx, n), pick(nu, idx, n)
        X = pick(nu_max, idx, n) if hp.amsgrad else []
        G = [x if x.dtype == dtype else x.to(dtype) for x in G]
        if fused_supported(device, dtype):
            steps = torch.full((), float(step), dtype=torch.float32, device=device)
            # The fused kernels' schema marks grads mutable; they write them only
            # with grad_scale / maximize, which are never passed here.
            fused(
                P,
                G,
                M,
                V,
                X,
                [steps] * len(P),
                lr=lr,
                beta1=b1,
                beta2=b2,
                weight_decay=hp.weight_decay,
                eps=hp.eps,
                amsgrad=hp.amsgrad,
                maximize=False,
            )
        else:
            _foreach_inplace(P, G, M, V, X, hp, lr, step)


def _moment_keys(hp: AdamHParams) -> tuple[str, ...]:
    return ("mu", "nu", "nu_max") if hp.amsgrad else ("mu", "nu")


def _make(hp: AdamHParams, name: str) -> Transform:
    keys = _moment_keys(hp)

    def init(params: TensorDictBase) -> TensorDict:
        check_floating(params, name)
        state: dict[str, object] = dict(scalar_state(0, lr_at(hp.lr, 0)))
        for k in keys:
            state[k] = tree.zeros_like(params)
        return TensorDict(state, batch_size=[])

    step = in_place_step(
        hp.lr,
        keys,
        lambda p, g, m, lr, count: _kernel(
            p, g, m[0], m[1], m[2] if hp.amsgrad else [], hp, lr, count + 1
        ),
    )

    def update(
        grads: TensorDictBase,
        state: TensorDictBase,
        params: TensorDictBase | None,
        *,
        donate: bool = False,
    ) -> tuple[TensorDict, TensorDict]:
        check_grads(grads, params, state["mu"])
        if params is None and hp.weight_decay != 0:
            raise ValueError(f"{name}.update needs params when weight_decay != 0")
        n = int(state["count"])
        lr = lr_at(hp.lr, n)
        b1, b2 = hp.betas
        wd = hp.weight_decay
        # Moments are updated in place: in their own buffers when donated, else in
        # fresh copies (the same ops either way, so both give bitwise equal results).
        # Maths runs on local shards; the update is wrapped back like the grads.
        g_leaves = tree.leaves(grads)
        if not g_leaves:  # nothing to optimize (foreach ops reject empty lists)
            empty: dict[str, object] = dict(scalar_state(n + 1, lr))
            empty.update((k, state[k].clone()) for k in keys)
            return cast(TensorDict, grads.clone()), TensorDict(empty, batch_size=[])
        g = locals_(g_leaves)
        p = locals_(tree.leaves(params)) if params is not None else []
        moments = {k: tree.leaves(state[k]) for k in keys}
        if not donate:
            moments = {k: [t.clone() for t in m] for k, m in moments.items()}
        mu, nu = locals_(moments["mu"]), locals_(moments["nu"])
        if wd != 0 and not hp.decoupled_weight_decay:
            g = list(torch._foreach_add(g, p, alpha=wd))
        torch._foreach_lerp_(mu, g, 1 - b1)
        foreach_mul_(nu, b2)
        torch._foreach_addcmul_(nu, g, g, 1 - b2)
        den_src = nu
        if hp.amsgrad:
            den_src = locals_(moments["nu_max"])
            torch._foreach_maximum_(den_src, nu)
        step_size = (lr / (1 - b1 ** float(n + 1))) * -1
        den = list(torch._foreach_sqrt(den_src))
        torch._foreach_div_(den, (1 - b2 ** float(n + 1)) ** 0.5)
        torch._foreach_add_(den, hp.eps)
        upd = list(torch._foreach_div(mu, den))
        del den
        foreach_mul_(upd, step_size)
        if wd != 0 and hp.decoupled_weight_decay:
            torch._foreach_add_(upd, p, alpha=-lr * wd)
        new_state: dict[str, object] = dict(scalar_state(n + 1, lr))
        for k in keys:
            new_state[k] = state[k] if donate else tree.rebuild(state[k], moments[k])
        return tree.rebuild(grads, wrap_like(g_leaves, upd)), TensorDict(new_state, batch_size=[])

    return Transform(init_fn=init, update_fn=update, step_fn=step, name=name, hparams=hp)


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
    the params' dtype and device) and, with ``amsgrad``, ``nu_max``.

    Update ``n`` (0-based) uses ``lr(n)`` and bias correction ``1 - beta ** (n + 1)``.
    ``step(..., donate=True)`` updates params and moments in their own buffers
    with ``torch._fused_adam_`` (``_foreach_*`` where no fused kernel exists for a
    device/dtype), bitwise equal to ``torch.optim.Adam(fused=True)``; with
    ``donate=False`` it runs the same kernel on fresh copies and mutates nothing.
    ``update`` returns the directions ``new_params - params`` (``_foreach_*``).

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
        ['count', 'lr', 'mu', 'nu']
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
