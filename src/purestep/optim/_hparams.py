"""Validated hyperparameters of the optimizers.

Each optimizer factory builds one frozen attrs class from here, so a bad value
fails at construction with the field's name (``adamw(lr=-1.0)`` raises
``ValueError: lr must be >= 0, got -1.0``). The instance is kept as
``Transform.hparams``.

``lr`` is a float or a schedule ``count -> lr`` (see
:mod:`purestep.optim.schedules`). One of purestep's schedules is checked here
over its whole domain (``adamw(lr=schedules.linear(0.1, -0.1, 10))`` raises
:class:`~purestep.errors.ScheduleError` naming count 6, where it goes
negative); another callable is checked here at count 0 and by every update at
the count it applies (a negative or non-finite value raises there, before
anything changes).

Example:
    >>> from purestep.optim._hparams import AdamHParams
    >>> AdamHParams(lr=1e-3).betas
    (0.9, 0.999)
    >>> AdamHParams(lr=1e-3, eps=0.0)
    Traceback (most recent call last):
    ...
    ValueError: eps must be > 0, got 0.0
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
from tensordict import TensorDictBase

from purestep import tree
from purestep.errors import ScheduleError
from purestep.optim._base import ScalarOrSchedule
from purestep.optim.schedules import first_count_below

__all__ = [
    "AdamHParams",
    "ClipHParams",
    "LionHParams",
    "SGDHParams",
    "check_grads",
]


def _number(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{field} must be a real number, got {value!r}")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"{field} must be finite, got {x}")
    return x


def _validate_lr(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    name = attribute.name
    if callable(value):
        bad = first_count_below(value, 0.0)  # purestep's schedules: every count
        if bad is not None:
            raise ScheduleError(
                f"{name}: the schedule {value!r} goes negative at count {bad} "
                f"({name}({bad}) = {value(bad)!r}); a learning rate must be >= 0 at every "
                "count: fix its end points (a negative lr would ascend the loss)",
                count=bad,
            )
        try:
            first = value(0)
        except Exception as e:  # a schedule that cannot be evaluated is a bad argument
            raise ScheduleError(
                f"{name}: schedule {value!r} failed at count 0: {e}", count=0
            ) from e
        try:
            x = _number(f"{name}(0)", first)
        except ValueError as e:
            raise ScheduleError(str(e), count=0) from e
        if x < 0:
            raise ScheduleError(
                f"{name} must be >= 0, but the schedule gives {name}(0) = {x}", count=0
            )
        return
    x = _number(name, value)
    if x < 0:
        raise ValueError(f"{name} must be >= 0, got {x}")


def _non_negative(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    x = _number(attribute.name, value)
    if x < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {x}")


def _positive(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    x = _number(attribute.name, value)
    if x <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {x}")


def _unit_interval(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    x = _number(attribute.name, value)
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"{attribute.name} must be in [0, 1], got {x}")


def _to_betas(value: Any) -> Any:
    return tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) else value


def _validate_betas(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    name = attribute.name
    if not isinstance(value, tuple) or len(value) != 2:
        raise ValueError(f"{name} must be a pair (beta1, beta2), got {value!r}")
    for i, b in enumerate(value):
        x = _number(f"{name}[{i}]", b)
        if not 0.0 <= x < 1.0:
            raise ValueError(f"{name}[{i}] must be in [0, 1), got {x}")


def _is_bool(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{attribute.name} must be a bool, got {value!r}")


@attrs.frozen
class AdamHParams:
    """Hyperparameters of :func:`~purestep.optim.adam` / :func:`~purestep.optim.adamw`.

    Attributes:
        lr: learning rate (>= 0) or schedule ``count -> lr``.
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator, > 0.
        weight_decay: >= 0; L2 (added to the gradient) for Adam, decoupled for AdamW.
        amsgrad: keep the running maximum of the second moment.
        decoupled_weight_decay: True for AdamW.

    Example:
        >>> AdamHParams(lr=1e-3, betas=[0.9, 0.95]).betas
        (0.9, 0.95)
    """

    lr: ScalarOrSchedule = attrs.field(default=1e-3, validator=_validate_lr)
    betas: tuple[float, float] = attrs.field(
        default=(0.9, 0.999), converter=_to_betas, validator=_validate_betas
    )
    eps: float = attrs.field(default=1e-8, validator=_positive)
    weight_decay: float = attrs.field(default=0.0, validator=_non_negative)
    amsgrad: bool = attrs.field(default=False, validator=_is_bool)
    decoupled_weight_decay: bool = attrs.field(default=False, validator=_is_bool)


@attrs.frozen
class SGDHParams:
    """Hyperparameters of :func:`~purestep.optim.sgd` (as ``torch.optim.SGD``).

    Attributes:
        lr: learning rate (>= 0) or schedule ``count -> lr``.
        momentum: >= 0; 0 disables the momentum buffer.
        dampening: in [0, 1]; must be 0 with nesterov.
        weight_decay: >= 0, L2 (added to the gradient).
        nesterov: Nesterov momentum; needs ``momentum > 0`` and ``dampening == 0``.

    Example:
        >>> SGDHParams(lr=0.1, momentum=0.9, nesterov=True).nesterov
        True
    """

    lr: ScalarOrSchedule = attrs.field(default=1e-3, validator=_validate_lr)
    momentum: float = attrs.field(default=0.0, validator=_non_negative)
    dampening: float = attrs.field(default=0.0, validator=_unit_interval)
    weight_decay: float = attrs.field(default=0.0, validator=_non_negative)
    nesterov: bool = attrs.field(default=False, validator=_is_bool)

    def __attrs_post_init__(self) -> None:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(
                "nesterov=True requires momentum > 0 and dampening == 0, "
                f"got momentum={self.momentum}, dampening={self.dampening}"
            )


@attrs.frozen
class LionHParams:
    """Hyperparameters of :func:`~purestep.optim.lion` (defaults as in optax).

    Attributes:
        lr: learning rate (>= 0) or schedule ``count -> lr``.
        betas: ``(beta1, beta2)`` in [0, 1): interpolation for the sign, decay of the moment.
        weight_decay: >= 0, decoupled (``p -= lr * weight_decay * p``).

    Example:
        >>> LionHParams(lr=1e-4).betas
        (0.9, 0.99)
    """

    lr: ScalarOrSchedule = attrs.field(default=1e-4, validator=_validate_lr)
    betas: tuple[float, float] = attrs.field(
        default=(0.9, 0.99), converter=_to_betas, validator=_validate_betas
    )
    weight_decay: float = attrs.field(default=1e-3, validator=_non_negative)


@attrs.frozen
class ClipHParams:
    """Hyperparameters of :func:`~purestep.optim.clip_by_global_norm`.

    Attributes:
        max_norm: > 0, the largest global L2 norm the gradients keep.

    Example:
        >>> ClipHParams(max_norm=1.0).max_norm
        1.0
    """

    max_norm: float = attrs.field(validator=_positive)


def check_grads(
    grads: TensorDictBase,
    params: TensorDictBase | None,
    state_tree: TensorDictBase | None = None,
) -> None:
    """Raise ``ValueError`` naming the key path and both shapes where grads and params differ.

    Without params, grads are checked against ``state_tree`` (e.g. the first moment).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> w = TensorDict({"w": torch.ones(2)}, [])
        >>> check_grads(TensorDict({"w": torch.ones(3)}, []), w)
        Traceback (most recent call last):
        ...
        ValueError: grads at w has shape (3,), but params has shape (2,)
    """
    if params is not None:
        tree.assert_same_structure(params, grads)
    elif state_tree is not None:
        tree.assert_same_structure(state_tree, grads, like="optimizer state")
