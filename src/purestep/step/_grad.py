"""Functional calls and gradients: ``call``, ``value_and_grad``, ``live_roles``.

Two kinds of roles:

* **functional** roles (the default): state params are plain tensors; the loss
  function runs modules with them through :func:`call`, and grads come from
  ``torch.autograd.grad``.
* **bound** roles: state params *are* a module's ``nn.Parameter`` objects (an
  FSDP2 binding, :func:`purestep.distributed.fsdp.bind`). The module runs with
  its own params, grads come from ``backward()`` and ``.grad`` (FSDP reduces
  them there), and accumulation weights each microbatch's loss before
  ``backward`` so ``.grad`` holds the weighted sum at the last microbatch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any, Protocol

import attrs
import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from purestep import tree
from purestep.step._sink import GradSink, take_sink
from purestep.step._swap import swapped

__all__ = [
    "GradFn",
    "LossFn",
    "Microbatch",
    "call",
    "current_microbatch",
    "is_bound",
    "live_roles",
    "value_and_grad",
]

LossFn = Callable[
    [TensorDictBase, TensorDictBase, torch.Tensor],
    tuple[torch.Tensor | Mapping[str, torch.Tensor], Mapping[str, Any] | TensorDictBase | None],
]


class GradFn(Protocol):
    """``grad_fn(params, batch, key, *, roles=None) -> (grads, metrics)``."""

    def __call__(
        self,
        params: TensorDictBase,
        batch: TensorDictBase,
        key: torch.Tensor,
        *,
        roles: Sequence[str] | None = None,
    ) -> tuple[TensorDict, TensorDict]: ...


@attrs.frozen
class Microbatch:
    """Where a ``grad_fn`` call sits inside :func:`purestep.accumulate`.

    Attributes:
        index: 0-based microbatch number.
        count: number of microbatches ``k``.
        weight: this microbatch's share of the full batch (``size / B``).
    """

    index: int = 0
    count: int = 1
    weight: float = 1.0

    @property
    def is_last(self) -> bool:
        """True on the final microbatch (when bound roles sync and harvest grads)."""
        return self.index == self.count - 1


_LIVE: ContextVar[frozenset[str] | None] = ContextVar("purestep_live_roles", default=None)
_MICRO: ContextVar[Microbatch] = ContextVar("purestep_microbatch", default=Microbatch())  # noqa: B039 (frozen)

# Called as hook(role_leaves, microbatch) right before backward() of a bound role;
# the FSDP adapter registers one to switch gradient sync on the last microbatch only.
BoundBackwardHook = Callable[[Sequence[torch.Tensor], Microbatch], None]
_BOUND_HOOKS: list[BoundBackwardHook] = []


# Called as hook(bound_leaves, metrics) -> metrics by train_step when the state has
# bound roles; the FSDP adapter registers one that averages the per-rank metrics.
BoundMetricsHook = Callable[[Sequence[torch.Tensor], TensorDict], TensorDict]
_BOUND_METRICS_HOOKS: list[BoundMetricsHook] = []


def register_bound_backward_hook(hook: BoundBackwardHook) -> None:
    """Register ``hook(role_leaves, microbatch)``, run before ``backward()`` of bound roles.

    Used by adapters: the FSDP adapter turns gradient sync on for the last
    microbatch only. Registering the same hook twice has no effect.

    Example:
        >>> register_bound_backward_hook(lambda leaves, mb: None)  # doctest: +SKIP
    """
    if hook not in _BOUND_HOOKS:
        _BOUND_HOOKS.append(hook)


def register_bound_metrics_hook(hook: BoundMetricsHook) -> None:
    """Register ``hook(bound_leaves, metrics) -> metrics``, run by ``train_step`` (adapters).

    The FSDP adapter registers one that averages per-rank metrics over the
    data-parallel ranks, so a bound step logs the same loss as one process.

    Example:
        >>> register_bound_metrics_hook(lambda leaves, metrics: metrics)  # doctest: +SKIP
    """
    if hook not in _BOUND_METRICS_HOOKS:
        _BOUND_METRICS_HOOKS.append(hook)


def reduce_bound_metrics(params: TensorDictBase, metrics: TensorDict) -> TensorDict:
    """Pass ``metrics`` through the bound-metrics hooks when ``params`` has bound roles.

    With functional roles only, ``metrics`` is returned as is (no hook runs).

    Example:
        >>> from tensordict import TensorDict
        >>> m = TensorDict({"loss": torch.tensor(1.0)}, [])
        >>> reduce_bound_metrics(TensorDict({"s": {"w": torch.ones(1)}}, []), m) is m
        True
    """
    if not _BOUND_METRICS_HOOKS:
        return metrics
    bound: list[torch.Tensor] = []
    for role in params.keys():
        role_params = params.get(role)
        if is_bound(role_params):
            bound.extend(tree.leaves(role_params))
    if not bound:
        return metrics
    for hook in _BOUND_METRICS_HOOKS:
        metrics = hook(bound, metrics)
    return metrics


def live_roles() -> frozenset[str] | None:
    """The roles whose gradients the current ``grad_fn`` call computes.

    A loss function can skip the work of roles that are not live on this step
    (e.g. DMD2's student on non-update steps). ``None`` outside a ``grad_fn`` call.

    Example:
        >>> live_roles() is None
        True
    """
    return _LIVE.get()


def current_microbatch() -> Microbatch:
    """The :class:`Microbatch` being computed (``Microbatch()`` outside accumulation).

    Example:
        >>> current_microbatch().is_last
        True
    """
    return _MICRO.get()


@contextlib.contextmanager
def microbatch_scope(mb: Microbatch) -> Iterator[None]:
    """Mark the enclosed ``grad_fn`` call as microbatch ``mb`` (used by ``accumulate``)."""
    token = _MICRO.set(mb)
    try:
        yield
    finally:
        _MICRO.reset(token)


def is_bound(params: TensorDictBase) -> bool:
    """True when ``params`` are a module's own ``nn.Parameter`` objects (a bound role).

    Example:
        >>> from tensordict import TensorDict
        >>> is_bound(TensorDict({"w": torch.ones(1)}, []))
        False
    """
    first = tree.first_leaf(params)
    return isinstance(first, nn.Parameter)


def call(module: nn.Module, params: TensorDictBase, *args: Any, **kwargs: Any) -> Any:
    """Run ``module(*args, **kwargs)`` with ``params`` in place of its own parameters.

    The module's own parameters are restored afterwards; the module keeps no
    reference to ``params``. Keys of ``params`` follow the module tree (as
    :meth:`TensorDict.from_module`); params not in ``params`` (frozen ones,
    buffers) are the module's own. When ``params`` are the module's own
    ``nn.Parameter`` objects (a bound role) the module is called directly.

    FSDP-managed modules cannot take other params (FSDP registers its own in
    forward), so DTensor ``params`` that are not the bound parameters must be
    *detached views* of them (``params.detach()``), used under
    ``torch.no_grad()``: the module is then called directly. Anything else
    (other weights such as an EMA copy, or detached params with grad enabled)
    raises ``ValueError``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from tensordict import TensorDict
        >>> lin = nn.Linear(1, 1)
        >>> p = TensorDict({"weight": torch.full((1, 1), 2.0), "bias": torch.zeros(1)}, [])
        >>> call(lin, p, torch.ones(1, 1))
        tensor([[2.]])
    """
    first = tree.first_leaf(params)
    if isinstance(first, nn.Parameter):
        return module(*args, **kwargs)
    if getattr(module, "_is_fsdp_managed_module", False) and hasattr(first, "to_local"):
        # set by fully_shard on every module it manages
        _check_detached_bound(module, params)
        return module(*args, **kwargs)
    with swapped(module, params):  # == params.to_module(module), fast for plain tensors
        return module(*args, **kwargs)


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


def _with_roles(params: TensorDictBase, new: Mapping[str, TensorDict]) -> TensorDictBase:
    """``params.copy()`` with the roles in ``new`` replaced (what the loss function sees).

    The top level is built directly for a plain TensorDict (no batch dims, no
    device): copying the replaced roles' subtrees first would cost ~1 µs per leaf.
    """
    if (
        type(params) is not TensorDict
        or params.device is not None
        or params.batch_dims
        or any(type(v) is not TensorDict for v in params._tensordict.values())
    ):
        out = params.copy()
        for role, td in new.items():
            out.set(role, td)
        return out
    src = {k: new[k] if k in new else v.copy() for k, v in params._tensordict.items()}
    return tree.plain_td(src, params.batch_size)


def _as_metrics(metrics: Mapping[str, Any] | TensorDictBase | None) -> TensorDict:
    if metrics is None or (not isinstance(metrics, TensorDictBase) and not metrics):
        return tree.plain_td({})
    if isinstance(metrics, TensorDictBase):
        td = metrics
    else:
        td = TensorDict(
            {
                k: (
                    v if isinstance(v, (torch.Tensor, TensorDictBase, Mapping)) else torch.tensor(v)
                )
                for k, v in metrics.items()
            },
            batch_size=[],
        )
    return td.detach()  # type: ignore[no-any-return]


def _role_losses(
    loss: torch.Tensor | Mapping[str, torch.Tensor], roles: Sequence[str]
) -> dict[str, torch.Tensor]:
    if isinstance(loss, torch.Tensor):
        out = dict.fromkeys(roles, loss)
    elif isinstance(loss, Mapping):
        out = {r: loss[r] for r in roles if r in loss}
    else:
        raise TypeError(
            f"loss_fn returned a loss of type {type(loss).__name__}; expected a scalar "
            "tensor or a mapping {role: scalar tensor}"
        )
    for role, value in out.items():
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"loss for role {role!r} must be a scalar tensor; got {shape}")
    return out


def _loss_metrics(loss: torch.Tensor | Mapping[str, torch.Tensor], metrics: TensorDict) -> None:
    if isinstance(loss, torch.Tensor):
        if "loss" not in metrics.keys():
            metrics.set("loss", loss.detach().reshape(()))
    else:
        for role, value in loss.items():
            if isinstance(value, torch.Tensor):
                metrics.set((role, "loss"), value.detach().reshape(()))


def _functional_grads(
    losses: dict[str, torch.Tensor],
    leaves: dict[str, list[torch.Tensor]],
    sink: GradSink | None = None,
) -> dict[str, list[torch.Tensor]]:
    if sink is not None and sink.accepts(losses):
        return sink.backward(losses, leaves)  # accumulate(): fold grads in as they come
    out: dict[str, list[torch.Tensor]] = {}
    distinct = {id(v) for v in losses.values()}
    if len(distinct) == 1 and len(losses) > 0:
        # one scalar loss for every live role: a single backward pass.
        roles = list(losses)
        flat = [t for r in roles for t in leaves[r]]
        grads = torch.autograd.grad(
            next(iter(losses.values())), flat, allow_unused=True, materialize_grads=True
        )
        i = 0
        for r in roles:
            out[r] = list(grads[i : i + len(leaves[r])])
            i += len(leaves[r])
        return out
    items = list(losses.items())
    for j, (role, loss) in enumerate(items):
        out[role] = list(
            torch.autograd.grad(
                loss,
                leaves[role],
                retain_graph=j < len(items) - 1,
                allow_unused=True,
                materialize_grads=True,
            )
        )
    return out


def _bound_grads(
    losses: dict[str, torch.Tensor],
    leaves: dict[str, list[torch.Tensor]],
    idle: list[torch.Tensor],
) -> dict[str, list[torch.Tensor]]:
    """``backward()`` of the bound roles' losses; harvest ``.grad`` on the last microbatch.

    ``idle`` are the params of bound roles that get no grads from this call (not
    live, or no loss of their own): the hooks see them too (so their modules'
    sync settings follow the microbatch) and any ``.grad`` that ``backward()``
    left on them is dropped, so it cannot leak into a later step.
    """
    mb = current_microbatch()
    for role in losses:
        for hook in _BOUND_HOOKS:
            hook(leaves[role], mb)
    if idle:
        for hook in _BOUND_HOOKS:
            hook(idle, mb)
    distinct: dict[int, torch.Tensor] = {id(v): v for v in losses.values()}
    scaled = [v * mb.weight if mb.weight != 1.0 else v for v in distinct.values()]
    torch.autograd.backward(scaled)
    out: dict[str, list[torch.Tensor]] = {}
    if not mb.is_last:
        return out
    for role in losses:
        grads = []
        for p in leaves[role]:
            g = p.grad
            grads.append(torch.zeros_like(p) if g is None else g)
            p.grad = None
        out[role] = grads
    for p in idle:
        p.grad = None
    return out


def _grad_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


def _make_grad_leaves(params: TensorDictBase) -> tuple[TensorDict, list[torch.Tensor]]:
    """Fresh requires-grad leaves for ``params`` (sharing memory) and the tree holding them."""
    return tree.map_with_leaves(params, _grad_leaf)


def value_and_grad(loss_fn: LossFn) -> GradFn:
    """Turn ``loss_fn(params, batch, key) -> (loss, metrics)`` into a gradient function.

    ``loss`` is a scalar (every live role differentiates it) or ``{role: scalar}``
    (each role is differentiated only by its own loss; a live role absent from
    the mapping gets no gradient and is not updated). ``metrics`` is a mapping or
    TensorDict of scalars, or None.

    The returned ``grad_fn(params, batch, key, *, roles=None)`` computes grads for
    ``roles`` (default: every role in ``params``). Other roles are passed to
    ``loss_fn`` detached, so no graph is built through them. Returns
    ``(grads, metrics)``: grads is a TensorDict ``{role: tree}`` shaped like
    ``params[role]``; metrics a TensorDict of detached scalars on device, with
    the loss under ``"loss"`` (or ``(role, "loss")`` for per-role losses).

    Bound roles (:func:`purestep.distributed.fsdp.bind`) run the module with its
    own params, so they are never detached: grads come from one ``backward()``
    of all bound roles' losses, and a bound role's grads are those of the *sum*
    of the losses that reach its params. With ``{role: loss}`` over several
    bound roles, detach across roles (as DMD2's losses do). Grads that reach a
    bound role with no loss of its own on this call are dropped.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> def loss_fn(params, batch, key):
        ...     return (params["m", "w"] * batch["x"]).sum(), {}
        >>> grad_fn = value_and_grad(loss_fn)
        >>> params = TensorDict({"m": {"w": torch.ones(2)}}, [])
        >>> batch = TensorDict({"x": torch.tensor([1.0, 2.0])}, [2])
        >>> grads, metrics = grad_fn(params, batch, torch.tensor(0))
        >>> grads["m", "w"]
        tensor([1., 2.])
    """

    def grad_fn(
        params: TensorDictBase,
        batch: TensorDictBase,
        key: torch.Tensor,
        *,
        roles: Sequence[str] | None = None,
    ) -> tuple[TensorDict, TensorDict]:
        all_roles = list(params.keys())
        live = all_roles if roles is None else list(roles)
        unknown = [r for r in live if r not in all_roles]
        if unknown:
            raise KeyError(f"roles {unknown} have no params (roles with params: {all_roles})")
        sink = take_sink()  # before loss_fn, so that nested grad_fn calls do not take it
        leaves: dict[str, list[torch.Tensor]] = {}
        bound: dict[str, bool] = {}
        tracked: dict[str, TensorDict] = {}
        for role in live:
            role_params = params.get(role)
            bound[role] = is_bound(role_params)
            if bound[role]:
                leaves[role] = tree.leaves(role_params)
            else:
                tracked[role], leaves[role] = (
                    sink.leaves_for(role, role_params, _make_grad_leaves)
                    if sink is not None
                    else _make_grad_leaves(role_params)
                )
        call_params = _with_roles(params, tracked)
        token = _LIVE.set(frozenset(live))
        try:
            with torch.enable_grad():
                loss, raw_metrics = loss_fn(call_params, batch, key)
                losses = _role_losses(loss, live)
                func = {r: v for r, v in losses.items() if not bound[r]}
                bnd = {r: v for r, v in losses.items() if bound[r]}
                grad_lists = _functional_grads(func, leaves, sink) if func else {}
                if bnd:
                    idle = [
                        t
                        for r in all_roles
                        if r not in bnd and (bound[r] if r in bound else is_bound(params.get(r)))
                        for t in tree.leaves(params.get(r))
                    ]
                    grad_lists.update(_bound_grads(bnd, leaves, idle))
        finally:
            _LIVE.reset(token)
        metrics = _as_metrics(raw_metrics)
        _loss_metrics(loss, metrics)
        grads = tree.plain_td(
            {r: tree.rebuild(params.get(r), grad_lists[r]) for r in live if r in grad_lists}
        )
        return grads, metrics

    return grad_fn
