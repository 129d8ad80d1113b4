"""attrs validators shared by the methods' config classes.

Each one raises ``ValueError`` naming the class and the field
(``DMD2Config.t_scale must be a finite float > 0, got -1``), so a bad
hyperparameter fails at construction, where it entered.

Example:
    >>> import attrs
    >>> @attrs.frozen
    ... class Cfg:
    ...     scale: float = attrs.field(default=1.0, validator=positive)
    >>> Cfg(2.0).scale
    2.0
    >>> Cfg(-1.0)
    Traceback (most recent call last):
    ...
    ValueError: Cfg.scale must be a finite float > 0, got -1.0
"""

from __future__ import annotations

import math
from typing import Any

import attrs

__all__ = [
    "finite",
    "keys",
    "name",
    "non_negative",
    "positive",
    "positive_int",
    "unit",
]


def _where(instance: object, attribute: attrs.Attribute[Any]) -> str:
    return f"{type(instance).__name__}.{attribute.name}"


def _real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def positive(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A finite float ``> 0``.

    Example:
        >>> import attrs
        >>> attrs.make_class("C", {"x": attrs.field(validator=positive)})(1.0).x
        1.0
    """
    if not (_real(value) and math.isfinite(value) and value > 0):
        raise ValueError(f"{_where(instance, attribute)} must be a finite float > 0, got {value!r}")


def non_negative(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A finite float ``>= 0``.

    Example:
        >>> import attrs
        >>> attrs.make_class("C", {"x": attrs.field(validator=non_negative)})(0.0).x
        0.0
    """
    if not (_real(value) and math.isfinite(value) and value >= 0):
        raise ValueError(
            f"{_where(instance, attribute)} must be a finite float >= 0, got {value!r}"
        )


def finite(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A finite float.

    Example:
        >>> import attrs
        >>> attrs.make_class("C", {"x": attrs.field(validator=finite)})(-3.0).x
        -3.0
    """
    if not (_real(value) and math.isfinite(value)):
        raise ValueError(f"{_where(instance, attribute)} must be a finite float, got {value!r}")


def unit(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A float in ``[0, 1]``.

    Example:
        >>> import attrs
        >>> attrs.make_class("C", {"x": attrs.field(validator=unit)})(0.5).x
        0.5
    """
    if not (_real(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"{_where(instance, attribute)} must be a float in [0, 1], got {value!r}")


def positive_int(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """An int ``>= 1`` (not a bool).

    Example:
        >>> import attrs
        >>> attrs.make_class("C", {"x": attrs.field(validator=positive_int)})(3).x
        3
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{_where(instance, attribute)} must be an int >= 1, got {value!r}")


def name(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A non-empty str.

    Example:
        >>> import attrs
        >>> attrs.make_class("C", {"x": attrs.field(validator=name)})("student").x
        'student'
    """
    if not (isinstance(value, str) and value):
        raise ValueError(f"{_where(instance, attribute)} must be a non-empty str, got {value!r}")


def keys(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A tuple of non-empty str batch keys, none of them ``"index"`` (reserved for sample ids).

    Example:
        >>> import attrs
        >>> attrs.make_class("C", {"x": attrs.field(validator=keys)})(("label",)).x
        ('label',)
    """
    for k in value:
        if not (isinstance(k, str) and k):
            raise ValueError(
                f"{_where(instance, attribute)} must hold non-empty str keys, got {value!r}"
            )
        if k == "index":
            raise ValueError(
                f"{_where(instance, attribute)}: {k!r} is reserved for sample ids, got {value!r}"
            )
