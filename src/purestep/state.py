"""The training state: one TensorDict with everything that changes during training.

Layout (see ``docs/ARCHITECTURE.md``)::

    state = TensorDict({
        "params":    {role: {module-path...: Tensor}},  # trainable weights per role
        "opt_state": {role: {...}},                     # per-role optimizer state
        "rng":       int64 0-dim CPU tensor,            # root PRNG key
        "step":      int64 0-dim CPU tensor,            # steps taken by the method
    }, batch_size=[])

Wrappers add their own keys (``"ema"``, ``"skip"``), methods their ``"extra"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from purestep import rng, tree
from purestep.optim import Transform

__all__ = ["ParamSource", "init_state", "params_of", "roles"]


@runtime_checkable
class ParamSource(Protocol):
    """Anything that supplies a role's params as a TensorDict (e.g. an FSDP binding).

    ``aliases_module`` tells whether the returned params *are* the module's own
    parameters (updated in place) rather than a copy.
    """

    aliases_module: bool

    def params(self) -> TensorDictBase: ...


def _module_params(role: str, module: nn.Module) -> TensorDict:
    items = []
    for name, p in module.named_parameters():
        if p.requires_grad:
            items.append((tuple(name.split(".")), p.detach().clone()))
    if not items:
        raise ValueError(
            f"role {role!r}: module {type(module).__name__} has no trainable parameters "
            "(requires_grad=True); frozen roles such as a teacher are not state: "
            "capture them in the loss function instead"
        )
    return tree.unflatten(items)


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
      nested by module path; buffers and frozen params stay with the module.
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


def init_state(
    params: Mapping[str, nn.Module | TensorDictBase | ParamSource],
    optimizers: Mapping[str, Transform],
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
        A TensorDict with ``params``, ``opt_state``, ``rng`` and ``step`` (``0``).

    Raises:
        ValueError: an optimizer for a role that has no params, a role with no
            trainable params, a dotted leaf key.
        TypeError: a non-floating param, an optimizer that is not a Transform.

    Example:
        >>> from torch import nn
        >>> from purestep import optim
        >>> state = init_state({"student": nn.Linear(2, 2)}, {"student": optim.adamw(1e-3)}, seed=0)
        >>> sorted(state.keys())
        ['opt_state', 'params', 'rng', 'step']
    """
    if not params:
        raise ValueError("init_state: params is empty; pass {role: module or TensorDict}")
    unknown = sorted(set(optimizers) - set(params))
    if unknown:
        raise ValueError(
            f"init_state: optimizers given for role(s) {unknown} that have no params "
            f"(roles with params: {sorted(params)})"
        )
    for role, opt in optimizers.items():
        if not isinstance(opt, Transform):
            raise TypeError(
                f"optimizers[{role!r}] is {type(opt).__name__}; expected a purestep.optim.Transform"
            )
    role_params = {role: params_of(role, src) for role, src in params.items()}
    opt_state = {role: opt.init(role_params[role]) for role, opt in optimizers.items()}
    state = TensorDict(
        {
            "params": TensorDict(role_params, batch_size=[]),
            "opt_state": TensorDict(opt_state, batch_size=[]),
            "rng": rng.key(seed),
            "step": torch.zeros((), dtype=torch.int64),
        },
        batch_size=[],
    )
    if extra is not None:
        state["extra"] = extra if isinstance(extra, TensorDictBase) else TensorDict(extra, [])
    return state


def roles(state: TensorDictBase) -> list[str]:
    """The roles that have params in ``state``.

    Example:
        >>> from torch import nn
        >>> from purestep import optim
        >>> s = init_state({"student": nn.Linear(1, 1)}, {}, seed=0)
        >>> roles(s)
        ['student']
    """
    return list(state["params"].keys())
