"""The whole donated step in one CUDA graph (``mode="reduce-overhead"``).

A donated compiled step reads and writes the same state buffers every step,
so the graph's state inputs have fixed addresses: exactly what a CUDA graph
needs. Inductor's own CUDA graphs (cudagraph trees) do not know that: given a
graph that mutates its inputs they skip capture ("mutated inputs", measured on
the issue's H200 run), and they copy every other input into static buffers.
So purestep captures the compiled step itself:

* the first call of a variant runs normally (warm-up: kernels load, cuBLAS
  allocates its workspace), on a side stream;
* the second call captures the step into a ``torch.cuda.CUDAGraph`` (a pool
  shared by the step's graphs) and replays it; later calls copy the inputs
  that change every step (step key, learning rates, the batch) into the
  captured buffers and replay: one launch for the whole step;
* the state leaves must be the captured ones; a state with other buffers (a
  checkpoint loaded, a fresh state) is captured anew, once;
* graph outputs live in the graph's memory and are overwritten by the next
  replay: metrics are cloned for the caller; state leaves that the step sets
  anew (a clip norm) stay the graph's, which donation allows.

Only graphs whose used inputs are all on one CUDA device and whose optimizers
read no host value (``_kernels.FusedPlan``) are captured; the others run as
compiled, and ``stats().cudagraph_skipped`` says why. The logic is written
against a small :class:`Capturer` interface so that tests on a machine without
a GPU run it with :class:`EmulatedCapturer` (capture = remember the call,
replay = rerun it into the same output tensors).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

__all__ = ["Capturer", "CudaCapturer", "EmulatedCapturer", "StepGraph", "used_inputs"]

Fn = Callable[..., Sequence[torch.Tensor]]


class Replay(Protocol):
    """One captured graph."""

    def replay(self) -> None: ...


class Capturer(Protocol):
    """How graphs are warmed up, captured and replayed."""

    def warmup(self, fn: Fn, inputs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]: ...

    def capture(
        self, fn: Fn, inputs: Sequence[torch.Tensor]
    ) -> tuple[Replay, Sequence[torch.Tensor]]: ...


class CudaCapturer:
    """``torch.cuda.CUDAGraph`` capture on a side stream, one memory pool for a step's graphs."""

    def __init__(self) -> None:
        self.pool: Any = None
        self.stream: Any = None

    def _side(self) -> Any:
        if self.stream is None:
            self.stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        return self.stream

    def warmup(self, fn: Fn, inputs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """Run ``fn`` once on the capture stream (the warm-up the CUDA graph docs ask for)."""
        s = self._side()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            out = fn(*inputs)
        torch.cuda.current_stream().wait_stream(s)
        return out

    def capture(
        self, fn: Fn, inputs: Sequence[torch.Tensor]
    ) -> tuple[Replay, Sequence[torch.Tensor]]:
        """Record ``fn(*inputs)`` (nothing runs) into a new graph of this capturer's pool."""
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, pool=self.pool, stream=self._side()):
            out = fn(*inputs)
        return graph, out


class _EmulatedReplay:
    def __init__(
        self, fn: Fn, inputs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]
    ) -> None:
        self.fn, self.inputs, self.outs = fn, list(inputs), list(outs)
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        for o, n in zip(self.outs, self.fn(*self.inputs), strict=True):
            o.copy_(n)  # outputs live in the "graph's" memory, as with CUDA graphs


class EmulatedCapturer:
    """A stand-in for :class:`CudaCapturer` on machines without a GPU (tests).

    ``capture`` runs nothing (as a CUDA graph capture) and returns outputs
    that each replay overwrites in place; ``replay`` reruns the function on
    the captured input tensors. Counts captures and replays.

    Example:
        >>> cap = EmulatedCapturer()
        >>> x = torch.ones(2)
        >>> g, (out,) = cap.capture(lambda t: [t * 2], [x])
        >>> g.replay(); out
        tensor([2., 2.])
    """

    def __init__(self) -> None:
        self.captures = 0
        self.warmups = 0

    def warmup(self, fn: Fn, inputs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """Run ``fn`` once."""
        self.warmups += 1
        return fn(*inputs)

    def capture(
        self, fn: Fn, inputs: Sequence[torch.Tensor]
    ) -> tuple[Replay, Sequence[torch.Tensor]]:
        """Remember the call; the outputs are placeholders until the first replay."""
        self.captures += 1
        outs = [torch.empty_like(t) for t in fn(*[t.clone() for t in inputs])]
        return _EmulatedReplay(fn, inputs, outs), outs


def used_inputs(gm: torch.fx.GraphModule) -> list[int]:
    """Indices of the graph's inputs that some op reads (unused ones need no static buffer).

    Example:
        >>> from purestep.compile._trace import trace
        >>> used_inputs(trace(lambda a, b: [a + 1], [torch.ones(1), torch.ones(1)]).gm)
        [0]
    """
    return [i for i, n in enumerate(gm.graph.find_nodes(op="placeholder")) if n.users]


class StepGraph:
    """A compiled variant run under a whole-step CUDA graph (see the module docstring).

    Args:
        fn: the compiled graph, ``fn(*inputs) -> outputs``.
        static: indices of the inputs that must keep their address (state leaves).
        copied: indices of the inputs copied into captured buffers each call.
        capturer: how to capture (:class:`CudaCapturer` on CUDA).
    """

    def __init__(
        self, fn: Fn, static: Sequence[int], copied: Sequence[int], capturer: Capturer
    ) -> None:
        self.fn = fn
        self.static = list(static)
        self.copied = list(copied)
        self.capturer = capturer
        self.warmed = False
        self.graph: Replay | None = None
        self.inputs: list[torch.Tensor] = []
        self.outs: Sequence[torch.Tensor] = ()
        self.captures = 0

    def _same_state(self, leaves: Sequence[torch.Tensor]) -> bool:
        mine = self.inputs
        return all(leaves[i] is mine[i] for i in self.static)

    def __call__(self, *leaves: torch.Tensor) -> Sequence[torch.Tensor]:
        """Run the step: warm-up, capture, then replays; returns the graph's (static) outputs."""
        if not self.warmed:
            self.warmed = True
            return self.capturer.warmup(self.fn, leaves)
        if self.graph is None or not self._same_state(leaves):
            inputs = list(leaves)
            for i in self.copied:
                inputs[i] = leaves[i].clone()
            self.graph = None  # drop the old graph (and its hold on the old buffers) first
            self.graph, self.outs = self.capturer.capture(self.fn, inputs)
            self.inputs = inputs
            self.captures += 1
        else:
            mine = self.inputs
            for i in self.copied:
                mine[i].copy_(leaves[i], non_blocking=True)
        self.graph.replay()
        return self.outs
