"""The optimizer inside a compiled step: one opaque op per role, ``purestep::transform_step``.

A :class:`~purestep.optim.Transform` reads its update count on the host
(``int(state["count"])``) and turns it into Python floats (the learning rate,
Adam's bias corrections). Traced, those floats would be baked into the graph
as constants, so a schedule would need a new graph every step. Instead the
compiled step calls the transform's own ``step(..., donate=True)`` inside a
custom op that the tracer and inductor see as one opaque call mutating the
params and the optimizer state in place:

* the arithmetic is the eager step's (the same fused kernels), so the update
  is bitwise equal to the eager one given the same grads, for every transform
  (``chain``, clipping, user-written ones), with nothing compiled for it;
* the op's schema marks params, grads and optimizer-state leaves mutable, so
  functionalization and inductor's re-inplacing keep the update in place (no
  param-sized temporaries when the state is donated);
* the count, learning rate and the like stay 0-dim CPU tensors, read inside
  the op at run time: no graph is specialised on a step value.

A transform is passed to the op as an integer handle into a registry (the
schema cannot carry Python objects). The handle only names the registry slot,
so a graph cached on disk by inductor stays correct in another process: the
handle is looked up where the graph runs.

Under CUDA graphs the op's host reads would be frozen at capture; that path
uses device-scalar kernels instead (see ``_capturable``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import attrs
import torch
from tensordict import TensorDictBase

from purestep import tree
from purestep.optim import Transform

__all__ = ["TransformSlot", "register", "release", "transform_step"]

_LIB = "purestep"
_OP = "transform_step"
_SCHEMA = "(int handle, Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] opt_state) -> ()"


@attrs.frozen
class TransformSlot:
    """What the op needs to call a role's transform: the transform and the trees' structure.

    Attributes:
        transform: the role's optimizer.
        params: the role's params tree (structure only: leaves are ``meta`` tensors).
        opt_state: the role's optimizer state tree (structure only).
        role: the role's name, for errors.
        grads: the grads tree's structure when it is a subset of the params (a
            parameter no gradient reached), else ``None`` (shaped like ``params``).
    """

    transform: Transform
    params: TensorDictBase
    opt_state: TensorDictBase
    role: str
    grads: TensorDictBase | None = None


_SLOTS: dict[int, TransformSlot] = {}
_NEXT = [0]
_LOCK = threading.Lock()


def _structure(td: TensorDictBase) -> TensorDictBase:
    """``td`` with every leaf replaced by an empty ``meta`` tensor (no memory held)."""
    return tree.rebuild(td, [torch.empty(0, device="meta") for _ in tree.leaves(td)])


def register(
    transform: Transform,
    params: TensorDictBase,
    opt_state: TensorDictBase,
    role: str,
    grads: TensorDictBase | None = None,
) -> int:
    """A new handle for ``transform`` over trees shaped like ``params`` / ``opt_state``.

    Example:
        >>> from tensordict import TensorDict
        >>> from purestep import optim
        >>> p = TensorDict({"w": torch.ones(2)}, [])
        >>> opt = optim.sgd(lr=0.1)
        >>> h = register(opt, p, opt.init(p), "m")
        >>> release(h)
    """
    slot = TransformSlot(
        transform,
        _structure(params),
        _structure(opt_state),
        role,
        None if grads is None else _structure(grads),
    )
    with _LOCK:
        handle = _NEXT[0]
        _NEXT[0] += 1
        _SLOTS[handle] = slot
    return handle


def release(handle: int) -> None:
    """Forget ``handle`` (a compiled step that is garbage collected releases its handles).

    Example:
        >>> release(-1)  # unknown handles are ignored
    """
    with _LOCK:
        _SLOTS.pop(handle, None)


def _write_back(
    what: str, slot: TransformSlot, old: Sequence[torch.Tensor], new: list[torch.Tensor]
) -> None:
    if len(new) != len(old):
        raise ValueError(
            f"purestep.compile: role {slot.role!r}: {slot.transform.name}.step returned "
            f"{len(new)} {what} leaves for {len(old)}; a transform's state structure must "
            "not change between steps"
        )
    for o, n in zip(old, new, strict=True):
        if n is not o:  # replaced rather than updated in place (count, lr, a clip norm)
            if n.shape != o.shape or n.dtype != o.dtype or n.device != o.device:
                raise ValueError(
                    f"purestep.compile: role {slot.role!r}: {slot.transform.name}.step "
                    f"turned a {what} leaf of shape {tuple(o.shape)} {o.dtype} on {o.device} "
                    f"into {tuple(n.shape)} {n.dtype} on {n.device}"
                )
            o.copy_(n)


def transform_step(
    handle: int,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    opt_state: list[torch.Tensor],
) -> None:
    """Run the registered transform's donated ``step`` on these leaves, in place.

    Leaves that the transform replaces instead of updating in place (its count
    and learning rate, a clip norm) are copied into the given ones.

    Example:
        >>> from tensordict import TensorDict
        >>> from purestep import optim
        >>> p = TensorDict({"w": torch.ones(2)}, [])
        >>> opt = optim.sgd(lr=0.5)
        >>> s = opt.init(p)
        >>> h = register(opt, p, s, "m")
        >>> leaves = tree.leaves(p)
        >>> torch.ops.purestep.transform_step(h, leaves, [torch.ones(2)], tree.leaves(s))
        >>> leaves[0], int(s["count"])
        (tensor([0.5000, 0.5000]), 1)
        >>> release(h)
    """
    slot = _SLOTS.get(handle)
    if slot is None:
        raise RuntimeError(
            f"purestep.compile: optimizer handle {handle} is not registered in this process "
            "(the compiled step that owned it was garbage collected)"
        )
    p_td = tree.rebuild(slot.params, params)
    g_td = tree.rebuild(slot.params if slot.grads is None else slot.grads, grads)
    new_p, new_s = slot.transform.step(
        g_td, tree.rebuild(slot.opt_state, opt_state), p_td, donate=True
    )
    _write_back("param", slot, params, tree.leaves(new_p))
    _write_back("optimizer state", slot, opt_state, tree.leaves(new_s))


def _transform_step_fake(
    handle: int,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    opt_state: list[torch.Tensor],
) -> None:
    return None


def _define() -> None:
    qualname = f"{_LIB}::{_OP}"
    try:
        getattr(getattr(torch.ops, _LIB), _OP)
        return  # module re-imported (importlib.reload): the op exists
    except (AttributeError, RuntimeError):
        pass
    torch.library.define(qualname, _SCHEMA)
    torch.library.impl(qualname, "CompositeExplicitAutograd", transform_step)
    torch.library.register_fake(qualname, _transform_step_fake)


_define()
