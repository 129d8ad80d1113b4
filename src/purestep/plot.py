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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from purestep._images import image_grid, write_png
from purestep.loop import read_metrics

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
