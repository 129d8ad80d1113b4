r"""DiffusionNFT-style online RL for flow models, as pure functions of the state.

One *outer* step (:func:`make_step`) is the composition of four pure pieces:

1. :func:`sample`: ``G`` generations per prompt from the **old** policy, by an
   Euler ODE sampler from per-sample noise (no gradient);
2. a user ``reward_fn(x0, prompts) -> rewards [N]`` (pure) and
   :func:`advantages`, the group-normalised advantages;
3. ``inner_epochs`` epochs of minibatch updates of the **student** on the NFT
   objective (:func:`nft_loss_fn`), each a :func:`purestep.train_step` call
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

import math
from collections.abc import Callable

import attrs
import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from purestep import rng, tree
from purestep.methods import flow
from purestep.optim import Transform
from purestep.state import ParamSource, params_of
from purestep.state import init_state as _init_state
from purestep.step import Batch, LossFn, Step, accumulate, train_step, value_and_grad
from purestep.step._batch import as_batch, batch_size, with_index

__all__ = [
    "NFTConfig",
    "NFTStep",
    "RewardFn",
    "advantages",
    "init_state",
    "make_step",
    "nft_loss_fn",
    "old_update",
    "optimality_weight",
    "ramp_decay",
    "sample",
]

RewardFn = Callable[[torch.Tensor, TensorDictBase], torch.Tensor]
"""``reward_fn(x0 [N, ...], prompts TensorDict [N]) -> rewards [N]``; must be pure."""

DecayLike = float | Callable[[int], float]

ADV_EPS = 1e-4
"""The constant in ``(r - mean) / (std + ADV_EPS)``."""

PERM = int.from_bytes(b"nftperm", "big")
"""Purpose of the per-epoch minibatch permutation: ``fold_in(k_s, PERM, epoch)``."""
INNER_ROOT = -1
"""``fold_in(state["rng"], INNER_ROOT)`` is the root key of the inner updates (no step is -1)."""


# --------------------------------------------------------------------------- config


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"NFTConfig.{attribute.name} must be a finite float > 0, got {value!r}")


def _non_negative(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise ValueError(f"NFTConfig.{attribute.name} must be a finite float >= 0, got {value!r}")


def _keys(_: object, attribute: attrs.Attribute[tuple[str, ...]], value: tuple[str, ...]) -> None:
    for k in value:
        if not isinstance(k, str) or not k or k == "index":
            raise ValueError(
                f"NFTConfig.{attribute.name} must hold non-empty str keys other than 'index', "
                f"got {value!r}"
            )


@attrs.frozen(kw_only=True)
class NFTConfig:
    """Hyperparameters of the NFT objective (the maths is in the module docstring).

    Attributes:
        beta: strength of the implicit policies ``v+- = v_old +- beta (v - v_old)``.
        adv_clip: ``c``: advantages are clipped to ``[-c, c]`` and mapped to
            ``rho in [0, 1]``.
        kl_weight: weight of ``mean_d (v - v_ref)^2``; ``0`` skips the
            reference's forward pass (and the ``kl`` metric).
        timesteps: the training timestep distribution of the forward process.
        weight_eps: lower clip of the adaptive weights ``w+-``.
        cond_keys: prompt entries passed to the model as keyword arguments.
        t_scale: the model receives ``t * t_scale``.

    Example:
        >>> NFTConfig(beta=0.5).adv_clip
        5.0
    """

    beta: float = attrs.field(default=1.0, validator=_positive)
    adv_clip: float = attrs.field(default=5.0, validator=_positive)
    kl_weight: float = attrs.field(default=1e-4, validator=_non_negative)
    timesteps: flow.TimestepDist = attrs.field(
        factory=flow.TimestepDist, validator=attrs.validators.instance_of(flow.TimestepDist)
    )
    weight_eps: float = attrs.field(default=1e-5, validator=_positive)
    cond_keys: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_keys)
    t_scale: float = attrs.field(default=1.0, validator=_positive)


# --------------------------------------------------------------------------- pieces


def advantages(rewards: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    """Group-normalised advantages ``(r - mean) / (std + 1e-4)`` per prompt group.

    ``std`` is the population standard deviation (``ddof = 0``) of the group.

    Args:
        rewards: ``[P, G]`` (row ``p`` is prompt ``p``'s group), or ``[N]`` with
            ``group_size`` (consecutive runs of ``group_size`` form a group).
        group_size: ``G`` for 1-D ``rewards``; must divide ``N``.

    Returns:
        Advantages with ``rewards``' shape and dtype.

    Raises:
        ValueError: a shape that is neither ``[P, G]`` nor ``[N]`` with a
            dividing ``group_size``.

    Example:
        >>> advantages(torch.tensor([[1.0, 3.0], [2.0, 2.0]]))
        tensor([[-0.9999,  0.9999],
                [ 0.0000,  0.0000]])
    """
    if not isinstance(rewards, torch.Tensor) or not rewards.is_floating_point():
        raise TypeError(f"advantages: rewards must be a float tensor, got {rewards!r}")
    if rewards.ndim == 1:
        n = rewards.shape[0]
        if group_size is None or group_size < 1 or n % group_size:
            raise ValueError(
                f"advantages: 1-D rewards of length {n} need a group_size that divides it, "
                f"got group_size={group_size!r}"
            )
        return advantages(rewards.view(n // group_size, group_size)).view(n)
    if rewards.ndim != 2:
        raise ValueError(
            f"advantages: rewards must be [num_prompts, group_size] or [N], got shape "
            f"{tuple(rewards.shape)}"
        )
    if group_size is not None and group_size != rewards.shape[1]:
        raise ValueError(
            f"advantages: group_size={group_size} but rewards has shape {tuple(rewards.shape)}"
        )
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, correction=0, keepdim=True)
    return (rewards - mean) / (std + ADV_EPS)


def optimality_weight(adv: torch.Tensor, adv_clip: float) -> torch.Tensor:
    """``rho = clip(adv, -c, c) / (2c) + 1/2``, in ``[0, 1]``.

    Example:
        >>> optimality_weight(torch.tensor([-10.0, 0.0, 2.5]), 5.0)
        tensor([0.0000, 0.5000, 0.7500])
    """
    return adv.clamp(-adv_clip, adv_clip) / (2.0 * adv_clip) + 0.5


def _prompts(batch: Batch) -> TensorDictBase:
    if isinstance(batch, TensorDictBase) and batch.batch_dims >= 1:
        return with_index(batch)
    return with_index(as_batch(batch))


def _cond(prompts: TensorDictBase, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    missing = [k for k in keys if k not in prompts]
    if missing:
        raise KeyError(
            f"nft: prompts have no conditioning key(s) {missing} "
            f"(prompt keys: {sorted(prompts.keys())})"
        )
    return {k: prompts.get(k) for k in keys}


def sample(
    model: nn.Module,
    params: TensorDictBase,
    prompts: Batch,
    key: torch.Tensor,
    *,
    group_size: int,
    steps: int,
    sample_shape: tuple[int, ...],
    shift: float = 1.0,
    cond_keys: tuple[str, ...] = (),
    t_scale: float = 1.0,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> TensorDict:
    """Generate ``group_size`` samples per prompt with ``params`` (Euler ODE, no gradient).

    Prompt ``p`` (global id ``j = prompts["index"][p]``, default ``p``) gets
    samples ``i = j * group_size + g``; sample ``i`` starts from
    ``rng.normal(key, ..., index=i)``, so a sample does not depend on which other
    prompts share the batch. The model is called as ``model(x_t, t * t_scale,
    **cond)`` with ``t`` of shape ``[N]`` and ``cond`` the prompt entries named in
    ``cond_keys``, repeated per sample.

    Args:
        model: the flow model (``forward(x_t, t, **cond) -> velocity``).
        params: the params to sample with (e.g. ``state["params", "old"]``).
        prompts: a TensorDict ``[P]`` (it may have no entries) or a dict of tensors.
        key: a 0-dim int64 key.
        group_size: ``G`` samples per prompt.
        steps: Euler steps (``flow.timestep_schedule(steps, shift=shift)``).
        sample_shape: shape of one sample (without the batch dim).
        shift: timestep shift of the sampling schedule.
        cond_keys: prompt entries passed to the model.
        t_scale: the model receives ``t * t_scale``.
        dtype: sample dtype (default: the dtype of ``params``' first leaf).
        device: sample device (default: the device of ``params``' first leaf).

    Returns:
        A TensorDict ``[P * G]``, prompt-major, with ``"x0"`` (the samples),
        ``"prompt"`` (every prompt entry but ``"index"``, repeated), ``"group"``
        (prompt position ``p``, int64) and ``"index"`` (sample id ``i``, int64).

    Example:
        >>> class Zero(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = nn.Parameter(torch.zeros(()))
        ...     def forward(self, x, t):
        ...         return x * self.w
        >>> out = sample(Zero(), TensorDict({"w": torch.zeros(())}, []), TensorDict({}, [2]),
        ...              rng.key(0), group_size=3, steps=2, sample_shape=(2,))
        >>> out["x0"].shape, out["group"].tolist()
        (torch.Size([6, 2]), [0, 0, 0, 1, 1, 1])
    """
    if group_size < 1 or steps < 1:
        raise ValueError(f"sample: group_size and steps must be >= 1, got {group_size}, {steps}")
    td = _prompts(prompts)
    p = batch_size(td)
    first = tree.leaves(params)[0]
    dt = first.dtype if dtype is None else dtype
    dev = first.device if device is None else torch.device(device)
    prompt_ids = td.get("index")  # ids and positions on the prompts' device: no host sync
    rank = torch.arange(p * group_size, dtype=torch.int64, device=prompt_ids.device)
    pos = rank.div(group_size, rounding_mode="floor")  # p, repeated group_size times
    ids = prompt_ids[pos] * group_size + rank.remainder_(group_size)
    repeated = td.exclude("index")[pos].to(dev)  # the model's conditions, where it runs
    noise = rng.normal(key, (p * group_size, *sample_shape), dtype=dt, device=dev, index=ids)
    x0 = flow.sample(
        model,
        params,
        noise,
        flow.timestep_schedule(steps, shift=shift),
        cond=_cond(repeated, cond_keys),
        t_scale=t_scale,
    )
    assert isinstance(x0, torch.Tensor)
    return TensorDict(
        {"x0": x0, "prompt": repeated, "group": pos.to(dev), "index": ids.to(dev)},
        batch_size=[p * group_size],
    )


def nft_loss_fn(
    student_model: nn.Module,
    reference_model: nn.Module | None,
    reference_params: TensorDictBase | None,
    config: NFTConfig,
) -> LossFn:
    """Build the NFT loss ``loss_fn(params, batch, key) -> (loss, metrics)`` for inner updates.

    ``params`` holds ``"student"`` (differentiated) and ``"old"`` (no gradient),
    both run through ``student_model``; the frozen reference runs
    ``reference_model`` (default ``student_model``) with ``reference_params``.
    ``batch`` holds ``"x0"`` (rollouts ``[B, ...]``), ``"adv"`` (advantages
    ``[B]``), ``"index"`` (sample ids) and ``"prompt"`` (a TensorDict ``[B]``
    with the ``config.cond_keys``; optional when there are none). Sample ``i``
    draws its timestep from ``fold_in(key, Purpose.TIMESTEP, index[i])`` and its
    forward noise from ``fold_in(key, Purpose.NOISE, index[i])``, so
    accumulation splits see the same draws.

    Metrics: ``policy_loss``, ``rho`` (mean optimality weight) and, when
    ``kl_weight > 0``, ``kl`` (``mean (v - v_ref)^2``).

    Args:
        student_model: the module of the student and old policies.
        reference_model: the reference's module (``None``: ``student_model``).
        reference_params: the frozen reference's params; may be ``None`` when
            ``config.kl_weight == 0``.
        config: :class:`NFTConfig`.

    Example:
        >>> import purestep as ps
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = nn.Linear(2, 1)
        ...     def forward(self, x, t):
        ...         return self.lin(torch.cat([x, t[:, None]], dim=1))
        >>> net = Net()
        >>> p = ps.params_of("student", net)
        >>> loss_fn = nft_loss_fn(net, None, p, NFTConfig())
        >>> batch = TensorDict({"x0": torch.ones(4, 1), "adv": torch.zeros(4),
        ...                     "index": torch.arange(4)}, [4])
        >>> loss, m = loss_fn(TensorDict({"student": p, "old": p}, []), batch, rng.key(0))
        >>> sorted(m)
        ['kl', 'policy_loss', 'rho']
    """
    if not isinstance(config, NFTConfig):
        raise TypeError(f"nft_loss_fn: config must be an NFTConfig, got {type(config).__name__}")
    if reference_params is None and config.kl_weight > 0:
        raise ValueError(
            f"nft_loss_fn: kl_weight={config.kl_weight} needs reference_params "
            "(the frozen reference's params), or set NFTConfig(kl_weight=0)"
        )
    ref_model = student_model if reference_model is None else reference_model
    beta, clip, eps_w, ts = config.beta, config.adv_clip, config.weight_eps, config.t_scale

    def loss_fn(
        params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        for name in ("x0", "adv", "index"):
            if name not in batch:
                raise KeyError(f"nft loss: batch has no {name!r} (keys: {sorted(batch.keys())})")
        x0, adv, index = batch.get("x0"), batch.get("adv"), batch.get("index")
        b = x0.shape[0]
        if adv.shape != (b,):
            raise ValueError(
                f"nft loss: batch['adv'] must have shape ({b},), got {tuple(adv.shape)}"
            )
        prompt = batch.get("prompt") if "prompt" in batch else TensorDict({}, [b])
        cond = _cond(prompt, config.cond_keys)
        t = config.timesteps.sample(
            flow.purpose_key(key, flow.Purpose.TIMESTEP),
            b,
            index=index,
            device=x0.device,
            dtype=x0.dtype,
        )
        eps = flow.noise_like(flow.purpose_key(key, flow.Purpose.NOISE), x0, index)
        x_t = flow.interpolate(x0, eps, t)
        v = flow.predict_velocity(student_model, params.get("student"), x_t, t, cond, t_scale=ts)
        with torch.no_grad():
            v_old = flow.predict_velocity(
                student_model, params.get("old"), x_t, t, cond, t_scale=ts
            )
        v_pos = beta * v + (1.0 - beta) * v_old
        v_neg = (1.0 + beta) * v_old - beta * v
        dims = tuple(range(1, x0.ndim))
        err_pos = flow.x0_from_velocity(x_t, t, v_pos) - x0
        err_neg = flow.x0_from_velocity(x_t, t, v_neg) - x0
        with torch.no_grad():
            w_pos = err_pos.abs().mean(dim=dims).clamp_min(eps_w)
            w_neg = err_neg.abs().mean(dim=dims).clamp_min(eps_w)
        rho = optimality_weight(adv.to(x0.dtype), clip)
        pos = err_pos.square().mean(dim=dims) / w_pos
        neg = err_neg.square().mean(dim=dims) / w_neg
        policy = ((rho * pos + (1.0 - rho) * neg) / beta).mean()
        metrics = {"policy_loss": policy.detach(), "rho": rho.mean().detach()}
        loss = policy
        if config.kl_weight > 0:
            assert reference_params is not None
            with torch.no_grad():
                v_ref = flow.predict_velocity(ref_model, reference_params, x_t, t, cond, t_scale=ts)
            kl = (v - v_ref).square().mean(dim=dims).mean()
            metrics["kl"] = kl.detach()
            loss = loss + config.kl_weight * kl
        return loss, metrics

    return loss_fn


def _decay_value(decay: DecayLike, step: int) -> float:
    value = float(decay(step) if callable(decay) else decay)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"old_update: decay must be in [0, 1], got {value} at step {step}")
    return value


def old_update(state: TensorDictBase, decay: float, *, donate: bool = False) -> TensorDict:
    """Move the old policy towards the student: ``old <- decay * old + (1 - decay) * student``.

    Computed as ``torch.lerp(old, student, 1 - decay)`` leaf by leaf, so
    ``decay = 0`` copies the student and ``decay = 1`` keeps ``old``, exactly.

    Args:
        state: a state with ``params["old"]`` and ``params["student"]`` of one structure.
        decay: in ``[0, 1]``.
        donate: update ``old`` in its own buffers (``state`` is then invalid);
            ``False`` never mutates ``state``.

    Example:
        >>> s = TensorDict({"params": {"student": {"w": torch.ones(2)},
        ...                            "old": {"w": torch.zeros(2)}}}, [])
        >>> old_update(s, 0.75)["params", "old", "w"]
        tensor([0.2500, 0.2500])
    """
    d = float(decay)
    if not 0.0 <= d <= 1.0:
        raise ValueError(f"old_update: decay must be in [0, 1], got {d}")
    for role in ("old", "student"):
        if ("params", role) not in state.keys(include_nested=True):
            raise KeyError(f"old_update: state has no params[{role!r}]")
    old_td = state.get(("params", "old"))
    student_td = state.get(("params", "student"))
    tree.assert_same_structure(student_td, old_td, what="params['old']", like="params['student']")
    old, new = tree.leaves(old_td), tree.leaves(student_td)
    if donate:
        torch._foreach_lerp_([tree.local(o) for o in old], [tree.local(s) for s in new], 1.0 - d)
        return state
    out = state.copy()
    out.set(("params", "old"), tree.rebuild(old_td, torch._foreach_lerp(old, new, 1.0 - d)))
    return out


def ramp_decay(
    *, flat_steps: int = 0, rate: float = 0.001, max_decay: float = 0.5
) -> Callable[[int], float]:
    """DiffusionNFT's old-policy decay: ``min(max(s - flat_steps, 0) * rate, max_decay)``.

    ``0`` (old = student after each outer step) for ``flat_steps`` steps, then a
    linear ramp to ``max_decay``.

    Example:
        >>> d = ramp_decay(flat_steps=2, rate=0.25, max_decay=0.6)
        >>> [d(s) for s in range(6)]
        [0.0, 0.0, 0.0, 0.25, 0.5, 0.6]
    """
    if flat_steps < 0 or rate < 0 or not 0.0 <= max_decay <= 1.0:
        raise ValueError(
            f"ramp_decay: need flat_steps >= 0, rate >= 0, 0 <= max_decay <= 1; got "
            f"flat_steps={flat_steps}, rate={rate}, max_decay={max_decay}"
        )

    def decay(step: int) -> float:
        return min(max(step - flat_steps, 0) * rate, max_decay)

    return decay


# --------------------------------------------------------------------------- state


def init_state(
    student: nn.Module | TensorDictBase | ParamSource,
    optimizer: Transform,
    *,
    seed: int,
) -> TensorDict:
    """The NFT state: ``params["student"]`` (with ``optimizer``), ``params["old"]`` (a copy, no optimizer).

    Also ``extra["inner_step"] = 0``. The old policy is a separate copy of the
    student's params, so donated updates of one never touch the other.

    Example:
        >>> import purestep as ps
        >>> s = init_state(nn.Linear(2, 2), ps.optim.sgd(0.1), seed=0)
        >>> sorted(s["params"].keys()), list(s["opt_state"].keys())
        (['old', 'student'], ['student'])
    """
    student_params = params_of("student", student)
    return _init_state(
        {"student": student_params, "old": tree.clone(student_params)},
        {"student": optimizer},
        seed=seed,
        extra={"inner_step": torch.zeros((), dtype=torch.int64)},
    )


# --------------------------------------------------------------------------- outer step


def _mean_metrics(all_metrics: list[TensorDict]) -> TensorDict:
    """Leafwise mean over the inner updates (the last value for ``lr`` and non-floats)."""
    first = all_metrics[0]
    columns = list(zip(*(tree.leaves(m) for m in all_metrics), strict=True))
    out = []
    for path, col in zip(tree.paths(first), columns, strict=True):
        if path[-1] == "lr" or not col[0].is_floating_point():
            out.append(col[-1])
        else:
            out.append(torch.stack(list(col)).mean(dim=0))
    return tree.rebuild(first, out)


def _check_not_aliased(state: TensorDictBase) -> None:
    """A donated old-policy update must not write into the student's buffers."""
    student = {
        tree.local(t).data_ptr() for t in tree.leaves(state.get(("params", "student"))) if t.numel()
    }
    old = state.get(("params", "old"))
    for path, t in zip(tree.paths(old), tree.leaves(old), strict=True):
        if t.numel() and tree.local(t).data_ptr() in student:
            raise ValueError(
                f"nft: params['old'] at {tree.format_path(path)} shares memory with "
                "params['student']; donated updates would overwrite both. Build the state "
                "with nft.init_state (the old policy is a copy)"
            )


@attrs.frozen
class NFTStep:
    """The outer step built by :func:`make_step` (see there). Immutable; call it.

    ``step(state, prompts)`` is ``old_update(inner_updates(state, rollouts(state,
    prompts)))`` plus ``step += 1``; each piece is a pure function of its inputs
    (with ``donate=True``, :meth:`inner_updates` and the old-policy update reuse
    the state's buffers).
    """

    model: nn.Module
    reward_fn: RewardFn
    inner: Step
    config: NFTConfig
    group_size: int
    sample_steps: int
    sample_shape: tuple[int, ...]
    sample_shift: float
    inner_epochs: int
    minibatch_size: int | None
    decay: DecayLike
    donate: bool

    def map_inner(self, fn: Callable[[Step], Step]) -> NFTStep:
        """This step with its inner train step replaced by ``fn(inner)`` (``purestep.compile`` uses it).

        Example:
            >>> import purestep as ps
            >>> from torch import nn
            >>> s = make_step(nn.Linear(1, 1), lambda x, c: x[:, 0], ps.optim.sgd(0.1),
            ...               reference_params=None, sample_shape=(1,), config=NFTConfig(kl_weight=0.0))
            >>> s.map_inner(lambda inner: inner).inner is s.inner
            True
        """
        return attrs.evolve(self, inner=fn(self.inner))

    def prepare(self, state: TensorDictBase) -> TensorDict:
        """Check the roles and add ``extra["inner_step"] = 0`` when missing."""
        for role in ("student", "old"):
            if role not in state.get("params"):
                raise KeyError(f"nft: state has no params[{role!r}]; build it with nft.init_state")
        state = self.inner.prepare(state)
        if self.donate:
            _check_not_aliased(state)
        if ("extra", "inner_step") in state.keys(include_nested=True):
            return state
        out = state.copy()
        out.set(("extra", "inner_step"), torch.zeros((), dtype=torch.int64))
        return out

    def rollouts(self, state: TensorDictBase, prompts: Batch) -> tuple[TensorDict, TensorDict]:
        """Sample with ``params["old"]``, score, add advantages: ``(rollouts, metrics)``.

        The rollouts (:func:`sample`) gain ``"reward"`` and ``"adv"``. The noise
        key is ``fold_in(fold_in(state["rng"], state["step"]), Purpose.ROLLOUT_NOISE)``.
        Metrics: ``reward`` (mean) and ``reward_std``.
        """
        key = rng.fold_in(state.get("rng"), state.get("step"))
        ro = sample(
            self.model,
            state.get(("params", "old")),
            prompts,
            flow.purpose_key(key, flow.Purpose.ROLLOUT_NOISE),
            group_size=self.group_size,
            steps=self.sample_steps,
            sample_shape=self.sample_shape,
            shift=self.sample_shift,
            cond_keys=self.config.cond_keys,
            t_scale=self.config.t_scale,
        )
        n = batch_size(ro)
        with torch.no_grad():
            rewards = self.reward_fn(ro.get("x0"), ro.get("prompt"))
        if not isinstance(rewards, torch.Tensor) or rewards.shape != (n,):
            got = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards)
            raise ValueError(f"nft: reward_fn must return a tensor of shape ({n},), got {got}")
        rewards = rewards.detach().to(ro.get("x0").dtype)
        ro.set("reward", rewards)
        ro.set("adv", advantages(rewards, self.group_size))
        metrics = TensorDict(
            {"reward": rewards.mean(), "reward_std": rewards.std(correction=0)}, batch_size=[]
        )
        return ro, metrics

    def inner_updates(
        self, state: TensorDictBase, rollouts: TensorDictBase
    ) -> tuple[TensorDict, TensorDict]:
        """``inner_epochs`` epochs of minibatch updates of the student on ``rollouts``.

        Epoch ``e`` visits the rollouts in the order ``rng.randperm(fold_in(k_s,
        PERM, e), N)``. The updates run on a view of the state whose ``step`` is
        ``extra["inner_step"]`` and whose ``rng`` is ``fold_in(rng, INNER_ROOT)``.
        Returns the state with new student params, optimizer state and
        ``inner_step`` (``step`` and ``old`` unchanged) and the inner metrics
        averaged over the updates.
        """
        n = batch_size(rollouts)
        mb = n if self.minibatch_size is None else self.minibatch_size
        if n % mb:
            raise ValueError(
                f"nft: {n} rollouts (prompts x group_size={self.group_size}) are not divisible "
                f"by minibatch_size={mb}"
            )
        data = rollouts.select("x0", "adv", "index", "prompt", strict=False)
        view: TensorDictBase = TensorDict(
            {
                "params": state.get("params"),
                "opt_state": state.get("opt_state"),
                "rng": rng.fold_in(state.get("rng"), INNER_ROOT),
                "step": state.get(("extra", "inner_step")),
            },
            batch_size=[],
        )
        perm_key = rng.fold_in(state.get("rng"), state.get("step"), PERM)
        metrics: list[TensorDict] = []
        data_device = data.get("x0").device  # the order is drawn where the rollouts are
        for epoch in range(self.inner_epochs):
            perm = rng.randperm(rng.fold_in(perm_key, epoch), n, device=data_device)
            for start in range(0, n, mb):
                view, m = self.inner(view, data[perm[start : start + mb]])
                metrics.append(m)
        out = state if self.donate else state.copy()
        out.set("params", view.get("params"))
        out.set("opt_state", view.get("opt_state"))
        out.set(("extra", "inner_step"), view.get("step"))
        return out, _mean_metrics(metrics)

    def __call__(self, state: TensorDictBase, batch: Batch) -> tuple[TensorDict, TensorDict]:
        state = self.prepare(state)
        step = int(state.get("step"))
        decay = _decay_value(self.decay, step)
        ro, metrics = self.rollouts(state, batch)
        out, inner_metrics = self.inner_updates(state, ro)
        out = old_update(out, decay, donate=self.donate)
        if self.donate:
            out.get("step").add_(1)
        else:
            out.set("step", state.get("step") + 1)
        metrics.update(inner_metrics)
        metrics.set("old_decay", torch.tensor(decay, dtype=torch.float64))
        return out, metrics


def make_step(
    model: nn.Module,
    reward_fn: RewardFn,
    optimizer: Transform,
    *,
    reference_params: TensorDictBase | None,
    sample_shape: tuple[int, ...],
    reference_model: nn.Module | None = None,
    config: NFTConfig | None = None,
    group_size: int = 8,
    sample_steps: int = 10,
    sample_shift: float = 1.0,
    inner_epochs: int = 1,
    minibatch_size: int | None = None,
    accumulate_steps: int = 1,
    decay: DecayLike = 0.0,
    donate: bool = False,
) -> NFTStep:
    """Build the outer NFT step ``step(state, prompts) -> (state, metrics)``.

    Each call (outer step ``s = state["step"]``): samples ``group_size``
    rollouts per prompt with ``params["old"]`` (:func:`sample`), scores them with
    ``reward_fn(x0, cond)`` (pure, ``[N]`` rewards), computes
    :func:`advantages`, runs ``inner_epochs`` epochs over a fresh
    ``rng.randperm`` of the ``N`` rollouts in minibatches of
    ``minibatch_size``, each one ``train_step(accumulate(value_and_grad(
    nft_loss_fn(...)), accumulate_steps), {"student": optimizer})`` update, then
    applies :func:`old_update` with ``decay(s)`` and increments ``step``. Keys
    and counters: see the module docstring.

    Metrics: ``reward`` (mean), ``reward_std``, ``old_decay``, and the means over
    the inner updates of ``loss``, ``policy_loss``, ``kl``, ``rho`` and
    ``("student", "grad_norm")``; ``("student", "lr")`` of the last update.

    Args:
        model: the flow model of student and old (``forward(x_t, t, **cond)``).
        reward_fn: ``reward_fn(x0 [N, ...], cond TensorDict [N]) -> [N]``.
        optimizer: the student's optimizer.
        reference_params: frozen params of the KL reference (``None``: no KL term;
            then ``config.kl_weight`` must be 0).
        sample_shape: shape of one sample.
        reference_model: the reference's module (default ``model``).
        config: :class:`NFTConfig` (default ``NFTConfig()``).
        group_size: rollouts per prompt ``G``.
        sample_steps: Euler steps of the rollout sampler.
        sample_shift: timestep shift of the rollout sampler.
        inner_epochs: passes over the rollouts per outer step.
        minibatch_size: rollouts per inner update (default all ``N``); must divide ``N``.
        accumulate_steps: microbatches per inner update (:func:`purestep.accumulate`).
        decay: the old-policy decay, a float or ``decay(outer_step) -> float``
            (e.g. :func:`ramp_decay`).
        donate: reuse the input state's buffers (it is then invalid). ``False``
            never mutates an input; both give equal results.

    Example:
        >>> import purestep as ps
        >>> from torch import nn
        >>> step = make_step(nn.Linear(1, 1), lambda x, c: x[:, 0], ps.optim.sgd(0.1),
        ...                  reference_params=None, sample_shape=(1,),
        ...                  config=NFTConfig(kl_weight=0.0))
        >>> step.group_size
        8
    """
    cfg = NFTConfig() if config is None else config
    for name, value in (
        ("group_size", group_size),
        ("sample_steps", sample_steps),
        ("inner_epochs", inner_epochs),
        ("accumulate_steps", accumulate_steps),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"nft.make_step: {name} must be a positive int, got {value!r}")
    if minibatch_size is not None and (not isinstance(minibatch_size, int) or minibatch_size < 1):
        raise ValueError(
            f"nft.make_step: minibatch_size must be a positive int, got {minibatch_size!r}"
        )
    if not callable(decay):
        _decay_value(decay, 0)
    loss = nft_loss_fn(model, reference_model, reference_params, cfg)
    inner = train_step(
        accumulate(value_and_grad(loss), accumulate_steps), {"student": optimizer}, donate=donate
    )
    return NFTStep(
        model=model,
        reward_fn=reward_fn,
        inner=inner,
        config=cfg,
        group_size=group_size,
        sample_steps=sample_steps,
        sample_shape=tuple(sample_shape),
        sample_shift=float(sample_shift),
        inner_epochs=inner_epochs,
        minibatch_size=minibatch_size,
        decay=decay,
        donate=donate,
    )
