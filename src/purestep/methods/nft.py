r"""DiffusionNFT-style online RL for flow models, as pure functions of the state.

One *outer* step (:func:`make_step`) is the composition of four pure pieces:

1. :func:`sample`: ``G`` generations per prompt from the **old** policy, by an
   Euler ODE sampler from per-sample noise (no gradient);
2. a user ``reward_fn(x0, prompts) -> rewards [N]`` (pure) and
   :func:`advantages`, the group-normalised advantages;
3. ``inner_epochs`` epochs of minibatch updates of the **student** on the NFT
   objective (:func:`loss_fn`), each a :func:`purestep.train_step` call
   over :func:`purestep.accumulate` (so it has its own gradient accumulation);
4. :func:`old_update`: the old policy moves towards the student with a decay
   that may follow a schedule of the outer step (:func:`ramp_decay`).

Roles and state
---------------
* ``state["params", "student"]``: trained, with an optimizer in
  ``state["opt_state", "student"]``.
* ``state["params", "old"]``: the sampling policy. It is state (it changes)
  but has **no optimizer**: :func:`purestep.train_step` only updates roles in
  its ``optimizers``, and :func:`purestep.value_and_grad` passes it to the
  loss detached. It lives under ``params`` (not ``extra``) so the loss
  function receives it with the student, and checkpoints treat it as weights.
* ``state["extra", "inner_step"]``: the number of inner updates taken so far.
* the **reference** policy of the KL term is frozen: its params are captured
  by the loss closure and are not state.

Step counters and keys
----------------------
``state["step"]`` counts outer steps; outer step ``s`` uses the key
``k_s = fold_in(state["rng"], s)``: rollout noise from ``fold_in(k_s,
Purpose.ROLLOUT_NOISE)`` (row ``i`` from sample id ``index[i]``), the
epoch-``e`` minibatch permutation from ``fold_in(k_s, PERM, e)``. The inner
train steps run on a *view* of the state whose ``"step"`` is
``state["extra", "inner_step"]`` and whose ``"rng"`` is ``fold_in(state["rng"],
INNER_ROOT)`` with ``INNER_ROOT = -1`` (no outer step is ``-1``, so inner keys
never coincide with outer ones). Inner update ``u`` (counted over the whole
run) therefore gets the key ``fold_in(fold_in(rng, -1), u)``, distinct per
update, and the student's optimizer ``count`` (so its learning-rate schedule)
advances once per inner update. Within it sample ``i`` draws ``t`` and the
forward noise from ``fold_in(key, Purpose.TIMESTEP | Purpose.NOISE, index[i])``.
After an outer step, ``step`` has grown by one and ``inner_step`` by
``inner_epochs * N / minibatch_size``.

The maths (``t = 0`` data, ``t = 1`` noise, :mod:`purestep.methods.flow`)
------------------------------------------------------------------------
Rollouts. For prompt ``p`` with global id ``j_p`` and ``g < G`` the sample id is
``i = j_p G + g``; ``x0_i`` is the Euler solution of ``dx/dt = v_old(x, t)``
from ``x_1 = eps_i`` (per-sample noise) to ``t = 0``.

Advantages. Per prompt group, ``A_i = (r_i - mean_g r) / (std_g r + 1e-4)``
with the population standard deviation (``ddof = 0``), as in DiffusionNFT /
Flow-GRPO.

Optimality weight. ``rho_i = clip(A_i, -c, c) / (2c) + 1/2`` in ``[0, 1]``
(``c = adv_clip``): ``1`` for the best samples, ``0`` for the worst, ``1/2`` for
``A = 0``.

NFT objective. Each inner minibatch draws a fresh forward-process point per
sample, ``t_i`` (``config.timesteps``) and ``eps'_i``, with
``x_t = (1 - t) x0 + t eps'``. With ``v = v_theta(x_t, t)`` (student, with
gradient), ``v_o = v_old(x_t, t)`` and ``v_r = v_ref(x_t, t)`` (no gradient)::

    v+ = beta v + (1 - beta) v_o          # implicit positive policy
    v- = (1 + beta) v_o - beta v          # implicit negative policy
    e+ = (x_t - t v+) - x0,  e- = (x_t - t v-) - x0     # x0-prediction errors
    w+ = max(mean_d |e+|, eps_w),  w- = max(mean_d |e-|, eps_w)   # detached
    L_i = (rho mean_d(e+^2) / w+ + (1 - rho) mean_d(e-^2) / w-) / beta
          + kl_weight * mean_d (v - v_r)^2
    loss = mean_i L_i

(``mean_d`` averages over the non-batch dims.) Dividing each squared x0 error
by its own detached mean absolute error is DiffusionNFT's adaptive weighting;
dividing by ``beta`` keeps the gradient scale independent of ``beta`` (below).

Gradient at the old policy. Let ``theta = theta_old``, so ``v = v_o`` in value
and ``v+ = v- = v_o``, ``e+ = e- = e``, ``w+ = w- = w``. Since
``d v+/d v = beta`` and ``d v-/d v = -beta``, and ``d e/d v' = -t``::

    d L_i / d v = (rho (2 e / w)(-t) beta + (1 - rho)(2 e / w)(-t)(-beta)) / (beta D)
                = (2 rho - 1) * d/dv [ mean_d (x_t - t v - x0)^2 / w ]

so the policy gradient equals ``(2 rho - 1)`` times the gradient of the
adaptively weighted flow-matching loss on the same ``x_t`` (the
``kl_weight`` term adds ``2 kl_weight (v - v_r) / D``): samples with ``A > 0``
are fitted, samples with ``A < 0`` are pushed away, ``A = 0`` contributes
nothing. ``tests/test_nft.py`` checks this identity.

Old policy. After the inner epochs of outer step ``s``:
``old <- decay(s) * old + (1 - decay(s)) * student`` (``torch.lerp(old,
student, 1 - decay)``). ``decay = 0`` makes the next rollouts on-policy;
:func:`ramp_decay` is DiffusionNFT's ``min(max(s - flat, 0) * rate, max)``.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from tensordict import TensorDict
    >>> import purestep as ps
    >>> from purestep.methods import nft
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.lin = nn.Linear(2, 1)
    ...     def forward(self, x, t):
    ...         return self.lin(torch.cat([x, t[:, None]], dim=1))
    >>> net = Net()
    >>> ref = ps.params_of("reference", net)
    >>> step = nft.make_step(net, lambda x, c: x[:, 0], ps.optim.adamw(1e-2),
    ...                      reference_params=ref, sample_shape=(1,), group_size=4,
    ...                      sample_steps=2, minibatch_size=4)
    >>> state = step.prepare(nft.init_state(net, ps.optim.adamw(1e-2), seed=0))
    >>> state, metrics = step(state, TensorDict({}, [2]))
    >>> int(state["step"]), int(state["extra", "inner_step"])
    (1, 2)
"""

from __future__ import annotations

import warnings
from typing import Any

from purestep.methods._nft_advantages import ADV_EPS, advantages, optimality_weight
from purestep.methods._nft_objective import NFTConfig, loss_fn
from purestep.methods._nft_rollouts import RewardFn, sample
from purestep.methods._nft_step import (
    INNER_ROOT,
    PERM,
    NFTStep,
    init_state,
    make_step,
    old_update,
    ramp_decay,
)
from purestep.step import LossFn

__all__ = [
    "ADV_EPS",
    "INNER_ROOT",
    "PERM",
    "NFTConfig",
    "NFTStep",
    "RewardFn",
    "advantages",
    "init_state",
    "loss_fn",
    "make_step",
    "nft_loss_fn",
    "old_update",
    "optimality_weight",
    "ramp_decay",
    "sample",
]


def nft_loss_fn(*args: Any, **kwargs: Any) -> LossFn:
    """Deprecated name of :func:`loss_fn` (every method calls its loss builder ``loss_fn``).

    Example:
        >>> import warnings
        >>> from torch import nn
        >>> with warnings.catch_warnings(record=True) as w:
        ...     warnings.simplefilter("always")
        ...     f = nft_loss_fn(nn.Linear(2, 2), None, None, NFTConfig(kl_weight=0.0))
        >>> w[0].category.__name__
        'DeprecationWarning'
    """
    warnings.warn(
        "purestep.methods.nft.nft_loss_fn is deprecated; use nft.loss_fn (same arguments)",
        DeprecationWarning,
        stacklevel=2,
    )
    return loss_fn(*args, **kwargs)
