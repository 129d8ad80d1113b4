"""Training methods as loss functions plus step builders over the explicit state.

* :mod:`~purestep.methods.flow`: rectified-flow maths shared by all methods
  (interpolation, targets, timesteps, Euler sampler, classifier-free guidance).
* :mod:`~purestep.methods.finetune`: supervised flow matching.
* :mod:`~purestep.methods.dmd2`: distribution-matching distillation (student,
  frozen teacher, critic).
* :mod:`~purestep.methods.kd`: trajectory distillation from a teacher's cached
  ODE trajectories.
* :mod:`~purestep.methods.nft`: DiffusionNFT-style RL (rollouts with the old
  policy, group advantages, inner updates, old-policy averaging).

Example:
    >>> from purestep.methods import finetune, flow
    >>> flow.timestep_schedule(2).tolist()
    [1.0, 0.5, 0.0]
"""

from purestep.methods import dmd2, finetune, flow, kd, nft

__all__ = ["dmd2", "finetune", "flow", "kd", "nft"]
