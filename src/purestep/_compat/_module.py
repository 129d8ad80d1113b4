"""Guarded ``nn.Module`` internals: the slot dicts ``call`` swaps into and the global
parameter-registration hooks (``registration_hooks``).

Example:
    >>> from purestep._compat._module import registration_hooks
    >>> isinstance(registration_hooks(), dict)
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from purestep._compat._probe import _choose


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
