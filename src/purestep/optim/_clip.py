"""Gradient clipping by the global L2 norm of all leaves (DTensor-aware)."""

from __future__ import annotations

from typing import cast

import torch
from tensordict import TensorDict, TensorDictBase

from purestep import tree
from purestep.optim._base import Transform
from purestep.optim._hparams import ClipHParams, check_grads
from purestep.optim._kernels import foreach_mul_, local_shards

__all__ = ["clip_by_global_norm"]


def _first_device(td: TensorDictBase) -> torch.device:
    leaves = tree.leaves(td)
    return tree.local(leaves[0]).device if leaves else torch.device("cpu")


def clip_by_global_norm(max_norm: float) -> Transform:
    """Scale all grads by ``min(1, max_norm / (norm + 1e-6))``, ``norm`` their global L2 norm.

    As ``torch.nn.utils.clip_grad_norm_``: one norm over every leaf taken
    together (DTensor leaves, e.g. FSDP2-sharded grads, contribute their global
    norm, so every rank scales alike). The norm stays on device (no host sync).

    State (a TensorDict): ``norm``, the global norm of the grads *before*
    clipping at the last update (float32 0-dim on the grads' device; 0 before
    the first), for logging. With ``donate=True`` the grads are scaled in
    place (they are the step's own intermediates); otherwise new tensors are
    returned. Use it first in a :func:`~purestep.optim.chain`.

    Args:
        max_norm: > 0.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> clip = clip_by_global_norm(1.0)
        >>> g = TensorDict({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}, [])
        >>> u, s = clip.update(g, clip.init(g))
        >>> round(float(u["a"]), 4), round(float(u["b"]), 4), float(s["norm"])
        (0.6, 0.8, 5.0)
    """
    hp = ClipHParams(max_norm=max_norm)

    def init(params: TensorDictBase) -> TensorDict:
        norm = torch.zeros((), dtype=torch.float32, device=_first_device(params))
        return TensorDict({"norm": norm}, batch_size=[])

    def update(
        grads: TensorDictBase,
        state: TensorDictBase,
        params: TensorDictBase | None,
        *,
        donate: bool = False,
    ) -> tuple[TensorDict, TensorDict]:
        check_grads(grads, params)
        g = tree.leaves(grads)
        norm = tree.global_norm(g)
        coef = torch.clamp(hp.max_norm / (norm + 1e-6), max=1.0)
        new_state = TensorDict({"norm": norm}, batch_size=[])
        if not donate:  # the same in-place op on fresh copies
            g = [t.clone() for t in g]
        foreach_mul_(local_shards(g), coef)
        return cast(TensorDict, grads) if donate else tree.rebuild(grads, g), new_state

    return Transform(init_fn=init, update_fn=update, name="clip_by_global_norm", hparams=hp)
