"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), as in optax.

``c = beta1 * mu + (1 - beta1) * g``; ``p -= lr * (sign(c) + weight_decay * p)``;
``mu = beta2 * mu + (1 - beta2) * g``. There is no ``torch.optim`` Lion; the
tests check it against a per-tensor reference.
"""

from __future__ import annotations

from typing import cast

import torch
from tensordict import TensorDict, TensorDictBase

from purestep import tree
from purestep.optim._base import ScalarOrSchedule, Transform
from purestep.optim._hparams import (
    LionHParams,
    check_floating,
    check_grads,
    chunks,
    foreach_mul_,
    in_place_step,
    locals_,
    lr_at,
    pick,
    scalar_state,
    wrap_like,
)

__all__ = ["lion"]


def _kernel(
    p: list[torch.Tensor],
    g: list[torch.Tensor],
    mu: list[torch.Tensor],
    hp: LionHParams,
    lr: float,
) -> None:
    """Update plain (local) tensors ``p`` and ``mu`` in place; ``g`` is never written.

    The sign temporary is allocated per chunk (never parameter-sized).
    """
    n = len(p)
    if n == 0:
        return
    b1, b2 = hp.betas
    for (_, dtype), idx in tree.group_by_device_dtype(p).items():
        P, G, M = pick(p, idx, n), pick(g, idx, n), pick(mu, idx, n)
        G = [x if x.dtype == dtype else x.to(dtype) for x in G]
        for sl in chunks(P):
            c = list(torch._foreach_lerp(M[sl], G[sl], 1 - b1))
            torch._foreach_sign_(c)
            if hp.weight_decay != 0:
                foreach_mul_(P[sl], 1 - lr * hp.weight_decay)
            torch._foreach_add_(P[sl], c, alpha=-lr)
            del c
            torch._foreach_lerp_(M[sl], G[sl], 1 - b2)


def lion(
    lr: ScalarOrSchedule = 1e-4,
    betas: tuple[float, float] = (0.9, 0.99),
    weight_decay: float = 1e-3,
) -> Transform:
    """Lion: the sign of an interpolated momentum, with decoupled weight decay.

    Defaults are optax's (``b1=0.9``, ``b2=0.99``, ``weight_decay=1e-3``); Lion
    wants a learning rate ~3-10x smaller than AdamW's.

    State (a TensorDict): ``count`` (int64 0-dim CPU), ``lr`` (float64 0-dim CPU,
    the lr of the last update) and ``mu`` (a tree like params). ``step`` with
    ``donate=True`` updates params and ``mu`` in place with ``torch._foreach_*``;
    ``donate=False`` runs the same ops on fresh copies. ``update`` returns
    ``-lr * (sign(c) + weight_decay * p)``.

    Args:
        lr: learning rate >= 0, or a schedule ``count -> lr``.
        betas: ``(beta1, beta2)`` in [0, 1).
        weight_decay: >= 0, decoupled.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> opt = lion(lr=0.1, weight_decay=0.0)
        >>> p = TensorDict({"w": torch.zeros(2)}, [])
        >>> p2, s = opt.step(TensorDict({"w": torch.tensor([1.0, -2.0])}, []), opt.init(p), p)
        >>> p2["w"]
        tensor([-0.1000,  0.1000])
    """
    hp = LionHParams(lr=lr, betas=betas, weight_decay=weight_decay)

    def init(params: TensorDictBase) -> TensorDict:
        check_floating(params, "lion")
        state: dict[str, object] = dict(scalar_state(0, lr_at(hp.lr, 0)))
        state["mu"] = tree.zeros_like(params)
        return TensorDict(state, batch_size=[])

    step = in_place_step(hp.lr, ("mu",), lambda p, g, m, lr, count: _kernel(p, g, m[0], hp, lr))

    def update(
        grads: TensorDictBase,
        state: TensorDictBase,
        params: TensorDictBase | None,
        *,
        donate: bool = False,
    ) -> tuple[TensorDict, TensorDict]:
        check_grads(grads, params, state["mu"])
        if params is None and hp.weight_decay != 0:
            raise ValueError("lion.update needs params when weight_decay != 0")
        n = int(state["count"])
        lr = lr_at(hp.lr, n)
        b1, b2 = hp.betas
        g_leaves, mu_leaves = tree.leaves(grads), tree.leaves(state["mu"])
        if not g_leaves:  # nothing to optimize (foreach ops reject empty lists)
            empty = {**scalar_state(n + 1, lr), "mu": state["mu"].clone()}
            return cast(TensorDict, grads.clone()), TensorDict(empty, batch_size=[])
        if not donate:  # the same in-place ops on a fresh copy
            mu_leaves = [t.clone() for t in mu_leaves]
        g, mu = locals_(g_leaves), locals_(mu_leaves)
        upd = list(torch._foreach_lerp(mu, g, 1 - b1))
        torch._foreach_sign_(upd)
        if params is not None and hp.weight_decay != 0:
            torch._foreach_add_(upd, locals_(tree.leaves(params)), alpha=hp.weight_decay)
        foreach_mul_(upd, -lr)
        torch._foreach_lerp_(mu, g, 1 - b2)
        new_state: dict[str, object] = dict(scalar_state(n + 1, lr))
        new_state["mu"] = state["mu"] if donate else tree.rebuild(state["mu"], mu_leaves)
        return tree.rebuild(grads, wrap_like(g_leaves, upd)), TensorDict(new_state, batch_size=[])

    return Transform(init_fn=init, update_fn=update, step_fn=step, name="lion", hparams=hp)
