"""What each private torch/tensordict internal saves over its public alternative (docs/internals.md).

Usage::

    python benchmarks/internals.py            # both models, markdown table
    python benchmarks/internals.py --quick    # fewer rounds (a smoke run)

On the two models of ``benchmarks/step.py`` (``small``: 150 tensors, 1.0M
params; ``large``: 148 tensors, 25M params), each row times the private path
purestep takes and the public one it would otherwise take, for the same work:

* the AdamW update: the direct ``torch._fused_adamw_`` call on leaf lists (as
  ``optim.adamw`` makes it), the functional ``torch.optim.adam.adam(...,
  fused=True, decoupled_weight_decay=True)`` (no underscore, though not in
  torch's documented API; it calls the same kernel), and a
  ``torch.optim.AdamW(fused=True)`` object built per step around the state's
  tensors (``.grad`` and ``optimizer.state`` filled in, then cleared): the only
  fully public way without keeping an optimizer object between steps;
* the functional call's parameter swap: ``step._swap``'s ``plan_for`` /
  ``swap`` / ``restore`` (writes ``module.__dict__["_parameters"]`` directly)
  vs ``params.to_module(module)``;
* leaf walks over the params tree: ``tree.leaves`` (``TensorDict._tensordict``)
  vs ``td.values(include_nested=True, leaves_only=True)``, and ``tree.rebuild``
  (``_tensordict`` + ``TensorDict._new_unsafe``) vs ``td.apply``;
* the global grad norm: ``tree.global_norm`` (``torch._foreach_norm``) vs a
  per-tensor ``torch.linalg.vector_norm`` loop (``torch.nn.utils.get_total_norm``
  is public but calls the same ``_foreach_norm``);
* the EMA update: ``torch._foreach_lerp_`` vs a per-tensor ``lerp_`` loop;
* checkpoint records: ``torch.save(t, f, _use_new_zipfile_serialization=False)``
  per tensor vs the default zip format (what stock DCP writes), all leaves of
  the model plus AdamW state.

Then whole steps, A/B: the same ``train_step`` with one group of private paths
switched off by monkeypatching purestep (nothing else changes), so calls made
several times per step are all counted:

* ``tensordict private API off``: the ``tree`` walkers take the public
  TensorDict API (``values``, ``apply``) and ``tree.plain_td`` the checked
  ``TensorDict(...)`` constructor (``_with_roles`` still reads ``_tensordict``);
* ``fast swap off``: ``call`` swaps with ``params.to_module``, the path it
  takes when a global parameter-registration hook is installed.

The last column puts the difference into proportion: (public - private) as a
percentage of one purestep ``train_step(donate=True)`` on that model, measured
in the same process (for the checkpoint row, of one save of all records).
Each cell is the median process CPU time over rounds in which every variant
runs back to back (interleaved, so a slow second of a shared machine hits all).

Example:
    >>> import subprocess, sys  # doctest: +SKIP
    >>> subprocess.run([sys.executable, "benchmarks/internals.py", "--quick"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict
from torch.optim.adam import adam as adam_functional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step import LR, WEIGHT_DECAY, build, mse

import purestep
from purestep import optim, tree
from purestep.step import _call, _swap

Fn = Callable[[], Any]


def _time(fns: dict[str, Fn], rounds: int, n: int) -> dict[str, float]:
    """Median µs of process CPU time per call of each fn, rounds interleaved."""
    per: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        for _ in range(3):
            fn()
    for r in range(rounds):
        order = list(fns.items()) if r % 2 == 0 else list(reversed(fns.items()))
        for name, fn in order:
            t0 = time.process_time()
            for _ in range(n):
                fn()
            per[name].append(1e6 * (time.process_time() - t0) / n)
    return {k: statistics.median(v) for k, v in per.items()}


def _adam_fns(params: TensorDict) -> dict[str, Fn]:
    p = [t.clone() for t in tree.leaves(params)]
    g = [torch.randn_like(t) * 1e-3 for t in p]
    mu = [torch.zeros_like(t) for t in p]
    nu = [torch.zeros_like(t) for t in p]
    steps = [torch.ones((), dtype=torch.float32) for _ in p]
    kw: dict[str, Any] = {
        "lr": LR,
        "beta1": 0.9,
        "beta2": 0.999,
        "weight_decay": WEIGHT_DECAY,
        "eps": 1e-8,
        "amsgrad": False,
        "maximize": False,
    }

    def direct() -> None:
        torch._fused_adamw_(p, g, mu, nu, [], steps, **kw)

    def functional() -> None:
        adam_functional(p, g, mu, nu, [], steps, fused=True, decoupled_weight_decay=True, **kw)

    def public_object() -> None:
        opt = torch.optim.AdamW(p, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        for t, grad, m, v, s in zip(p, g, mu, nu, steps, strict=True):
            t.grad = grad
            opt.state[t] = {"step": s, "exp_avg": m, "exp_avg_sq": v}
        opt.step()
        for t in p:
            t.grad = None

    return {
        "torch._fused_adamw_ (direct)": direct,
        "torch.optim.adam.adam(fused=True, decoupled_weight_decay=True)": functional,
        "torch.optim.AdamW(fused=True) per step": public_object,
    }


@contextlib.contextmanager
def _patched(obj: Any, **attrs: Any) -> Iterator[None]:
    old = {k: getattr(obj, k) for k in attrs}
    for k, v in attrs.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(obj, k, v)


def _public_tensordict() -> contextlib.AbstractContextManager[None]:
    """``tree`` without ``_tensordict`` walks and ``_new_unsafe`` (its generic paths)."""
    return _patched(
        tree,
        _collect_leaves=lambda td, out: False,
        _collect_items=lambda td, prefix, keys, vals: False,
        _first_plain=lambda td: (False, None),
        _map_plain=lambda like, fn, out: None,
        _same_structure=lambda a, b, check_shapes: False,
        plain_td=lambda items, batch_size=(): TensorDict(items, batch_size),
    )


def _public_swap() -> contextlib.AbstractContextManager[None]:
    """``call`` taking its ``to_module`` path (as when a registration hook is installed)."""
    return _patched(_call, _registration_hooks=lambda: {0: None})


def _with(ctx: Callable[[], contextlib.AbstractContextManager[None]], fn: Fn) -> Fn:
    def run() -> None:
        with ctx():
            fn()

    return run


def rows_for(case: str, rounds: int) -> list[tuple[str, str, float, float, float]]:
    """(what, variant, µs, ratio to the private variant, % of a step) rows for one model."""
    model, batch = build(case)
    opts = {"student": optim.adamw(lr=LR, weight_decay=WEIGHT_DECAY)}
    state = purestep.init_state({"student": model}, opts, seed=0)
    params = state["params", "student"]

    def loss_fn(p: Any, b: Any, key: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        return mse(purestep.call(model, p["student"], b["x"]), b["y"]), {}

    train = purestep.train_step(purestep.value_and_grad(loss_fn), opts, donate=True)
    holder = [state.clone()]

    def ps_step() -> None:
        holder[0], _ = train(holder[0], batch)

    whole = _time(
        {
            "all private paths on": ps_step,
            "tensordict private API off": _with(_public_tensordict, ps_step),
            "fast swap off (to_module)": _with(_public_swap, ps_step),
        },
        rounds,
        5,
    )
    step_us = whole["all private paths on"]
    leaves = tree.leaves(params)
    grads = [torch.randn_like(t) for t in leaves]
    ema = [t.clone() for t in leaves]

    def swap_fast() -> None:
        plan = _swap.plan_for(model, params)
        _swap.restore(plan, _swap.swap(plan, params), params)

    def swap_public() -> None:
        with params.to_module(model):
            pass

    def ema_loop() -> None:
        for e, t in zip(ema, leaves, strict=True):
            e.lerp_(t, 0.001)

    def norm_loop() -> torch.Tensor:
        return torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in grads])
        )

    it = iter(())

    def take(_: torch.Tensor) -> torch.Tensor:
        return next(it)

    def rebuild_public() -> TensorDict:
        nonlocal it
        it = iter(leaves)
        out: TensorDict = params.apply(take)
        return out

    groups: list[tuple[str, dict[str, Fn], int]] = [
        ("AdamW update", _adam_fns(params), 10),
        (
            "parameter swap (enter + exit)",
            {
                "step._swap plan/swap/restore (slot dicts)": swap_fast,
                "params.to_module": swap_public,
            },
            50,
        ),
        (
            "leaf list of params",
            {
                "tree.leaves (_tensordict)": lambda: tree.leaves(params),
                "td.values(include_nested=True, leaves_only=True)": lambda: list(
                    params.values(include_nested=True, leaves_only=True)
                ),
            },
            200,
        ),
        (
            "rebuild params from leaves",
            {
                "tree.rebuild (_tensordict, _new_unsafe)": lambda: tree.rebuild(params, leaves),
                "td.apply": rebuild_public,
            },
            100,
        ),
        (
            "global grad norm",
            {
                "tree.global_norm (_foreach_norm)": lambda: tree.global_norm(grads),
                "per-tensor vector_norm loop": norm_loop,
            },
            20,
        ),
        (
            "EMA update",
            {
                "torch._foreach_lerp_": lambda: torch._foreach_lerp_(ema, leaves, 0.001),
                "per-tensor lerp_ loop": ema_loop,
            },
            20,
        ),
    ]
    out: list[tuple[str, str, float, float, float]] = []
    for what, fns, n in groups:
        got = _time(fns, rounds, n)
        base = next(iter(got.values()))
        for name, us in got.items():
            out.append((what, name, us, us / base, 100 * (us - base) / step_us))
    for name, us in whole.items():
        out.append(
            ("one train_step(donate=True)", name, us, us / step_us, 100 * (us - step_us) / step_us)
        )
    out += _record_rows(holder[0], rounds)
    return out


def _record_rows(state: TensorDict, rounds: int) -> list[tuple[str, str, float, float, float]]:
    tensors = [t for t in tree.leaves(state) if t.numel() > 0]

    def save(zip_format: bool) -> None:
        f = io.BytesIO()
        for t in tensors:
            torch.save(t, f, _use_new_zipfile_serialization=zip_format)

    got = _time(
        {
            "non-zip records (_use_new_zipfile_serialization=False)": lambda: save(False),
            "zip records (torch.save default, stock DCP)": lambda: save(True),
        },
        rounds,
        1,
    )
    base = next(iter(got.values()))
    return [
        (f"checkpoint records ({len(tensors)} tensors)", k, v, v / base, 100 * (v - base) / base)
        for k, v in got.items()
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--case", choices=["small", "large", "all"], default="all")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="3 rounds")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rounds = 3 if args.quick else args.rounds
    print(f"torch {torch.__version__}, one thread, {rounds} interleaved rounds, CPU time\n")
    print("| model | what | variant | µs | x private | Δ % of a step |")
    print("|---|---|---|---|---|---|")
    for case in ["small", "large"] if args.case == "all" else [args.case]:
        for what, name, us, ratio, pct in rows_for(case, rounds):
            print(f"| {case} | {what} | {name} | {us:,.0f} | {ratio:.2f} | {pct:+.2f} |")


if __name__ == "__main__":
    main()
