"""Metric sinks: JSONL, CSV, TensorBoard and plain callables ``(step, metrics) -> None``.

A sink is any callable ``sink(step, metrics)`` with ``metrics: dict[str, float]``.
Two optional methods let :func:`purestep.loop.run` keep file logs consistent
with checkpoints:

* ``start(step)``: called once before training (with the resumed checkpoint's
  step, or 0). File sinks drop every record with a step greater than ``step``,
  since those steps are replayed after a resume.
* ``close()``: called when the run ends (normally, by preemption or by an error).
* ``image(step, name, pixels)``: receives the :class:`Image` values that
  ``eval_fn`` returns (``pixels`` a ``uint8`` ``[H, W]`` or ``[H, W, 3]`` tensor).
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, TextIO

import torch

from purestep._atomic import write_text
from purestep._images import image_grid

__all__ = [
    "CSVSink",
    "Image",
    "JSONLSink",
    "Sink",
    "TensorBoardSink",
    "read_metrics",
]


class Sink(Protocol):
    """``sink(step, metrics)``; may also have ``start(step)`` and ``close()`` (see module doc)."""

    def __call__(self, step: int, metrics: Mapping[str, float]) -> None: ...


def _json_value(v: float) -> float | str:
    return v if math.isfinite(v) else str(v)


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a JSONL metrics log, in file order.

    Each record is ``{"step": int, name: float, ...}``. Non-finite values are
    stored as the strings ``"nan"``, ``"inf"``, ``"-inf"`` and read back as
    floats. Lines that do not parse (a line torn by a crash) are skipped.

    Example:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "m.jsonl")
        >>> sink = JSONLSink(p)
        >>> sink(1, {"loss": 0.5})
        >>> sink.close()
        >>> read_metrics(p)
        [{'step': 1, 'loss': 0.5}]
    """
    out: list[dict[str, Any]] = []
    with open(path) as fh:
        for line in fh:
            rec = _parse_line(line)
            if rec is not None:
                out.append(rec)
    return out


def _parse_line(line: str) -> dict[str, Any] | None:
    line = line.strip()
    if not line:
        return None
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
        return None
    return {k: (float(v) if isinstance(v, str) and k != "step" else v) for k, v in rec.items()}


class JSONLSink:
    """Append one JSON object per log point to ``path``: ``{"step": s, name: value, ...}``.

    Each record is flushed when written, so a killed process loses no logged
    record. ``start(step)`` (called by :func:`purestep.loop.run`) rewrites the
    file atomically keeping only records with ``"step" <= step``.

    Example:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
        >>> sink = JSONLSink(p)
        >>> sink(1, {"loss": 1.0}); sink(2, {"loss": 0.5})
        >>> sink.start(1)  # as after resuming from a checkpoint at step 1
        >>> sink.close()
        >>> [r["step"] for r in read_metrics(p)]
        [1]
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fh: TextIO | None = None

    def start(self, step: int) -> None:
        """Drop records with a step greater than ``step`` (atomically)."""
        self.close()
        if self.path.exists():
            with open(self.path) as fh:
                kept = [line for line in fh if (r := _parse_line(line)) and r["step"] <= step]
            write_text(self.path, "".join(ln if ln.endswith("\n") else ln + "\n" for ln in kept))

    def __call__(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a")  # noqa: SIM115 (kept open across calls)
        rec = {"step": int(step), **{k: _json_value(float(v)) for k, v in metrics.items()}}
        self._fh.write(json.dumps(rec) + "\n")
        self._fh.flush()

    def close(self) -> None:
        """Close the file (the next record reopens it)."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class CSVSink:
    """Write one row per log point to ``path``: a ``step`` column, then one column per metric.

    Columns are the metric names in order of first appearance; a record with a
    new name rewrites the file with the wider header (rare: the first record
    and the first evaluation). Missing values are empty cells. ``start(step)``
    keeps only rows with ``step <= step``, as :class:`JSONLSink`.

    Example:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "metrics.csv")
        >>> sink = CSVSink(p)
        >>> sink(1, {"loss": 1.0}); sink(2, {"loss": 0.5, "eval/loss": 0.7})
        >>> sink.close()
        >>> open(p).read().splitlines()
        ['step,loss,eval/loss', '1,1.0,', '2,0.5,0.7']
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._columns: list[str] | None = None
        self._fh: TextIO | None = None

    def _read(self) -> tuple[list[str], list[dict[str, str]]]:
        if not self.path.exists():
            return ["step"], []
        with open(self.path, newline="") as fh:
            reader = csv.DictReader(fh)
            rows = [r for r in reader if r.get("step", "").strip().isdigit()]
            return list(reader.fieldnames or ["step"]), rows

    def _rewrite(self, columns: list[str], rows: list[dict[str, str]]) -> None:
        self.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lines = [",".join(_csv_cell(c) for c in columns)]
        for r in rows:
            lines.append(",".join(_csv_cell(r.get(c) or "") for c in columns))
        write_text(self.path, "\n".join(lines) + "\n")
        self._columns = columns

    def start(self, step: int) -> None:
        """Drop rows with a step greater than ``step`` (atomically)."""
        columns, rows = self._read()
        self._rewrite(columns, [r for r in rows if int(r["step"]) <= step])

    def __call__(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._columns is None:
            if self.path.exists():
                self._columns, _ = self._read()
            else:
                self._rewrite(["step"], [])
        assert self._columns is not None
        new = [k for k in metrics if k not in self._columns]
        if new:
            columns, rows = self._read()
            self._rewrite(columns + [k for k in new if k not in columns], rows)
        if self._fh is None:
            self._fh = open(self.path, "a", newline="")  # noqa: SIM115 (kept open across calls)
        cells = [str(int(step))]
        cells += [repr(float(metrics[c])) if c in metrics else "" for c in self._columns[1:]]
        self._fh.write(",".join(cells) + "\n")
        self._fh.flush()

    def close(self) -> None:
        """Close the file (the next row reopens it)."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _csv_cell(value: str) -> str:
    if any(ch in value for ch in ',"\n\r'):
        return '"' + value.replace('"', '""') + '"'
    return value


class Image:
    """An image for :func:`run`'s ``eval_fn`` to return next to its scalars: ``{"samples": Image(x)}``.

    ``images`` is a ``uint8`` image ``[H, W]`` or ``[H, W, 3]`` (kept as is) or
    a batch ``[N, H, W]`` / ``[N, C, H, W]`` of float images, tiled by
    :func:`purestep.plot.image_grid` with ``value_range`` and ``ncol``. ``run``
    writes it to ``<checkpoint_dir>/images/<name>_<step>.png`` and to every sink
    with an ``image(step, name, pixels)`` method (the TensorBoard sink).

    Attributes:
        pixels: the ``uint8`` image ``[H, W]`` or ``[H, W, 3]``, on the CPU.

    Example:
        >>> import torch
        >>> Image(torch.zeros(4, 1, 2, 2)).pixels.shape
        torch.Size([7, 7])
    """

    def __init__(
        self,
        images: torch.Tensor,
        *,
        value_range: tuple[float, float] = (-1.0, 1.0),
        ncol: int | None = None,
    ) -> None:
        if not isinstance(images, torch.Tensor):
            raise TypeError(f"Image: expected a tensor, got {type(images).__name__}")
        x = images.detach()
        if x.dtype == torch.uint8 and (x.dim() == 2 or (x.dim() == 3 and x.shape[2] == 3)):
            self.pixels = x.cpu()
        else:
            self.pixels = image_grid(x, ncol=ncol, value_range=value_range)

    def __repr__(self) -> str:
        return f"Image({tuple(self.pixels.shape)})"


class TensorBoardSink:
    """Log scalars to TensorBoard event files in ``log_dir`` (needs the ``tensorboard`` package).

    ``start(step)`` opens the writer with ``purge_step=step + 1``, so TensorBoard
    hides events of steps replayed after a resume.

    Raises:
        ImportError: ``tensorboard`` is not installed (``pip install tensorboard``).

    Example:
        >>> import tempfile
        >>> try:
        ...     sink = TensorBoardSink(tempfile.mkdtemp())
        ... except ImportError:
        ...     sink = None
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(
                "the 'tensorboard' sink needs the tensorboard package: pip install tensorboard"
            ) from e
        self.log_dir = Path(log_dir)
        self._writer_cls: Callable[..., Any] = SummaryWriter
        self._writer: Any = None

    def start(self, step: int) -> None:
        """Open the writer, purging events after ``step``."""
        self.close()
        self._writer = self._writer_cls(str(self.log_dir), purge_step=step + 1)

    def __call__(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._writer is None:
            self._writer = self._writer_cls(str(self.log_dir))
        for name, value in metrics.items():
            self._writer.add_scalar(name, float(value), int(step))

    def image(self, step: int, name: str, pixels: torch.Tensor) -> None:
        """Log a ``uint8`` image ``[H, W]`` or ``[H, W, 3]`` (an :class:`Image`'s pixels)."""
        if self._writer is None:
            self._writer = self._writer_cls(str(self.log_dir))
        fmt = "HW" if pixels.dim() == 2 else "HWC"
        self._writer.add_image(name, pixels.numpy(), int(step), dataformats=fmt)

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


_NAMED: dict[str, tuple[str, Callable[[Path], Sink]]] = {
    "jsonl": ("metrics.jsonl", JSONLSink),
    "csv": ("metrics.csv", CSVSink),
    "tensorboard": ("tensorboard", TensorBoardSink),
}


def make_sinks(spec: Any, directory: Path | None) -> list[Sink]:
    """Sinks from ``spec``: names (``"jsonl"``, ``"csv"``, ``"tensorboard"``) or callables.

    Named sinks write into ``directory`` (``metrics.jsonl``, ``metrics.csv``,
    ``tensorboard/``) and are skipped when it is ``None``.
    """
    if isinstance(spec, str) or callable(spec):
        spec = (spec,)
    out: list[Sink] = []
    for s in spec:
        if isinstance(s, str):
            if s not in _NAMED:
                raise ValueError(
                    f"unknown sink {s!r}; expected one of {sorted(_NAMED)} or a callable "
                    "(step, metrics) -> None"
                )
            name, cls = _NAMED[s]
            if directory is not None:
                out.append(cls(directory / name))
        elif callable(s):
            out.append(s)
        else:
            raise TypeError(
                f"sink {s!r} is a {type(s).__name__}; expected a name {sorted(_NAMED)} "
                "or a callable (step, metrics) -> None"
            )
    return out


def check_sinks(spec: Any) -> None:
    """Validate a sinks spec without creating anything (``make_sinks`` with no directory)."""
    make_sinks(spec, None)
