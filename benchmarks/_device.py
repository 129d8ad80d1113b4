"""Device helpers shared by the benchmarks: one timer for CPU and CUDA, bandwidth, peak memory.

On CPU a call is timed by the wall clock (``time.perf_counter``), as the CPU
benchmarks always did. On CUDA it is timed by CUDA events around the call,
after a ``torch.cuda.synchronize()``, and read after the end event completes:
the time from the first kernel's start to the last one's end, including any
time the GPU waits for the host to launch work (which is what a launch-bound
step costs).

Example:
    >>> import torch  # doctest: +SKIP
    >>> seconds(lambda: torch.ones(3), torch.device("cpu")) >= 0  # doctest: +SKIP
    True
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

__all__ = ["bandwidth_probe", "cuda_peak_bytes", "device_arg", "parse_device", "seconds"]


def device_arg(ap: argparse.ArgumentParser) -> None:
    """Add ``--device {cpu,cuda}`` (default cpu: the CPU tables and targets stay as they were)."""
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu (wall clock) or cuda (CUDA events, memory from the CUDA allocator)",
    )


def parse_device(name: str) -> torch.device:
    """The device, or exit with a clear message when CUDA is asked for but absent."""
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False on this machine")
    return torch.device(name)


def seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds one ``fn()`` takes: wall clock on CPU, CUDA events on CUDA."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    torch.cuda.synchronize(device)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def bandwidth_probe(
    device: torch.device, gen: torch.Generator, mib: int = 256
) -> tuple[Callable[[], None], int]:
    """``a.add_(b)`` on two ``mib``-MiB fp32 tensors (read a, read b, write a) and its bytes."""
    n = mib * 1024 * 1024 // 4
    a = torch.randn(n, generator=gen).to(device)
    b = torch.randn(n, generator=gen).to(device)

    def run() -> None:
        a.add_(b)

    return run, 3 * 4 * n


def cuda_peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak CUDA memory allocated during ``fn()`` beyond what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before
