"""Sample grids as ``uint8`` images and PNG files (standard library only); public in :mod:`purestep.plot`."""

from __future__ import annotations

import math
import os
import struct
import zlib
from pathlib import Path

import torch

from purestep import _atomic

__all__ = ["image_grid", "write_png"]


def image_grid(
    images: torch.Tensor,
    *,
    ncol: int | None = None,
    value_range: tuple[float, float] = (-1.0, 1.0),
    pad: int = 1,
    pad_value: int = 255,
) -> torch.Tensor:
    """Tile ``images`` into one ``uint8`` image: ``[H', W']`` (grayscale) or ``[H', W', 3]``.

    ``images`` is ``[N, H, W]`` or ``[N, C, H, W]`` with ``C`` 1 or 3, any
    device and float dtype; values are mapped linearly from ``value_range`` to
    ``0..255`` (clamped). Image ``i`` goes to row ``i // ncol``, column
    ``i % ncol`` (``ncol`` defaults to ``ceil(sqrt(N))``), with ``pad`` pixels
    of ``pad_value`` around and between the tiles; empty tiles are padding.

    Raises:
        ValueError: another shape, an empty batch, a bad ``ncol``, ``pad`` or
            ``value_range``.

    Example:
        >>> import torch
        >>> g = image_grid(torch.zeros(5, 2, 3), ncol=3, value_range=(-1.0, 1.0))
        >>> g.shape, g.dtype, int(g[1, 1]), int(g[0, 0])
        (torch.Size([7, 13]), torch.uint8, 128, 255)
    """
    x = images.detach()
    if x.dim() == 4 and x.shape[1] in (1, 3):
        x = x[:, 0] if x.shape[1] == 1 else x.permute(0, 2, 3, 1)
    elif x.dim() != 3:
        raise ValueError(
            f"image_grid: images must be [N, H, W] or [N, C, H, W] (C 1 or 3), got {tuple(images.shape)}"
        )
    n = x.shape[0]
    if n == 0:
        raise ValueError("image_grid: no images")
    lo, hi = value_range
    if not hi > lo:
        raise ValueError(
            f"image_grid: value_range must be (low, high) with high > low, got {value_range}"
        )
    cols = math.ceil(math.sqrt(n)) if ncol is None else ncol
    if not isinstance(cols, int) or isinstance(cols, bool) or cols < 1:
        raise ValueError(f"image_grid: ncol must be a positive int, got {ncol!r}")
    if not isinstance(pad, int) or pad < 0 or not 0 <= pad_value <= 255:
        raise ValueError(f"image_grid: pad >= 0 and pad_value in 0..255, got {pad}, {pad_value}")
    rows = math.ceil(n / cols)
    h, w = x.shape[1], x.shape[2]
    scaled = ((x.float().cpu() - lo) / (hi - lo) * 255.0).round().clamp(0, 255).to(torch.uint8)
    out = torch.full(
        (rows * (h + pad) + pad, cols * (w + pad) + pad, *x.shape[3:]), pad_value, dtype=torch.uint8
    )
    for i in range(n):
        r, c = divmod(i, cols)
        top, left = pad + r * (h + pad), pad + c * (w + pad)
        out[top : top + h, left : left + w] = scaled[i]
    return out


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def write_png(image: torch.Tensor, path: str | os.PathLike[str]) -> Path:
    """Write a ``uint8`` image ``[H, W]`` (grayscale) or ``[H, W, 3]`` (RGB) as a PNG file.

    Standard library only (``zlib``); creates the parent directory; returns the path.
    The file is replaced atomically (a reader, or a crash mid-write, never sees
    half an image).

    Raises:
        ValueError: not a ``uint8`` tensor of those shapes.

    Example:
        >>> import tempfile, torch
        >>> p = write_png(torch.zeros(2, 3, dtype=torch.uint8), tempfile.mkdtemp() + "/a.png")
        >>> p.read_bytes()[:4]
        b'\\x89PNG'
    """
    if image.dtype != torch.uint8 or not (
        image.dim() == 2 or (image.dim() == 3 and image.shape[2] == 3)
    ):
        raise ValueError(
            f"write_png: image must be uint8 [H, W] or [H, W, 3], got {image.dtype} "
            f"{tuple(image.shape)} (image_grid makes one)"
        )
    h, w = image.shape[0], image.shape[1]
    color = 0 if image.dim() == 2 else 2
    rows = image.cpu().contiguous().reshape(h, -1)
    raw = b"".join(b"\x00" + bytes(row.tolist()) for row in rows)
    data = (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, color, 0, 0, 0))
        + _chunk(b"IDAT", zlib.compress(raw))
        + _chunk(b"IEND", b"")
    )
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    _atomic.replace_with(p, lambda fh: fh.write(data))
    return p
