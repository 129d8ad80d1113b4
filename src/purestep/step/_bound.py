"""Bound roles: state params that *are* a module's own ``nn.Parameter`` objects (FSDP2).

An adapter such as :func:`purestep.distributed.fsdp.bind` makes a role's state
params alias the module's own (sharded) parameters. Such a role runs the
module as it is, gets its gradients from ``backward()`` into ``.grad`` (FSDP
reduces them there) and is updated in place. Adapters plug into the step
through the two hook registries here:

* a *backward hook* ``hook(role_leaves, microbatch)`` runs right before
  ``backward()`` of bound roles (FSDP: gradient sync on the last microbatch only);
* a *metrics hook* ``hook(bound_leaves, metrics) -> metrics`` runs in
  ``train_step`` when the state has bound roles (FSDP: average per-rank metrics);
* a *graph hook* ``hook(role_leaves) -> tensors`` names the tensors that stand for
  those params in the autograd graph of their last forward (FSDP: the unsharded
  parameters), so the step can tell which bound roles a loss reaches.

Bound roles run one ``backward()`` over all their losses, so a role's ``.grad``
gathers every loss that reaches its modules. With one loss for all roles that is
the functional result; with a loss per role it is not when one role's loss
reaches another role's params, and :func:`purestep.value_and_grad` refuses that
case (the graph hooks let it see it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from purestep import tree
from purestep.step._context import Microbatch, current_microbatch

__all__ = [
    "BoundBackwardHook",
    "BoundGraphHook",
    "BoundMetricsHook",
    "bound_grads",
    "graph_params",
    "is_bound",
    "reduce_bound_metrics",
    "register_bound_backward_hook",
    "register_bound_graph_hook",
    "register_bound_metrics_hook",
]

BoundBackwardHook = Callable[[Sequence[torch.Tensor], Microbatch], None]
BoundMetricsHook = Callable[[Sequence[torch.Tensor], TensorDict], TensorDict]
BoundGraphHook = Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]]
_BOUND_HOOKS: list[BoundBackwardHook] = []
_BOUND_METRICS_HOOKS: list[BoundMetricsHook] = []
_BOUND_GRAPH_HOOKS: list[BoundGraphHook] = []


def is_bound(params: TensorDictBase) -> bool:
    """True when ``params`` are a module's own ``nn.Parameter`` objects (a bound role).

    Example:
        >>> from tensordict import TensorDict
        >>> is_bound(TensorDict({"w": torch.ones(1)}, []))
        False
    """
    first = tree.first_leaf(params)
    return isinstance(first, nn.Parameter)


def register_bound_backward_hook(hook: BoundBackwardHook) -> None:
    """Register ``hook(role_leaves, microbatch)``, run before ``backward()`` of bound roles.

    Registering the same hook twice has no effect.

    Example:
        >>> register_bound_backward_hook(lambda leaves, mb: None)  # doctest: +SKIP
    """
    if hook not in _BOUND_HOOKS:
        _BOUND_HOOKS.append(hook)


def register_bound_metrics_hook(hook: BoundMetricsHook) -> None:
    """Register ``hook(bound_leaves, metrics) -> metrics``, run by ``train_step``.

    Example:
        >>> register_bound_metrics_hook(lambda leaves, metrics: metrics)  # doctest: +SKIP
    """
    if hook not in _BOUND_METRICS_HOOKS:
        _BOUND_METRICS_HOOKS.append(hook)


def register_bound_graph_hook(hook: BoundGraphHook) -> None:
    """Register ``hook(role_leaves) -> tensors``: those params' tensors in the autograd graph.

    A bound module may compute with other tensors than the state's leaves (FSDP2
    runs forward with unsharded copies); the hook returns the ones the last forward
    used, so :func:`graph_params` can match a loss's graph to its roles. Registering
    the same hook twice has no effect.

    Example:
        >>> register_bound_graph_hook(lambda leaves: [])  # doctest: +SKIP
    """
    if hook not in _BOUND_GRAPH_HOOKS:
        _BOUND_GRAPH_HOOKS.append(hook)


def graph_params(leaves: Sequence[torch.Tensor]) -> set[int]:
    """``id()`` of the tensors that stand for ``leaves`` in the autograd graph (graph hooks).

    Empty when no graph hook is registered (nothing bound yet) or none knows ``leaves``.

    Example:
        >>> graph_params([torch.ones(1)])
        set()
    """
    return {id(t) for hook in _BOUND_GRAPH_HOOKS for t in hook(leaves)}


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


def bound_grads(
    losses: dict[str, torch.Tensor],
    leaves: dict[str, list[torch.Tensor]],
    idle: list[torch.Tensor],
) -> dict[str, list[torch.Tensor | None]]:
    """``backward()`` of the bound roles' losses; harvest ``.grad`` on the last microbatch.

    ``idle`` are the params of bound roles that get no grads from this call (not
    live, or no loss of their own): the hooks see them too (so their modules'
    sync settings follow the microbatch) and any ``.grad`` that ``backward()``
    left on them is dropped, so it cannot leak into a later step. A parameter
    whose ``.grad`` is None got no gradient (``None`` in the result).
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
    out: dict[str, list[torch.Tensor | None]] = {}
    if not mb.is_last:
        return out
    for role in losses:
        grads: list[torch.Tensor | None] = []
        for p in leaves[role]:
            grads.append(p.grad)
            p.grad = None
        out[role] = grads
    for p in idle:
        p.grad = None
    return out
