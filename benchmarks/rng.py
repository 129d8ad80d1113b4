"""purestep.rng draws against torch's own generator, on CPU or CUDA, side by side in one process.

Run: ``python benchmarks/rng.py [--rounds 7]`` (CPU) or ``python benchmarks/rng.py
--device cuda``.

For each draw and size, purestep's draw (from a CPU key, as in a training step)
is timed against torch's generator doing the same job on the same device:

* ``normal``: ``rng.normal(key, n)`` vs ``torch.randn(n, generator=g)``;
  ``normal, index``: ``rng.normal(key, (64, n / 64), index=arange(64))`` (per-sample
  rows, the training path) vs ``torch.randn``.
* ``uniform``: ``rng.uniform`` vs ``torch.rand``.
* ``randint``: ``rng.randint(key, 0, 1000, n)`` vs ``torch.randint`` (int64).
* ``bernoulli``: ``rng.bernoulli(key, 0.3, n)`` vs ``torch.bernoulli(full(n, 0.3))``.
* ``randperm``: ``rng.randperm(key, n)`` vs ``torch.randperm`` (sort-bound).

All floats are float32. Timing: after warm-up (which on CUDA includes compiling
the fused kernels), ``--rounds`` rounds; in each round every variant runs once
per repetition, interleaved, and is timed by the wall clock (CPU) or by CUDA
events after a synchronize (CUDA; see ``benchmarks/_device.py``). The table
shows medians over rounds; the ratio is the median over rounds of
``purestep / torch`` measured in the same round.

Bandwidth limit: ``a.add_(b)`` on two 256 MB tensors, timed the same way, gives
the achievable bandwidth ``BW``; a draw must at least write its output
(``n * itemsize`` bytes), so ``t_min = bytes / BW`` and the "of BW limit"
column is ``t_min / t`` (randperm's sort is not bandwidth-bound: no figure).

On CUDA the script also times the eager int64 path (``eager ms``: the fused
kernels off) and checks agreement with the CPU: integer, uniform and bernoulli
draws bitwise, normal's largest difference in units of float32 epsilon times
``max(1, |z|)`` (documented bound: 8).

Example:
    >>> import subprocess, sys  # doctest: +SKIP
    >>> subprocess.run([sys.executable, "benchmarks/rng.py", "--rounds", "3"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from _device import bandwidth_probe, device_arg, parse_device, seconds

from purestep import _rng_dispatch, rng

Draw = Callable[[], torch.Tensor]


def cases(n: int, device: torch.device, gen: torch.Generator) -> dict[str, tuple[Draw, Draw, int]]:
    """name -> (purestep draw, torch draw, output bytes)."""
    k = rng.fold_in(rng.key(0), 1)  # a CPU key, as state["rng"] gives
    rows = 64
    idx = torch.arange(rows, device=device)
    half = torch.full((n,), 0.3, device=device)
    f4, i8 = 4 * n, 8 * n
    return {
        "normal": (
            lambda: rng.normal(k, n, device=device),
            lambda: torch.randn(n, device=device, generator=gen),
            f4,
        ),
        "normal, index": (
            lambda: rng.normal(k, (rows, n // rows), index=idx),
            lambda: torch.randn(rows, n // rows, device=device, generator=gen),
            f4,
        ),
        "uniform": (
            lambda: rng.uniform(k, n, device=device),
            lambda: torch.rand(n, device=device, generator=gen),
            f4,
        ),
        "randint": (
            lambda: rng.randint(k, 0, 1000, n, device=device),
            lambda: torch.randint(0, 1000, (n,), device=device, generator=gen),
            i8,
        ),
        "bernoulli": (
            lambda: rng.bernoulli(k, 0.3, n, device=device),
            lambda: torch.bernoulli(half, generator=gen),
            f4,
        ),
        "randperm": (
            lambda: rng.randperm(k, n, device=device),
            lambda: torch.randperm(n, device=device, generator=gen),
            0,
        ),
    }


def eager(fn: Draw) -> Draw:
    """``fn`` with the fused kernels off (the eager int64 path)."""

    def run() -> torch.Tensor:
        saved = _rng_dispatch.kernels
        _rng_dispatch.kernels = lambda dev: None  # type: ignore[assignment]
        try:
            return fn()
        finally:
            _rng_dispatch.kernels = saved  # type: ignore[assignment]

    return run


def agreement(device: torch.device) -> list[str]:
    """CUDA vs CPU: exact draws bitwise, normal's largest difference in eps * max(1, |z|)."""
    k, n, idx = rng.key(5), 1 << 20, torch.arange(8)
    lines = []
    exact = {
        "uniform": lambda d, i: rng.uniform(k, (8, n // 8), index=i, device=d),
        "randint": lambda d, i: rng.randint(k, -7, 1000, (8, n // 8), index=i, device=d),
        "bernoulli": lambda d, i: rng.bernoulli(k, 0.3, (8, n // 8), index=i, device=d),
        "randperm": lambda d, i: rng.randperm(k, 4096, index=i, device=d),
    }
    for name, f in exact.items():
        same = torch.equal(f(device, idx.to(device)).cpu(), f(torch.device("cpu"), idx))
        lines.append(f"{name}: CUDA == CPU bitwise: {same}")
    cpu = rng.normal(k, (8, n // 8), index=idx).double()
    for label, fn in (
        ("fused kernel", lambda: rng.normal(k, (8, n // 8), index=idx.to(device))),
        ("eager CUDA", eager(lambda: rng.normal(k, (8, n // 8), index=idx.to(device)))),
    ):
        z = fn().double().cpu()
        units = ((z - cpu).abs() / (torch.finfo(torch.float32).eps * cpu.abs().clamp_min(1))).max()
        lines.append(f"normal ({label}) vs CPU: max |diff| = {float(units):.2f} eps * max(1, |z|)")
    z_f = rng.normal(k, (8, n // 8), index=idx.to(device))
    z_e = eager(lambda: rng.normal(k, (8, n // 8), index=idx.to(device)))()
    lines.append(f"normal fused kernel == eager CUDA bitwise: {torch.equal(z_f, z_e)}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=3, help="timed calls per variant per round")
    ap.add_argument("--sizes", type=int, nargs="*", help="values per draw (default per device)")
    device_arg(ap)
    args = ap.parse_args()
    device = parse_device(args.device)
    cuda = device.type == "cuda"
    sizes = args.sizes or ([1 << 20, 1 << 24, 1 << 26] if cuda else [1 << 20])
    gen = torch.Generator(device=device).manual_seed(0)
    probe, probe_bytes = bandwidth_probe(device, torch.Generator().manual_seed(1))
    where = torch.cuda.get_device_name(device) if cuda else f"{torch.get_num_threads()} threads"
    print(
        f"purestep.rng vs torch's generator, torch {torch.__version__}, {device.type} ({where}), "
        f"{args.rounds} rounds x {args.reps} reps (interleaved), medians\n"
    )
    head = "| draw | values | purestep ms | torch ms | purestep / torch | of BW limit |"
    rule = "|---|---:|---:|---:|---:|---:|"
    if cuda:
        head, rule = head + " eager ms | eager / torch |", rule + "---:|---:|"
    rows, bws = [], []
    for n in sizes:
        table = cases(n, device, gen)
        timed: dict[str, Draw] = {"probe": probe}
        for name, (ours, theirs, _) in table.items():
            timed[f"{name}/purestep"], timed[f"{name}/torch"] = ours, theirs
            if cuda:
                timed[f"{name}/eager"] = eager(ours)
        for fn in timed.values():  # warm-up: kernel compiles, allocator, the one-time check
            fn()
            fn()
        times: dict[str, list[float]] = {name: [] for name in timed}
        names = list(timed)
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            per: dict[str, list[float]] = {name: [] for name in names}
            for _ in range(args.reps):
                for name in order:
                    per[name].append(seconds(timed[name], device))
            for name in names:
                times[name].append(statistics.median(per[name]))
        bw = probe_bytes / statistics.median(times["probe"])
        bws.append(bw)
        for name, (_, _, nbytes) in table.items():
            ours, theirs = times[f"{name}/purestep"], times[f"{name}/torch"]
            ratio = statistics.median(a / b for a, b in zip(ours, theirs, strict=True))
            t = statistics.median(ours)
            frac = f"{nbytes / bw / t:.0%}" if nbytes else "-"
            line = (
                f"| {name} | {n:,} | {1e3 * t:.3f} | {1e3 * statistics.median(theirs):.3f} | "
                f"{ratio:.2f}x | {frac} |"
            )
            if cuda:
                e = times[f"{name}/eager"]
                er = statistics.median(a / b for a, b in zip(e, theirs, strict=True))
                line += f" {1e3 * statistics.median(e):.3f} | {er:.1f}x |"
            rows.append((name, n, ratio, line))
    print(f"memory bandwidth (in-place add): {statistics.median(bws) / 1e9:.1f} GB/s\n")
    print(head)
    print(rule)
    for *_, line in rows:
        print(line)
    big = [r for name, n, r, _ in rows if name.startswith("normal") and n >= 1 << 20]
    if big and cuda:  # the target is for CUDA; the CPU path is the eager reference
        print(f"\nnormal / torch.randn for >= 1M values: worst {max(big):.2f}x (target <= 1.5)")
    if cuda:
        print("\nagreement with the CPU (1M values):")
        for line in agreement(device):
            print(f"  {line}")


if __name__ == "__main__":
    main()
