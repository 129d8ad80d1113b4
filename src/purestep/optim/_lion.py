"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), as in optax.

``c = beta1 * mu + (1 - beta1) * g``; ``p -= lr * (sign(c) + weight_decay * p)``;
``mu = beta2 * mu + (1 - beta2) * g``. There is no ``torch.optim`` Lion; the
tests check it against a per-tensor reference.
"""

from __future__ import annotations

import torch

from purestep import _compat, tree
from purestep.optim._base import ScalarOrSchedule, Transform
from purestep.optim._hparams import LionHParams
from purestep.optim._kernels import chunks, foreach_mul_, kernel_transform, pick

__all__ = ["lion"]


def _lion(
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
            c = list(_compat.foreach_lerp(M[sl], G[sl], 1 - b1))
            _compat.foreach_sign_(c)
            if hp.weight_decay != 0:
                foreach_mul_(P[sl], 1 - lr * hp.weight_decay)
            _compat.foreach_add_(P[sl], c, alpha=-lr)
            del c
            _compat.foreach_lerp_(M[sl], G[sl], 1 - b2)


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
    ``new_params - params`` of the same step.

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

    def kernel(
        p: list[torch.Tensor],
        g: list[torch.Tensor],
        m: list[list[torch.Tensor]],
        rate: float,
        steps: list[torch.Tensor] | None,
        count: int,
    ) -> None:
        _lion(p, g, m[0], hp, rate)

    return kernel_transform(
        name="lion",
        hparams=hp,
        lr=hp.lr,
        moments=("mu",),
        kernel=kernel,
        decays=hp.weight_decay != 0,
    )
