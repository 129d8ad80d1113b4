"""purestep: functional, stateless training steps for PyTorch.

A training method is a pure function ``step(state, batch) -> (state, metrics)``
over one explicit :class:`tensordict.TensorDict` state that holds params,
optimizer state, the PRNG key and the step counter.

Example:
    >>> import torch
    >>> from torch import nn
    >>> import purestep as ps
    >>> net = nn.Linear(2, 1)
    >>> def loss_fn(params, batch, key):
    ...     return ((ps.call(net, params["student"], batch["x"]) - batch["y"]) ** 2).mean(), {}
    >>> opt = {"student": ps.optim.adamw(lr=1e-2)}
    >>> step = ps.train_step(ps.accumulate(ps.value_and_grad(loss_fn), 2), opt)
    >>> state = ps.init_state({"student": net}, opt, seed=0)
    >>> state, metrics = step(state, {"x": torch.ones(4, 2), "y": torch.zeros(4, 1)})
"""

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from purestep import errors, export, optim, rng, tree
from purestep.compile import CompiledStep, CompileStats, compile
from purestep.errors import (
    BatchError,
    DonatedStateError,
    ModuleInUseError,
    PurestepError,
    RoleError,
    ScheduleError,
    StateError,
)
from purestep.state import buffers_of, init_state, params_of, roles, variables
from purestep.step import (
    EMAStep,
    NonFiniteError,
    Step,
    TrainStep,
    accumulate,
    apply_gradients,
    call,
    call_scope,
    current_microbatch,
    live_roles,
    skip_nonfinite,
    train_step,
    value_and_grad,
    with_ema,
)

if TYPE_CHECKING:
    from purestep import checkpoint, loop

from purestep._version import __version__

_LAZY = ("checkpoint", "loop")  # above the step layer: imported on first use


def __getattr__(name: str) -> ModuleType:
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BatchError",
    "CompileStats",
    "CompiledStep",
    "DonatedStateError",
    "EMAStep",
    "ModuleInUseError",
    "NonFiniteError",
    "PurestepError",
    "RoleError",
    "ScheduleError",
    "StateError",
    "Step",
    "TrainStep",
    "__version__",
    "accumulate",
    "apply_gradients",
    "buffers_of",
    "call",
    "call_scope",
    "checkpoint",
    "compile",
    "current_microbatch",
    "errors",
    "export",
    "init_state",
    "live_roles",
    "loop",
    "optim",
    "params_of",
    "rng",
    "roles",
    "skip_nonfinite",
    "train_step",
    "tree",
    "value_and_grad",
    "variables",
    "with_ema",
]
