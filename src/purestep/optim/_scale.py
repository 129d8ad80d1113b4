"""Multiply updates by a schedule of the transform's own count (optax's ``scale_by_schedule``)."""

from __future__ import annotations

from typing import cast

from tensordict import TensorDict, TensorDictBase

from purestep import tree
from purestep.optim._base import ScalarOrSchedule, Transform
from purestep.optim._hparams import check_grads
from purestep.optim._kernels import foreach_mul_, local_shards, lr_at, scalar_state

__all__ = ["scale_by_schedule"]


def scale_by_schedule(schedule: ScalarOrSchedule) -> Transform:
    """Multiply updates by ``schedule(count)``; ``count`` counts this transform's updates.

    As in optax, updates are *multiplied*: to descend, the factor must be
    negative, e.g. ``scale_by_schedule(lambda n: -lr(n))`` after a transform
    that yields the raw direction. The first update uses ``schedule(0)``.

    State (a TensorDict): ``count`` (int64 0-dim CPU). With ``donate=True``
    the updates are scaled in place.

    Args:
        schedule: a schedule ``count -> factor`` or a constant float.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from purestep.optim import schedules
        >>> t = scale_by_schedule(schedules.linear(-1.0, 0.0, 2))
        >>> g = TensorDict({"w": torch.ones(2)}, [])
        >>> s = t.init(g)
        >>> u, s = t.update(g, s)
        >>> u2, s = t.update(g, s)
        >>> u["w"], u2["w"], int(s["count"])
        (tensor([-1., -1.]), tensor([-0.5000, -0.5000]), 2)
    """
    if not callable(schedule) and (
        isinstance(schedule, bool) or not isinstance(schedule, int | float)
    ):
        raise TypeError(f"schedule must be a callable count -> value or a number, got {schedule!r}")

    def init(params: TensorDictBase) -> TensorDict:
        return TensorDict(scalar_state(0), batch_size=[])

    def update(
        grads: TensorDictBase,
        state: TensorDictBase,
        params: TensorDictBase | None,
        *,
        donate: bool = False,
    ) -> tuple[TensorDict, TensorDict]:
        check_grads(grads, params)
        n = int(state["count"])
        factor = lr_at(schedule, n)
        g = tree.leaves(grads)
        new_state = TensorDict(scalar_state(n + 1), batch_size=[])
        if not donate:  # the same in-place op on fresh copies
            g = [t.clone() for t in g]
        foreach_mul_(local_shards(g), factor)
        return cast(TensorDict, grads) if donate else tree.rebuild(grads, g), new_state

    return Transform(init_fn=init, update_fn=update, name="scale_by_schedule", hparams=schedule)
