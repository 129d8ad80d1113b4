"""The training state: one TensorDict with everything that changes during training.

Layout (see ``docs/ARCHITECTURE.md``)::

    state = TensorDict({
        "params":    {role: {module-path...: Tensor}},  # trainable weights per role
        "opt_state": {role: {...}},                     # per-role optimizer state
        "rng":       int64 0-dim CPU tensor,            # root PRNG key
        "step":      int64 0-dim CPU tensor,            # steps taken by the method
        "buffers":   {role: {module-path...: Tensor}},  # persistent buffers (when a role has any)
    }, batch_size=[])

Wrappers add their own keys (``"ema"``, ``"skip"``), methods their ``"extra"``.

Each well-known key has a constant here (from ``purestep._keys``, their one home):
:data:`PARAMS`, :data:`OPT_STATE`, :data:`RNG`, :data:`STEP`, :data:`BUFFERS`,
:data:`EMA`, :data:`EMA_BUFFERS`, :data:`SKIP` (with :data:`SKIP_TOTAL` and
:data:`SKIP_CONSECUTIVE`), :data:`EXTRA`, and :data:`STATE_KEYS` (all of them).
The library names keys only through them; user code may use either.

Example:
    >>> from purestep import state
    >>> state.PARAMS, state.STEP
    ('params', 'step')
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from purestep import rng, tree
from purestep._keys import (
    BUFFERS,
    EMA,
    EMA_BUFFERS,
    EXTRA,
    OPT_STATE,
    PARAMS,
    RNG,
    SKIP,
    SKIP_CONSECUTIVE,
    SKIP_TOTAL,
    STATE_KEYS,
    STEP,
)
from purestep._layout import layout_of
from purestep._sharing import shared_memory, sharing_message
from purestep.errors import StateError

__all__ = [
    "BUFFERS",
    "EMA",
    "EMA_BUFFERS",
    "EXTRA",
    "OPT_STATE",
    "PARAMS",
    "RNG",
    "SKIP",
    "SKIP_CONSECUTIVE",
    "SKIP_TOTAL",
    "STATE_KEYS",
    "STEP",
    "ParamSource",
    "buffers_of",
    "init_state",
    "params_of",
    "roles",
    "variables",
]


@runtime_checkable
class Optimizer(Protocol):
    """What :func:`init_state` needs of an optimizer: ``init``, ``update`` and ``step``.

    :class:`purestep.optim.Transform` is one; ``state`` is a base module and does
    not import ``optim``, so it checks this protocol instead.
    """

    def init(self, params: TensorDictBase) -> TensorDict: ...

    def update(self, *args: Any, **kwargs: Any) -> Any: ...

    def step(self, *args: Any, **kwargs: Any) -> Any: ...


@runtime_checkable
class ParamSource(Protocol):
    """Anything that supplies a role's params as a TensorDict (e.g. an FSDP binding).

    ``aliases_module`` tells whether the returned params *are* the module's own
    parameters (updated in place) rather than a copy.
    """

    aliases_module: bool

    def params(self) -> TensorDictBase: ...


def _module_params(role: str, module: nn.Module) -> TensorDict:
    layout = layout_of(module)  # tied parameters once, under their first name; no _orig_mod.
    items = [(path, p.detach().clone()) for path, p in layout.params if p.requires_grad]
    if not items:
        raise ValueError(
            f"role {role!r}: module {type(module).__name__} has no trainable parameters "
            "(requires_grad=True); frozen roles such as a teacher are not state: "
            "capture them in the loss function instead"
        )
    return tree.unflatten(items)


def buffers_of(role: str, module: nn.Module, *, copy: bool = True) -> TensorDict | None:
    """A module's persistent buffers (copied, nested by module path), or None when it has none.

    With ``copy=False`` the tree holds the module's own buffer tensors (a
    binding whose state aliases the module, such as FSDP's).

    Non-persistent buffers (``register_buffer(..., persistent=False)``: rotary
    caches, attention masks) are derived data, not state, and stay with the module.

    Example:
        >>> from torch import nn
        >>> sorted(buffers_of("student", nn.BatchNorm1d(2)).keys())
        ['num_batches_tracked', 'running_mean', 'running_var']
    """
    layout = layout_of(module)
    items = [
        (path, b.detach().clone() if copy else b)
        for path, b, persistent in layout.buffers
        if persistent
    ]
    return tree.unflatten(items) if items else None


def _check_params(role: str, params: TensorDictBase) -> None:
    ps = tree.paths(params)
    if not ps:
        raise ValueError(f"role {role!r} has no params (empty TensorDict)")
    for path, leaf in zip(ps, tree.leaves(params), strict=True):
        for part in path:
            if "." in part:
                raise ValueError(
                    f"role {role!r}: leaf key {part!r} at {tree.format_path((role, *path))} "
                    "contains '.'; nest keys by module path instead "
                    "(TensorDict.from_module or .unflatten_keys('.'))"
                )
        if not leaf.is_floating_point():
            raise TypeError(
                f"role {role!r}: param {tree.format_path(path)} has dtype {leaf.dtype}; "
                "trainable params must be floating point"
            )


def params_of(role: str, source: nn.Module | TensorDictBase | ParamSource) -> TensorDictBase:
    """A role's params as a TensorDict detached from autograd.

    * ``nn.Module``: its trainable parameters (``requires_grad=True``), copied,
      nested by module path. A tied parameter (GPT-2's ``lm_head.weight`` is
      ``transformer.wte.weight``) is one leaf, under its first name in
      ``named_parameters()``; ``torch.compile`` wrappers add no ``_orig_mod.``.
      Frozen params stay with the module (buffers: :func:`buffers_of`).
    * ``TensorDict``: used as given, detached (no copy).
    * a :class:`ParamSource` (such as an FSDP binding): its params, which alias
      the module's own parameters.

    Example:
        >>> from torch import nn
        >>> sorted(params_of("student", nn.Linear(2, 3)).keys())
        ['bias', 'weight']
    """
    if isinstance(source, nn.Module):
        out: TensorDictBase = _module_params(role, source)
    elif isinstance(source, TensorDictBase):
        out = source.detach()
    elif isinstance(source, ParamSource):
        out = source.params()
    else:
        raise TypeError(
            f"params[{role!r}] is {type(source).__name__}; expected an nn.Module, "
            "a TensorDict or a binding (purestep.distributed.fsdp.bind)"
        )
    _check_params(role, out)
    return out


def _source_buffers(
    role: str, source: nn.Module | TensorDictBase | ParamSource
) -> TensorDictBase | None:
    if isinstance(source, nn.Module):
        return buffers_of(role, source)
    if isinstance(source, ParamSource):
        get = getattr(source, "buffers", None)
        found = get() if callable(get) else None
        return found if isinstance(found, TensorDictBase) else None
    return None


def init_state(
    params: Mapping[str, nn.Module | TensorDictBase | ParamSource],
    optimizers: Mapping[str, Optimizer],
    *,
    seed: int,
    extra: Mapping[str, Any] | TensorDictBase | None = None,
) -> TensorDict:
    """Build the training state.

    Args:
        params: ``{role: module | TensorDict | binding}`` for every trainable role.
        optimizers: ``{role: Transform}``; every key must be a role in ``params``.
            Roles without an optimizer keep params in state but are never updated
            by :func:`purestep.train_step` (e.g. a policy moved by a method itself).
        seed: the root PRNG seed (``state["rng"] = rng.key(seed)``).
        extra: optional method-owned tensors stored under ``state["extra"]``.

    Returns:
        A TensorDict with ``params``, ``opt_state``, ``rng`` and ``step`` (``0``),
        and ``buffers`` ``{role: tree}`` for the roles whose modules have
        persistent buffers (BatchNorm statistics): the step swaps them in with
        the params and returns their updates in the new state.

    Raises:
        ValueError: an optimizer for a role that has no params, a role with no
            trainable params, a dotted leaf key.
        TypeError: a non-floating param, an optimizer that is not a Transform,
            ``params``/``optimizers`` that are not mappings.
        StateError: two leaves share memory (the same TensorDict given for two
            roles, one tensor under two keys, an expanded tensor): a donated
            step would update that memory twice. Modules are copied, so only
            TensorDicts given as they are can do this; pass ``td.clone()``.

    Example:
        >>> from torch import nn
        >>> from purestep import optim
        >>> state = init_state({"student": nn.Linear(2, 2)}, {"student": optim.adamw(1e-3)}, seed=0)
        >>> sorted(state.keys())
        ['opt_state', 'params', 'rng', 'step']
    """
    for name, arg, what in (
        ("params", params, "{role: module or TensorDict}"),
        ("optimizers", optimizers, "{role: Transform} (may be empty)"),
    ):
        if not isinstance(arg, Mapping) or isinstance(arg, TensorDictBase | nn.Module):
            raise TypeError(
                f"init_state: {name} is a {type(arg).__name__}; expected a mapping {what}, "
                "e.g. init_state({'student': model}, {'student': optim.adamw(1e-3)}, seed=0)"
            )
    if not params:
        raise ValueError("init_state: params is empty; pass {role: module or TensorDict}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"init_state: seed must be an int, got {seed!r}")
    unknown = sorted(set(optimizers) - set(params))
    if unknown:
        raise ValueError(
            f"init_state: optimizers given for role(s) {unknown} that have no params "
            f"(roles with params: {sorted(params)})"
        )
    for role, opt in optimizers.items():
        if not isinstance(opt, Optimizer):
            raise TypeError(
                f"optimizers[{role!r}] is {type(opt).__name__}; expected a purestep.optim.Transform"
            )
    role_params = {role: params_of(role, src) for role, src in params.items()}
    role_buffers: dict[str, TensorDictBase] = {}
    for role, src in params.items():
        found = _source_buffers(role, src)
        if found is not None:
            role_buffers[role] = found
    _check_no_sharing(role_params, role_buffers)
    opt_state = {role: opt.init(role_params[role]) for role, opt in optimizers.items()}
    content: dict[str, Any] = {
        PARAMS: TensorDict(role_params, batch_size=[]),
        OPT_STATE: TensorDict(opt_state, batch_size=[]),
        RNG: rng.key(seed),
        STEP: torch.zeros((), dtype=torch.int64),
    }
    if role_buffers:
        content[BUFFERS] = TensorDict(role_buffers, batch_size=[])
    state = TensorDict(content, batch_size=[])
    if extra is not None:
        state[EXTRA] = extra if isinstance(extra, TensorDictBase) else TensorDict(extra, [])
    return state


def _check_no_sharing(
    role_params: Mapping[str, TensorDictBase], role_buffers: Mapping[str, TensorDictBase]
) -> None:
    items: list[tuple[tree.KeyPath, torch.Tensor]] = []
    for kind, trees in ((PARAMS, role_params), (BUFFERS, role_buffers)):
        for role, td in trees.items():
            items.extend(
                ((kind, role, *p), t) for p, t in zip(tree.paths(td), tree.leaves(td), strict=True)
            )
    shared = shared_memory(items)
    if shared:
        raise StateError(sharing_message("init_state", shared), path=shared[0][0])


def roles(state: TensorDictBase) -> list[str]:
    """The roles that have params in ``state``.

    Example:
        >>> from torch import nn
        >>> from purestep import optim
        >>> s = init_state({"student": nn.Linear(1, 1)}, {}, seed=0)
        >>> roles(s)
        ['student']
    """
    return list(state[PARAMS].keys())


def variables(state: TensorDictBase, role: str, *, ema: bool = False) -> TensorDict:
    """A role's params (or EMA params) and buffers as one tree, to :func:`purestep.call` with.

    Outside a step (evaluation, sampling) a module needs its buffers too
    (BatchNorm's running statistics live in ``state["buffers", role]``, not in
    the module). With ``ema=True`` the EMA params (:func:`purestep.with_ema`)
    and, when kept, the EMA buffers are used.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from purestep import call, optim
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        >>> s = init_state({"student": net}, {"student": optim.sgd(0.1)}, seed=0)
        >>> net.eval()(torch.ones(1, 2)).shape == call(net, variables(s, "student"), torch.ones(1, 2)).shape
        True
    """
    keys = state.keys()
    if ema:
        if (EMA, role) not in state.keys(include_nested=True):
            raise KeyError(f"variables: state has no EMA for role {role!r} (see with_ema)")
        params = state.get((EMA, role))
        if EMA_BUFFERS in keys and role in state.get(EMA_BUFFERS).keys():
            return tree.merge(params, state.get((EMA_BUFFERS, role)), what=f"role {role!r}")
    else:
        if role not in state.get(PARAMS).keys():
            raise KeyError(
                f"variables: no params for role {role!r} (roles: {list(state.get(PARAMS).keys())})"
            )
        params = state.get((PARAMS, role))
    if BUFFERS in keys and role in state.get(BUFFERS).keys():
        return tree.merge(params, state.get((BUFFERS, role)), what=f"role {role!r}")
    return tree.plain_td(dict(params.items())) if type(params) is TensorDict else params.copy()
