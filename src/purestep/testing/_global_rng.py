"""Detect a step drawing from torch's global generators (the CPU one, and CUDA's where initialised).

A pure step takes its randomness from the state's key (``purestep.rng`` draws,
or ``purestep.call(..., key=)``, which forks the global generators, seeds them
from the key and restores them). A step that draws from the global generators
anyway (a module left in train mode with dropout, a diffusers model dropping
class labels with ``torch.rand``, a ``torch.randn`` without ``generator=`` in
the loss) gives different results on every call, so every property check fails
on it; :class:`RngWatch` lets the checks say that this is the cause.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["RngWatch", "global_rng_states"]

T = TypeVar("T")

ADVICE = (
    "a pure step takes its randomness from the state's key: pass key= to purestep.call "
    "(it seeds torch's global generators from the key for the call and restores them), draw "
    "with purestep.rng, or put the module in eval mode (dropout, a diffusers model in train "
    "mode dropping class labels with torch.rand, a torch.rand/randn without generator=)"
)


def global_rng_states() -> dict[str, torch.Tensor]:
    """The states of torch's global generators: ``"cpu"``, and ``"cuda:i"`` where CUDA is initialised.

    Example:
        >>> list(global_rng_states())[0]
        'cpu'
    """
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        for i in range(torch.cuda.device_count()):
            states[f"cuda:{i}"] = torch.cuda.get_rng_state(i)
    return states


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    # a generator initialised during the call (CUDA) has no "before": it cannot be compared
    return [name for name, s in before.items() if name in after and not torch.equal(s, after[name])]


class RngWatch:
    """Records which step calls changed the global generators' states.

    Example:
        >>> w = RngWatch()
        >>> _ = w.call("step 0", torch.rand, 1)
        >>> w.consumed
        ['step 0 (the cpu generator)']
    """

    def __init__(self) -> None:
        self.consumed: list[str] = []

    def call(self, where: str, fn: Callable[..., T], *args: Any) -> T:
        """Return ``fn(*args)``; note ``where`` if it changed a global generator's state."""
        before = global_rng_states()
        out = fn(*args)
        changed = _changed(before, global_rng_states())
        if changed:
            self.consumed.append(f"{where} (the {' and '.join(changed)} generator)")
        return out

    def hint(self) -> str:
        """A sentence to append to a failure ("" when no call drew from the global generators)."""
        if not self.consumed:
            return ""
        more = len(self.consumed) - 1
        where = self.consumed[0] + (f" and {more} more step call{'s' * (more > 1)}" if more else "")
        return (
            f". Likely cause: the step drew from torch's global RNG (its state changed during "
            f"{where}), so repeated calls differ; {ADVICE}"
        )
