"""``call``: run a module with the tensors of a tree in place of its own.

``call(module, tree, *args, key=None, **kwargs)`` puts the tree's leaves (params
and buffers, keyed by module path) into the module's slots, every aliased slot
of a tied parameter included (:mod:`purestep.step._swap`), runs the module, and
puts the module's own tensors back.

Inside a :func:`call_scope` (which :func:`purestep.value_and_grad` opens around
the loss *and* its backward pass) the tensors stay in place until the scope
closes, so activation checkpointing, which runs the forward again during
backward, recomputes with the same tensors. A module called twice in one scope
with *different* tensors for the same slot keeps the first call's tensors
after the second call returns; should a recompute then run through such a
module, it raises instead of recomputing with the wrong tensors.

``key=`` keys module-level randomness that draws from torch's global
generators (``nn.Dropout``): the CPU generator, and the CUDA generators of the
devices in use, are forked, seeded from the key, and restored on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torch.nn.modules import module as _torch_module

from purestep import _compat, rng, tree
from purestep.step import _swap
from purestep.step._context import current_microbatch

__all__ = ["CallScope", "call", "call_scope", "recording_modules"]

_DROPOUT_TAG = 0x6D6F6475  # folded into a call's key before seeding the global generators


def _registration_hooks() -> dict[Any, Any]:
    return _compat.registration_hooks()


class _Batch:
    """The slots one call of a scope filled: their originals and the tree entries they hold."""

    __slots__ = ("entries", "leaves", "originals", "paths", "td")

    def __init__(
        self,
        entries: list[tuple[dict[str, Any], str, int]],
        originals: list[Any],
        td: TensorDictBase,
        leaves: list[torch.Tensor],
        paths: list[tuple[str, ...]],
    ) -> None:
        self.entries, self.originals = entries, originals
        self.td, self.leaves, self.paths = td, leaves, paths


class CallScope:
    """Keeps the swaps of every :func:`call` made inside it until :meth:`close`.

    The first call records its slots as one batch (no per-slot bookkeeping: the
    common case of one forward per scope stays cheap); a later call builds the
    slot index once and fills only the slots no earlier call holds.

    Attributes:
        conflicts: ids of slot dicts that a later call of the scope filled with
            other tensors than the first (a recompute through them raises).
    """

    def __init__(self) -> None:
        self._batches: list[_Batch] = []
        self._index: dict[tuple[int, str], tuple[_Batch, int]] = {}
        self._plans: list[tuple[_swap.Plan, nn.Module]] = []
        self.conflicts: dict[int, str] = {}

    def _indexed(self) -> dict[tuple[int, str], tuple[_Batch, int]]:
        index = self._index
        if len(index) < sum(len(b.entries) for b in self._batches):
            index.clear()
            for b in self._batches:
                for j, (d, key, _) in enumerate(b.entries):
                    index.setdefault((id(d), key), (b, j))
        return index

    def run(
        self,
        plan: _swap.Plan,
        td: TensorDictBase,
        leaves: list[torch.Tensor],
        module: nn.Module,
        fn: Callable[[], Any],
    ) -> Any:
        """Swap ``td`` into ``module``, run ``fn``, keep new slots held until :meth:`close`."""
        _swap.acquire(plan, module)
        self._plans.append((plan, module))
        entries = plan.entries
        if not self._batches:
            self._batches.append(
                _Batch(entries, [d[k] for d, k, _ in entries], td, leaves, plan.paths)
            )
            for d, key, i in entries:
                d[key] = leaves[i]
            return fn()
        index = self._indexed()
        fresh: list[tuple[dict[str, Any], str, int]] = []
        again: list[tuple[dict[str, Any], str, int]] = []
        for d, key, i in entries:
            h = index.get((id(d), key))
            if h is None:
                fresh.append((d, key, i))
            elif d[key] is not leaves[i] and not _holds(h, leaves[i]):
                # another tensor for a held slot: params vs params.detach(), two roles
                again.append((d, key, i))
                self.conflicts[id(d)] = type(module).__name__
            # else the slot holds this tensor, or what an earlier call with this tensor
            # reassigned it to (a buffer `self.n = self.n + 1`): the module sees that, as
            # it would in plain PyTorch, and close writes the last value into the tree
        if fresh:
            self._batches.append(_Batch(fresh, [d[k] for d, k, _ in fresh], td, leaves, plan.paths))
            for d, key, i in fresh:
                d[key] = leaves[i]
        if not again:
            return fn()
        previous = [d[key] for d, key, _ in again]
        for d, key, i in again:
            d[key] = leaves[i]
        try:
            return fn()
        finally:
            replaced: dict[int, Any] = {}
            for (d, key, i), prev in zip(again, previous, strict=True):
                if d[key] is not leaves[i]:
                    replaced[i] = d[key]
                d[key] = prev
            if replaced:
                _swap._write_back(td, plan.paths, replaced)

    def close(self) -> None:
        """Put every held slot's original back (writing replaced tensors into their trees)."""
        try:
            for b in self._batches:
                leaves = b.leaves
                replaced: dict[int, Any] = {}
                for (d, key, i), original in zip(b.entries, b.originals, strict=True):
                    current = d.get(key)
                    if current is not leaves[i]:
                        replaced[i] = current
                    d[key] = original
                if replaced:
                    _swap._write_back(b.td, b.paths, replaced)
            self._batches.clear()
            self._index.clear()
        finally:
            for plan, _ in reversed(self._plans):
                _swap.release(plan)
            self._plans.clear()

    @contextlib.contextmanager
    def recompute_guard(self) -> Iterator[None]:
        """Raise if a module whose slots conflict runs a forward (a checkpoint recompute)."""
        if not self.conflicts:
            yield
            return
        conflicts = self.conflicts

        def hook(module: nn.Module, args: Any) -> None:
            d = module.__dict__
            for name in ("_parameters", "_buffers"):
                if id(d[name]) in conflicts:
                    raise RuntimeError(
                        f"call: {type(module).__name__} is being recomputed during backward "
                        "(activation checkpointing), but the loss called it with different "
                        "tensors for the same parameters (e.g. params and params.detach(), or "
                        "two roles sharing one module), so the recompute cannot use the "
                        "tensors of the call it repeats. Call the module with one set of "
                        "tensors per loss, use separate module instances per role, or turn "
                        "checkpointing off for it"
                    )

        handle = _torch_module.register_module_forward_pre_hook(hook)
        try:
            yield
        finally:
            handle.remove()


def _holds(held: tuple[_Batch, int], leaf: torch.Tensor) -> bool:
    """Whether the call that holds a slot put ``leaf`` there."""
    batch, j = held
    return batch.leaves[batch.entries[j][2]] is leaf


_SCOPE: ContextVar[CallScope | None] = ContextVar("purestep_call_scope", default=None)


@contextlib.contextmanager
def call_scope() -> Iterator[CallScope]:
    """Keep the tensors of every :func:`call` inside the block in place until it ends.

    :func:`purestep.value_and_grad` opens one around the loss and the backward
    pass. Open one yourself when you differentiate a loss built with ``call``
    outside ``value_and_grad`` and the model uses activation checkpointing.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from tensordict import TensorDict
        >>> lin = nn.Linear(1, 1)
        >>> w = TensorDict({"weight": torch.ones(1, 1, requires_grad=True)}, [])
        >>> with call_scope():
        ...     loss = call(lin, w, torch.ones(1, 1)).sum()
        ...     loss.backward()
        >>> w["weight"].grad
        tensor([[1.]])
    """
    scope = CallScope()
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)
        scope.close()


_RECORDER: ContextVar[dict[int, tuple[nn.Module, dict[tuple[str, ...], torch.Tensor]]] | None] = (
    ContextVar("purestep_module_recorder", default=None)
)


@contextlib.contextmanager
def recording_modules() -> Iterator[
    dict[int, tuple[nn.Module, dict[tuple[str, ...], torch.Tensor]]]
]:
    """Snapshot (clone) the own tensors of every module :func:`call` runs inside the block.

    Used by :func:`purestep.testing.assert_pure` to check that a step leaves the
    modules it calls unchanged. Yields ``{id: (module, {path: snapshot})}``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from tensordict import TensorDict
        >>> lin = nn.Linear(1, 1)
        >>> with recording_modules() as seen:
        ...     _ = call(lin, TensorDict({"bias": torch.zeros(1)}, []), torch.ones(1, 1))
        >>> sorted(p for p in seen[id(lin)][1])
        [('bias',), ('weight',)]
    """
    seen: dict[int, tuple[nn.Module, dict[tuple[str, ...], torch.Tensor]]] = {}
    token = _RECORDER.set(seen)
    try:
        yield seen
    finally:
        _RECORDER.reset(token)


def _record(module: nn.Module) -> None:
    seen = _RECORDER.get()
    if seen is not None and id(module) not in seen:
        snap = {p: t.detach().clone() for p, t in _swap.module_tensors(module)}
        seen[id(module)] = (module, snap)


def _check_key(key: Any) -> torch.Tensor:
    if (
        not isinstance(key, torch.Tensor)
        or key.dtype != torch.int64
        or key.ndim != 0
        or key.device.type != "cpu"
    ):
        what = (
            f"a {key.dtype} tensor of shape {tuple(key.shape)} on {key.device}"
            if isinstance(key, torch.Tensor)
            else type(key).__name__
        )
        raise TypeError(
            f"call: key= is the PRNG key that seeds module randomness (a 0-dim int64 CPU "
            f"tensor from purestep.rng), got {what}. To pass an argument named 'key' to the "
            "module's forward (nn.MultiheadAttention), pass it positionally"
        )
    return key


def _cuda_devices(td: TensorDictBase) -> list[int]:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return []
    devices = {torch.cuda.current_device()}
    first = tree.first_leaf(td)
    if first is not None and first.is_cuda and first.device.index is not None:
        devices.add(first.device.index)
    return sorted(devices)


def _run(module: nn.Module, args: Any, kwargs: Any, key: torch.Tensor | None, td: Any) -> Any:
    if key is None:
        return module(*args, **kwargs)
    seed = int(rng.fold_in(key, _DROPOUT_TAG, current_microbatch().index))
    devices = _cuda_devices(td)
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.default_generator.manual_seed(seed)
        for d in devices:
            torch.cuda.default_generators[d].manual_seed(seed)
        return module(*args, **kwargs)


def _expanded(module: nn.Module, td: TensorDictBase) -> TensorDict:
    """``td`` with every alias path of a tied tensor added (for the generic fallbacks)."""
    layout = _swap.layout_of(module)
    items: dict[tuple[str, ...], torch.Tensor] = {}
    for path, leaf in zip(tree.paths(td), tree.leaves(td), strict=True):
        canon = layout.canonical.get(path, path)
        for other, c in layout.canonical.items():
            if c == canon:
                items[other] = leaf
        items[path] = leaf
    return tree.unflatten(list(items.items()))


def call(
    module: nn.Module, params: TensorDictBase, *args: Any, key: Any = None, **kwargs: Any
) -> Any:
    """Run ``module(*args, **kwargs)`` with the tensors of ``params`` in place of its own.

    ``params`` is a tree keyed by module path (as :func:`purestep.init_state`
    builds it): parameters and, optionally, buffers. Every slot that holds a
    given tensor gets the replacement, so tied parameters (GPT-2's ``lm_head``
    and ``wte``) stay tied and their gradients sum over all uses. Entries not
    in ``params`` are the module's own (frozen parameters, buffers); a key that
    names no parameter or buffer raises ``KeyError``. Buffers the forward
    updates in place (BatchNorm statistics) are updated in ``params``' tensors,
    and a buffer it reassigns is written into ``params``: the module keeps
    none of it. ``torch.compile``'d modules are unwrapped for the swap and run
    compiled.

    Inside :func:`purestep.value_and_grad` (a :func:`call_scope`), the tensors
    stay in place until the gradients are computed, so activation
    checkpointing recomputes with them. When ``params`` are the module's own
    ``nn.Parameter`` objects (a bound FSDP role) the module is called as it is.

    Args:
        module: the module (or a ``torch.compile`` wrapper of it).
        params: the tensors to use.
        *args: positional arguments of the forward.
        key: a PRNG key (``purestep.rng``): torch's global CPU and CUDA
            generators are forked, seeded from it (and the microbatch number
            inside :func:`purestep.accumulate`) and restored, so module dropout
            is deterministic and resumable. Fold a distinct constant into the
            key for each call that should draw different noise. Module dropout
            is *not* invariant to how a batch is cut (``accumulate(k)`` or the
            world size): torch's generator draws a mask for the whole tensor
            the module sees, so sample ``i``'s mask depends on the batch's
            shape and position, unlike ``purestep.rng`` draws with ``index=``.
        **kwargs: keyword arguments of the forward.

    Raises:
        KeyError: a key of ``params`` is not a parameter or buffer of the module.
        ModuleInUseError: another thread is running a ``call`` on the module.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from tensordict import TensorDict
        >>> lin = nn.Linear(1, 1)
        >>> p = TensorDict({"weight": torch.full((1, 1), 2.0), "bias": torch.zeros(1)}, [])
        >>> call(lin, p, torch.ones(1, 1))
        tensor([[2.]])
    """
    if key is not None:
        key = _check_key(key)
    first = tree.first_leaf(params)
    if isinstance(first, nn.Parameter):
        return _run(module, args, kwargs, key, params)
    target = _swap.unwrap(module)
    if getattr(target, "_is_fsdp_managed_module", False) and hasattr(first, "to_local"):
        # set by fully_shard on every module it manages
        _check_detached_bound(target, params)
        return _run(module, args, kwargs, key, params)
    _record(target)
    if torch.compiler.is_compiling():
        from torch.func import functional_call

        flat = {
            tree.format_path(p): t
            for p, t in zip(tree.paths(params), tree.leaves(params), strict=True)
        }
        return functional_call(target, flat, args, kwargs, tie_weights=True, strict=False)
    if type(params) is not TensorDict or _registration_hooks():
        with _expanded(target, params).to_module(target):
            return _run(module, args, kwargs, key, params)
    plan, leaves = _swap.plan_and_leaves(target, params)
    scope = _SCOPE.get()
    if scope is not None:
        return scope.run(
            plan, params, leaves, target, lambda: _run(module, args, kwargs, key, params)
        )
    _swap.acquire(plan, target)
    try:
        olds = _swap.swap(plan, params, leaves)
        try:
            return _run(module, args, kwargs, key, params)
        finally:
            _swap.restore(plan, olds, params, leaves)
    finally:
        _swap.release(plan)


def _storage(t: torch.Tensor) -> tuple[int, int]:
    loc = tree.local(t)
    return loc.untyped_storage().data_ptr(), int(loc.storage_offset())


def _check_detached_bound(module: nn.Module, params: TensorDictBase) -> None:
    """DTensor params of an FSDP module must be detached views of its own, used without grad."""
    if torch.is_grad_enabled():
        raise ValueError(
            f"call: {type(module).__name__} got DTensor params that are not its bound "
            "parameters; an FSDP-sharded module always runs with its own parameters. To stop "
            "gradients into them, call it under torch.no_grad() (detached views are fine there)"
        )
    for path, leaf in zip(tree.paths(params), tree.leaves(params), strict=True):
        name = ".".join(path)
        try:
            own = module.get_parameter(name)
        except AttributeError:
            raise ValueError(f"call: {type(module).__name__} has no parameter {name!r}") from None
        # between iterations FSDP registers the sharded params; if it keeps unsharded ones
        # (reshard_after_forward=False), the check cannot see the shard and is skipped
        if hasattr(own, "to_local") and _storage(own) != _storage(leaf):
            raise ValueError(
                f"call: param {name!r} is a DTensor that does not share memory with "
                f"{type(module).__name__}'s own (FSDP-sharded) parameter; an FSDP module "
                "always runs with its own parameters: copy other weights (e.g. an EMA) into "
                "them first"
            )
