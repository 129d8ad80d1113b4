"""purestep: functional, stateless training steps for PyTorch.

A training method is a pure function ``step(state, batch) -> (state, metrics)``
over one explicit :class:`tensordict.TensorDict` state that holds params,
optimizer state, the PRNG key and the step counter.
"""

from purestep import optim, rng, tree

__version__ = "0.1.0"

__all__ = ["__version__", "optim", "rng", "tree"]
