"""Kernel plumbing shared by the optimizers: one in-place kernel makes a whole ``Transform``.

An optimizer writes its arithmetic once, as an in-place *kernel* over flat
lists of local tensors (fused torch kernels where they exist, ``_foreach_*``
otherwise). :func:`kernel_transform` derives everything else from it:

* ``step(donate=True)``: the kernel on the params' and moments' own buffers;
* ``step(donate=False)``: the same kernel on fresh copies (bitwise equal);
* ``update``: the pure step, returned as ``new_params - params`` (optax's
  contract; ``apply_updates`` of it equals the step up to the rounding of that
  subtraction).

Before a kernel runs, every gradient is given its parameter's strides
(:func:`match_layout`): fused kernels pair elements by memory offset, so a
channels_last or stride-0 (expanded) gradient would update the wrong elements.
Optimizers with per-parameter step counts (Adam's bias correction) keep them as
a tree ``steps`` like the params, as ``torch.optim`` keeps ``state["step"]``
per parameter, so a parameter skipped in a step (no gradient) keeps its count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch
from tensordict import TensorDict, TensorDictBase

from purestep import _compat, tree
from purestep.errors import ScheduleError
from purestep.optim._base import ScalarOrSchedule, Transform
from purestep.optim._steps import bump_steps, pack_steps

__all__ = [
    "TEMP_CHUNK_ELEMENTS",
    "Kernel",
    "all_dense",
    "chunks",
    "foreach_mul_",
    "fused_supported",
    "is_dense",
    "kernel_transform",
    "local_shards",
    "lr_at",
    "match_layout",
    "pick",
    "scalar_state",
]

_FUSED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_FUSED_DEVICES = frozenset({"cpu", "cuda", "xpu", "hpu"})
_HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})

# Temporaries of the ``_foreach_*`` fallbacks are allocated per chunk of at most
# this many elements, so the donated path never holds a parameter-sized temporary.
TEMP_CHUNK_ELEMENTS = 1 << 22


def lr_at(lr: ScalarOrSchedule, count: int) -> float:
    """The learning rate for update number ``count`` (0-based).

    Example:
        >>> lr_at(0.1, 5), lr_at(lambda n: 1.0 / (n + 1), 3)
        (0.1, 0.25)
    """
    return float(lr(count)) if callable(lr) else float(lr)


def checked_lr(lr: ScalarOrSchedule, count: int, who: str) -> float:
    """:func:`lr_at`, refusing a value that is not finite or is negative (at this count).

    A schedule valid at count 0 can still go wrong later (a user function can
    return a negative value or NaN): the step that would apply it raises
    :class:`~purestep.errors.ScheduleError` before anything is changed.

    Example:
        >>> checked_lr(lambda n: 0.1 - 0.05 * n, 3, "adamw")
        Traceback (most recent call last):
        ...
        purestep.errors.ScheduleError: adamw: the learning rate at update 3 is -0.05...; it must be finite and >= 0 (check the schedule)
    """
    try:
        x = lr_at(lr, count)
    except (TypeError, ValueError, OverflowError) as e:
        raise ScheduleError(
            f"{who}: the learning-rate schedule failed at update {count}: {e}", count=count
        ) from e
    if not math.isfinite(x) or x < 0:
        raise ScheduleError(
            f"{who}: the learning rate at update {count} is {x!r}; it must be finite and >= 0 "
            "(check the schedule)",
            count=count,
        )
    return x


# The largest finite float16 value: a learning rate below it fits every floating dtype.
_SMALLEST_MAX = float(torch.finfo(torch.float16).max)


def check_lr_fits(rate: float, params: Sequence[torch.Tensor], count: int, who: str) -> None:
    """Refuse a learning rate that overflows the dtype of some param (it would make them inf/NaN).

    Free for ordinary values: only a rate above float16's largest value looks
    at the params' dtypes.

    Example:
        >>> check_lr_fits(1e300, [torch.zeros(1)], 0, "sgd")
        Traceback (most recent call last):
        ...
        purestep.errors.ScheduleError: sgd: the learning rate at update 0 is 1e+300, which overflows torch.float32 (the params' dtype, largest value 3.4028234663852886e+38); the update would make the params inf or NaN
    """
    if rate <= _SMALLEST_MAX:
        return
    for p in params:
        if p.is_floating_point() and rate > torch.finfo(p.dtype).max:
            raise ScheduleError(
                f"{who}: the learning rate at update {count} is {rate!r}, which overflows "
                f"{p.dtype} (the params' dtype, largest value {torch.finfo(p.dtype).max!r}); "
                "the update would make the params inf or NaN",
                count=count,
            )


def scalar_state(count: int, lr: float | None = None) -> dict[str, torch.Tensor]:
    """The CPU scalars of an optimizer state: ``count`` (int64) and optionally ``lr`` (float64).

    Example:
        >>> scalar_state(3, 0.5)
        {'count': tensor(3), 'lr': tensor(0.5000, dtype=torch.float64)}
    """
    cpu = torch.device("cpu")  # also under a ``with torch.device(...)`` default
    out = {"count": torch.tensor(count, dtype=torch.int64, device=cpu)}
    if lr is not None:
        out["lr"] = torch.tensor(lr, dtype=torch.float64, device=cpu)
    return out


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


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory without gaps or overlaps (any dim order).

    Fused kernels walk a tensor's memory linearly; a sliced (gapped) or
    expanded (overlapping) tensor cannot go through them.

    Example:
        >>> is_dense(torch.zeros(3, 4).t()), is_dense(torch.zeros(4, 6)[:, :3])
        (True, False)
    """
    if t.is_contiguous():
        return True
    return _gapless(t)


def all_dense(ts: list[torch.Tensor]) -> bool:
    """Whether every tensor of ``ts`` is :func:`is_dense` (contiguous ones checked in C).

    Example:
        >>> all_dense([torch.zeros(2), torch.zeros(4, 6)[:, :3]])
        False
    """
    return all(map(torch.Tensor.is_contiguous, ts)) or all(map(is_dense, ts))


def _gapless(t: torch.Tensor) -> bool:
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def match_layout(params: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """``grads`` with every gradient given its parameter's strides (copied only where they differ).

    Example:
        >>> p = [torch.zeros(2, 3)]
        >>> g = match_layout(p, [torch.ones(()).expand(2, 3)])  # a stride-0 gradient
        >>> g[0].stride()
        (3, 1)
    """
    _contiguous = torch.Tensor.is_contiguous
    if all(map(_contiguous, params)) and all(map(_contiguous, grads)):
        return grads  # the common case, checked without a Python frame per tensor
    out: list[torch.Tensor] | None = None
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        if (g.is_contiguous() and p.is_contiguous()) or g.stride() == p.stride():
            continue
        if out is None:
            out = list(grads)
        out[i] = torch.empty_like(p, dtype=g.dtype).copy_(g) if is_dense(p) else g.contiguous()
    return grads if out is None else out


def _clone(t: torch.Tensor) -> torch.Tensor:
    """A copy with ``t``'s strides, also when ``t`` is not dense (``clone`` would compact it).

    The pure path runs the kernel on copies; keeping a sliced param's strides
    sends the copy down the same (stride-aware) path as the donated param, so
    the two stay bitwise equal.
    """
    if type(t) is not torch.Tensor or is_dense(t):
        return t.clone()
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


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


def local_shards(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The local shard of every DTensor in ``tensors`` (plain tensors as they are).

    Example:
        >>> a = [torch.ones(1)]
        >>> local_shards(a)[0] is a[0]
        True
    """
    tensor = torch.Tensor
    return [t if type(t) is tensor else tree.local(t) for t in tensors]


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
        elif device.type == "cpu":  # on the CPU also under a ``with torch.device(...)`` default
            f = torch.tensor(factor, dtype=torch.float64, device=device)
        else:
            f = factor
        _compat.foreach_mul_(ts, f)


class Kernel(Protocol):
    """``kernel(params, grads, moments, lr, steps, count)``: update local tensors in place.

    ``moments`` holds one leaf list per moment key; ``steps`` the per-parameter
    step tensors (already counting this update; ``None`` for optimizers without
    them); ``count`` the role's updates before this one. ``grads`` have their
    parameters' strides and must not be written.
    """

    def __call__(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        moments: list[list[torch.Tensor]],
        lr: float,
        steps: list[torch.Tensor] | None,
        count: int,
        /,
    ) -> None: ...


def step_device(p: torch.Tensor, fused: bool) -> torch.device:
    """Where a parameter's step count lives: with the param for fused kernels, else on CPU."""
    loc = tree.local(p)
    return loc.device if fused and fused_supported(loc.device, loc.dtype) else torch.device("cpu")


def kernel_transform(
    *,
    name: str,
    hparams: Any,
    lr: ScalarOrSchedule,
    moments: Sequence[str],
    kernel: Kernel,
    steps: bool = False,
    fused_steps: bool = True,
    decays: bool = False,
) -> Transform:
    """A :class:`~purestep.optim.Transform` whose ``step`` and ``update`` both run ``kernel``.

    State: ``count`` (int64 CPU, updates done), ``lr`` (float64 CPU, the lr of
    the last update; before the first, the one it will use), a tree like the
    params per key of ``moments`` (zeros, the params' dtype and device) and,
    with ``steps=True``, ``steps``: a float32 0-dim tensor per parameter (on the
    parameter's device where a fused kernel takes it, else on CPU).

    Args:
        name: the optimizer's name (errors, reprs).
        hparams: the validated hyperparameters (kept as ``Transform.hparams``).
        lr: the learning rate or schedule (``count -> lr``).
        moments: state keys of the per-parameter trees.
        kernel: the arithmetic (see :class:`Kernel`).
        steps: keep per-parameter step counts.
        fused_steps: put step counts on the parameter's device where fused
            kernels run (``False``: always on CPU).
        decays: ``update`` needs params (weight decay); without, zeros stand in.

    Example:
        >>> from tensordict import TensorDict
        >>> def sgd_kernel(p, g, moments, lr, steps, count):
        ...     torch._foreach_add_(p, g, alpha=-lr)
        >>> t = kernel_transform(name="plain", hparams=None, lr=0.5, moments=(), kernel=sgd_kernel)
        >>> p = TensorDict({"w": torch.ones(2)}, [])
        >>> new_p, s = t.step(p.apply(torch.ones_like), t.init(p), p)
        >>> new_p["w"], int(s["count"]), bool(p["w"][0] == 1)
        (tensor([0.5000, 0.5000]), 1, True)
    """
    keys = tuple(moments)

    def init(params: TensorDictBase) -> TensorDict:
        check_floating(params, name)
        first = checked_lr(lr, 0, name)
        check_lr_fits(first, tree.leaves(params), 0, name)
        state: dict[str, object] = dict(scalar_state(0, first))
        for k in keys:
            state[k] = tree.zeros_like(params)
        if steps:
            state["steps"] = tree.rebuild(
                params,
                pack_steps(
                    [
                        torch.zeros((), dtype=torch.float32, device=step_device(p, fused_steps))
                        for p in tree.leaves(params)
                    ]
                ),
            )
        return TensorDict(state, batch_size=[])

    def run(
        grads: TensorDictBase,
        state: TensorDictBase,
        params: TensorDictBase,
        *,
        donate_params: bool,
        donate_state: bool,
    ) -> tuple[list[torch.Tensor], dict[str, object]]:
        n = int(state["count"])
        rate = checked_lr(lr, n, name)
        p = tree.leaves(params)
        check_lr_fits(rate, p, n, name)
        m = [tree.leaves(state[k]) for k in keys]
        s = tree.leaves(state["steps"]) if steps else None
        s_in = s
        if not donate_params:
            p = [_clone(t) for t in p]
        if not donate_state:
            m = [[_clone(t) for t in ms] for ms in m]
        if s is not None and s:
            s = bump_steps(s, donate=donate_state)
        lp = local_shards(p)
        if lp:
            g = match_layout(lp, local_shards(tree.leaves(grads)))
            kernel(lp, g, [local_shards(ms) for ms in m], rate, s, n)
        new_state: dict[str, object] = dict(scalar_state(n + 1, rate))
        for k, ms in zip(keys, m, strict=True):
            new_state[k] = state[k] if donate_state else tree.rebuild(state[k], ms)
        if steps:
            assert s is not None
            new_state["steps"] = (
                state["steps"] if donate_state and s is s_in else tree.rebuild(state["steps"], s)
            )
        return p, new_state

    def step(
        grads: TensorDictBase,
        state: TensorDictBase,
        params: TensorDictBase,
        *,
        donate: bool = False,
    ) -> tuple[TensorDict, TensorDict]:
        p, new_state = run(grads, state, params, donate_params=donate, donate_state=donate)
        new_params = cast(TensorDict, params) if donate else tree.rebuild(params, p)
        return new_params, TensorDict(new_state, batch_size=[])

    def update(
        grads: TensorDictBase,
        state: TensorDictBase,
        params: TensorDictBase | None,
        *,
        donate: bool = False,
    ) -> tuple[TensorDict, TensorDict]:
        if params is None:
            if decays:
                raise ValueError(f"{name}.update needs params when weight_decay != 0")
            if keys:
                tree.assert_same_structure(state[keys[0]], grads, like="optimizer state")
            params = tree.zeros_like(grads)  # updates do not depend on params: exact
        tree.assert_same_structure(params, grads)
        p, new_state = run(grads, state, params, donate_params=False, donate_state=donate)
        before = local_shards(tree.leaves(params))
        lp = local_shards(p)
        if lp:
            _compat.foreach_sub_(lp, before)
        return tree.rebuild(params, p), TensorDict(new_state, batch_size=[])

    return Transform(init_fn=init, update_fn=update, step_fn=step, name=name, hparams=hparams)


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


GroupFn = Callable[[list[int]], None]
