"""``purestep.compile`` against eager and compiled imperative loops, side by side in one process.

Usage::

    python benchmarks/compile.py                    # all cases: timing, compile times, memory
    python benchmarks/compile.py --case small       # one case: small | large | accum
    python benchmarks/compile.py --quick            # 3 rounds of 3 steps, no cold compiles
    python benchmarks/compile.py --device cuda      # on a GPU (adds CUDA graphs: reduce-overhead)

Cases (the models and batches of ``benchmarks/step.py``):

* ``small``: 75 residual ``tanh(Linear(116, 116))`` layers, 1.02M params in 150
  tensors, batch 64.
* ``large``: a 12-block pre-LN transformer, 25.0M params in 148 tensors, batch 4 x 16.
* ``accum``: ``large`` with batch 8 x 16 in ``accumulate(4)`` microbatches.

Variants (same model, batch and initial weights; AdamW lr 1e-4, weight decay 0.01):

* ``eager loop``: ``zero_grad``, forward, ``backward`` (per microbatch, loss
  scaled by its share), ``torch.optim.AdamW(fused=True).step()``.
* ``compiled loop``: PyTorch's own recipe: the same loop with
  ``torch.compile(model)`` and a ``torch.compile``d ``opt.step()`` (``AdamW``
  with a tensor learning rate, its foreach path compiled by inductor), as in
  the "Compiling the optimizer with torch.compile" tutorial. The anchor to beat.
* ``purestep``: ``train_step(value_and_grad(loss_fn), {"student": adamw},
  donate=True, grad_norm=False)`` (``accumulate(grad_fn, 4)`` for ``accum``):
  the same work as the loop.
* ``purestep.compile``: that step through :func:`purestep.compile` (on CUDA
  also ``mode="reduce-overhead"``: the donated step in a CUDA graph).

Timing: every variant is built and compiled (warm-up) first, then all run
*interleaved*, each step slot running one step of every variant in an order
that reverses between slots. Ratios are ``eager loop time / variant time``
(speed-ups) per slot, and the table gives their median (and inter-quartile
range) over all slots, from wall time and from process CPU time (one intra-op
thread: the CPU time leaves out waiting for a core on a shared machine).

Compile times: each compiled variant is built in a fresh subprocess with an
empty inductor cache directory (*cold*), then again in another fresh process
with the cache the first one left (*warm*); the time is that of the first
step (trace + compile + run) minus a normal step.

Peak memory: each variant in a fresh subprocess. On CPU,
``torch.profiler.profile(profile_memory=True)`` records every allocation of
the c10 CPU allocator from the model's construction on; *step peak* is the
largest total of live tensor bytes during three steps after warm-up (weights,
optimizer state, grads, activations, temporaries). On CUDA,
``torch.cuda.max_memory_allocated`` over the same steps.

Example:
    >>> import subprocess, sys  # doctest: +SKIP
    >>> subprocess.run([sys.executable, "benchmarks/compile.py", "--quick", "--case", "small"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

import purestep
from purestep import optim, tree

_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("purestep_bench_step", _HERE / "step.py")
assert _spec is not None and _spec.loader is not None
bench_step = importlib.util.module_from_spec(_spec)
sys.modules["purestep_bench_step"] = bench_step
_spec.loader.exec_module(bench_step)

CASES: dict[str, dict[str, Any]] = bench_step.CASES
LR = 1e-4
WEIGHT_DECAY = 0.01
VARIANTS = ("eager loop", "compiled loop", "purestep", "purestep.compile")
COMPILED = ("compiled loop", "purestep.compile")
# targets from issue 14: speed-up vs the eager loop, on CPU / on an H200
TARGETS = {
    "cpu": {"small": 1.4, "large": 1.1, "accum": None},
    "cuda": {"small": 3.0, "large": None, "accum": None},
}
TARGET_VS_COMPILED = {"cpu": {"small": 1.0, "large": 1.0}, "cuda": {"large": 1.2}}
MEM_TARGET = 1.05
COLD_TARGET_S = {"small": 60.0}

StepFn = Callable[[], None]


def build(case: str, device: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The case's model and batch (identical on every call) on ``device``."""
    model, batch = bench_step.build(case)
    return model.to(device), {k: v.to(device) for k, v in batch.items()}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def eager_loop(model: torch.nn.Module, batch: dict[str, torch.Tensor], k: int) -> StepFn:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    return _loop(model, model, batch, k, lambda: opt.step(), opt)


def compiled_loop(model: torch.nn.Module, batch: dict[str, torch.Tensor], k: int) -> StepFn:
    """``torch.compile(model)`` and a compiled ``opt.step()`` (PyTorch's recipe)."""
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(
        model.parameters(), lr=torch.tensor(LR, device=device), weight_decay=WEIGHT_DECAY
    )

    @torch.compile(fullgraph=False)
    def opt_step() -> None:
        opt.step()

    return _loop(model, torch.compile(model), batch, k, opt_step, opt)


def _loop(
    model: torch.nn.Module,
    fwd: Callable[..., torch.Tensor],
    batch: dict[str, torch.Tensor],
    k: int,
    opt_step: Callable[[], None],
    opt: torch.optim.Optimizer,
) -> StepFn:
    x, y = batch["x"], batch["y"]
    b = x.shape[0]
    sizes = purestep.step.microbatch_sizes(b, k)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        if k == 1:
            bench_step.mse(fwd(x), y).backward()
        else:
            start = 0
            for n in sizes:
                xs, ys = x[start : start + n], y[start : start + n]
                start += n
                (bench_step.mse(fwd(xs), ys) * (n / b)).backward()
        opt_step()

    step.model = model  # type: ignore[attr-defined]
    return step


def purestep_step(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    k: int,
    *,
    compiled: bool,
    mode: str | None = None,
) -> StepFn:
    """``train_step`` (donated, no grad-norm metric: the loop's work), maybe compiled."""

    def loss_fn(
        params: TensorDictBase, b: TensorDictBase, key: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return bench_step.mse(purestep.call(model, params["student"], b["x"]), b["y"]), {}

    opts = {"student": optim.adamw(lr=LR, weight_decay=WEIGHT_DECAY)}
    grad_fn = purestep.value_and_grad(loss_fn)
    if k > 1:
        grad_fn = purestep.accumulate(grad_fn, k)
    train: Any = purestep.train_step(grad_fn, opts, donate=True, grad_norm=False)
    if compiled:
        train = purestep.compile(train, mode=mode)
    holder = {"state": purestep.init_state({"student": model}, opts, seed=0)}
    model.to("meta")  # the state owns the weights; the module is a template

    def step() -> None:
        holder["state"], _ = train(holder["state"], batch)

    step.holder = holder  # type: ignore[attr-defined]
    step.train = train  # type: ignore[attr-defined]
    return step


def make(case: str, variant: str, device: str) -> StepFn:
    model, batch = build(case, device)
    k = CASES[case]["k"]
    if variant == "eager loop":
        return eager_loop(model, batch, k)
    if variant == "compiled loop":
        return compiled_loop(model, batch, k)
    mode = "reduce-overhead" if device == "cuda" else None
    return purestep_step(model, batch, k, compiled=variant == "purestep.compile", mode=mode)


def weights(fn: StepFn) -> list[torch.Tensor]:
    if hasattr(fn, "holder"):
        return tree.leaves(fn.holder["state"]["params", "student"])  # type: ignore[attr-defined]
    return tree.leaves(TensorDict.from_module(fn.model).detach())  # type: ignore[attr-defined]


def max_diff(a: StepFn, b: StepFn) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(weights(a), weights(b), strict=True))


# ----------------------------------------------------------------------------- timing


def _q(xs: list[float], q: float) -> float:
    return (
        statistics.quantiles(xs, n=4, method="inclusive")[0 if q < 0.5 else 2]
        if len(xs) > 1
        else xs[0]
    )


def time_case(
    case: str, device: str, rounds: int, steps: int, warmup: int
) -> tuple[dict[str, Any], dict[str, float]]:
    """Interleaved step times; speed-ups vs the eager loop; weights' drift from the eager loop."""
    fns = {}
    setup = {}
    for v in VARIANTS:
        t0 = time.perf_counter()
        fns[v] = make(case, v, device)
        for _ in range(warmup):
            fns[v]()
        _sync(device)
        setup[v] = time.perf_counter() - t0
    wall: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        gc.collect()
        for i in range(steps):
            order = VARIANTS if (r * steps + i) % 2 == 0 else VARIANTS[::-1]
            for v in order:
                _sync(device)
                w0, c0 = time.perf_counter(), time.process_time()
                fns[v]()
                _sync(device)
                c1, w1 = time.process_time(), time.perf_counter()
                wall[v].append(w1 - w0)
                cpu[v].append(c1 - c0)
    out: dict[str, Any] = {}
    base = "eager loop"
    for v in VARIANTS:
        sw = [b / a for a, b in zip(wall[v], wall[base], strict=True)]
        sc = [b / a for a, b in zip(cpu[v], cpu[base], strict=True)]
        sv = [b / a for a, b in zip(wall[v], wall["compiled loop"], strict=True)]
        out[v] = {
            "ms": 1e3 * statistics.median(wall[v]),
            "cpu_ms": 1e3 * statistics.median(cpu[v]),
            "speedup": statistics.median(sw),
            "speedup_iqr": (_q(sw, 0.25), _q(sw, 0.75)),
            "cpu_speedup": statistics.median(sc),
            "cpu_speedup_iqr": (_q(sc, 0.25), _q(sc, 0.75)),
            "vs_compiled_loop": statistics.median(sv),
            "setup_s": setup[v],
        }
    drift = {v: max_diff(fns[v], fns[base]) for v in VARIANTS if v != base}
    return out, drift


# ----------------------------------------------------------------------------- subprocess probes


def compile_child(case: str, variant: str, device: str) -> dict[str, float]:
    """First step (trace + compile + run) and a later step, in this fresh process."""
    t0 = time.perf_counter()
    fn = make(case, variant, device)
    t1 = time.perf_counter()
    fn()
    _sync(device)
    t2 = time.perf_counter()
    later = []
    for _ in range(3):
        t3 = time.perf_counter()
        fn()
        _sync(device)
        later.append(time.perf_counter() - t3)
    step_s = statistics.median(later)
    out = {"build_s": t1 - t0, "first_step_s": t2 - t1, "compile_s": t2 - t1 - step_s}
    train = getattr(fn, "train", None)
    if train is not None and hasattr(train, "stats"):
        st = train.stats()
        out["trace_s"] = sum(st.trace_s)
        out["inductor_s"] = sum(st.compile_s)
    return out


def memory_child(case: str, variant: str, device: str, steps: int = 3) -> dict[str, float]:
    """Peak bytes during ``steps`` steps after warm-up (see the module docstring)."""
    if device == "cuda":
        fn = make(case, variant, device)
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        return {"step_peak_mb": torch.cuda.max_memory_allocated() / 2**20}
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn = make(case, variant, device)
        for _ in range(2):
            fn()
        with record_function("purestep_bench_steps"):
            for _ in range(steps):
                fn()
    kineto = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
    t_steps = min(e.start_ns() for e in kineto if e.name() == "purestep_bench_steps")
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in kineto
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    live = step_peak = 0
    for t, nbytes in events:
        live += nbytes
        if t >= t_steps:
            step_peak = max(step_peak, live)
    return {"step_peak_mb": step_peak / 2**20}


def _child(args: list[str], env: dict[str, str] | None = None) -> dict[str, float]:
    cmd = [sys.executable, os.path.abspath(__file__), *args]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{res.stderr[-4000:]}")
    out: dict[str, float] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def compile_times(case: str, variant: str, device: str, threads: int) -> dict[str, float]:
    """Cold (empty cache dir) and warm (the cache the cold run left) first-step compile times."""
    with tempfile.TemporaryDirectory(prefix="purestep-inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        args = ["--_compile", case, variant, device, "--threads", str(threads)]
        cold = _child(args, env)
        warm = _child(args, env)
    return {
        "cold_s": cold["compile_s"],
        "warm_s": warm["compile_s"],
        **{f"cold_{k}": v for k, v in cold.items()},
    }


# ----------------------------------------------------------------------------- report


def _met(ok: bool | None) -> str:
    return "" if ok is None else ("met" if ok else "**not met**")


def report(
    device: str,
    results: dict[str, dict[str, Any]],
    drift: dict[str, dict[str, float]],
    compiles: dict[tuple[str, str], dict[str, float]],
    mem: dict[tuple[str, str], dict[str, float]],
) -> str:
    nan = float("nan")
    lines = [
        "| case | variant | step ms | speed-up vs eager loop, wall (IQR) | CPU-time speed-up "
        "| vs compiled loop | target | cold / warm compile s | step peak MB (vs eager loop) "
        "| max weight diff vs eager loop |",
        "|---|---|---:|---|---:|---:|---|---|---|---:|",
    ]
    for case, res in results.items():
        for v, r in res.items():
            tgt = []
            t = TARGETS[device].get(case) if v == "purestep.compile" else None
            if t is not None:
                tgt.append(f">= {t}x: {_met(r['speedup'] >= t)}")
            tv = TARGET_VS_COMPILED[device].get(case) if v == "purestep.compile" else None
            if tv is not None:
                tgt.append(
                    f"> compiled loop{'' if tv == 1.0 else f' x{tv}'}: {_met(r['vs_compiled_loop'] > tv if tv == 1.0 else r['vs_compiled_loop'] >= tv)}"
                )
            c = compiles.get((case, v))
            cs = ""
            if c:
                cs = f"{c['cold_s']:.0f} / {c['warm_s']:.0f}"
                ct = (
                    COLD_TARGET_S.get(case) if v == "purestep.compile" and device == "cpu" else None
                )
                if ct is not None:
                    tgt.append(f"cold <= {ct:.0f} s: {_met(c['cold_s'] <= ct)}")
            m = mem.get((case, v), {}).get("step_peak_mb", nan)
            mb = mem.get((case, "eager loop"), {}).get("step_peak_mb", nan)
            ms = "" if m != m else (f"{m:.1f}" if v == "eager loop" else f"{m:.1f} ({m / mb:.3f})")
            if v.startswith("purestep") and m == m:
                tgt.append(f"mem <= {MEM_TARGET}x: {_met(m / mb <= MEM_TARGET)}")
            (lo, hi) = r["speedup_iqr"]
            d = drift.get(case, {}).get(v)
            lines.append(
                f"| {case} | {v} | {r['ms']:.2f} | {r['speedup']:.3f} ({lo:.2f}-{hi:.2f}) | "
                f"{r['cpu_speedup']:.3f} | {r['vs_compiled_loop']:.3f} | {'; '.join(tgt)} | {cs} | "
                f"{ms} | {'' if d is None else f'{d:.2e}'} |"
            )
    return "\n".join(lines)


def _reexec_with_malloc_env() -> None:
    missing = {k: v for k, v in bench_step.MALLOC_ENV.items() if k not in os.environ}
    if missing:
        os.environ.update(missing)
        os.execv(sys.executable, [sys.executable, *sys.argv])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--case", choices=[*CASES, "all"], default="all")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant per round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="3 rounds of 3 steps, no cold compiles")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: default)")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--no-compile-times", action="store_true")
    ap.add_argument("--json", type=str, default=None, help="also write the results here")
    ap.add_argument("--_compile", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--_memory", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    _reexec_with_malloc_env()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args._compile:
        print(json.dumps(compile_child(*args._compile)))
        return
    if args._memory:
        print(json.dumps(memory_child(*args._memory)))
        return
    if args.quick:
        args.rounds, args.steps, args.no_compile_times = 3, 3, True
    cases = list(CASES) if args.case == "all" else [args.case]
    results: dict[str, dict[str, Any]] = {}
    drift: dict[str, dict[str, float]] = {}
    compiles: dict[tuple[str, str], dict[str, float]] = {}
    mem: dict[tuple[str, str], dict[str, float]] = {}
    for case in cases:
        if not args.no_compile_times:
            for v in COMPILED:
                compiles[case, v] = compile_times(case, v, args.device, args.threads)
                print(f"# {case} / {v}: {compiles[case, v]}", flush=True)
        results[case], drift[case] = time_case(
            case, args.device, args.rounds, args.steps, args.warmup
        )
        print(f"# {case}: {json.dumps(results[case])}", flush=True)
        if not args.no_memory:
            for v in VARIANTS:
                mem[case, v] = _child(
                    ["--_memory", case, v, args.device, "--threads", str(args.threads)]
                )
    print(
        f"\ntorch {torch.__version__}, device {args.device}, {torch.get_num_threads()} thread(s), "
        f"{args.rounds} rounds x {args.steps} steps\n"
    )
    print(report(args.device, results, drift, compiles, mem))
    if args.json:
        blob = {
            "results": results,
            "drift": drift,
            "compiles": {f"{c}/{v}": x for (c, v), x in compiles.items()},
            "memory": {f"{c}/{v}": x for (c, v), x in mem.items()},
        }
        Path(args.json).write_text(json.dumps(blob, indent=1))


if __name__ == "__main__":
    main()
