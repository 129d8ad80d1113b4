"""``value_and_grad``: gradients of a loss over explicit params, as the imperative loop gets them.

Two kinds of roles:

* **functional** roles (the default): state params are plain tensors; the loss
  function runs modules with them through :func:`purestep.call`. The step makes
  fresh requires-grad leaves that share the params' memory, runs the loss and
  ``torch.autograd.backward(loss, inputs=leaves)``, and takes each leaf's
  ``.grad``: autograd's own accumulation, so gradients have their parameter's
  memory layout (channels_last, never stride 0), a parameter no gradient
  reaches has none (it is skipped by the optimizer, as in torch), and the
  result is bitwise the imperative loop's.
* **bound** roles: state params *are* a module's ``nn.Parameter`` objects (an
  FSDP2 binding, :mod:`purestep.step._bound`).

The loss runs inside a :func:`purestep.step.call_scope` that closes after the
backward pass, so activation checkpointing recomputes with the same tensors.
Checkpointing with ``use_reentrant=True`` cannot run under ``inputs=`` (torch
refuses); when the graph holds such a checkpoint the backward runs without
``inputs`` and the gradients of every other leaf it reaches are put back as
they were.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from tensordict import TensorDict, TensorDictBase

from purestep import _compat, tree
from purestep.step._bound import bound_grads, graph_params, is_bound
from purestep.step._call import call_scope
from purestep.step._context import live_scope
from purestep.step._sink import MicrobatchGrads, take_sink

__all__ = ["GradFn", "LossFn", "value_and_grad"]

KeyPath = tuple[str, ...]

LossFn = Callable[
    [TensorDictBase, TensorDictBase, torch.Tensor],
    tuple[torch.Tensor | Mapping[str, torch.Tensor], Mapping[str, Any] | TensorDictBase | None],
]


class GradFn(Protocol):
    """``grad_fn(params, batch, key, *, roles=None, buffers=None, donate=False) -> (grads, metrics)``.

    ``buffers`` (optional) is the caller's working copy ``{role: tree}`` of the
    roles' buffers: the forward's updates are written into it (see
    :func:`value_and_grad`). ``donate=True`` allows the forward to write into
    ``params`` (a donated step); otherwise ``params`` are never written.
    """

    def __call__(
        self,
        params: TensorDictBase,
        batch: TensorDictBase,
        key: torch.Tensor,
        *,
        roles: Sequence[str] | None = None,
        buffers: TensorDictBase | None = None,
        donate: bool = False,  # pragma: no mutate (a Protocol stub, never run)
    ) -> tuple[TensorDict, TensorDict]: ...


def _as_metrics(metrics: Mapping[str, Any] | TensorDictBase | None) -> TensorDict:
    if metrics is None or (not isinstance(metrics, TensorDictBase) and not metrics):
        return tree.plain_td({})
    if isinstance(metrics, TensorDictBase):
        td = metrics
    elif isinstance(metrics, Mapping):
        td = TensorDict({k: _metric_value(k, v) for k, v in metrics.items()}, batch_size=[])
    else:
        raise TypeError(
            f"loss_fn returned metrics of type {type(metrics).__name__}; expected a mapping "
            "or TensorDict of scalars, or None"
        )
    return td.detach()  # type: ignore[no-any-return]


def _metric_value(key: str, value: Any) -> Any:
    """A metric value as a tensor (a number becomes a 0-dim tensor); a TypeError naming ``key``."""
    if isinstance(value, (torch.Tensor, TensorDictBase, Mapping)):
        return value
    try:
        return torch.tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(
            f"loss_fn returned metric {key!r} = {value!r} of type {type(value).__name__}; "
            "a metric must be a tensor or a number"
        ) from e


def _unpack(out: Any) -> tuple[Any, Any]:
    if not isinstance(out, tuple) or len(out) != 2:
        got = f"a tuple of {len(out)}" if isinstance(out, tuple) else f"a {type(out).__name__}"
        raise TypeError(
            f"loss_fn must return (loss, metrics), got {got}; return `loss, {{}}` when there "
            "are no metrics"
        )
    return out


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


def _grad_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


def _copy_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _make_leaves(
    params: TensorDictBase, copies: frozenset[int] | None
) -> tuple[TensorDict, list[torch.Tensor]]:
    """Requires-grad leaves for ``params``: views sharing memory, copies at ``copies`` (all: None)."""
    if copies is None:
        return tree.map_with_leaves(params, _copy_leaf)
    if not copies:
        return tree.map_with_leaves(params, _grad_leaf)
    src = tree.leaves(params)
    new = [_copy_leaf(t) if i in copies else _grad_leaf(t) for i, t in enumerate(src)]
    return tree.rebuild(params, new), new


def _loss_view(
    params: TensorDictBase,
    tracked: Mapping[str, TensorDict],
    buffers: TensorDictBase | None,
    bound: Mapping[str, bool],
) -> TensorDictBase:
    """What the loss sees: live roles' tracked leaves, the others as given, plus buffers."""
    with_buffers = (
        [r for r in buffers.keys() if r in params.keys() and not bound.get(r, False)]
        if buffers is not None
        else []
    )
    simple = (
        type(params) is _compat.PLAIN_TD
        and params.device is None
        and not params.batch_dims
        and all(type(v) is TensorDict for v in params._tensordict.values())
    )
    if not simple:
        out = params.copy()
        for role, td in tracked.items():
            out.set(role, td)
    else:
        out = tree.plain_td(
            {k: tracked[k] if k in tracked else v.copy() for k, v in params._tensordict.items()},
            params.batch_size,
        )
    if with_buffers:
        assert buffers is not None
        for role in with_buffers:
            # keep_a: a param the forward writes in place is in ``buffers`` too (its new value)
            merged = tree.merge(
                out.get(role), buffers.get(role), what=f"role {role!r}", keep_a=True
            )
            out.set(role, merged)
    return out


def _collect_buffers(view: TensorDictBase, buffers: TensorDictBase, params: TensorDictBase) -> None:
    """Copy into ``buffers`` every buffer tensor the forward replaced in ``view``."""
    for role in buffers.keys():
        if role not in view.keys():
            continue
        merged = view.get(role)
        role_bufs = buffers.get(role)
        bufs = tree.paths(role_bufs)
        if role in params.keys() and len(bufs) > 0:
            own = set(tree.paths(params.get(role)))
            skip = [p in own for p in bufs]  # written params: their value is set after
        else:
            skip = [False] * len(bufs)
        for path, leaf, param in zip(bufs, tree.leaves(role_bufs), skip, strict=True):
            current = None if param else merged.get(path)
            if current is not None and current is not leaf:
                buffers.set((role, *path), current)


def _walk_graph(roots: Sequence[torch.Tensor]) -> Any:
    # ``seen`` keeps the node objects alive: torch < 2.13 wraps C++ nodes in fresh Python
    # objects on every access, so a bare id() could be reused by the next wrapper.
    seen: dict[int, Any] = {}
    stack = [r.grad_fn for r in roots if r.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen[id(fn)] = fn
        yield fn
        stack.extend(f for f, _ in fn.next_functions if f is not None)


def _has_reentrant_checkpoint(losses: Sequence[torch.Tensor]) -> bool:
    return any(type(fn).__name__ == "CheckpointFunctionBackward" for fn in _walk_graph(losses))


def _check_bound_losses_apart(
    losses: dict[str, torch.Tensor], leaves: dict[str, list[torch.Tensor]]
) -> None:
    """Refuse a bound role's loss that reaches another bound role with a loss of its own.

    Bound roles share one ``backward()``, so that other role's ``.grad`` would gather
    this loss too, where a functional role gets the gradient of its own loss only.
    """
    if len({id(v) for v in losses.values()}) < 2:
        return
    seen = {role: graph_params(leaves[role]) for role in losses}
    for role, loss in losses.items():
        reached = {id(fn.variable) for fn in _walk_graph([loss]) if hasattr(fn, "variable")}
        for other, other_loss in losses.items():
            if other_loss is not loss and reached & seen[other]:
                raise ValueError(
                    f"the loss of bound role {role!r} reaches the params of bound role "
                    f"{other!r}, which has a loss of its own: bound (FSDP) roles run one "
                    f"backward() over all their losses, so the gradient of {other!r} would "
                    f"include the loss of {role!r}. Detach what the loss of {role!r} reads "
                    f"from the modules of {other!r} (e.g. critic(student_out.detach())), or "
                    "return one loss for both"
                )


def _foreign_leaves(losses: Sequence[torch.Tensor], ours: set[int]) -> list[torch.Tensor]:
    out = []
    for fn in _walk_graph(losses):
        var = getattr(fn, "variable", None)
        if isinstance(var, torch.Tensor) and id(var) not in ours:
            out.append(var)
    return out


def _stash(ts: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    return [None if t.grad is None else t.grad.clone() for t in ts]


def _unstash(ts: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    for t, g in zip(ts, grads, strict=True):
        t.grad = g


def _backward(
    losses: dict[str, torch.Tensor],
    leaves: dict[str, list[torch.Tensor]],
    weight: float,
    reentrant: bool,
) -> None:
    """Backward of each role's loss into its leaves' ``.grad`` (``weight`` times)."""
    for role, loss in losses.items():
        if not loss.requires_grad:
            raise ValueError(
                f"the loss of role {role!r} does not depend on any tensor that requires grad: "
                f"run its modules with params[{role!r}] through purestep.call"
            )

    def scaled(loss: torch.Tensor) -> torch.Tensor:
        return loss * weight if weight != 1.0 else loss

    single = len({id(v) for v in losses.values()}) == 1
    items = list(losses.items())
    if not reentrant:
        if single:
            flat = [t for r in losses for t in leaves[r]]
            torch.autograd.backward(scaled(items[0][1]), inputs=flat)
            return
        for j, (role, loss) in enumerate(items):
            torch.autograd.backward(
                scaled(loss), inputs=leaves[role], retain_graph=j < len(items) - 1
            )
        return
    # use_reentrant=True checkpoints refuse inputs=: plain backward, then undo what it
    # did to every other leaf (other roles' leaves, tensors outside the params).
    ours = {id(t) for r in losses for t in leaves[r]}
    foreign = _foreign_leaves([v for _, v in items], ours)
    saved = _stash(foreign)
    try:
        if single:
            torch.autograd.backward(scaled(items[0][1]))
            return
        for j, (role, loss) in enumerate(items):
            others = [t for r, _ in items if r != role for t in leaves[r]]
            kept = _stash(others)
            torch.autograd.backward(scaled(loss), retain_graph=j < len(items) - 1)
            _unstash(others, kept)
    finally:
        _unstash(foreign, saved)


class _Writes:
    """Which params a role's forward writes in place (learned on the first pure call)."""

    def __init__(self) -> None:
        self.learned: dict[str, frozenset[int]] = {}


def value_and_grad(loss_fn: LossFn) -> GradFn:
    """Turn ``loss_fn(params, batch, key) -> (loss, metrics)`` into a gradient function.

    ``loss`` is a scalar (every live role differentiates it) or ``{role: scalar}``
    (each role is differentiated only by its own loss; a live role absent from
    the mapping gets no gradient and is not updated). ``metrics`` is a mapping or
    TensorDict of scalars, or None.

    The returned ``grad_fn(params, batch, key, *, roles=None, buffers=None,
    donate=False)`` computes grads for ``roles`` (default: every role in
    ``params``). Other roles are passed to ``loss_fn`` as given (no graph is
    built through them). Returns ``(grads, metrics)``: grads is a TensorDict
    ``{role: tree}`` holding a gradient for every param that received one, in
    the param's memory layout (a param that no gradient reaches is left out,
    and the optimizers skip it, as ``torch.optim`` skips a ``.grad`` of None);
    metrics a TensorDict of detached scalars on device, with the loss under
    ``"loss"`` (or ``(role, "loss")`` for per-role losses).

    Buffers: with ``buffers={role: tree}`` (as :func:`purestep.train_step`
    passes the state's), ``loss_fn`` sees ``params[role]`` with the role's
    buffers merged in, so :func:`purestep.call` swaps both; updates the
    forward makes (BatchNorm statistics) land in ``buffers``, which the caller
    owns, never in the module or in ``params``.

    Purity: with ``donate=False`` the forward never writes into ``params``. A
    parameter the module writes in place (``nn.Embedding(max_norm=...)``) is
    found on the first call (which runs on copies) and from then on computed on
    a copy, whose new value is put into ``buffers`` under the parameter's path
    (:func:`purestep.train_step` hands it to the optimizer, as the imperative
    loop's in-place write would). A write into another parameter later raises.

    Bound roles (:func:`purestep.distributed.fsdp.bind`) run the module with its
    own params, so they are never detached: grads come from one ``backward()``
    of all bound roles' losses, and a bound role's grads are those of the *sum*
    of the losses that reach its params.

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
    writes = _Writes()
    reentrant: list[bool | None] = [None]

    def grad_fn(
        params: TensorDictBase,
        batch: TensorDictBase,
        key: torch.Tensor,
        *,
        roles: Sequence[str] | None = None,
        buffers: TensorDictBase | None = None,
        donate: bool = False,
    ) -> tuple[TensorDict, TensorDict]:
        all_roles = list(params.keys())
        live = all_roles if roles is None else list(roles)
        unknown = [r for r in live if r not in all_roles]
        if unknown:
            raise KeyError(f"roles {unknown} have no params (roles with params: {all_roles})")
        sink: MicrobatchGrads | None = take_sink()  # before loss_fn: nested grad_fns do not take it
        weight = sink.weight if sink is not None else 1.0
        leaves: dict[str, list[torch.Tensor]] = {}
        bound: dict[str, bool] = {}
        tracked: dict[str, TensorDict] = {}
        guard: dict[str, tuple[list[torch.Tensor], list[int], list[int]]] = {}
        copy_versions: dict[str, list[tuple[int, int]]] = {}
        for role in all_roles:
            role_params = params.get(role)
            # no mutants here: the helper has its own, and value_and_grad's keep their numbers
            _check_role_tree(role, role_params)  # pragma: no mutate
            bound[role] = is_bound(role_params)
            if bound[role]:
                if role in live:
                    leaves[role] = tree.leaves(role_params)
                continue
            if role not in live:
                if not donate:  # a non-live role's params are the caller's: watch them too
                    src = tree.leaves(role_params)
                    guard[role] = (src, list(range(len(src))), [t._version for t in src])
                continue
            copies: frozenset[int] | None = frozenset()
            if not donate:
                copies = writes.learned.get(role)  # None: not learned yet, copy everything
            if sink is not None:
                tracked[role], leaves[role] = sink.leaves_for(role, role_params, _make_with(copies))
                copies = sink.copies.setdefault(role, copies)  # those of the reused leaves
            else:
                tracked[role], leaves[role] = _make_leaves(role_params, copies)
            if not donate:
                src = tree.leaves(role_params)
                n = len(src)
                copied = list(range(n)) if copies is None else sorted(copies)
                shared = [] if copies is None else [i for i in range(n) if i not in copies]
                guard[role] = (src, shared, [src[i]._version for i in shared])
                copy_versions[role] = [(i, leaves[role][i]._version) for i in copied]
        view = _loss_view(params, tracked, buffers, bound)
        with live_scope(frozenset(live)), torch.enable_grad(), call_scope() as scope:
            loss, raw_metrics = _unpack(loss_fn(view, batch, key))
            losses = _role_losses(loss, live)
            func = {r: v for r, v in losses.items() if not bound[r]}
            bnd = {r: v for r, v in losses.items() if bound[r]}
            with scope.recompute_guard():
                if func:
                    if reentrant[0] is None:
                        reentrant[0] = _has_reentrant_checkpoint(list(func.values()))
                    _backward(func, leaves, weight, bool(reentrant[0]))
                grad_lists: dict[str, list[torch.Tensor | None]] = {
                    r: [t.grad for t in leaves[r]] for r in func
                }
                if bnd:
                    idle = [
                        t
                        for r in all_roles
                        if r not in bnd and bound[r]
                        for t in tree.leaves(params.get(r))
                    ]
                    _check_bound_losses_apart(bnd, leaves)
                    grad_lists.update(bound_grads(bnd, leaves, idle))
        if sink is not None:
            sink.served.update(func)
        if buffers is not None:
            _collect_buffers(view, buffers, params)
        if not donate:
            _check_writes(params, guard, copy_versions, leaves, tracked, writes, buffers)
        metrics = _as_metrics(raw_metrics)
        _loss_metrics(loss, metrics)
        grads = tree.plain_td(
            {r: tree.select(params.get(r), grad_lists[r]) for r in live if r in grad_lists}
        )
        return grads, metrics

    return grad_fn


def _check_role_tree(role: str, role_params: Any) -> None:
    """Refuse a role whose params are not a tree (a bare tensor directly under the role)."""
    if not isinstance(role_params, TensorDictBase):
        raise TypeError(
            f"params[{role!r}] is a {type(role_params).__name__}, not a tree of tensors: "
            "value_and_grad takes params as {role: {name: tensor}}; put it under a role, "
            f"e.g. {{'model': {{{role!r}: ...}}}}"
        )


def _make_with(
    copies: frozenset[int] | None,
) -> Callable[[TensorDictBase], tuple[TensorDict, list[torch.Tensor]]]:
    def make(p: TensorDictBase) -> tuple[TensorDict, list[torch.Tensor]]:
        return _make_leaves(p, copies)

    return make


def _check_writes(
    params: TensorDictBase,
    guard: dict[str, tuple[list[torch.Tensor], list[int], list[int]]],
    copy_versions: dict[str, list[tuple[int, int]]],
    leaves: dict[str, list[torch.Tensor]],
    tracked: Mapping[str, TensorDict],
    writes: _Writes,
    buffers: TensorDictBase | None,
) -> None:
    """Pure call: learn which params the forward writes, hand their new values over, or raise."""
    for role, (src, idx, before) in guard.items():
        changed = [i for i, v in zip(idx, before, strict=True) if src[i]._version != v]
        if changed:
            names = ", ".join(
                repr(tree.format_path((role, *tree.paths(params.get(role))[i]))) for i in changed
            )
            raise RuntimeError(
                f"the forward wrote in place into {names} of the input state although the "
                "step does not donate it (donate=False), so the input has been modified. "
                "The module writes into its weights only on some calls; build the step with "
                "donate=True, or keep such writes out of the forward"
            )
    for role, versions in copy_versions.items():
        written = [i for i, v in versions if leaves[role][i]._version != v]
        if role not in writes.learned:
            writes.learned[role] = frozenset(written)
        if not written:
            continue
        if buffers is None:
            names = ", ".join(
                repr(tree.format_path((role, *tree.paths(tracked[role])[i]))) for i in written
            )
            raise RuntimeError(
                f"the forward writes in place into {names} (e.g. nn.Embedding(max_norm=...)); "
                "pass buffers= (a TensorDict that receives the new values) to grad_fn, or use "
                "purestep.train_step, which hands them to the optimizer"
            )
        role_paths = tree.paths(tracked[role])
        for i in written:
            buffers.set((role, *role_paths[i]), leaves[role][i].detach())
