"""An optional reference training loop: progress, metric logs, checkpoints, resume, preemption.

:func:`run` drives any ``step(state, batch) -> (state, metrics)`` over an
iterable of batches. Everything it needs to resume (the state, the data
position, a stateful loader's state) goes into :mod:`purestep.checkpoint`
checkpoints, so a run killed at any moment and restarted with
``resume="latest"`` ends with the state an uninterrupted run would have.
Users with loops of their own call the step and the checkpoint functions
directly (``examples/custom_loop.py``).

Example:
    >>> import torch
    >>> from torch import nn
    >>> import purestep as ps
    >>> from purestep import loop
    >>> net = nn.Linear(2, 1)
    >>> loss = lambda p, b, k: (((ps.call(net, p["m"], b["x"]) - b["y"]) ** 2).mean(), {})
    >>> opt = {"m": ps.optim.sgd(lr=0.1)}
    >>> step = ps.train_step(ps.value_and_grad(loss), opt)
    >>> seen = []
    >>> state = loop.run(step, ps.init_state({"m": net}, opt, seed=0),
    ...                  [{"x": torch.ones(4, 2), "y": torch.zeros(4, 1)}], num_steps=4,
    ...                  log_every=2, sinks=[lambda s, m: seen.append(s)], progress=False)
    >>> seen
    [2, 4]
"""

from purestep.loop._run import LOOP_KEY, BatchKeyError, CollectiveTimeoutError, Preempted, run
from purestep.loop._sinks import (
    CSVSink,
    Image,
    JSONLSink,
    Sink,
    TensorBoardSink,
    read_metrics,
)

__all__ = [
    "LOOP_KEY",
    "BatchKeyError",
    "CSVSink",
    "CollectiveTimeoutError",
    "Image",
    "JSONLSink",
    "Preempted",
    "Sink",
    "TensorBoardSink",
    "read_metrics",
    "run",
]
