"""Small ``nn.Module``s with the patterns real models have, for :func:`purestep.testing.models`.

A :class:`ModelSpec` says which patterns a :class:`DrawnModel` has: BatchNorm
(persistent buffers updated by the forward), activation-checkpointed blocks
(``torch.utils.checkpoint``, reentrant or not), a submodule used twice, tied
weights (two layers holding one ``nn.Parameter``), a branch whose parameters get
no gradient (never used, or used only for some inputs), and channels_last
convolutions (weights and/or input). Weights come from a local generator seeded
by the spec; building one never touches torch's global RNG.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["BLOCK_KINDS", "LAYOUTS", "UNUSED", "DrawnModel", "ModelSpec"]

BlockKind = Literal["conv", "batchnorm", "checkpoint", "checkpoint_reentrant", "shared"]
Layout = Literal["contiguous", "channels_last_input", "channels_last"]
Unused = Literal["none", "never", "sometimes"]

BLOCK_KINDS: tuple[BlockKind, ...] = (
    "conv",
    "batchnorm",
    "checkpoint",
    "checkpoint_reentrant",
    "shared",
)
LAYOUTS: tuple[Layout, ...] = ("contiguous", "channels_last_input", "channels_last")
UNUSED: tuple[Unused, ...] = ("none", "never", "sometimes")


@attrs.frozen
class ModelSpec:
    """What a :class:`DrawnModel` is made of.

    Attributes:
        blocks: the conv-stage blocks after the stem, in order: ``"conv"`` (3x3
            conv + tanh), ``"batchnorm"`` (``BatchNorm2d``), ``"checkpoint"`` /
            ``"checkpoint_reentrant"`` (a 1x1 conv + tanh run through
            ``torch.utils.checkpoint`` with ``use_reentrant=False`` / ``True``),
            ``"shared"`` (the previous block applied again: one submodule, two uses).
        tied: two linear layers share one weight.
        unused: ``"never"``: a branch whose parameters never get a gradient;
            ``"sometimes"``: a branch used only for batches whose mean input is
            positive (no gradient on the other steps).
        layout: ``"channels_last_input"``: contiguous conv weights on
            channels_last input; ``"channels_last"``: weights and input channels_last.
        channels: conv channels.
        size: input height and width.
        hidden: width of the linear layers.
        outputs: output features.
        seed: seed of the local generator the weights are drawn from.

    Example:
        >>> ModelSpec(blocks=("batchnorm",), tied=True).layout
        'contiguous'
    """

    blocks: tuple[BlockKind, ...] = attrs.field(default=(), converter=tuple)
    tied: bool = False
    unused: Unused = "none"
    layout: Layout = "contiguous"
    channels: int = 3
    size: int = 4
    hidden: int = 6
    outputs: int = 2
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        for kind in self.blocks:
            if kind not in BLOCK_KINDS:
                raise ValueError(f"ModelSpec: unknown block kind {kind!r}; one of {BLOCK_KINDS}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"ModelSpec: unknown layout {self.layout!r}; one of {LAYOUTS}")
        if self.unused not in UNUSED:
            raise ValueError(f"ModelSpec: unknown unused {self.unused!r}; one of {UNUSED}")


class _Checkpointed(nn.Module):
    """``inner`` run through ``torch.utils.checkpoint`` (its activations recomputed in backward)."""

    def __init__(self, inner: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.inner = inner
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(self.inner, x, use_reentrant=self.reentrant)
        return out


def _block(kind: str, c: int, previous: nn.Module | None) -> nn.Module:
    meta = torch.device("meta")
    if kind == "batchnorm":
        return nn.BatchNorm2d(c, device=meta)
    if kind == "shared" and previous is not None:
        return previous
    if kind in ("checkpoint", "checkpoint_reentrant"):
        inner = nn.Sequential(nn.Conv2d(c, c, 1, device=meta), nn.Tanh())
        return _Checkpointed(inner, reentrant=kind == "checkpoint_reentrant")
    return nn.Sequential(nn.Conv2d(c, c, 3, padding=1, device=meta), nn.Tanh())


class DrawnModel(nn.Module):
    """``x [B, 3, size, size] -> [B, outputs]``: a conv stem, the spec's blocks, linear layers.

    Attributes:
        spec: the :class:`ModelSpec` it was built from.
        batch_fields: trailing shapes of the batch fields it trains on
            (``{"x": (3, size, size), "y": (outputs,)}``), for :func:`purestep.testing.batches`.

    Example:
        >>> m = DrawnModel(ModelSpec(blocks=("batchnorm", "checkpoint"), tied=True))
        >>> m(torch.zeros(2, 3, 4, 4)).shape
        torch.Size([2, 2])
        >>> m.tied_b.weight is m.tied_a.weight
        True
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        c, d, meta = spec.channels, spec.hidden, torch.device("meta")
        self.batch_fields: dict[str, Sequence[int]] = {
            "x": (3, spec.size, spec.size),
            "y": (spec.outputs,),
        }
        self.stem = nn.Conv2d(3, c, 3, padding=1, device=meta)
        blocks: list[nn.Module] = []
        for kind in spec.blocks:
            blocks.append(_block(kind, c, blocks[-1] if blocks else None))
        self.blocks = nn.ModuleList(blocks)
        self.proj = nn.Linear(c * spec.size * spec.size, d, device=meta)
        if spec.tied:
            self.tied_a = nn.Linear(d, d, device=meta)
            self.tied_b = nn.Linear(d, d, device=meta)
        if spec.unused != "none":
            self.branch = nn.Linear(d, d, device=meta)
        self.head = nn.Linear(d, spec.outputs, device=meta)
        self.to_empty(device="cpu")  # gives each slot its own tensor: tie afterwards
        if spec.tied:
            self.tied_b.weight = self.tied_a.weight
        self._init_weights(spec.seed)
        if spec.layout == "channels_last":
            self.to(memory_format=torch.channels_last)  # type: ignore[call-overload]

    def _init_weights(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():  # each tied parameter once
                fan_in = p[0].numel() if p.ndim > 1 else p.numel()
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.reset_running_stats()
                    m.weight.add_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.layout != "contiguous":
            x = x.contiguous(memory_format=torch.channels_last)
        h = torch.tanh(self.stem(x))
        for block in self.blocks:
            h = block(h)
        h = torch.tanh(self.proj(h.flatten(1)))
        if self.spec.tied:
            h = torch.tanh(self.tied_b(torch.tanh(self.tied_a(h))))
        if self.spec.unused == "sometimes" and bool(x.mean() > 0):
            h = h + self.branch(h)
        out: torch.Tensor = self.head(h)
        return out
