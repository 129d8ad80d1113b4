"""What purestep's misuse checks cost per step (issue 11), measured two ways.

Usage::

    python benchmarks/checks.py                   # small case, donated and pure steps
    python benchmarks/checks.py --case large --slots 200

1. **The checks alone**, timed on the states of ``benchmarks/step.py``'s cases:
   ``check_state`` when the state's structure was checked before (the cache
   hit every training step takes), registering the returned state's nodes, the
   donation mark (a new top-level node and one attribute), the batch-index
   bookkeeping; and a full check (a cache miss: a state new to purestep).
2. **A/B, interleaved**: the same ``train_step`` (fused AdamW, ``grad_norm=False``)
   on two copies of the model, one with the checks, one with them patched out
   (``check_state``, ``remember``, the donation mark and ``fresh_top``, the
   batch checks). Times in (1) are thread CPU time. Each slot runs one step of each (the order alternating);
   the ratio is the median over slots of ``with / without`` measured in the
   same slot, with its interquartile range, for wall and thread CPU time.

The machine this runs on is shared: read the IQR, not only the median.

Example:
    >>> import subprocess, sys  # doctest: +SKIP
    >>> subprocess.run([sys.executable, "benchmarks/checks.py", "--slots", "50"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from step import LR, WEIGHT_DECAY, build, mse  # benchmarks/step.py (the script's folder)

import purestep
from purestep import optim
from purestep.step import _batch, _donation, _train, _validate

_TRAIN_NAMES = ("check_state", "remember", "mark_donated", "fresh_top", "check_live")
_BATCH_NAMES = ("_check_not_empty", "_remember_distinct")
_ON = {n: getattr(_train, n) for n in _TRAIN_NAMES}
_ON_BATCH = {n: getattr(_batch, n) for n in _BATCH_NAMES}


def _noop(*_: Any, **__: Any) -> None:
    return None


_OFF: dict[str, Callable[..., Any]] = {
    "check_state": _noop,
    "remember": _noop,
    "mark_donated": _noop,
    "fresh_top": lambda s: s,
    "check_live": _noop,
}
_OFF_BATCH: dict[str, Callable[..., Any]] = {"_check_not_empty": _noop, "_remember_distinct": _noop}


def _checks(on: bool) -> None:
    for name, fn in (_ON if on else _OFF).items():
        setattr(_train, name, fn)
    for name, fn in (_ON_BATCH if on else _OFF_BATCH).items():
        setattr(_batch, name, fn)


def _median_us(fn: Callable[[], object], n: int = 2000) -> float:
    """Median thread CPU time of ``fn`` (a shared machine's waiting is not counted)."""
    ts = []
    for _ in range(n):
        t0 = time.thread_time()
        fn()
        ts.append(time.thread_time() - t0)
    return 1e6 * statistics.median(ts)


def checks_alone(case: str) -> dict[str, float]:
    """Microseconds per call of each check on the case's state (medians)."""
    model, batch = build(case)
    opts = {"student": optim.adamw(lr=LR, weight_decay=WEIGHT_DECAY)}
    state = purestep.init_state({"student": model}, opts, seed=0)
    t0 = time.thread_time()
    _validate.check_state(state, opts, who="bench", donate=True, cached=False)
    first = 1e6 * (time.thread_time() - t0)
    out = {"full check, first (us)": first}
    out["full check, same structure (us)"] = _median_us(
        lambda: _validate.check_state(state, opts, who="bench", donate=True, cached=False), n=20
    )
    out["check_state, checked before (us)"] = _median_us(
        lambda: _validate.check_state(state, opts, who="bench", donate=True)
    )
    out["remember returned nodes (us)"] = _median_us(lambda: _validate.remember(state, opts))
    out["fresh_top (us)"] = _median_us(lambda: _donation.fresh_top(state))

    def mark() -> None:
        _donation.mark_donated(_donation.fresh_top(state), "bench")

    out["mark_donated (us)"] = _median_us(mark) - out["fresh_top (us)"]
    idx = torch.arange(batch["x"].shape[0])
    out["index bookkeeping (us)"] = _median_us(lambda: _batch._remember_distinct(idx))
    out["per step, total (us)"] = sum(
        out[k]
        for k in (
            "check_state, checked before (us)",
            "remember returned nodes (us)",
            "fresh_top (us)",
            "mark_donated (us)",
            "index bookkeeping (us)",
        )
    )
    return out


def _variant(case: str, donate: bool) -> list[Any]:
    model, batch = build(case)

    def loss_fn(p: Any, b: Any, key: torch.Tensor) -> Any:
        return mse(purestep.call(model, p["student"], b["x"]), b["y"]), {}

    opts = {"student": optim.adamw(lr=LR, weight_decay=WEIGHT_DECAY)}
    step = purestep.train_step(
        purestep.value_and_grad(loss_fn), opts, donate=donate, grad_norm=False
    )
    state = purestep.init_state({"student": model}, opts, seed=0)
    model.to("meta")
    return [step, state, batch]


def _run(v: list[Any], on: bool) -> tuple[float, float]:
    _checks(on)
    t0, c0 = time.perf_counter(), time.thread_time()
    v[1], _ = v[0](v[1], v[2])
    return time.perf_counter() - t0, time.thread_time() - c0


def ab(case: str, donate: bool, slots: int) -> dict[str, Any]:
    """Interleaved steps with and without the checks: per-slot ratios."""
    with_checks, without = _variant(case, donate), _variant(case, donate)
    try:
        for _ in range(5):
            _run(with_checks, True)
            _run(without, False)
        wall, cpu, t_on, t_off = [], [], [], []
        for i in range(slots):
            if i % 2:
                a, b = _run(with_checks, True), _run(without, False)
            else:
                b, a = _run(without, False), _run(with_checks, True)
            wall.append(a[0] / b[0])
            cpu.append(a[1] / b[1])
            t_on.append(a[0])
            t_off.append(b[0])
    finally:
        _checks(True)
    wq, cq = statistics.quantiles(wall, n=4), statistics.quantiles(cpu, n=4)
    return {
        "ms with": 1e3 * statistics.median(t_on),
        "ms without": 1e3 * statistics.median(t_off),
        "wall": (statistics.median(wall), wq[0], wq[2]),
        "cpu": (statistics.median(cpu), cq[0], cq[2]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default="small", choices=["small", "large", "accum"])
    parser.add_argument("--slots", type=int, default=300, help="A/B slots (0: checks alone)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, {os.cpu_count()} CPUs, load {os.getloadavg()}")
    for name, us in checks_alone(args.case).items():
        print(f"{args.case}: {name:36s} {us:10.1f}")
    for donate in (True, False) if args.slots else ():
        r = ab(args.case, donate, args.slots)
        print(
            f"{args.case} donate={donate}: {r['ms with']:.2f} ms with checks, "
            f"{r['ms without']:.2f} ms without; with/without over {args.slots} slots: "
            f"wall {r['wall'][0]:.4f} (IQR {r['wall'][1]:.4f}-{r['wall'][2]:.4f}), "
            f"CPU {r['cpu'][0]:.4f} (IQR {r['cpu'][1]:.4f}-{r['cpu'][2]:.4f})"
        )


if __name__ == "__main__":
    main()
