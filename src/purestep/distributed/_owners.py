"""Which FSDP binding owns a sharded parameter: the registry the step-layer hooks consult.

:func:`purestep.distributed.fsdp.bind` registers every sharded parameter of a
binding with an :class:`Owner` (the binding's FSDP modules, by weak reference,
its mesh and its sync policy). The step layer hands its hooks the leaves of a
bound role; :func:`owners_of` maps them back to their bindings. Keys are the
parameters' ``id()``, guarded by a weak reference against id reuse, and an
entry is dropped when its parameter is garbage collected, so the registry never
keeps a module or a parameter alive.

Example:
    >>> import torch
    >>> owners_of([torch.ones(1)])  # an unbound tensor has no owner
    []
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import cast

import attrs
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

__all__ = ["Owner", "owners_of", "register"]


@attrs.frozen(eq=False)
class Owner:
    """What the backward/metrics hooks need to know about a binding (no strong module refs)."""

    modules: tuple[weakref.ref[nn.Module], ...]
    mesh: DeviceMesh
    sync_every_microbatch: bool
    # index into ``modules`` -> the params that module's last forward ran with
    # (FSDP2's unsharded parameters: the autograd graph's leaves), by weak reference
    forward_params: dict[int, tuple[weakref.ref[torch.Tensor], ...]] = attrs.field(
        factory=dict, init=False
    )

    def graph_params(self) -> list[torch.Tensor]:
        """The params the binding's modules last ran forward with (still alive)."""
        out = []
        for refs in self.forward_params.values():
            for ref in refs:
                t = ref()
                if t is not None:
                    out.append(t)
        return out

    def fsdp_modules(self) -> list[FSDPModule]:
        out = []
        for ref in self.modules:
            m = ref()
            if m is not None:
                out.append(cast(FSDPModule, m))
        return out


# id(sharded param) -> (weakref to the param, owner). The weakref guards against id reuse;
# entries are removed when the param is garbage collected.
_OWNERS: dict[int, tuple[weakref.ref[torch.Tensor], Owner]] = {}


def register(params: Iterable[torch.Tensor], owner: Owner) -> None:
    """Record ``owner`` as the owner of each of ``params`` (until the param is collected).

    Example:
        >>> p = torch.ones(1)
        >>> owner = Owner(modules=(), mesh=None, sync_every_microbatch=False)
        >>> register([p], owner)
        >>> owners_of([p, torch.ones(1)]) == [owner]
        True
    """
    for p in params:
        key = id(p)
        _OWNERS[key] = (weakref.ref(p), owner)
        weakref.finalize(p, _OWNERS.pop, key, None)


def owners_of(leaves: Sequence[torch.Tensor]) -> list[Owner]:
    """The distinct owners of ``leaves`` (registered params only), in first-seen order.

    Example:
        >>> owners_of([])
        []
    """
    found: dict[int, Owner] = {}
    for t in leaves:
        entry = _OWNERS.get(id(t))
        if entry is not None and entry[0]() is t:
            found.setdefault(id(entry[1]), entry[1])
    return list(found.values())
