"""optax-style optimizers over TensorDicts: pure ``init``/``update`` and a fused ``step``.

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from purestep import optim
    >>> t = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(lr=1e-3))
    >>> p = TensorDict({"w": torch.ones(3)}, [])
    >>> s = t.init(p)
    >>> p2, s2 = t.step(TensorDict({"w": torch.ones(3)}, []), s, p)
"""

from purestep.optim import schedules
from purestep.optim._base import (
    Schedule,
    ScalarOrSchedule,
    Transform,
    apply_updates,
    chain,
    current_lr,
)

__all__ = [
    "Schedule",
    "ScalarOrSchedule",
    "Transform",
    "apply_updates",
    "chain",
    "current_lr",
    "schedules",
]
