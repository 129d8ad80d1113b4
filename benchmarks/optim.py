"""AdamW step time and peak extra memory: purestep (donated, pure) vs ``torch.optim.AdamW``.

Run: ``python benchmarks/optim.py [--rounds 7] [--iters 5]``; on a GPU
``python benchmarks/optim.py --device cuda [--dtype bf16]``.

Model: a GPT-like parameter list, ~24.8M fp32 params in 148 tensors of mixed
sizes (12 blocks of d=384: qkv, out, mlp weights, biases, layer norms; token
and position embeddings). Grads are fixed random tensors. With ``--device
cuda`` the default model is GPT-2-medium-sized (d=1024, 24 blocks, vocabulary
50304: ~355M params in 292 tensors; ``--model small`` keeps the CPU one), in
``--dtype`` (fp32 or bf16; the moments are in the params' dtype, as torch's).

Variants (same hyperparameters, each with its own params/grads/state):

* ``purestep donated``: ``opt.step(grads, state, params, donate=True)``.
* ``purestep pure``: ``params, state = opt.step(grads, state, params)`` (new
  buffers each step; the old ones are dropped, as in a training loop).
* ``torch fused``: ``torch.optim.AdamW(fused=True)``.
* ``torch foreach``: ``torch.optim.AdamW(foreach=True)``.

Timing: after warmup, ``--rounds`` rounds of ``--iters`` iterations; each
iteration runs every variant once, in an order rotated per iteration, so load
from other processes hits all variants alike. A variant's time in a round is
the median of its iterations; the table shows the median over rounds, and each
ratio is the median over rounds of the ratio of the two variants' times *in
the same round*.

The "min" columns (fastest iteration of each variant) are shown beside the
medians: on a shared machine, other processes inflate medians; the minimum is
the least disturbed estimate of a variant's own cost.

Bandwidth limit: ``a.add_(b)`` on two 256 MB tensors, timed interleaved with
the variants, gives the achievable memory bandwidth ``BW = 3 * 256 MB / t``. An AdamW step must at
least read params, grads, exp_avg, exp_avg_sq and write params, exp_avg,
exp_avg_sq: ``7 * 4 * N`` bytes in fp32 (``7 * 2 * N`` in bf16), so
``t_min = 28 N / BW``; the table's "of BW limit" column is ``t_min / t``.

On CUDA each call is timed by CUDA events after a synchronize (see
``benchmarks/_device.py``) and the peak extra memory is the CUDA allocator's
peak during one step beyond what was allocated before it.

Peak extra memory: one step of each variant runs under
``torch.profiler.profile(profile_memory=True)``; every CPU allocator
allocation and free is a ``[memory]`` event with a signed byte count. The
running sum of those, in time order, peaks at the largest amount of memory the
step held beyond what existed before it (temporaries and, for the pure path,
the new params and moments it returns). Reported in units of the parameter
bytes (``4 N``).

Allocator: glibc's defaults make large allocations ``mmap``-backed and give
freed memory back to the OS, so allocating paths pay page faults on fresh
memory each step and their times swing with allocator state. The script
re-executes itself with ``MALLOC_MMAP_THRESHOLD_`` (32 MiB, the largest glibc
accepts; every tensor here is smaller) and ``MALLOC_TRIM_THRESHOLD_`` (64 GiB)
fixed before torch is imported, so freed buffers are reused.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable

_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024), "MALLOC_TRIM_THRESHOLD_": str(64 << 30)}
if any(os.environ.get(k) != v for k, v in _ENV.items()):
    os.environ.update(_ENV)
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch  # noqa: E402
from _device import (  # noqa: E402
    bandwidth_probe,
    cuda_peak_bytes,
    device_arg,
    parse_device,
    seconds,
)
from tensordict import TensorDict  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from purestep import optim  # noqa: E402

LR, WD = 1e-3, 0.01


def param_shapes(d: int = 384, layers: int = 12, vocab: int = 8192, ctx: int = 1024) -> dict:
    """Nested dict of shapes: 148 tensors, ~24.8M params at the defaults."""
    shapes: dict = {"tok_emb": (vocab, d), "pos_emb": (ctx, d)}
    for i in range(layers):
        shapes[f"h{i}"] = {
            "ln1": {"weight": (d,), "bias": (d,)},
            "attn": {"qkv": {"weight": (3 * d, d), "bias": (3 * d,)}},
            "proj": {"weight": (d, d), "bias": (d,)},
            "ln2": {"weight": (d,), "bias": (d,)},
            "fc1": {"weight": (4 * d, d), "bias": (4 * d,)},
            "fc2": {"weight": (d, 4 * d), "bias": (d,)},
        }
    shapes["ln_f"] = {"weight": (d,), "bias": (d,)}
    return shapes


MODELS = {
    "small": {"d": 384, "layers": 12, "vocab": 8192, "ctx": 1024},
    "medium": {"d": 1024, "layers": 24, "vocab": 50304, "ctx": 1024},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_tree(
    shapes: dict,
    gen: torch.Generator,
    scale: float,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> TensorDict:
    def build(node: dict) -> dict:
        return {
            k: build(v)
            if isinstance(v, dict)
            else (torch.randn(v, generator=gen) * scale).to(device=device, dtype=dtype)
            for k, v in node.items()
        }

    return TensorDict(build(shapes), batch_size=[])


class Variant:
    """One optimizer setup with its own buffers; ``run()`` does one step."""

    def __init__(self, name: str, run: Callable[[], None]) -> None:
        self.name, self.run = name, run
        self.times: list[list[float]] = []  # per round

    def round_medians(self) -> list[float]:
        return [statistics.median(ts) for ts in self.times]


def purestep_variant(params: TensorDict, grads: TensorDict, donate: bool) -> Variant:
    opt = optim.adamw(lr=LR, weight_decay=WD)
    box = {"p": params.clone(), "s": opt.init(params)}

    def run() -> None:
        box["p"], box["s"] = opt.step(grads, box["s"], box["p"], donate=donate)

    return Variant("purestep adamw " + ("donated" if donate else "pure"), run)


def torch_variant(params: TensorDict, grads: TensorDict, kind: str) -> Variant:
    ps = [torch.nn.Parameter(t.clone()) for t in params.values(True, True)]
    for p, g in zip(ps, grads.values(True, True), strict=True):
        p.grad = g.clone()
    opt = torch.optim.AdamW(ps, lr=LR, weight_decay=WD, **{kind: True})
    return Variant(f"torch AdamW({kind}=True)", opt.step)


def peak_extra_bytes(fn: Callable[[], None], device: torch.device) -> int:
    """Peak memory held during ``fn()`` beyond what existed before it (CPU: profiler events)."""
    if device.type == "cuda":
        return cuda_peak_bytes(fn, device)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    device_arg(ap)
    ap.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    ap.add_argument("--model", choices=list(MODELS), help="default: small on CPU, medium on CUDA")
    args = ap.parse_args()
    device = parse_device(args.device)
    dtype = DTYPES[args.dtype]
    size = args.model or ("medium" if device.type == "cuda" else "small")

    gen = torch.Generator().manual_seed(0)
    shapes = param_shapes(**MODELS[size])
    params = make_tree(shapes, gen, 0.02, device, dtype)
    grads = make_tree(shapes, gen, 1e-3, device, dtype)
    leaves = list(params.values(True, True))
    n = sum(t.numel() for t in leaves)
    elem = leaves[0].element_size()
    param_bytes = elem * n

    variants = [
        purestep_variant(params, grads, donate=True),
        purestep_variant(params, grads, donate=False),
        torch_variant(params, grads, "fused"),
        torch_variant(params, grads, "foreach"),
    ]
    probe_fn, probe_bytes = bandwidth_probe(device, gen)
    probe = Variant("in-place add", probe_fn)
    timed = [*variants, probe]
    for v in timed:
        for _ in range(args.warmup):
            v.run()
    k = 0
    for _ in range(args.rounds):
        for v in timed:
            v.times.append([])
        for _ in range(args.iters):
            k = (k + 1) % len(timed)
            for v in timed[k:] + timed[:k]:
                v.times[-1].append(seconds(v.run, device))

    bw = probe_bytes / statistics.median(probe.round_medians())
    t_min = 7 * elem * n / bw
    peaks = {v.name: peak_extra_bytes(v.run, device) / param_bytes for v in variants}
    med = {v.name: statistics.median(v.round_medians()) for v in variants}
    by_name = {v.name: v for v in variants}

    def ratio(a: str, b: str) -> float:
        """Median over rounds of time(a) / time(b) in the same round."""
        ra, rb = by_name[a].round_medians(), by_name[b].round_medians()
        return statistics.median(x / y for x, y in zip(ra, rb, strict=True))

    fused_name, foreach_name = "torch AdamW(fused=True)", "torch AdamW(foreach=True)"

    where = (
        f"{torch.get_num_threads()} threads"
        if device.type == "cpu"
        else f"{torch.cuda.get_device_name(device)}, CUDA events"
    )
    print(
        f"AdamW step, {n / 1e6:.1f}M {args.dtype} params in {len(leaves)} tensors, "
        f"torch {torch.__version__}, {device.type}: {where}, "
        f"{args.rounds} rounds x {args.iters} iters (interleaved), medians"
    )
    print(
        f"memory bandwidth (in-place add): {bw / 1e9:.1f} GB/s -> "
        f"AdamW limit {t_min * 1e3:.1f} ms ({7 * elem} bytes/param)\n"
    )
    fastest = {v.name: min(min(ts) for ts in v.times) for v in variants}
    print(
        "| variant | median ms | vs torch fused | of BW limit | min ms | min vs fused "
        "| peak extra (param copies) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for v in variants:
        m = med[v.name]
        print(
            f"| {v.name} | {m * 1e3:.1f} | {ratio(v.name, fused_name):.2f}x | {t_min / m:.0%} | "
            f"{fastest[v.name] * 1e3:.1f} | {fastest[v.name] / fastest[fused_name]:.2f}x | "
            f"{peaks[v.name]:.3f} |"
        )
    donated, pure = "purestep adamw donated", "purestep adamw pure"
    print()
    print(f"donated / torch fused   = {ratio(donated, fused_name):.3f}  (target <= 1.05)")
    print(f"donated peak extra      = {peaks[donated]:.4f}  (target <= 0.05)")
    print(f"pure / torch foreach    = {ratio(pure, foreach_name):.3f}  (target <= 1.5)")
    print(f"pure / torch fused      = {ratio(pure, fused_name):.3f}")


if __name__ == "__main__":
    main()
