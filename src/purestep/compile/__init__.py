"""The whole training step as one compiled graph: :func:`compile`.

Example:
    >>> import torch
    >>> from torch import nn
    >>> import purestep as ps
    >>> net = nn.Linear(2, 1)
    >>> loss = lambda p, b, k: (((ps.call(net, p["m"], b["x"]) - b["y"]) ** 2).mean(), {})
    >>> opt = {"m": ps.optim.sgd(lr=0.1)}
    >>> step = ps.compile(ps.train_step(ps.value_and_grad(loss), opt), backend="eager")
    >>> state = ps.init_state({"m": net}, opt, seed=0)
    >>> state, _ = step(state, {"x": torch.ones(2, 2), "y": torch.zeros(2, 1)})
"""

from purestep.compile._step import CompiledStep, CompileStats, compile
from purestep.compile._trace import TraceError

__all__ = ["CompileStats", "CompiledStep", "TraceError", "compile"]
