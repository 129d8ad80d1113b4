"""Running steps for the checks: prepare, run over batches, note global-RNG draws."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tensordict import TensorDictBase

from purestep.step import Batch, as_batch
from purestep.testing._compare import snapshot
from purestep.testing._global_rng import RngWatch

__all__ = ["StepFn", "explain", "prepare", "run_steps", "run_watched"]

StepFn = Callable[[TensorDictBase, Batch], tuple[TensorDictBase, TensorDictBase]]


def prepare(step: StepFn, state: TensorDictBase) -> TensorDictBase:
    """``step.prepare(state)`` for steps built by purestep (they add the keys they keep), else ``state``."""
    prep = getattr(step, "prepare", None)
    return prep(state) if prep is not None else state


def run_steps(
    step: StepFn, state: TensorDictBase, batches: Sequence[Batch]
) -> tuple[TensorDictBase, list[TensorDictBase]]:
    """Run ``step`` over ``batches`` from ``state``; returns the final state and all metrics.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> step = lambda s, b: (s, TensorDict({}, []))
        >>> final, ms = run_steps(step, TensorDict({"x": torch.ones(1)}, []), [{}, {}])
        >>> len(ms)
        2
    """
    metrics = []
    for b in batches:
        state, m = step(state, b)
        metrics.append(m)
    return state, metrics


def run_watched(
    step: StepFn,
    state: TensorDictBase,
    batches: Sequence[Batch],
    watch: RngWatch,
    label: str,
    first: int = 0,
) -> tuple[TensorDictBase, list[TensorDictBase]]:
    """:func:`run_steps` on snapshots of the batches, noting global-RNG draws in ``watch``."""
    metrics = []
    for i, b in enumerate(batches):
        batch = snapshot(as_batch(b))
        state, m = watch.call(f"step {first + i} of {label}", step, state, batch)
        metrics.append(m)
    return state, metrics


def explain(error: AssertionError, watch: RngWatch) -> AssertionError:
    """``error`` with the global-RNG hint after its first line (when the watch saw a draw)."""
    hint = watch.hint()
    if not hint:
        return error
    first, nl, rest = str(error).partition("\n")
    return AssertionError(f"{first}{hint}{nl}{rest}")
