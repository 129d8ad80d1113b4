"""Between a training state and ``nn.Module`` weights: export a role, load weights into a module.

The state keeps a role's trainable params (``state["params", role]``), its
persistent buffers (``state["buffers", role]``) and, with :func:`purestep.with_ema`,
their averages (``state["ema", role]``, ``state["ema_buffers", role]``); the
module itself keeps whatever it was built with. These helpers move weights
across that boundary:

* :func:`module_variables`: a detached copy of *all* of a module's params
  (trainable or frozen) and persistent buffers, as a tree to
  :func:`purestep.call` it with (a frozen teacher's weights, loaded from a
  pretrained module).
* :func:`state_dict`: a role's weights (or EMA weights) as a flat
  ``{"a.b.weight": tensor}`` dict with ``module.state_dict()``'s keys, so
  ``module.load_state_dict``, ``torch.save`` or ``save_pretrained`` take it.
* :func:`load_params`: copy a tree (or a flat state dict) into a module's own
  tensors in place, so the module computes with the trained weights.

The round trip "train a teacher, then distil it"::

    t_state = loop.run(finetune_step, finetune.init_state(teacher, opt, seed=0), data, ...)
    teacher_vars = ps.variables(t_state, "student", ema=True)      # params + buffers
    export.load_params(teacher, teacher_vars)                         # the module is trained now
    teacher.save_pretrained("teacher/")                               # (a diffusers model)

and back, from pretrained weights: ``init_state({"student": Model.from_pretrained(...)})``
copies the module's weights into the state, and
``export.module_variables(Model.from_pretrained(...))`` gives a frozen teacher's.

Example:
    >>> import torch
    >>> from torch import nn
    >>> import purestep as ps
    >>> from purestep import export, optim
    >>> net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    >>> state = ps.init_state({"student": net}, {"student": optim.sgd(0.1)}, seed=0)
    >>> sd = export.state_dict(state, "student", module=net)
    >>> sorted(sd) == sorted(net.state_dict())
    True
    >>> fresh = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    >>> _ = export.load_params(fresh, ps.variables(state, "student"))
    >>> torch.equal(fresh[0].weight, net[0].weight)
    True
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from purestep import tree
from purestep.state import variables
from purestep.step import module_tensors

__all__ = ["load_params", "module_variables", "state_dict"]


def _flat(td: TensorDictBase) -> dict[str, torch.Tensor]:
    return {".".join(p): t for p, t in zip(tree.paths(td), tree.leaves(td), strict=True)}


def _module_entries(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every key of ``module.state_dict()`` (aliases of tied tensors included) -> its tensor."""
    return dict(module.state_dict(keep_vars=True).items())


def module_variables(module: nn.Module) -> TensorDict:
    """A detached copy of all of ``module``'s params (trainable or frozen) and persistent buffers.

    Nested by module path, one leaf per tied tensor (under its first name), so
    :func:`purestep.call` runs the module with it. Use it for a frozen role
    whose module holds the weights to use (loaded with ``from_pretrained``,
    ``load_state_dict`` or :func:`load_params`).

    Raises:
        ValueError: the module has no parameters.

    Example:
        >>> from torch import nn
        >>> sorted(module_variables(nn.BatchNorm1d(2)).keys())
        ['bias', 'num_batches_tracked', 'running_mean', 'running_var', 'weight']
    """
    if next(iter(module.parameters()), None) is None:
        raise ValueError(f"module_variables: {type(module).__name__} has no parameters")
    saved = {id(t) for t in _module_entries(module).values()}  # persistent buffers only
    items = [(p, t.detach().clone()) for p, t in module_tensors(module) if id(t) in saved]
    return tree.unflatten(items)


def state_dict(
    state: TensorDictBase,
    role: str,
    *,
    ema: bool = False,
    module: nn.Module | None = None,
) -> dict[str, torch.Tensor]:
    """``role``'s weights (``ema=True``: its EMA weights) as a flat ``module.state_dict()``-style dict.

    Holds the role's params and persistent buffers (EMA buffers when kept,
    else the live ones: see :func:`purestep.variables`), keys joined with
    ``"."``. With ``module`` the dict has exactly ``module.state_dict()``'s
    keys: the module's frozen params (not state) are taken from the module, and
    every alias of a tied tensor is filled, so ``module.load_state_dict(sd)``
    (strict) and ``save_pretrained(..., state_dict=sd)`` accept it. The
    tensors are the state's own (no copy): clone them before changing them.

    Raises:
        KeyError: the state has no such role (or no EMA for it), or, with
            ``module``, a state key that is not one of the module's tensors
            (names it: the module is not the role's).
        ValueError: a shape that differs from the module's (names the key).

    Example:
        >>> from torch import nn
        >>> import purestep as ps
        >>> net = nn.Linear(2, 3)
        >>> s = ps.init_state({"student": net}, {}, seed=0)
        >>> sorted(state_dict(s, "student"))
        ['bias', 'weight']
    """
    flat = _flat(variables(state, role, ema=ema))
    if module is None:
        return flat
    entries = _module_entries(module)
    unknown = sorted(k for k in flat if k not in entries)
    if unknown:
        raise KeyError(
            f"export.state_dict: role {role!r} has keys that {type(module).__name__} does not "
            f"have: {unknown[:8]}{' ...' if len(unknown) > 8 else ''}"
        )
    out: dict[str, torch.Tensor] = {}
    by_id: dict[int, torch.Tensor] = {}
    for k, t in flat.items():
        by_id[id(entries[k])] = t
    for k, target in entries.items():
        value = by_id.get(id(target))
        if value is None:  # not state (a frozen param, a buffer of a frozen role): the module's
            value = target.detach()
        elif value.shape != target.shape:
            raise ValueError(
                f"export.state_dict: role {role!r} key {k!r} has shape {tuple(value.shape)}, "
                f"{type(module).__name__} has {tuple(target.shape)}"
            )
        out[k] = value
    return out


def load_params(
    module: nn.Module,
    params: TensorDictBase | Mapping[str, torch.Tensor],
    *,
    strict: bool = True,
) -> nn.Module:
    """Copy ``params`` into ``module``'s own parameters and buffers, in place; returns ``module``.

    ``params`` is a tree nested by module path (e.g. :func:`purestep.variables`
    or ``state["ema", role]``) or a flat ``{"a.b.weight": tensor}`` dict. Every
    alias of a tied tensor gets the value; values are cast to the module's
    dtype and device. Nothing changes when a check fails.

    Args:
        module: the module to write into.
        params: the values.
        strict: every *trainable* parameter of the module must be given (a
            tree of params only is enough; buffers and frozen params are
            optional). A key the module does not have always raises.

    Raises:
        KeyError: a key the module does not have, or (``strict``) trainable
            parameters that are not given; all named.
        ValueError: a shape that differs from the module's (names the key).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from tensordict import TensorDict
        >>> net = nn.Linear(1, 1)
        >>> _ = load_params(net, TensorDict({"weight": torch.ones(1, 1), "bias": torch.zeros(1)}, []))
        >>> net.weight.item(), net.bias.item()
        (1.0, 0.0)
    """
    flat = _flat(params) if isinstance(params, TensorDictBase) else dict(params)
    entries = _module_entries(module)
    unknown = sorted(k for k in flat if k not in entries)
    if unknown:
        raise KeyError(
            f"load_params: {type(module).__name__} has no parameter or buffer "
            f"{unknown[:8]}{' ...' if len(unknown) > 8 else ''}"
        )
    given = {id(entries[k]) for k in flat}
    if strict:
        missing = [
            n for n, p in module.named_parameters() if p.requires_grad and id(p) not in given
        ]
        if missing:
            raise KeyError(
                f"load_params: no value for the trainable parameters {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''} of {type(module).__name__} "
                "(strict=False loads a subset)"
            )
    for k, v in flat.items():
        if tuple(v.shape) != tuple(entries[k].shape):
            raise ValueError(
                f"load_params: {k!r} has shape {tuple(v.shape)}, {type(module).__name__} has "
                f"{tuple(entries[k].shape)}"
            )
    with torch.no_grad():
        for k, v in flat.items():
            entries[k].copy_(v)
    return module
