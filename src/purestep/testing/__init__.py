"""Property checks and hypothesis strategies for step functions (yours and ours).

Example:
    >>> import torch
    >>> from torch import nn
    >>> import purestep as ps
    >>> from purestep import testing
    >>> net = nn.Linear(2, 1)
    >>> opt = {"m": ps.optim.adamw(1e-2)}
    >>> gf = ps.value_and_grad(lambda p, b, k: (ps.call(net, p["m"], b["x"]).pow(2).mean(), {}))
    >>> state = ps.init_state({"m": net}, opt, seed=0)
    >>> testing.assert_pure(ps.train_step(gf, opt), state, {"x": torch.ones(4, 2)})
"""

from purestep.testing._compare import assert_trees_close, assert_trees_equal, snapshot
from purestep.testing.checks import (
    assert_accumulation_invariant,
    assert_cadence,
    assert_deterministic,
    assert_donation_safe,
    assert_pure,
    assert_resume_exact,
    run_steps,
)
from purestep.testing.imperative import (
    ImperativeLoss,
    assert_matches_imperative,
    torch_optimizer_for,
)
from purestep.testing.strategies import (
    DrawnModel,
    ModelSpec,
    adam_hparams,
    batches,
    models,
    param_trees,
    sgd_hparams,
    states,
    tensors,
)
from purestep.testing.workers import WorkerError, WorkerPool

__all__ = [
    "DrawnModel",
    "ImperativeLoss",
    "ModelSpec",
    "WorkerError",
    "WorkerPool",
    "adam_hparams",
    "assert_accumulation_invariant",
    "assert_cadence",
    "assert_deterministic",
    "assert_donation_safe",
    "assert_matches_imperative",
    "assert_pure",
    "assert_resume_exact",
    "assert_trees_close",
    "assert_trees_equal",
    "batches",
    "models",
    "param_trees",
    "run_steps",
    "sgd_hparams",
    "snapshot",
    "states",
    "tensors",
    "torch_optimizer_for",
]
