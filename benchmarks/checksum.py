"""Checksum throughput: the measurement behind checkpoint integrity's choice of ``xxh3_64``.

Run: ``python benchmarks/checksum.py [--mb 64] [--rounds 7]``.

Candidates (one CPU thread):

* ``zlib.crc32`` and ``zlib.adler32``: the standard library, no new dependency;
* ``xxhash.xxh3_64`` / ``xxh64`` / ``xxh3_128`` (the ``xxhash`` package);
* ``crc32c`` (the ``crc32c`` package, hardware CRC32C), when installed;
* a vectorised torch hash: the sum of the data as int64 words times odd weights
  (wrapping), which detects any single-bit flip; ``int32 sum`` is its cheapest form.

Two measurements, each the median (and range) over ``--rounds`` interleaved rounds:

* ``cold``: one call over a ``--mb`` buffer that does not fit in cache (what
  hashing a tensor after writing it would cost);
* ``hot``: one 512 KiB piece hashed again and again (it stays in cache): what
  purestep's writer and reader pay, since they hash each 512 KiB piece right
  after copying it to or from the file.

Prints a markdown table of GB/s.
"""

from __future__ import annotations

import argparse
import statistics
import time
import zlib
from collections.abc import Callable

import torch
import xxhash

CHUNK = 1 << 19


def candidates() -> dict[str, Callable[[memoryview], object]]:
    """Every checksum to time, by name."""
    weights: dict[int, torch.Tensor] = {}

    def weighted(mv: memoryview) -> int:
        x = torch.frombuffer(mv, dtype=torch.int64)
        w = weights.get(x.numel())
        if w is None:
            w = weights[x.numel()] = torch.arange(x.numel(), dtype=torch.int64).mul_(2).add_(1)
        return int((x * w).sum())

    def int32_sum(mv: memoryview) -> int:
        return int(torch.frombuffer(mv, dtype=torch.int32).sum(dtype=torch.int64))

    out: dict[str, Callable[[memoryview], object]] = {
        "zlib.crc32": zlib.crc32,
        "zlib.adler32": zlib.adler32,
        "xxhash.xxh3_64": xxhash.xxh3_64_intdigest,
        "xxhash.xxh64": xxhash.xxh64_intdigest,
        "xxhash.xxh3_128": xxhash.xxh3_128_intdigest,
        "torch weighted int64 sum": weighted,
        "torch int32 sum": int32_sum,
    }
    try:
        import crc32c  # type: ignore[import-not-found]

        out["crc32c (package)"] = crc32c.crc32c
    except ImportError:
        pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    src = torch.randint(0, 256, (args.mb << 20,), dtype=torch.uint8)
    mv = memoryview(src.numpy())
    piece = mv[:CHUNK]
    reps = max(1, (args.mb << 20) // CHUNK)
    n = src.numel()
    fns = candidates()
    cold: dict[str, list[float]] = {k: [] for k in fns}
    hot: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(args.rounds + 1):
        names = list(fns)
        k = r % len(names)
        for name in names[k:] + names[:k]:
            fn = fns[name]
            t = time.perf_counter()
            fn(mv)
            cold[name].append(time.perf_counter() - t)
            t = time.perf_counter()
            for _ in range(reps):
                fn(piece)
            hot[name].append(time.perf_counter() - t)
        if r == 0:  # warm-up
            for v in (*cold.values(), *hot.values()):
                v.clear()

    def gbs(times: list[float]) -> str:
        return (
            f"{n / statistics.median(times) / 1e9:.2f} "
            f"({n / max(times) / 1e9:.2f}-{n / min(times) / 1e9:.2f})"
        )

    print(f"### checksums over {args.mb} MiB, one thread, medians of {args.rounds} rounds\n")
    print("| checksum | cold GB/s (range) | hot 512 KiB pieces, GB/s (range) |")
    print("|---|---:|---:|")
    for name in sorted(fns, key=lambda k: statistics.median(cold[k])):
        print(f"| {name} | {gbs(cold[name])} | {gbs(hot[name])} |")


if __name__ == "__main__":
    main()
