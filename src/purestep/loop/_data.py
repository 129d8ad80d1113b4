"""The loop's view of ``data``: re-iterated passes, a saved position, and stateful loaders."""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["DataStream", "decode_state", "encode_state"]


def encode_state(obj: Any) -> torch.Tensor:
    """A data loader's ``state_dict()`` as a uint8 tensor (``torch.save`` bytes).

    Example:
        >>> decode_state(encode_state({"epoch": 3, "seen": [1, 2]}))
        {'epoch': 3, 'seen': [1, 2]}
    """
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def decode_state(t: torch.Tensor) -> Any:
    """Inverse of :func:`encode_state` (``torch.load(weights_only=True)``: no code runs).

    Example:
        >>> decode_state(encode_state([1.5]))
        [1.5]
    """
    return torch.load(io.BytesIO(t.cpu().numpy().tobytes()), weights_only=True)


def _set_epoch(data: Any, epoch: int) -> None:
    for obj in (data, getattr(data, "sampler", None)):
        fn = getattr(obj, "set_epoch", None)
        if callable(fn):
            fn(epoch)
            return


class DataStream:
    """Batches from ``data``, re-iterated when exhausted, with a position that can be restored.

    Position: ``consumed`` (batches taken in the whole run), ``epoch`` (passes
    completed) and ``position`` (batches taken in the current pass). Before each
    pass, ``data.set_epoch(epoch)`` (or ``data.sampler.set_epoch``) is called
    when it exists, so shuffling samplers such as ``DistributedSampler`` give
    each pass its own, reproducible order.

    ``data`` is *stateful* when it has ``state_dict()`` and ``load_state_dict()``
    (torchdata's ``StatefulDataLoader``): its state is saved and restored.
    Otherwise a restored position is reached by skipping batches of a fresh
    pass, which is exact when iterating ``data`` is deterministic given the
    pass number.
    """

    def __init__(self, data: Iterable[Any]) -> None:
        if not isinstance(data, Iterable):
            raise TypeError(f"data is a {type(data).__name__}; expected an iterable of batches")
        self.data = data
        self.stateful = callable(getattr(data, "state_dict", None)) and callable(
            getattr(data, "load_state_dict", None)
        )
        self.consumed = 0
        self.epoch = 0
        self.position = 0
        self._it: Iterator[Any] | None = None

    def check_state(self) -> None:
        """Fail early if a stateful ``data``'s state cannot be saved as plain containers."""
        if not self.stateful:
            return
        sd = self.data.state_dict()  # type: ignore[attr-defined]
        try:
            decode_state(encode_state(sd))
        except Exception as e:
            raise TypeError(
                f"data.state_dict() of {type(self.data).__name__} cannot be checkpointed: it must "
                f"hold only tensors, numbers, strings and lists/dicts of them ({e})"
            ) from e

    def _begin_pass(self) -> None:
        _set_epoch(self.data, self.epoch)
        self._it = iter(self.data)

    def next(self) -> Any:
        """The next batch, starting a new pass when the current one is exhausted."""
        if self._it is None:
            self._begin_pass()
        assert self._it is not None
        try:
            batch = next(self._it)
        except StopIteration:
            if self.position == 0:
                raise ValueError(self._empty_message()) from None
            self.epoch += 1
            self.position = 0
            self._begin_pass()
            try:
                batch = next(self._it)
            except StopIteration:
                raise ValueError(self._empty_message()) from None
        self.position += 1
        self.consumed += 1
        return batch

    def _empty_message(self) -> str:
        what = type(self.data).__name__
        if self.epoch == 0:
            return f"data ({what}) yielded no batches"
        return (
            f"data ({what}) yielded no batches in pass {self.epoch} after {self.consumed} "
            "batches in earlier passes; the loop re-iterates data when it is exhausted, so "
            "pass a re-iterable (a list, a DataLoader), not a one-shot iterator or generator"
        )

    def per_rank(self) -> dict[str, torch.Tensor]:
        """This rank's position (and loader state) as tensors for a checkpoint."""
        out = {
            "epoch": torch.tensor(self.epoch, dtype=torch.int64),
            "position": torch.tensor(self.position, dtype=torch.int64),
        }
        if self.stateful:
            out["data_state"] = encode_state(self.data.state_dict())  # type: ignore[attr-defined]
        return out

    def restore(self, consumed: int, epoch: int, position: int, data_state: Any | None) -> None:
        """Continue from a saved position: load the loader's state, or skip to ``position``."""
        self.consumed, self.epoch, self.position = consumed, epoch, position
        if data_state is not None:
            self.data.load_state_dict(data_state)  # type: ignore[attr-defined]
            self._begin_pass()
            return
        self._begin_pass()
        assert self._it is not None
        for i in range(position):
            try:
                next(self._it)
            except StopIteration:
                raise ValueError(
                    f"cannot restore the data position: pass {epoch} of data "
                    f"({type(self.data).__name__}) has {i} batches, but the checkpoint was "
                    f"saved after {position} batches of it; did the data change?"
                ) from None

    def skip(self, consumed: int) -> None:
        """Reach a position known only as a batch count: skip ``consumed`` batches from the start."""
        for _ in range(consumed):
            self.next()
