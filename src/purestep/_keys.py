"""The training state's well-known keys: one home for the names, so no module spells them.

Every module that reads or writes a key of the state (the one TensorDict of
``docs/ARCHITECTURE.md``, "The state") names it by one of these constants, not by
a string literal; ``tests/test_architecture.py`` fails when a raw literal for one
of them appears in ``src/``. They are plain module-level strings (a step pays
nothing for them) and public as ``purestep.state.PARAMS`` etc.

===============  ==================================================================
constant         state entry
===============  ==================================================================
``PARAMS``       ``{role: tree}``: trainable weights per role
``OPT_STATE``    ``{role: tree}``: per-role optimizer state (count, lr, moments)
``RNG``          int64 0-dim CPU tensor: the root PRNG key
``STEP``         int64 0-dim CPU tensor: steps taken by the method
``BUFFERS``      ``{role: tree}``: persistent module buffers (BatchNorm statistics)
``EMA``          ``{role: tree}``: EMA copies of params (``with_ema``)
``EMA_BUFFERS``  ``{role: tree}``: EMA copies of buffers (``with_ema(buffers=True)``)
``SKIP``         ``{SKIP_TOTAL, SKIP_CONSECUTIVE}`` counters (``skip_nonfinite``)
``EXTRA``        ``{...}``: method-owned tensors (e.g. DiffusionNFT's inner counter)
===============  ==================================================================

A key path into the state is a tuple of these and role / module-path names:
``state[PARAMS, "student"]``, ``state.get((SKIP, SKIP_TOTAL))``.

Example:
    >>> import torch
    >>> from purestep import init_state, optim
    >>> from purestep.state import PARAMS, STEP
    >>> state = init_state({"m": torch.nn.Linear(2, 1)}, {"m": optim.sgd(0.1)}, seed=0)
    >>> int(state[STEP]), sorted(state[PARAMS, "m"].keys())
    (0, ['bias', 'weight'])
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "BUFFERS",
    "EMA",
    "EMA_BUFFERS",
    "EXTRA",
    "OPT_STATE",
    "PARAMS",
    "RNG",
    "SKIP",
    "SKIP_CONSECUTIVE",
    "SKIP_TOTAL",
    "STATE_KEYS",
    "STEP",
]

PARAMS: Final = "params"
OPT_STATE: Final = "opt_state"
RNG: Final = "rng"
STEP: Final = "step"
BUFFERS: Final = "buffers"
EMA: Final = "ema"
EMA_BUFFERS: Final = "ema_buffers"
SKIP: Final = "skip"
EXTRA: Final = "extra"

SKIP_TOTAL: Final = "total"
"""``state[SKIP, SKIP_TOTAL]``: non-finite steps skipped since the start."""
SKIP_CONSECUTIVE: Final = "consecutive"
"""``state[SKIP, SKIP_CONSECUTIVE]``: non-finite steps skipped in a row."""

STATE_KEYS: Final = (PARAMS, OPT_STATE, RNG, STEP, BUFFERS, EMA, EMA_BUFFERS, SKIP, EXTRA)
"""Every top-level key purestep's steps and wrappers own, in the layout's order."""
