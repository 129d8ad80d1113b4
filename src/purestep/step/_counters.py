"""The state's counters: ``STEP``, advanced by every step, and ``skip_nonfinite``'s ``SKIP``.

A train step with ``skip_nonfinite``, the :class:`~purestep.SkipNonFinite`
wrapper and a compiled step share these: :func:`skip_update` is the one ending
of a skipped step (only ``step`` and the skip counters move), :func:`set_skip`
writes the counters after a good step, :func:`add_skip_counters` adds them in
``prepare``.

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> s = add_skip_counters(TensorDict({"step": torch.tensor(0)}, []))
    >>> int(s["skip", "total"]), int(s["skip", "consecutive"])
    (0, 0)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
from tensordict import TensorDict, TensorDictBase

from purestep import tree
from purestep._keys import SKIP, SKIP_CONSECUTIVE, SKIP_TOTAL, STEP
from purestep.errors import NonFiniteError, StateError

__all__ = ["add_skip_counters", "all_finite", "next_step", "set_skip", "skip_update"]


def next_step(state: TensorDictBase, out: TensorDictBase, donate: bool) -> None:
    """Set ``out[STEP]`` to ``state[STEP] + 1`` (in place when ``donate``).

    Example:
        >>> s = TensorDict({"step": torch.tensor(4)}, [])
        >>> out = s.copy()
        >>> next_step(s, out, donate=False)
        >>> int(out["step"]), int(s["step"])
        (5, 4)
    """
    if donate:
        out.get(STEP).add_(1)
    else:
        out.set(STEP, state.get(STEP) + 1)


def _check_skip(skip: object) -> None:
    if not isinstance(skip, TensorDictBase):
        raise StateError(
            f"skip_nonfinite: state['skip'] is a {type(skip).__name__}; it keeps a "
            "tree {'total', 'consecutive'} there (drop it and call step.prepare to rebuild)",
            path=(SKIP,),
        )
    for key in (SKIP_TOTAL, SKIP_CONSECUTIVE):
        t = skip.get(key) if key in skip.keys() else None
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.ndim == 0):
            raise StateError(
                f"skip_nonfinite: state['skip', {key!r}] must be an int64 0-dim tensor (a count of "
                "skipped steps); drop state['skip'] and call step.prepare to rebuild it",
                path=(SKIP, key),
            )


def all_finite(metrics: TensorDictBase, norms: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A CPU bool: every grad norm and every floating ``loss`` metric is finite.

    Example:
        >>> m = TensorDict({"student": {"loss": torch.tensor(float("nan"))}}, [])
        >>> bool(all_finite(m, {"student": torch.tensor(1.0)}))
        False
    """
    checks = [torch.isfinite(n).all() for n in norms.values()]
    for path, leaf in zip(tree.paths(metrics), tree.leaves(metrics), strict=True):
        if path[-1] == "loss" and leaf.is_floating_point():
            checks.append(
                torch.isfinite(leaf).all().to(checks[0].device if checks else leaf.device)
            )
    if not checks:
        return torch.ones((), dtype=torch.bool)
    return torch.stack([c.cpu() for c in checks]).all()


def skip_update(
    state: TensorDictBase,
    metrics: TensorDict,
    *,
    donate: bool,
    max_consecutive: int | None,
) -> tuple[TensorDict, TensorDict]:
    """The result of a step whose update is discarded: only ``step`` and the skip counters move.

    The shared ending of every ``skip_nonfinite`` path (a train step's, a wrapper's, a
    compiled step's): counts the skip, raises :class:`NonFiniteError` past
    ``max_consecutive`` consecutive skips, and sets the ``skipped`` metric.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> s = add_skip_counters(TensorDict({"step": torch.tensor(4)}, []))
        >>> out, m = skip_update(s, TensorDict({}, []), donate=False, max_consecutive=None)
        >>> int(out["step"]), int(out["skip", "total"]), bool(m["skipped"])
        (5, 1, True)
    """
    consecutive = int(state.get((SKIP, SKIP_CONSECUTIVE))) + 1
    if max_consecutive is not None and consecutive > max_consecutive:
        raise NonFiniteError(
            f"{consecutive} consecutive steps with a non-finite loss or gradient "
            f"(max_consecutive={max_consecutive}), last at step {int(state.get(STEP))}"
        )
    out = cast(TensorDict, state) if donate else state.copy()
    next_step(state, out, donate)
    set_skip(out, state, consecutive=consecutive, total_inc=1, donate=donate)
    metrics.set("skipped", torch.ones((), dtype=torch.bool))
    return out, metrics


def add_skip_counters(state: TensorDictBase) -> TensorDict:
    """``state`` with ``state["skip", "total" | "consecutive"]`` (int64 zeros) where missing.

    Example:
        >>> from tensordict import TensorDict
        >>> sorted(add_skip_counters(TensorDict({}, []))["skip"].keys())
        ['consecutive', 'total']
    """
    if SKIP in state.keys():
        _check_skip(state.get(SKIP))
        return cast(TensorDict, state)
    out = state.copy()
    zero = torch.zeros((), dtype=torch.int64)
    out.set(SKIP, TensorDict({SKIP_TOTAL: zero, SKIP_CONSECUTIVE: zero.clone()}, []))
    return out


def set_skip(
    out: TensorDictBase, state: TensorDictBase, *, consecutive: int, total_inc: int, donate: bool
) -> None:
    """Write the skip counters of ``out`` from ``state``'s (in place when ``donate``).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> s = add_skip_counters(TensorDict({}, []))
        >>> set_skip(s, s, consecutive=0, total_inc=0, donate=True)
        >>> int(s["skip", "consecutive"])
        0
    """
    total = state.get((SKIP, SKIP_TOTAL))
    if donate:
        out.get((SKIP, SKIP_CONSECUTIVE)).fill_(consecutive)
        total.add_(total_inc)
    else:
        out.set((SKIP, SKIP_CONSECUTIVE), torch.tensor(consecutive, dtype=torch.int64))
        out.set((SKIP, SKIP_TOTAL), total + total_inc)
