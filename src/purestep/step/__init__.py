"""Step composition: gradients, accumulation, optimizer steps and wrappers.

Every builder returns a function with the step signature
``step(state, batch) -> (state, metrics)``; see ``docs/ARCHITECTURE.md``.
"""

from purestep.errors import ModuleInUseError, NonFiniteError
from purestep.step._accumulate import accumulate, microbatch_sizes
from purestep.step._batch import Batch, as_batch, batch_size, check_index, with_index
from purestep.step._bound import (
    is_bound,
    register_bound_backward_hook,
    register_bound_graph_hook,
    register_bound_metrics_hook,
)
from purestep.step._call import call, call_scope, recording_modules
from purestep.step._context import Microbatch, current_microbatch, live_roles
from purestep.step._counters import (
    add_skip_counters,
    all_finite,
    next_step,
    set_skip,
    skip_update,
)
from purestep.step._donation import is_donated
from purestep.step._grad import GradFn, LossFn, value_and_grad
from purestep.step._swap import module_tensors
from purestep.step._train import Step, TrainStep, apply_gradients, train_step
from purestep.step._validate import check_state
from purestep.step._wrappers import EMAStep, skip_nonfinite, with_ema

__all__ = [
    "Batch",
    "EMAStep",
    "GradFn",
    "LossFn",
    "Microbatch",
    "ModuleInUseError",
    "NonFiniteError",
    "Step",
    "TrainStep",
    "accumulate",
    "add_skip_counters",
    "all_finite",
    "apply_gradients",
    "as_batch",
    "batch_size",
    "call",
    "call_scope",
    "check_index",
    "check_state",
    "current_microbatch",
    "is_bound",
    "is_donated",
    "live_roles",
    "microbatch_sizes",
    "module_tensors",
    "next_step",
    "recording_modules",
    "register_bound_backward_hook",
    "register_bound_graph_hook",
    "register_bound_metrics_hook",
    "set_skip",
    "skip_nonfinite",
    "skip_update",
    "train_step",
    "value_and_grad",
    "with_ema",
    "with_index",
]
