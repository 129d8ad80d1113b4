"""A small transformer denoiser and a synthetic sequence distribution, shared by examples.

The model maps a noisy sequence ``x_t`` ``[B, L, C]`` and a timestep ``t`` ``[B]``
to a velocity ``[B, L, C]`` (the flow-matching convention of
:mod:`purestep.methods.flow`). Its :class:`Block` s are the units an FSDP
example shards individually (``fsdp.bind(model, shard=[Block])``).

Everything random is explicit: weights come from a ``torch.Generator`` seeded
by the caller (the model is built on the meta device, so no global RNG is
touched) and data from :mod:`purestep.rng` keys folded with global sample ids.

Example:
    >>> import torch
    >>> from purestep import rng
    >>> model = init_weights(Denoiser(DenoiserConfig(width=32, depth=1)), seed=0)
    >>> x0 = sample_sequences(rng.key(0), torch.arange(4), DenoiserConfig())
    >>> model(x0, torch.full((4,), 0.5)).shape
    torch.Size([4, 16, 4])
"""

from __future__ import annotations

import math
from typing import TypeVar

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from purestep import rng

__all__ = ["Block", "Denoiser", "DenoiserConfig", "init_weights", "sample_sequences"]

M = TypeVar("M", bound=nn.Module)


@attrs.frozen(kw_only=True)
class DenoiserConfig:
    """Sizes of :class:`Denoiser` and of the synthetic data.

    Attributes:
        channels: features per sequence position (``C``).
        seq_len: sequence length (``L``).
        width: transformer width.
        depth: number of :class:`Block` s.
        heads: attention heads (``width`` must be divisible by it).
        t_freqs: sin/cos frequency pairs of the timestep embedding.
    """

    channels: int = 4
    seq_len: int = 16
    width: int = 64
    depth: int = 2
    heads: int = 4
    t_freqs: int = 8

    def __attrs_post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(
                f"DenoiserConfig: width={self.width} is not divisible by heads={self.heads}"
            )


class Block(nn.Module):
    """Pre-norm transformer block, modulated by the timestep embedding (scale/shift, adaLN-style)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False, device="meta")
        self.qkv = nn.Linear(width, 3 * width, device="meta")
        self.proj = nn.Linear(width, width, device="meta")
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False, device="meta")
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width, device="meta"),
            nn.GELU(),
            nn.Linear(4 * width, width, device="meta"),
        )
        self.mod = nn.Linear(width, 4 * width, device="meta")  # scale/shift for both norms

    def forward(self, h: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        b, n, w = h.shape
        s1, b1, s2, b2 = self.mod(temb)[:, None, :].chunk(4, dim=-1)
        a = self.norm1(h) * (1 + s1) + b1
        q, k, v = self.qkv(a).view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, w)
        h = h + self.proj(att)
        return h + self.mlp(self.norm2(h) * (1 + s2) + b2)  # type: ignore[no-any-return]


class Denoiser(nn.Module):
    """``forward(x_t [B, L, C], t [B]) -> velocity [B, L, C]``; built on meta (see :func:`init_weights`)."""

    def __init__(self, cfg: DenoiserConfig) -> None:
        super().__init__()
        self.cfg = cfg
        w = cfg.width
        self.embed = nn.Linear(cfg.channels, w, device="meta")
        self.pos = nn.Parameter(torch.empty(cfg.seq_len, w, device="meta"))
        self.time = nn.Sequential(
            nn.Linear(2 * cfg.t_freqs, w, device="meta"), nn.SiLU(), nn.Linear(w, w, device="meta")
        )
        self.blocks = nn.ModuleList([Block(w, cfg.heads) for _ in range(cfg.depth)])
        self.norm = nn.LayerNorm(w, device="meta")
        self.out = nn.Linear(w, cfg.channels, device="meta")

    def forward(self, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        freqs = torch.exp(
            torch.arange(self.cfg.t_freqs, device=t.device, dtype=x_t.dtype) * math.log(2.0)
        )
        ang = t[:, None].to(x_t.dtype) * freqs[None, :] * math.pi
        temb = self.time(torch.cat([ang.sin(), ang.cos()], dim=1))
        h = self.embed(x_t) + self.pos
        for blk in self.blocks:
            h = blk(h, temb)
        # a Linear on [B, L, W] returns a view; FSDP warns about view outputs of a root
        # module (an in-place op on them would skip its backward hook), so return a copy
        return self.out(self.norm(h)).clone()  # type: ignore[no-any-return]


def init_weights(model: M, seed: int, device: torch.device | str = "cpu") -> M:
    """Materialise a meta-built model on ``device`` with weights drawn from ``seed``.

    Linear weights ~ N(0, 1/fan_in) (the output and modulation layers scaled
    by 0.1, so the initial output and modulation are small), biases 0, norm
    weights 1, positional table ~ N(0, 0.02). The same seed gives the same
    weights on every rank and device.
    """
    model.to_empty(device=device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.ndim == 1:  # norm weights
                p.fill_(1.0)
            elif name == "pos":
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            else:
                w = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1])
                small = name.startswith("out.") or name.endswith("mod.weight")
                p.copy_(w * (0.1 if small else 1.0))
    return model


def sample_sequences(
    key: torch.Tensor,
    index: torch.Tensor,
    cfg: DenoiserConfig,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Synthetic data ``[len(index), L, C]``: per sample and channel a sine with its own
    frequency, phase and amplitude, drawn from ``fold_in(key, index[i])``.

    Sample ``i`` depends only on ``key`` and its global id ``index[i]``, not on the
    batch it is in, so every world size sees the same data.
    """
    u = rng.uniform(key, (index.shape[0], cfg.channels, 3), index=index, device=device)
    freq = 1.0 + 3.0 * u[..., 0:1]
    phase = 2 * math.pi * u[..., 1:2]
    amp = 0.5 + u[..., 2:3]
    pos = torch.linspace(0.0, 2 * math.pi, cfg.seq_len, device=u.device)
    x = amp * torch.sin(freq * pos + phase)  # [B, C, L]
    return x.transpose(1, 2).contiguous()
