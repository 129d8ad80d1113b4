"""Checkpoint throughput: ``purestep.checkpoint`` vs raw ``torch.save`` vs the disk itself.

Run: ``python benchmarks/checkpoint.py [--mb 200] [--rounds 5] [--dir /tmp]``.

State: an AdamW training state of about ``--mb`` MB: fp32 params of a GPT-like
shape mix (12 blocks: qkv, out, two MLP weights, biases, norms; embeddings),
their ``mu`` and ``nu`` moments, an int64 count, a float64 lr, rng and step.

Measured, in one process, interleaved (each round runs every variant once, in
a rotated order) and reported as medians over ``--rounds`` after one warm-up
round:

* ``disk write + fsync``: one ``write`` of a bytes buffer of the state's size,
  then ``fsync``: what the disk (and page cache) accepts.
* ``torch.save + fsync``: the flat ``{key: tensor}`` dict in one file, fsynced
  (durable, like a checkpoint must be). ``torch.save`` alone (page cache only)
  is listed too.
* ``ckpt.save``: ``purestep.checkpoint.save`` (DCP write with fsync, every
  record hashed with ``xxh3_64``, ``metadata.json``, atomic no-replace rename).
  ``ckpt.save (no checksums)`` is the same save with the hasher replaced by a
  no-op, to show what the checksums cost (a benchmark-only patch: that
  checkpoint would fail verification).
* ``ckpt.save async_``: time until ``save(..., async_=True)`` returns (the
  training loop is blocked only this long: flatten, stage a CPU copy into
  reused buffers, start the background thread), and the time until
  ``wait()`` returns. The first async save of a run also allocates the staging
  buffers (page faults); that warm-up value is reported separately.
* ``ckpt.load`` (every record's checksum verified, the default),
  ``ckpt.load (verify=False)`` and ``torch.load``: read back into fresh tensors.

Two states are measured: the GPT-like AdamW state (hundreds of small and
medium tensors) and one of 48 equal large tensors, because DCP's cost has a
per-tensor part (each tensor is its own record) on top of the per-byte part.
Stock DCP's zip records cost about 0.2 ms each here; purestep's non-zip
records (``purestep.distributed._storage``) a few tens of microseconds.

Throughput is state bytes / median time. Files are removed after each
measurement; reads come from the page cache (it is not dropped).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tensordict import TensorDict

from purestep import checkpoint as ckpt
from purestep.distributed import _ckpt_integrity


class _NoHash:
    """Stands in for the xxh3_64 hasher in the no-checksum comparison."""

    def update(self, data: object) -> None:
        pass

    def hexdigest(self) -> str:
        return "0" * 16


def make_state(mb: float) -> TensorDict:
    """An AdamW state (params, mu, nu: same shapes) of about ``mb`` megabytes in total."""

    def total_mb(
        d: int,
    ) -> float:  # params: embeddings (8192 + 1024) d + 12 blocks of 12 d^2 + 13 d
        return 3 * 4 * (9216 * d + 12 * (12 * d * d + 13 * d)) / 1e6

    d = 16
    while total_mb(d + 16) <= mb:
        d += 16
    g = torch.Generator().manual_seed(0)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    params: dict[str, object] = {"tok": t(8192, d), "pos": t(1024, d)}
    for i in range(12):
        params[f"h{i}"] = {
            "qkv": {"weight": t(3 * d, d), "bias": t(3 * d)},
            "out": {"weight": t(d, d), "bias": t(d)},
            "fc1": {"weight": t(4 * d, d), "bias": t(4 * d)},
            "fc2": {"weight": t(d, 4 * d), "bias": t(d)},
            "ln1": {"weight": t(d), "bias": t(d)},
            "ln2": {"weight": t(d), "bias": t(d)},
        }
    p = TensorDict(params, [])
    return TensorDict(
        {
            "params": {"student": p},
            "opt_state": {
                "student": {
                    "count": torch.tensor(1000),
                    "lr": torch.tensor(3e-4, dtype=torch.float64),
                    "mu": p.apply(lambda x: torch.randn(x.shape, generator=g)),
                    "nu": p.apply(lambda x: torch.rand(x.shape, generator=g)),
                }
            },
            "rng": torch.tensor(1234567),
            "step": torch.tensor(1000),
        },
        [],
    )


def make_big_tensor_state(mb: float) -> TensorDict:
    """About ``mb`` megabytes in 48 equal fp32 tensors, plus rng and step (few, large leaves)."""
    n = int(mb * 1e6 / 4 / 48)
    g = torch.Generator().manual_seed(1)
    return TensorDict(
        {
            "params": {f"w{i}": torch.randn(n, generator=g) for i in range(48)},
            "rng": torch.tensor(7),
            "step": torch.tensor(1),
        },
        [],
    )


def nbytes(state: TensorDict) -> int:
    return sum(v.numel() * v.element_size() for v in state.values(True, True))


def bench(title: str, state: TensorDict, rounds: int, base: Path) -> None:
    """Time every variant on ``state`` (interleaved rounds) and print a markdown table."""
    size = nbytes(state)
    flat = {".".join(k): v for k, v in state.items(True, True)}
    like = state.apply(torch.zeros_like)
    blob = os.urandom(1 << 20) * (size >> 20)
    times: dict[str, list[float]] = {}
    first_async_block: list[float] = []

    def timed(name: str, fn: Callable[[], None]) -> None:
        t = time.perf_counter()
        fn()
        times.setdefault(name, []).append(time.perf_counter() - t)

    def disk() -> None:
        with open(base / "raw.bin", "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())

    def tsave(fsync: bool) -> Callable[[], None]:
        def run() -> None:
            with open(base / "ts.pt", "wb") as f:
                torch.save(flat, f)
                f.flush()
                if fsync:
                    os.fsync(f.fileno())

        return run

    def csave() -> None:
        ckpt.save(state, base / "c")

    def csave_nohash() -> None:
        real = _ckpt_integrity.hasher
        _ckpt_integrity.hasher = _NoHash  # type: ignore[assignment]
        try:
            ckpt.save(state, base / "n")
        finally:
            _ckpt_integrity.hasher = real

    def casync() -> None:  # records its own two timings
        t = time.perf_counter()
        h = ckpt.save(state, base / "a", async_=True)
        blocked = time.perf_counter() - t
        h.wait()
        total = time.perf_counter() - t
        if not first_async_block:
            first_async_block.append(blocked)
        else:
            times.setdefault("ckpt.save async_ (blocked)", []).append(blocked)
            times.setdefault("ckpt.save async_ (until wait returns)", []).append(total)

    def cload() -> None:
        ckpt.load(base / "c", like=like)

    def cload_noverify() -> None:
        ckpt.load(base / "c", like=like, verify=False)

    def tload() -> None:
        torch.load(base / "ts.pt", weights_only=True)

    def cleanup() -> None:
        for p in ("raw.bin", "ts.pt"):
            (base / p).unlink(missing_ok=True)
        for p in ("c", "a", "n"):
            shutil.rmtree(base / p, ignore_errors=True)

    writers: list[tuple[str, Callable[[], None]]] = [
        ("disk write + fsync", disk),
        ("torch.save + fsync", tsave(True)),
        ("torch.save (no fsync)", tsave(False)),
        ("ckpt.save", csave),
        ("ckpt.save (no checksums)", csave_nohash),
        ("ckpt.save async_", casync),
    ]
    readers: list[tuple[str, Callable[[], None]]] = [
        ("ckpt.load", cload),
        ("ckpt.load (verify=False)", cload_noverify),
        ("torch.load", tload),
    ]
    for r in range(rounds + 1):
        k = r % len(writers)
        for name, fn in writers[k:] + writers[:k]:
            timed(name, fn)
        for name, fn in readers[k % 3 :] + readers[: k % 3]:
            timed(name, fn)
        if r == 0:  # warm-up round
            times.clear()
        cleanup()
    ckpt.release_staging_buffers()

    med = {k: statistics.median(v) for k, v in times.items()}
    gb = size / 1e9
    ref = med["torch.save + fsync"]
    print(f"### {title}: {size / 1e6:.0f} MB in {len(flat)} tensors, medians of {rounds} rounds\n")
    print("| operation | median s | GB/s | vs torch.save + fsync |")
    print("|---|---:|---:|---:|")
    times.pop("ckpt.save async_", None)
    for name in [
        "disk write + fsync",
        "torch.save + fsync",
        "torch.save (no fsync)",
        "ckpt.save",
        "ckpt.save (no checksums)",
        "ckpt.save async_ (blocked)",
        "ckpt.save async_ (until wait returns)",
        "torch.load",
        "ckpt.load",
        "ckpt.load (verify=False)",
    ]:
        t = med[name]
        print(f"| {name} | {t:.3f} | {gb / t:.2f} | {ref / t:.2f}x |")
    print(
        f"| ckpt.save async_ (blocked), first save: new buffers | {first_async_block[0]:.3f} | | |"
    )
    print()

    def ratios(a: str, b: str) -> str:
        """median and range of the per-round ratios time(b) / time(a) (a's throughput vs b's)."""
        r = sorted(tb / ta for ta, tb in zip(times[a], times[b], strict=True))
        return f"{statistics.median(r):.2f} (rounds {r[0]:.2f}-{r[-1]:.2f})"

    print(
        f"- sync save throughput / torch.save+fsync, checksums on: "
        f"{ratios('ckpt.save', 'torch.save + fsync')} (target >= 0.70); without: "
        f"{ratios('ckpt.save (no checksums)', 'torch.save + fsync')}"
    )
    print(
        f"- load throughput / torch.load, verified: {ratios('ckpt.load', 'torch.load')} "
        f"(target >= 0.80); verify=False: {ratios('ckpt.load (verify=False)', 'torch.load')}"
    )
    print(
        f"- sync save throughput / torch.save (no fsync): "
        f"{med['torch.save (no fsync)'] / med['ckpt.save']:.2f}"
    )
    block = med["ckpt.save async_ (blocked)"] / med["ckpt.save"]
    print(f"- async blocked / sync save time: {block:.2f} (target <= 0.25)\n")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--mb", type=float, default=200.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    base = Path(tempfile.mkdtemp(prefix="purestep-bench-", dir=args.dir))
    try:
        bench("GPT-like AdamW state", make_state(args.mb), args.rounds, base)
        bench("48 large tensors", make_big_tensor_state(args.mb), args.rounds, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
