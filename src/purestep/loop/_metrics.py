"""Metrics between log points: kept on device, averaged, read with one host sync per device."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from tensordict import TensorDictBase

__all__ = ["MetricBuffer", "flat_metrics"]


def _items(metrics: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(metrics, TensorDictBase):
        for key in metrics.keys():
            yield from _items(metrics.get(key), f"{prefix}{key}/")
    elif isinstance(metrics, Mapping):
        for key, value in metrics.items():
            yield from _items(value, f"{prefix}{key}/")
    else:
        yield prefix[:-1], metrics


def flat_metrics(metrics: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """``{"a/b": 0-dim tensor}`` from a nested TensorDict or mapping of scalars.

    Non-scalar tensors are averaged; Python numbers become float64 CPU tensors.
    Nothing is moved between devices (no host sync).

    Example:
        >>> import torch
        >>> m = flat_metrics({"student": {"lr": 0.1}, "loss": torch.tensor([1.0, 3.0])})
        >>> {k: float(v) for k, v in m.items()}
        {'student/lr': 0.1, 'loss': 2.0}
    """
    out: dict[str, torch.Tensor] = {}
    for name, value in _items(metrics, prefix):
        if isinstance(value, torch.Tensor):
            t = value.detach()
            if t.numel() != 1:
                t = t.to(_acc_dtype(t.device)).mean()
            out[name] = t.reshape(())
        elif isinstance(value, (bool, int, float)):
            out[name] = torch.tensor(float(value), dtype=torch.float64)
        else:
            raise TypeError(
                f"metric {name!r} is a {type(value).__name__}; metrics must be numbers or tensors"
            )
    return out


def _acc_dtype(device: torch.device) -> torch.dtype:
    return torch.float64 if device.type in ("cpu", "cuda") else torch.float32


class MetricBuffer:
    """Per-metric lists of device tensors since the last :meth:`pop`.

    :meth:`pop` returns each metric's mean over the steps that reported it,
    reading the values with one ``.cpu()`` per device (none for CPU metrics).

    Example:
        >>> import torch
        >>> buf = MetricBuffer()
        >>> buf.add({"loss": torch.tensor(1.0)}); buf.add({"loss": torch.tensor(3.0)})
        >>> buf.pop()
        {'loss': 2.0}
    """

    def __init__(self) -> None:
        self._values: dict[str, list[torch.Tensor]] = {}

    def __bool__(self) -> bool:
        return bool(self._values)

    def add(self, metrics: Any) -> None:
        """Record one step's metrics (a nested TensorDict or mapping of scalars)."""
        for name, t in flat_metrics(metrics).items():
            self._values.setdefault(name, []).append(t)

    def clear(self) -> None:
        """Drop the values without reading them (ranks other than 0 log nothing)."""
        self._values = {}

    def pending(self) -> dict[str, list[str]]:
        """The values since the last :meth:`pop`, exact (``float.hex``), to carry across a restart.

        Each value as :meth:`pop` would average it (float64 on CPU and CUDA),
        read to the host.

        Example:
            >>> import torch
            >>> buf = MetricBuffer(); buf.add({"loss": torch.tensor(0.5)})
            >>> buf.pending()
            {'loss': ['0x1.0000000000000p-1']}
        """
        out: dict[str, list[str]] = {}
        for name, vals in self._values.items():
            dt = _acc_dtype(vals[0].device)
            host = torch.stack([v.to(device=vals[0].device, dtype=dt) for v in vals]).cpu()
            out[name] = [float(x).hex() for x in host.tolist()]
        return out

    def restore(self, pending: Mapping[str, Any]) -> None:
        """Put back values saved by :meth:`pending` (as float64 CPU tensors, before any new ones).

        Raises:
            ValueError: ``pending`` is not ``{name: [float.hex strings]}``.

        Example:
            >>> buf = MetricBuffer(); buf.restore({"loss": ["0x1.0p-1"]})
            >>> buf.pop()
            {'loss': 0.5}
        """
        for name, vals in pending.items():
            if not isinstance(name, str) or not isinstance(vals, list):
                raise ValueError(f"pending metrics: bad entry {name!r}: {vals!r}")
            try:
                ts = [torch.tensor(float.fromhex(v), dtype=torch.float64) for v in vals]
            except (TypeError, ValueError) as e:
                raise ValueError(f"pending metrics: bad values of {name!r}: {vals!r}") from e
            self._values[name] = ts + self._values.get(name, [])

    def pop(self) -> dict[str, float]:
        """The means since the last pop, as Python floats; empties the buffer."""
        names = list(self._values)
        by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        for name in names:
            vals = self._values[name]
            dev = vals[0].device
            dt = _acc_dtype(dev)
            mean = torch.stack([v.to(device=dev, dtype=dt) for v in vals]).mean()
            by_device.setdefault(dev, []).append((name, mean))
        self._values = {}
        out: dict[str, float] = {}
        for group in by_device.values():
            host = torch.stack([m for _, m in group]).cpu().tolist()
            out.update({name: float(v) for (name, _), v in zip(group, host, strict=True)})
        return {name: out[name] for name in names}
