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
from purestep.optim._adam import adam, adamw
from purestep.optim._base import (
    ScalarOrSchedule,
    Schedule,
    Transform,
    apply_updates,
    chain,
    current_lr,
)
from purestep.optim._clip import clip_by_global_norm
from purestep.optim._hparams import AdamHParams, ClipHParams, LionHParams, SGDHParams
from purestep.optim._lion import lion
from purestep.optim._mixed import mixed_precision
from purestep.optim._muon import MuonHParams, is_matrix, muon
from purestep.optim._scale import scale_by_schedule
from purestep.optim._sgd import sgd

__all__ = [
    "AdamHParams",
    "ClipHParams",
    "LionHParams",
    "MuonHParams",
    "SGDHParams",
    "ScalarOrSchedule",
    "Schedule",
    "Transform",
    "adam",
    "adamw",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "current_lr",
    "is_matrix",
    "lion",
    "mixed_precision",
    "muon",
    "scale_by_schedule",
    "schedules",
    "sgd",
]
