"""The DiffusionNFT outer step: rollouts, inner updates, old-policy averaging (see :mod:`.nft`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import attrs
import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from purestep import _compat as _ops  # attrs 26.1's __repr__ reads a global _compat
from purestep import rng, tree
from purestep._keys import EXTRA, OPT_STATE, PARAMS, RNG, STEP
from purestep.methods import flow
from purestep.methods._nft_advantages import advantages
from purestep.methods._nft_objective import NFTConfig, loss_fn
from purestep.methods._nft_rollouts import RewardFn, sample
from purestep.optim import Transform
from purestep.state import ParamSource, params_of
from purestep.state import init_state as _init_state
from purestep.step import Batch, Step, train_step, value_and_grad
from purestep.step import accumulate as _accumulate

__all__ = [
    "INNER_ROOT",
    "PERM",
    "DecayLike",
    "NFTStep",
    "init_state",
    "make_step",
    "old_update",
    "ramp_decay",
]

DecayLike = float | Callable[[int], float]

PERM = int.from_bytes(b"nftperm", "big")
"""Purpose of the per-epoch minibatch permutation: ``fold_in(k_s, PERM, epoch)``."""
INNER_ROOT = -1
"""``fold_in(state["rng"], INNER_ROOT)`` is the root key of the inner updates (no step is -1)."""
INNER_STEP = "inner_step"
"""``state["extra", INNER_STEP]``: the inner updates taken so far (DiffusionNFT's own key)."""


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
        if (PARAMS, role) not in state.keys(include_nested=True):
            raise KeyError(f"old_update: state has no params[{role!r}]")
    old_td = state.get((PARAMS, "old"))
    student_td = state.get((PARAMS, "student"))
    tree.assert_same_structure(student_td, old_td, what="params['old']", like="params['student']")
    old, new = tree.leaves(old_td), tree.leaves(student_td)
    if donate:
        _ops.foreach_lerp_([tree.local(o) for o in old], [tree.local(s) for s in new], 1.0 - d)
        return state
    out = state.copy()
    out.set((PARAMS, "old"), tree.rebuild(old_td, _ops.foreach_lerp(old, new, 1.0 - d)))
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
        extra={INNER_STEP: torch.zeros((), dtype=torch.int64)},
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
        tree.local(t).data_ptr() for t in tree.leaves(state.get((PARAMS, "student"))) if t.numel()
    }
    old = state.get((PARAMS, "old"))
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
            if role not in state.get(PARAMS):
                raise KeyError(f"nft: state has no params[{role!r}]; build it with nft.init_state")
        state = self.inner.prepare(state)
        if self.donate:
            _check_not_aliased(state)
        if (EXTRA, INNER_STEP) in state.keys(include_nested=True):
            return state
        out = state.copy()
        out.set((EXTRA, INNER_STEP), torch.zeros((), dtype=torch.int64))
        return out

    def rollouts(self, state: TensorDictBase, prompts: Batch) -> tuple[TensorDict, TensorDict]:
        """Sample with ``params["old"]``, score, add advantages: ``(rollouts, metrics)``.

        The rollouts (:func:`sample`) gain ``"reward"`` and ``"adv"``. The noise
        key is ``fold_in(fold_in(state["rng"], state["step"]), Purpose.ROLLOUT_NOISE)``.
        Metrics: ``("rollout", "reward")`` (mean) and ``("rollout", "reward_std")``.
        """
        key = rng.fold_in(state.get(RNG), state.get(STEP))
        ro = sample(
            self.model,
            state.get((PARAMS, "old")),
            prompts,
            flow.purpose_key(key, flow.Purpose.ROLLOUT_NOISE),
            group_size=self.group_size,
            steps=self.sample_steps,
            sample_shape=self.sample_shape,
            shift=self.sample_shift,
            cond_keys=self.config.cond_keys,
            t_scale=self.config.t_scale,
        )
        n = int(ro.batch_size[0])
        with torch.no_grad():
            rewards = self.reward_fn(ro.get("x0"), ro.get("prompt"))
        if not isinstance(rewards, torch.Tensor) or rewards.shape != (n,):
            got = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards)
            raise ValueError(f"nft: reward_fn must return a tensor of shape ({n},), got {got}")
        rewards = rewards.detach().to(ro.get("x0").dtype)
        ro.set("reward", rewards)
        ro.set("adv", advantages(rewards, self.group_size))
        metrics = TensorDict(
            {"rollout": {"reward": rewards.mean(), "reward_std": rewards.std(correction=0)}},
            batch_size=[],
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
        n = int(rollouts.batch_size[0])
        mb = n if self.minibatch_size is None else self.minibatch_size
        if n % mb:
            raise ValueError(
                f"nft: {n} rollouts (prompts x group_size={self.group_size}) are not divisible "
                f"by minibatch_size={mb}"
            )
        data = rollouts.select("x0", "adv", "index", "prompt", strict=False)
        view: TensorDictBase = TensorDict(
            {
                PARAMS: state.get(PARAMS),
                OPT_STATE: state.get(OPT_STATE),
                RNG: rng.fold_in(state.get(RNG), INNER_ROOT),
                STEP: state.get((EXTRA, INNER_STEP)),
            },
            batch_size=[],
        )
        perm_key = rng.fold_in(state.get(RNG), state.get(STEP), PERM)
        metrics: list[TensorDict] = []
        data_device = data.get("x0").device  # the order is drawn where the rollouts are
        for epoch in range(self.inner_epochs):
            perm = rng.randperm(rng.fold_in(perm_key, epoch), n, device=data_device)
            for start in range(0, n, mb):
                view, m = self.inner(view, data[perm[start : start + mb]])
                metrics.append(m)
        out = state if self.donate else state.copy()
        out.set(PARAMS, view.get(PARAMS))
        out.set(OPT_STATE, view.get(OPT_STATE))
        out.set((EXTRA, INNER_STEP), view.get(STEP))
        return out, _mean_metrics(metrics)

    def __call__(self, state: TensorDictBase, batch: Batch) -> tuple[TensorDict, TensorDict]:
        state = self.prepare(state)
        step = int(state.get(STEP))
        decay = _decay_value(self.decay, step)
        ro, metrics = self.rollouts(state, batch)
        out, inner_metrics = self.inner_updates(state, ro)
        out = old_update(out, decay, donate=self.donate)
        if self.donate:
            out.get(STEP).add_(1)
        else:
            out.set(STEP, state.get(STEP) + 1)
        metrics.update(inner_metrics)
        metrics.set(("old", "decay"), torch.tensor(decay, dtype=torch.float64))
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
    accumulate: int = 1,
    decay: DecayLike = 0.0,
    donate: bool = False,
    accumulate_steps: int | None = None,
) -> NFTStep:
    """Build the outer NFT step ``step(state, prompts) -> (state, metrics)``.

    Each call (outer step ``s = state["step"]``): samples ``group_size``
    rollouts per prompt with ``params["old"]`` (:func:`sample`), scores them with
    ``reward_fn(x0, cond)`` (pure, ``[N]`` rewards), computes
    :func:`advantages`, runs ``inner_epochs`` epochs over a fresh
    ``rng.randperm`` of the ``N`` rollouts in minibatches of
    ``minibatch_size``, each one ``train_step(accumulate(value_and_grad(
    loss_fn(...)), accumulate), {"student": optimizer})`` update, then
    applies :func:`old_update` with ``decay(s)`` and increments ``step``. Keys
    and counters: see the module docstring.

    Metrics: ``("rollout", "reward")`` (mean), ``("rollout", "reward_std")``,
    ``("old", "decay")``, and the means over the inner updates of ``loss`` and
    ``("student", name)`` for ``policy_loss``, ``kl``, ``rho`` and
    ``grad_norm``; ``("student", "lr")`` of the last update.

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
        accumulate: microbatches per inner update (:func:`purestep.accumulate`).
        decay: the old-policy decay, a float or ``decay(outer_step) -> float``
            (e.g. :func:`ramp_decay`).
        donate: reuse the input state's buffers (it is then invalid). ``False``
            never mutates an input; both give equal results.
        accumulate_steps: deprecated name of ``accumulate`` (a ``DeprecationWarning``).

    Example:
        >>> import purestep as ps
        >>> from torch import nn
        >>> step = make_step(nn.Linear(1, 1), lambda x, c: x[:, 0], ps.optim.sgd(0.1),
        ...                  reference_params=None, sample_shape=(1,),
        ...                  config=NFTConfig(kl_weight=0.0))
        >>> step.group_size
        8
    """
    if accumulate_steps is not None:
        warnings.warn(
            "nft.make_step(accumulate_steps=...) is deprecated; use accumulate= (as the other "
            "methods' make_step)",
            DeprecationWarning,
            stacklevel=2,
        )
        accumulate = accumulate_steps
    cfg = NFTConfig() if config is None else config
    for name, value in (
        ("group_size", group_size),
        ("sample_steps", sample_steps),
        ("inner_epochs", inner_epochs),
        ("accumulate", accumulate),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"nft.make_step: {name} must be a positive int, got {value!r}")
    if minibatch_size is not None and (not isinstance(minibatch_size, int) or minibatch_size < 1):
        raise ValueError(
            f"nft.make_step: minibatch_size must be a positive int, got {minibatch_size!r}"
        )
    if not callable(decay):
        _decay_value(decay, 0)
    loss = loss_fn(model, reference_model, reference_params, cfg)
    inner = train_step(
        _accumulate(value_and_grad(loss), accumulate), {"student": optimizer}, donate=donate
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
