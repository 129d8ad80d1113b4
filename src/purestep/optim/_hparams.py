"""Validated hyperparameters of the optimizers, and the plumbing they share.

Shared plumbing: the ``count``/``lr`` scalars of a state, the grads check,
which (device, dtype) pairs have fused kernels, and chunking for the
``torch._foreach_*`` fallbacks.

Each optimizer factory builds one frozen attrs class from here, so a bad value
fails at construction with the field's name (``adamw(lr=-1.0)`` raises
``ValueError: lr must be >= 0, got -1.0``). The instance is kept as
``Transform.hparams``.

``lr`` is a float or a schedule ``count -> lr`` (see
:mod:`purestep.optim.schedules`); a schedule is checked once, at count 0.

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
from collections.abc import Callable, Sequence
from typing import Any, cast

import attrs
import torch
from tensordict import TensorDict, TensorDictBase

from purestep import tree
from purestep.optim._base import ScalarOrSchedule, StepFn

__all__ = [
    "AdamHParams",
    "ClipHParams",
    "LionHParams",
    "SGDHParams",
    "check_floating",
    "check_grads",
    "chunks",
    "foreach_mul_",
    "fused_supported",
    "locals_",
    "lr_at",
    "pick",
    "scalar_state",
    "wrap_like",
]

_FUSED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_FUSED_DEVICES = frozenset({"cpu", "cuda", "xpu", "hpu"})
_HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})

# Temporaries of the ``_foreach_*`` fallbacks are allocated per chunk of at most
# this many elements, so the donated path never holds a parameter-sized temporary.
TEMP_CHUNK_ELEMENTS = 1 << 22


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
        try:
            first = value(0)
        except Exception as e:  # a schedule that cannot be evaluated is a bad argument
            raise ValueError(f"{name}: schedule {value!r} failed at count 0: {e}") from e
        x = _number(f"{name}(0)", first)
        if x < 0:
            raise ValueError(f"{name} must be >= 0, but the schedule gives {name}(0) = {x}")
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


def lr_at(lr: ScalarOrSchedule, count: int) -> float:
    """The learning rate for update number ``count`` (0-based).

    Example:
        >>> lr_at(0.1, 5), lr_at(lambda n: 1.0 / (n + 1), 3)
        (0.1, 0.25)
    """
    return float(lr(count)) if callable(lr) else float(lr)


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


def scalar_state(count: int, lr: float | None = None) -> dict[str, torch.Tensor]:
    """The CPU scalars of an optimizer state: ``count`` (int64) and optionally ``lr`` (float64).

    Example:
        >>> scalar_state(3, 0.5)
        {'count': tensor(3), 'lr': tensor(0.5000, dtype=torch.float64)}
    """
    out = {"count": torch.tensor(count, dtype=torch.int64)}
    if lr is not None:
        out["lr"] = torch.tensor(lr, dtype=torch.float64)
    return out


def check_grads(
    grads: TensorDictBase,
    params: TensorDictBase | None,
    state_tree: TensorDictBase | None = None,
) -> None:
    """Raise ``ValueError`` naming the key path and both shapes where grads and params differ.

    Without params, grads are checked against ``state_tree`` (e.g. the first moment).

    Example:
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


def check_floating(params: TensorDictBase, who: str) -> None:
    """Raise ``TypeError`` naming the first param leaf that is not floating point.

    Example:
        >>> from tensordict import TensorDict
        >>> check_floating(TensorDict({"w": torch.ones(1, dtype=torch.int64)}, []), "adam")
        Traceback (most recent call last):
        ...
        TypeError: adam: params at w has dtype torch.int64; only floating-point params are supported
    """
    for path, leaf in zip(tree.paths(params), tree.leaves(params), strict=True):
        if not leaf.is_floating_point():
            raise TypeError(
                f"{who}: params at {tree.format_path(path)} has dtype {leaf.dtype}; "
                "only floating-point params are supported"
            )


def fused_supported(device: torch.device, dtype: torch.dtype, *, kernel: str = "adam") -> bool:
    """Whether the fused kernel (``"adam"``: ``_fused_adam(w)_``, ``"sgd"``: ``_fused_sgd_``) is used.

    CPU and CUDA (also XPU, HPU) run them for fp16, bf16, fp32 and fp64; other
    combinations use the in-place ``torch._foreach_*`` fallback. Exception: the
    CPU ``_fused_sgd_`` of torch <= 2.13 skips or corrupts fp16/bf16 tensors of
    16 or more elements (pytorch/pytorch#191763), so SGD falls back there.

    Example:
        >>> fused_supported(torch.device("cpu"), torch.bfloat16)
        True
        >>> fused_supported(torch.device("cpu"), torch.bfloat16, kernel="sgd")
        False
        >>> fused_supported(torch.device("meta"), torch.float32)
        False
    """
    if device.type not in _FUSED_DEVICES or dtype not in _FUSED_DTYPES:
        return False
    return not (kernel == "sgd" and device.type == "cpu" and dtype in _HALF_DTYPES)


def pick(items: list[torch.Tensor], idx: list[int], total: int) -> list[torch.Tensor]:
    """``[items[i] for i in idx]``, or ``items`` itself when ``idx`` selects all ``total``.

    Example:
        >>> a = [torch.zeros(1), torch.ones(1)]
        >>> pick(a, [0, 1], 2) is a, len(pick(a, [1], 2))
        (True, 1)
    """
    return items if len(idx) == total else [items[i] for i in idx]


def chunks(tensors: list[torch.Tensor], budget: int | None = None) -> list[slice]:
    """Slices of ``tensors`` holding at most ``budget`` elements each (a larger tensor alone).

    ``budget`` defaults to ``TEMP_CHUNK_ELEMENTS`` (read at call time).

    Example:
        >>> chunks([torch.zeros(3), torch.zeros(3), torch.zeros(5)], budget=6)
        [slice(0, 2, None), slice(2, 3, None)]
    """
    if budget is None:
        budget = TEMP_CHUNK_ELEMENTS
    out: list[slice] = []
    start, size = 0, 0
    for i, t in enumerate(tensors):
        n = t.numel()
        if i > start and size + n > budget:
            out.append(slice(start, i))
            start, size = i, 0
        size += n
    if start < len(tensors):
        out.append(slice(start, len(tensors)))
    return out


def locals_(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The local shard of every DTensor in ``tensors`` (plain tensors as they are).

    Example:
        >>> a = [torch.ones(1)]
        >>> locals_(a)[0] is a[0]
        True
    """
    tensor = torch.Tensor
    return [t if type(t) is tensor else tree.local(t) for t in tensors]


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t) is not torch.Tensor and hasattr(t, "device_mesh")


def wrap_like(templates: Sequence[torch.Tensor], local: list[torch.Tensor]) -> list[torch.Tensor]:
    """New local shards ``local[i]`` as DTensors laid out like ``templates[i]`` where that is one.

    Elementwise optimizer maths runs on local shards (``_foreach_*`` kernels
    reject lists that mix DTensors and tensors); this puts the results back.

    Example:
        >>> out = wrap_like([torch.zeros(2)], [torch.ones(2)])
        >>> out[0]
        tensor([1., 1.])
    """
    if not any(_is_dtensor(t) for t in templates):
        return local
    from torch.distributed.tensor import DTensor

    out: list[torch.Tensor] = []
    for t, x in zip(templates, local, strict=True):
        if _is_dtensor(t):
            d: DTensor = t  # type: ignore[assignment]
            out.append(
                DTensor.from_local(
                    x,
                    d.device_mesh,
                    d.placements,
                    run_check=False,
                    shape=d.shape,
                    stride=d.stride(),
                )
            )
        else:
            out.append(x)
    return out


def foreach_mul_(tensors: list[torch.Tensor], factor: float | torch.Tensor) -> None:
    """``t *= factor`` in place for plain tensors, one ``_foreach_mul_`` per device.

    On CPU a Python float is passed as a 0-dim float64 tensor: CPU
    ``torch._foreach_mul_`` rounds a Python scalar to the tensors' dtype first
    (for bf16, ``1 - 1e-4`` becomes ``1.0``), a tensor scalar is applied in the
    op's math type. A tensor ``factor`` is moved to each device.

    Example:
        >>> x = [torch.ones(2, dtype=torch.bfloat16)]
        >>> foreach_mul_(x, 0.99756)
        >>> x[0]
        tensor([0.9961, 0.9961], dtype=torch.bfloat16)
    """
    if not tensors:
        return
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for device, ts in by_device.items():
        f: float | torch.Tensor
        if isinstance(factor, torch.Tensor):
            f = factor.to(device)
        elif device.type == "cpu":
            f = torch.tensor(factor, dtype=torch.float64)
        else:
            f = factor
        torch._foreach_mul_(ts, f)


InPlaceKernel = Callable[
    [list[torch.Tensor], list[torch.Tensor], list[list[torch.Tensor]], float, int], None
]
"""``kernel(params, grads, moments, lr, count)``: update local tensors in place.

``moments`` holds one leaf list per state key; ``count`` is the number of
updates done before this one; ``grads`` must not be written."""


def in_place_step(lr: ScalarOrSchedule, keys: Sequence[str], kernel: InPlaceKernel) -> StepFn:
    """The fused ``step`` of a transform whose state is ``count``, ``lr`` and moment trees.

    ``state[k]`` for ``k`` in ``keys`` are trees shaped like the params. Donated,
    ``kernel`` runs on the params' and moments' own (local) buffers; otherwise
    on fresh copies, so both paths give bitwise equal results. The new state has
    ``count + 1`` and the lr used.

    Example:
        >>> from tensordict import TensorDict
        >>> def sgd_kernel(p, g, moments, lr, count):
        ...     torch._foreach_add_(p, g, alpha=-lr)
        >>> step = in_place_step(0.5, (), sgd_kernel)
        >>> p = TensorDict({"w": torch.ones(2)}, [])
        >>> new_p, new_s = step(p.apply(torch.ones_like), TensorDict(scalar_state(0), []), p)
        >>> new_p["w"], int(new_s["count"]), bool(p["w"][0] == 1)
        (tensor([0.5000, 0.5000]), 1, True)
    """

    def step(
        grads: TensorDictBase,
        state: TensorDictBase,
        params: TensorDictBase,
        *,
        donate: bool = False,
    ) -> tuple[TensorDict, TensorDict]:
        n = int(state["count"])
        rate = lr_at(lr, n)
        p = tree.leaves(params)
        moments = [tree.leaves(state[k]) for k in keys]
        if not donate:  # fresh buffers, then the same in-place kernel on them
            p = [t.clone() for t in p]
            moments = [[t.clone() for t in m] for m in moments]
        kernel(locals_(p), locals_(tree.leaves(grads)), [locals_(m) for m in moments], rate, n)
        new_state: dict[str, object] = dict(scalar_state(n + 1, rate))
        if donate:
            new_state.update((k, state[k]) for k in keys)
            return cast(TensorDict, params), TensorDict(new_state, batch_size=[])
        new_state.update((k, tree.rebuild(state[k], m)) for k, m in zip(keys, moments, strict=True))
        return tree.rebuild(params, p), TensorDict(new_state, batch_size=[])

    return step
