"""Plot a metrics log written by :func:`purestep.loop.run`: one panel per metric family.

Usage::

    python -m purestep.plot metrics.jsonl -o curves.png

A metric's *family* is the last part of its name, so ``loss``,
``student/loss`` and ``critic/loss`` share the ``loss`` panel (one line each),
``student/lr`` goes to ``lr`` and ``student/grad_norm`` to ``grad_norm``;
evaluation metrics keep their prefix (``eval/loss``, ``eval/student/loss`` ->
``eval/loss``). Panels come in the order loss, lr, grad_norm, then the others
by name. Needs matplotlib (``pip install matplotlib``).

Images: :func:`image_grid` tiles a batch of images into one ``uint8`` image
and :func:`write_png` writes it (standard library only), for sample grids.
"""

from __future__ import annotations

import argparse
import math
import os
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from purestep.loop._sinks import read_metrics

__all__ = ["families", "image_grid", "main", "plot_metrics", "write_png"]

_FIRST = ("loss", "lr", "grad_norm")


def _family(name: str) -> str:
    parts = name.split("/")
    if parts[0] == "eval" and len(parts) > 1:
        return f"eval/{parts[-1]}"
    return parts[-1]


def families(names: Sequence[str]) -> dict[str, list[str]]:
    """Group metric names into panels: ``{family: [names...]}``, in panel order.

    Example:
        >>> families(["student/lr", "loss", "eval/loss", "critic/loss", "student/grad_norm"])
        {'loss': ['loss', 'critic/loss'], 'lr': ['student/lr'], 'grad_norm': ['student/grad_norm'], 'eval/loss': ['eval/loss']}
    """
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(_family(name), []).append(name)

    def order(fam: str) -> tuple[int, int, str]:
        base = fam.removeprefix("eval/")
        rank = _FIRST.index(base) if base in _FIRST else len(_FIRST)
        return (fam.startswith("eval/"), rank, fam)

    return {fam: groups[fam] for fam in sorted(groups, key=order)}


def _series(records: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    out: dict[str, tuple[list[int], list[float]]] = {}
    for rec in records:
        for name, value in rec.items():
            if name == "step" or not isinstance(value, (int, float)):
                continue
            steps, values = out.setdefault(name, ([], []))
            steps.append(int(rec["step"]))
            values.append(float(value))
    return out


def plot_metrics(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    title: str | None = None,
    log_loss: bool = False,
) -> list[str]:
    """Plot the JSONL log at ``path`` into the image ``out``; returns the panels' families.

    Args:
        path: a ``metrics.jsonl`` (records ``{"step": s, name: value, ...}``).
        out: the image file (format from its suffix, e.g. ``.png``, ``.pdf``).
        title: a figure title (default: the log's path).
        log_loss: log scale for ``loss`` panels (when all values are positive).

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: the log has no metric values.

    Example:
        >>> import os, tempfile
        >>> from purestep.loop import JSONLSink
        >>> d = tempfile.mkdtemp()
        >>> sink = JSONLSink(os.path.join(d, "m.jsonl"))
        >>> for s in (1, 2): sink(s, {"loss": 1.0 / s, "m/lr": 0.1})
        >>> sink.close()
        >>> plot_metrics(os.path.join(d, "m.jsonl"), os.path.join(d, "c.png"))  # doctest: +SKIP
        ['loss', 'lr']
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("purestep.plot needs matplotlib: pip install matplotlib") from e
    series = _series(read_metrics(path))
    if not series:
        raise ValueError(f"{path}: no metric values to plot")
    groups = families(list(series))
    n = len(groups)
    cols = 1 if n == 1 else 2
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(6 * cols, 3.2 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (fam, names) in zip(axes, groups.items(), strict=False):
        for name in names:
            steps, values = series[name]
            ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=name)
        ax.set_title(fam)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        positive = all(v > 0 for name in names for v in series[name][1] if math.isfinite(v))
        if log_loss and fam.endswith("loss") and positive:
            ax.set_yscale("log")
        if len(names) > 1 or names[0] != fam:
            ax.legend(fontsize="small")
    for ax in axes[n:]:
        ax.set_visible(False)
    fig.suptitle(title if title is not None else str(path))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return list(groups)


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
    p.write_bytes(data)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m purestep.plot metrics.jsonl -o curves.png``.

    Example:
        >>> main(["--help"])  # doctest: +SKIP
    """
    ap = argparse.ArgumentParser(
        prog="python -m purestep.plot",
        description="Plot loss, lr, grad-norm (and other) curves from a purestep metrics.jsonl, "
        "one panel per metric family.",
    )
    ap.add_argument("log", help="a metrics.jsonl written by purestep.loop.run")
    ap.add_argument("-o", "--out", default="curves.png", help="output image (default curves.png)")
    ap.add_argument("--title", default=None, help="figure title (default: the log's path)")
    ap.add_argument("--log-loss", action="store_true", help="log scale for loss panels")
    args = ap.parse_args(argv)
    panels = plot_metrics(args.log, args.out, title=args.title, log_loss=args.log_loss)
    print(f"wrote {args.out} ({len(panels)} panels: {', '.join(panels)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
