"""Low-precision params with full-precision master weights: :func:`mixed_precision`."""

from __future__ import annotations

from typing import cast

import torch
from tensordict import TensorDict, TensorDictBase

from purestep import tree
from purestep.optim._base import Transform

__all__ = ["mixed_precision"]

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_dtype(master_dtype: torch.dtype) -> None:
    if not isinstance(master_dtype, torch.dtype) or master_dtype not in _FLOAT:
        raise TypeError(
            f"mixed_precision: master_dtype must be a floating torch.dtype, got {master_dtype!r}"
        )


def _master_copy(params: TensorDictBase, dtype: torch.dtype) -> TensorDict:
    """A fresh ``dtype`` copy of every param; a non-floating param is refused, named."""
    leaves = tree.leaves(params)
    for path, x in zip(tree.paths(params), leaves, strict=True):
        if not x.is_floating_point():
            raise TypeError(
                f"mixed_precision: param {tree.format_path(path)} has dtype {x.dtype}; "
                "master weights need floating params"
            )
    return tree.rebuild(params, [x.to(dtype, copy=True) for x in leaves])


def mixed_precision(inner: Transform, *, master_dtype: torch.dtype = torch.float32) -> Transform:
    """Keep ``master_dtype`` master weights of low-precision params and step ``inner`` on them.

    The usual mixed-precision recipe without a second model: the state's params
    are e.g. bfloat16 (what the forward and backward use, under
    ``torch.autocast`` inside the loss), while the optimizer state holds a
    ``master_dtype`` (float32) copy of every param, ``master``, and the inner
    optimizer's state (Adam's moments) over the master copy, so in float32 too.
    Each step casts the gradients to ``master_dtype``, runs ``inner.step`` on
    the master weights and writes them back, rounded to each param's dtype.

    Equal, bitwise, to torch's AMP recipe (a float32 model, ``torch.autocast``
    to bfloat16 and the float32 optimizer) for a model whose params autocast
    casts to bfloat16 (``nn.Linear``, convolutions, embeddings): there autocast
    rounds the float32 weight before the matmul and casts the bfloat16 gradient
    back, which is what this transform's round trip does. Params that autocast
    runs in float32 (norms' weights) are read in bfloat16 here, rounded.

    State: ``{"inner": inner's state, "master": master params}``. Its size is
    that of ``inner``'s state for float32 params plus a float32 copy of the
    params.

    ``update`` returns ``new_master - params`` in ``master_dtype`` (adding it in
    ``master_dtype`` and rounding gives the new params); a training step uses
    ``step``, which writes the rounded master weights directly. With
    ``donate=True`` the params, the master copy and ``inner``'s state are updated
    in place.

    Args:
        inner: the optimizer to run on the master weights, e.g. ``adamw(1e-3)``.
        master_dtype: the master weights' (and so the inner state's) dtype.

    Raises:
        TypeError: ``inner`` is not a :class:`Transform`, ``master_dtype`` is
            not a floating dtype, or (at ``init``) a param is not floating.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from purestep import optim
        >>> t = optim.mixed_precision(optim.adamw(lr=1e-3))
        >>> p = TensorDict({"w": torch.ones(2, dtype=torch.bfloat16)}, [])
        >>> s = t.init(p)
        >>> s["master", "w"].dtype, s["inner", "mu", "w"].dtype
        (torch.float32, torch.float32)
        >>> p2, s2 = t.step(TensorDict({"w": torch.ones(2, dtype=torch.bfloat16)}, []), s, p)
        >>> p2["w"].dtype, round(float(s2["master", "w"][0]), 5)
        (torch.bfloat16, 0.99899)
    """
    if not isinstance(inner, Transform):
        raise TypeError(f"mixed_precision: inner is {type(inner).__name__}, not a Transform")
    _check_dtype(master_dtype)

    def init(params: TensorDictBase) -> TensorDict:
        master = _master_copy(params, master_dtype)
        return TensorDict({"inner": inner.init(master), "master": master}, batch_size=[])

    def _inner_step(
        grads: TensorDictBase, state: TensorDictBase, *, donate: bool
    ) -> tuple[TensorDict, TensorDict]:
        g = tree.rebuild(grads, [x.to(master_dtype) for x in tree.leaves(grads)])
        return inner.step(g, state["inner"], state["master"], donate=donate)

    def update(
        grads: TensorDictBase,
        state: TensorDictBase,
        params: TensorDictBase | None,
        *,
        donate: bool = False,
    ) -> tuple[TensorDict, TensorDict]:
        if params is None:
            raise ValueError("mixed_precision: update needs params (the master copy is per param)")
        old_params = [x.to(master_dtype) for x in tree.leaves(params)]  # params are not stepped
        master, inner_state = _inner_step(grads, state, donate=donate)
        updates = tree.rebuild(
            params,
            [m - p for m, p in zip(tree.leaves(master), old_params, strict=True)],
        )
        return updates, TensorDict({"inner": inner_state, "master": master}, batch_size=[])

    def step(
        grads: TensorDictBase,
        state: TensorDictBase,
        params: TensorDictBase,
        *,
        donate: bool = False,
    ) -> tuple[TensorDict, TensorDict]:
        tree.assert_same_structure(params, state["master"], what="the master params")
        master, inner_state = _inner_step(grads, state, donate=donate)
        new_state = TensorDict({"inner": inner_state, "master": master}, batch_size=[])
        p_leaves, m_leaves = tree.leaves(params), tree.leaves(master)
        if donate:
            for p, m in zip(p_leaves, m_leaves, strict=True):
                tree.local(p).copy_(tree.local(m))
            return cast(TensorDict, params), new_state
        new_p = [m.to(p.dtype, copy=True) for p, m in zip(p_leaves, m_leaves, strict=True)]
        return tree.rebuild(params, new_p), new_state

    return Transform(
        init_fn=init,
        update_fn=update,
        step_fn=step,
        name=f"mixed_precision({inner.name})",
    )
