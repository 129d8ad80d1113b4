"""Adapters for torch.distributed: DCP checkpoints (``checkpoint``), FSDP2 binding (``fsdp``),
collective timeouts (``timeouts``).

Submodules are imported on first attribute access, so ``import purestep.distributed``
stays cheap and does not require every adapter to be importable.

Example:
    >>> from purestep import distributed
    >>> distributed.checkpoint.step_dir("/ckpt", 5).name
    'step_00000005'
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["checkpoint", "fsdp", "timeouts"]


def __getattr__(name: str) -> ModuleType:
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
