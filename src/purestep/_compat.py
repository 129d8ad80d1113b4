"""Guarded access to the private torch and tensordict internals purestep uses.

Every private call the library makes on a hot path goes through a name bound
here once, at import: the private internal when a probe on a tiny input shows
it exists and gives the answer purestep relies on, else a public path that
gives the same result, only slower. So a torch or tensordict release that
removes or changes an internal costs speed, never correctness. Each internal
that falls back emits one :class:`CompatWarning` naming it, and is listed in
:data:`FALLBACKS`. ``docs/internals.md`` is the register of these internals.

Setting the environment variable ``PURESTEP_COMPAT=public`` before purestep is
imported forces every fallback (tests use it to run the optimizer parity and
checkpoint round-trip tests on the public paths). The probes run then too, so
they stay exercised; their result is ignored.

Call sites read one attribute (``_compat.foreach_add_(...)``, ``type(td) is
_compat.PLAIN_TD``): there is no per-call probing or dispatch.

Example:
    >>> import torch
    >>> from purestep import _compat
    >>> x = [torch.ones(2)]
    >>> _ = _compat.foreach_add_(x, [torch.ones(2)], alpha=2.0)
    >>> x[0]
    tensor([3., 3.])
"""

from __future__ import annotations

import io
import os
import warnings
import zipfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from tensordict import TensorDict

__all__ = [
    "FALLBACKS",
    "FORCE_PUBLIC",
    "NON_ZIP_RECORDS",
    "PLAIN_TD",
    "CompatWarning",
    "cpu_loader",
    "foreach_add",
    "foreach_add_",
    "foreach_addcdiv_",
    "foreach_addcmul_",
    "foreach_copy_",
    "foreach_div_",
    "foreach_lerp",
    "foreach_lerp_",
    "foreach_maximum_",
    "foreach_mul_",
    "foreach_norm",
    "foreach_sign_",
    "foreach_sqrt",
    "foreach_sub_",
    "fused_adam_",
    "fused_adamw_",
    "fused_sgd_",
    "narrow_tensor_by_index",
    "new_td",
    "registration_hooks",
    "save_record",
]

FORCE_PUBLIC: bool = os.environ.get("PURESTEP_COMPAT", "").strip().lower() == "public"
"""True when ``PURESTEP_COMPAT=public`` was set at import: every internal uses its fallback."""

FALLBACKS: dict[str, str] = {}
"""Internal name -> why its public fallback is in use (empty when every probe passed)."""


class CompatWarning(RuntimeWarning):
    """A private torch/tensordict internal is unavailable or changed; a public path is used."""


def _choose(name: str, probe: Callable[[], Any], fast: Callable[[], Any], public: Any) -> Any:
    """``fast()`` if ``probe()`` passes (and fallbacks are not forced), else ``public``.

    ``probe`` raises (any exception) or returns False when the internal is missing
    or misbehaves. A failed probe warns once, naming ``name``.
    """
    try:
        ok = probe() is not False
        why = "" if ok else "its probe gave an unexpected result"
    except Exception as e:  # any failure means "do not use it"
        ok, why = False, f"{type(e).__name__}: {e}"
    if ok and not FORCE_PUBLIC:
        return fast()
    if not ok:
        FALLBACKS[name] = why
        warnings.warn(
            f"purestep: {name} is unavailable or changed in torch {torch.__version__} "
            f"({why}); using its public fallback. This affects speed, not correctness.",
            CompatWarning,
            stacklevel=2,
        )
    else:
        FALLBACKS[name] = "forced by PURESTEP_COMPAT=public"
    return public


def _probe_tensors(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [
        torch.tensor([0.5, -1.25, 2.0], dtype=dtype),
        torch.tensor([[3.0, -0.75], [1.5, 0.25]], dtype=dtype),
    ]


# --------------------------------------------------------------------------- tensordict


class _NoPlainNode:
    """Stands in for ``TensorDict`` in the fast-walk gates: no node is of this type."""


def _probe_td_storage() -> bool:
    a, b, c = torch.ones(2), torch.zeros(1), torch.full((3,), 2.0)
    td = TensorDict({"a": a, "n": {"b": b}}, [])
    d = td._tensordict
    if not isinstance(d, dict) or d["a"] is not a or type(d["n"]) is not TensorDict:
        return False
    if d["n"]._tensordict["b"] is not b:
        return False
    td.set("c", c)  # a live dict, in insertion order
    if list(d) != ["a", "n", "c"] or d["c"] is not c:
        return False
    return td._device is None and td._batch_size == torch.Size([])


def _probe_new_unsafe() -> bool:
    a, sub = torch.ones(2), TensorDict({"b": torch.zeros(1)}, [])
    td = TensorDict._new_unsafe({"a": a, "n": sub}, batch_size=torch.Size([]), nested=False)
    return (
        type(td) is TensorDict
        and td.get("a") is a
        and td.get("n") is sub
        and td.batch_size == torch.Size([])
        and td.device is None
        and not td.is_locked
    )


def _new_td_public(
    items: dict[str, Any], batch_size: torch.Size, nested: bool = False
) -> TensorDict:
    """The checked constructor: same result as ``_new_unsafe`` for the inputs purestep passes."""
    return TensorDict(items, batch_size=batch_size)


PLAIN_TD: type = _choose(
    "TensorDict._tensordict/_device/_batch_size",
    _probe_td_storage,
    lambda: TensorDict,
    _NoPlainNode,
)
"""``TensorDict`` when its private storage dict may be walked directly; else a type no
node has, so every tree walker in :mod:`purestep.tree` takes the generic API."""

new_td: Callable[..., TensorDict] = _choose(
    "TensorDict._new_unsafe",
    _probe_new_unsafe,
    lambda: TensorDict._new_unsafe,
    _new_td_public,
)
"""``new_td(items, batch_size=, nested=False)``: a TensorDict of ``items`` without copies."""


# --------------------------------------------------------------------------- nn.Module slots


def _probe_module_slots() -> bool:
    from torch import nn

    lin, bn = nn.Linear(2, 2), nn.BatchNorm1d(2)
    net = nn.Sequential(lin, bn)
    bn.register_buffer("scratch", torch.zeros(2), persistent=False)
    if net.__dict__["_modules"]["0"] is not lin:
        return False
    if bn.__dict__["_non_persistent_buffers_set"] != {"scratch"}:
        return False
    slots, bufs = lin.__dict__["_parameters"], bn.__dict__["_buffers"]
    w, mean = torch.zeros(2, 2), torch.full((2,), 5.0)
    slots["weight"], bufs["running_mean"] = w, mean
    net.eval()
    with torch.no_grad():
        out = net(torch.ones(1, 2))
        var = bn.running_var
        assert var is not None
        want = (lin.bias - 5.0) / torch.sqrt(var + bn.eps) * bn.weight + bn.bias
    return lin.weight is w and bn.running_mean is mean and torch.allclose(out, want[None])


def _hooks_dict() -> dict[Any, Any]:
    from torch.nn.modules import module

    hooks: dict[Any, Any] = module._global_parameter_registration_hooks
    return hooks


def _probe_hooks_dict() -> bool:
    from torch.nn.modules import module

    hooks = _hooks_dict()
    before = len(hooks)
    handle = module.register_module_parameter_registration_hook(lambda m, name, p: None)
    try:
        seen = len(hooks) == before + 1
    finally:
        handle.remove()
    return isinstance(hooks, dict) and seen and len(hooks) == before


_ALWAYS_TO_MODULE: dict[Any, Any] = {"purestep._compat": "module slot swap disabled"}

_SLOTS_OK: bool = _choose(
    'nn.Module.__dict__["_parameters" | "_buffers" | "_modules" | "_non_persistent_buffers_set"]',
    _probe_module_slots,
    lambda: True,
    False,
)

_HOOKS: Callable[[], dict[Any, Any]] = _choose(
    "torch.nn.modules.module._global_parameter_registration_hooks",
    _probe_hooks_dict,
    lambda: _hooks_dict,
    lambda: _ALWAYS_TO_MODULE,
)

registration_hooks: Callable[[], dict[Any, Any]] = (
    _HOOKS if _SLOTS_OK else (lambda: _ALWAYS_TO_MODULE)
)
"""The global parameter-registration hooks (``call`` swaps slots directly only while
none is installed). When the dict or the module slot dicts cannot be trusted it
returns a non-empty dict, so ``call`` always takes tensordict's ``to_module``."""


# --------------------------------------------------------------------------- _foreach_*


def _arg(a: Any, i: int) -> Any:
    """The ``i``-th element of a per-tensor list argument, or the scalar/tensor itself."""
    return a[i] if isinstance(a, (list, tuple)) else a


def _loop_add_(self: Sequence[torch.Tensor], other: Any, *, alpha: float = 1) -> None:
    for i, t in enumerate(self):
        o = _arg(other, i)
        t.add_(o, alpha=alpha) if isinstance(o, torch.Tensor) else t.add_(o * alpha)


def _loop_add(self: Sequence[torch.Tensor], other: Any, *, alpha: float = 1) -> list[torch.Tensor]:
    out = []
    for i, t in enumerate(self):
        o = _arg(other, i)
        out.append(torch.add(t, o, alpha=alpha) if isinstance(o, torch.Tensor) else t + o * alpha)
    return out


def _loop_sub_(self: Sequence[torch.Tensor], other: Any, *, alpha: float = 1) -> None:
    for i, t in enumerate(self):
        o = _arg(other, i)
        t.sub_(o, alpha=alpha) if isinstance(o, torch.Tensor) else t.sub_(o * alpha)


_HALF = (torch.float16, torch.bfloat16)


def _loop_mul_(self: Sequence[torch.Tensor], other: Any) -> None:
    # ``_foreach_mul_`` applies a 0-dim tensor scalar in the op's math type (fp32 for
    # fp16/bf16) and rounds once; ``Tensor.mul_`` would round the scalar first.
    for i, t in enumerate(self):
        o = _arg(other, i)
        if t.dtype in _HALF and isinstance(o, torch.Tensor) and o.dim() == 0:
            t.copy_(t.float() * o.to(torch.float32))
        else:
            t.mul_(o)


def _loop_div_(self: Sequence[torch.Tensor], other: Any) -> None:
    for i, t in enumerate(self):
        t.div_(_arg(other, i))


def _loop_lerp_(self: Sequence[torch.Tensor], end: Sequence[torch.Tensor], weight: Any) -> None:
    for i, t in enumerate(self):
        t.lerp_(end[i], _arg(weight, i))


def _loop_lerp(
    self: Sequence[torch.Tensor], end: Sequence[torch.Tensor], weight: Any
) -> list[torch.Tensor]:
    return [torch.lerp(t, end[i], _arg(weight, i)) for i, t in enumerate(self)]


def _loop_addcmul_(
    self: Sequence[torch.Tensor],
    t1: Sequence[torch.Tensor],
    t2: Sequence[torch.Tensor],
    value: Any = 1,
) -> None:
    for i, t in enumerate(self):
        t.addcmul_(t1[i], t2[i], value=_arg(value, i))


def _loop_addcdiv_(
    self: Sequence[torch.Tensor],
    t1: Sequence[torch.Tensor],
    t2: Sequence[torch.Tensor],
    value: Any = 1,
) -> None:
    for i, t in enumerate(self):
        v = _arg(value, i)
        t.addcdiv_(t1[i], t2[i], value=v.item() if isinstance(v, torch.Tensor) else v)


def _loop_maximum_(self: Sequence[torch.Tensor], other: Sequence[torch.Tensor]) -> None:
    for i, t in enumerate(self):
        torch.maximum(t, other[i], out=t)


def _loop_sqrt(self: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.sqrt(t) for t in self]


def _loop_sign_(self: Sequence[torch.Tensor]) -> None:
    for t in self:
        t.sign_()


def _loop_copy_(self: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    for i, t in enumerate(self):
        t.copy_(src[i])


def _loop_norm(
    self: Sequence[torch.Tensor], ord: float = 2, dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    return [torch.linalg.vector_norm(t, ord, dtype=dtype) for t in self]


def _clone(ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in ts]


def _same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """Bitwise equal values (NaN where the other has NaN), dtypes and shapes."""
    return len(a) == len(b) and all(
        x.dtype == y.dtype
        and x.shape == y.shape
        and torch.equal(x.isnan(), y.isnan())
        and torch.equal(x.nan_to_num(), y.nan_to_num())
        for x, y in zip(a, b, strict=True)
    )


def _cast(arg: Any, dtype: torch.dtype) -> Any:
    """A probe argument for ``dtype``: tensor lists converted, scalars as they are."""
    if isinstance(arg, list) and arg and isinstance(arg[0], torch.Tensor):
        return [a.to(dtype) for a in arg]
    return arg


def _probe_inplace(
    name: str, loop: Callable[..., None], *args: Any, **kw: Any
) -> Callable[[], bool]:
    def probe() -> bool:
        for dtype in (torch.float32, torch.bfloat16):
            x, y = _probe_tensors(dtype), _probe_tensors(dtype)
            cast_args = [_cast(arg, dtype) for arg in args]
            getattr(torch, name)(x, *cast_args, **kw)
            loop(y, *cast_args, **kw)
            if not _same(x, y):
                return False
        return True

    return probe


def _probe_outofplace(
    name: str, loop: Callable[..., list[torch.Tensor]], *args: Any, **kw: Any
) -> Callable[[], bool]:
    def probe() -> bool:
        for dtype in (torch.float32, torch.bfloat16):
            x = _probe_tensors(dtype)
            before = _clone(x)
            cast_args = [_cast(arg, dtype) for arg in args]
            got = list(getattr(torch, name)(x, *cast_args, **kw))
            if not _same(got, loop(x, *cast_args, **kw)) or not _same(x, before):
                return False
        return True

    return probe


_OTHER = [torch.tensor([1.0, 0.5, -3.0]), torch.tensor([[0.25, 2.0], [-1.0, 4.0]])]
_POS = [torch.tensor([1.0, 0.5, 3.0]), torch.tensor([[0.25, 2.0], [1.0, 4.0]])]


def _foreach(name: str, loop: Callable[..., Any], probe: Callable[[], bool]) -> Any:
    return _choose(f"torch.{name}", probe, lambda: getattr(torch, name), loop)


foreach_add_: Callable[..., None] = _foreach(
    "_foreach_add_", _loop_add_, _probe_inplace("_foreach_add_", _loop_add_, _OTHER, alpha=-0.5)
)
foreach_add: Callable[..., list[torch.Tensor]] = _foreach(
    "_foreach_add", _loop_add, _probe_outofplace("_foreach_add", _loop_add, _OTHER, alpha=0.3)
)
foreach_sub_: Callable[..., None] = _foreach(
    "_foreach_sub_", _loop_sub_, _probe_inplace("_foreach_sub_", _loop_sub_, _OTHER)
)
foreach_mul_: Callable[..., None] = _foreach(
    "_foreach_mul_",
    _loop_mul_,
    _probe_inplace("_foreach_mul_", _loop_mul_, torch.tensor(1 - 1e-4, dtype=torch.float64)),
)
foreach_div_: Callable[..., None] = _foreach(
    "_foreach_div_", _loop_div_, _probe_inplace("_foreach_div_", _loop_div_, [0.75, 3.0])
)
foreach_lerp_: Callable[..., None] = _foreach(
    "_foreach_lerp_", _loop_lerp_, _probe_inplace("_foreach_lerp_", _loop_lerp_, _OTHER, 0.1)
)
foreach_lerp: Callable[..., list[torch.Tensor]] = _foreach(
    "_foreach_lerp", _loop_lerp, _probe_outofplace("_foreach_lerp", _loop_lerp, _OTHER, 0.1)
)
foreach_addcmul_: Callable[..., None] = _foreach(
    "_foreach_addcmul_",
    _loop_addcmul_,
    _probe_inplace("_foreach_addcmul_", _loop_addcmul_, _OTHER, _OTHER, 0.001),
)
foreach_addcdiv_: Callable[..., None] = _foreach(
    "_foreach_addcdiv_",
    _loop_addcdiv_,
    _probe_inplace("_foreach_addcdiv_", _loop_addcdiv_, _OTHER, _POS, -0.01),
)
foreach_maximum_: Callable[..., None] = _foreach(
    "_foreach_maximum_", _loop_maximum_, _probe_inplace("_foreach_maximum_", _loop_maximum_, _OTHER)
)
foreach_sqrt: Callable[..., list[torch.Tensor]] = _foreach(
    "_foreach_sqrt", _loop_sqrt, _probe_outofplace("_foreach_sqrt", _loop_sqrt)
)
foreach_sign_: Callable[..., None] = _foreach(
    "_foreach_sign_", _loop_sign_, _probe_inplace("_foreach_sign_", _loop_sign_)
)
foreach_copy_: Callable[..., None] = _foreach(
    "_foreach_copy_", _loop_copy_, _probe_inplace("_foreach_copy_", _loop_copy_, _OTHER)
)
foreach_norm: Callable[..., list[torch.Tensor]] = _foreach(
    "_foreach_norm",
    _loop_norm,
    _probe_outofplace("_foreach_norm", _loop_norm, 2, dtype=torch.float32),
)


# --------------------------------------------------------------------------- fused optimizer kernels
# Fallback: torch's functional optimizer API with ``fused=True``, which runs the same
# kernel (bitwise equal results) after its own argument checks and device/dtype grouping.


def _public_fused_adam(decoupled: bool) -> Callable[..., None]:
    from torch.optim.adam import adam

    def fused(
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        max_exp_avg_sqs: list[torch.Tensor],
        state_steps: list[torch.Tensor],
        **kw: Any,
    ) -> None:
        # The functional API counts the step itself; purestep's steps already count it.
        adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            [s - 1 for s in state_steps],
            fused=True,
            decoupled_weight_decay=decoupled,
            **kw,
        )

    return fused


def _public_fused_sgd(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    momentum_buffer_list: list[torch.Tensor],
    *,
    momentum: float,
    is_first_step: bool,
    **kw: Any,
) -> None:
    from torch.optim.sgd import sgd

    # The functional API starts the buffers itself when given none (its first step).
    bufs: list[torch.Tensor | None] = (
        [None] * len(params) if is_first_step or momentum == 0 else list(momentum_buffer_list)
    )
    sgd(params, grads, bufs, fused=True, momentum=momentum, **kw)
    if is_first_step and momentum != 0:
        for dst, src in zip(momentum_buffer_list, bufs, strict=True):
            assert src is not None
            dst.copy_(src)


def _probe_fused(name: str, public: Callable[..., None], **hp: Any) -> Callable[[], bool]:
    def probe() -> bool:
        p, g = _probe_tensors(), [t * 0.5 - 0.1 for t in _probe_tensors()]
        g0 = _clone(g)
        runs = []
        for fn in (getattr(torch, name), public):
            pp = _clone(p)
            if name == "_fused_sgd_":
                bufs = [torch.zeros_like(t) for t in p]
                for k in range(2):
                    fn(pp, g, bufs, is_first_step=k == 0, momentum=0.9, **hp)
                runs.append(pp + bufs)
            else:
                m = [torch.zeros_like(t) for t in p]
                v = [torch.zeros_like(t) for t in p]
                vmax = [torch.zeros_like(t) for t in p]
                for k in range(2):
                    steps = [torch.tensor(float(k + 1)) for _ in p]
                    fn(pp, g, m, v, vmax, steps, amsgrad=True, maximize=False, **hp)
                runs.append(pp + m + v + vmax)
        return _same(runs[0], runs[1]) and _same(g, g0) and not _same(p, runs[0][: len(p)])

    return probe


_ADAM_HP = {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1, "eps": 1e-8}
_SGD_HP = {"lr": 0.1, "weight_decay": 0.01, "dampening": 0.0, "nesterov": True, "maximize": False}

fused_adam_: Callable[..., None] = _choose(
    "torch._fused_adam_",
    _probe_fused("_fused_adam_", _public_fused_adam(False), **_ADAM_HP),
    lambda: torch._fused_adam_,
    _public_fused_adam(False),
)
"""``torch._fused_adam_`` (same keyword signature), or ``torch.optim.adam.adam(fused=True)``."""

fused_adamw_: Callable[..., None] = _choose(
    "torch._fused_adamw_",
    _probe_fused("_fused_adamw_", _public_fused_adam(True), **_ADAM_HP),
    lambda: torch._fused_adamw_,
    _public_fused_adam(True),
)
"""``torch._fused_adamw_``, or ``torch.optim.adam.adam(fused=True, decoupled_weight_decay=True)``."""

fused_sgd_: Callable[..., None] = _choose(
    "torch._fused_sgd_",
    _probe_fused("_fused_sgd_", _public_fused_sgd, **_SGD_HP),
    lambda: torch._fused_sgd_,
    _public_fused_sgd,
)
"""``torch._fused_sgd_`` (same keyword signature), or ``torch.optim.sgd.sgd(fused=True)``."""


# --------------------------------------------------------------------------- checkpoint records


def _narrow_public(
    tensor: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]
) -> torch.Tensor:
    """``tensor[o0:o0+s0, o1:o1+s1, ...]`` as a chain of ``Tensor.narrow`` (a view)."""
    for d, (o, s) in enumerate(zip(offsets, sizes, strict=True)):
        if o != 0 or s != tensor.size(d):
            tensor = tensor.narrow(d, o, s)
    return tensor


def _private_narrow() -> Callable[..., torch.Tensor]:
    from torch.distributed._shard._utils import narrow_tensor_by_index as fn

    return fn


def _probe_narrow() -> bool:
    t = torch.arange(24.0).reshape(4, 6)
    for offsets, sizes in (((1, 2), (2, 3)), ((0, 0), (4, 6)), ((3, 5), (1, 1))):
        got, want = _private_narrow()(t, offsets, sizes), _narrow_public(t, offsets, sizes)
        if not torch.equal(got, want) or got.data_ptr() != want.data_ptr():
            return False
    return True


narrow_tensor_by_index: Callable[[torch.Tensor, Sequence[int], Sequence[int]], torch.Tensor] = (
    _choose(
        "torch.distributed._shard._utils.narrow_tensor_by_index",
        _probe_narrow,
        _private_narrow,
        _narrow_public,
    )
)
"""The chunk ``offsets``/``sizes`` of ``tensor`` as a view (as DCP's own reader narrows)."""


def _save_non_zip(tensor: torch.Tensor, stream: Any, zip_: bool) -> None:
    torch.save(tensor, stream, _use_new_zipfile_serialization=zip_)


def _save_public(tensor: torch.Tensor, stream: Any, zip_: bool) -> None:
    torch.save(tensor, stream)  # always a zip record


def _probe_non_zip() -> bool:
    t = torch.arange(5, dtype=torch.float32)
    buf = io.BytesIO()
    _save_non_zip(t, buf, False)
    raw = buf.getvalue()
    if zipfile.is_zipfile(io.BytesIO(raw)):
        return False
    tail = (5).to_bytes(8, "little") + t.numpy().tobytes()
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    return raw.endswith(tail) and torch.equal(back, t)


NON_ZIP_RECORDS: bool = _choose(
    "torch.save(_use_new_zipfile_serialization=False)", _probe_non_zip, lambda: True, False
)
"""Whether checkpoint records may use ``torch.save``'s non-zip format (see ``distributed/_storage``)."""

save_record: Callable[[torch.Tensor, Any, bool], None] = (
    _save_non_zip if NON_ZIP_RECORDS else _save_public
)
"""``save_record(tensor, stream, zip_)``: ``torch.save`` a record, non-zip unless ``zip_``
(always zip when :data:`NON_ZIP_RECORDS` is False)."""


class _PublicCpuLoader:
    """DCP's serial CPU loader, in public calls: each item resolved, detached, on the CPU, in order.

    A view of a larger storage is copied so only its own bytes are written (as DCP does).
    """

    def __init__(self, resolve: Callable[[Any], Any]) -> None:
        self.resolve = resolve
        self.items: list[Any] = []

    def add(self, size: int, obj: Any) -> None:
        self.items.append(obj)

    def start_loading(self) -> None:
        pass

    def values(self) -> Iterator[tuple[torch.Tensor, Any]]:
        for obj in self.items:
            t = self.resolve(obj).detach().cpu()
            if t.untyped_storage().size() != t.nbytes:
                t = t.clone()
            yield t, obj


def _private_cpu_loader(resolve: Callable[[Any], Any], copy_ahead: int) -> Any:
    from torch.distributed.checkpoint import filesystem as fs

    if torch.cuda.is_available() and copy_ahead > 0:
        return fs._OverlappingCpuLoader(resolve, inflight_threshhold=copy_ahead)
    return fs._SerialCpuLoader(resolve)


def _probe_cpu_loader() -> bool:
    import inspect

    from torch.distributed.checkpoint import filesystem as fs

    if "inflight_threshhold" not in inspect.signature(fs._OverlappingCpuLoader).parameters:
        return False
    items = [torch.arange(6.0)[1:4], torch.ones(2, dtype=torch.bfloat16)]
    loader = _private_cpu_loader(items.__getitem__, 0)
    for i, t in enumerate(items):
        loader.add(t.nbytes, i)
    loader.start_loading()
    out = list(loader.values())
    return [o for _, o in out] == [0, 1] and all(
        torch.equal(t, items[o])
        and t.device.type == "cpu"
        and t.untyped_storage().size() == t.nbytes
        for t, o in out
    )


cpu_loader: Callable[[Callable[[Any], Any], int], Any] = _choose(
    "torch.distributed.checkpoint.filesystem._SerialCpuLoader/_OverlappingCpuLoader",
    _probe_cpu_loader,
    lambda: _private_cpu_loader,
    lambda resolve, copy_ahead: _PublicCpuLoader(resolve),
)
"""``cpu_loader(resolve, copy_ahead)``: DCP's loader of a save plan's tensors to the CPU
(``add(size, item)``, ``start_loading()``, ``values()`` -> ``(cpu tensor, item)`` in order);
the public fallback loads serially (no copy-ahead overlap on a GPU)."""
