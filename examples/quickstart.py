"""Quickstart: a flow-matching velocity model on 8 Gaussians, in a 20-line custom loop.

Shows the core pieces: an explicit state (``init_state``), a pure loss with
per-sample noise (``rng`` with ``index=``), ``value_and_grad`` ->
``accumulate`` -> ``train_step`` -> ``with_ema``, and a plain loop with tqdm.
Writes ``metrics.jsonl`` and ``samples.png`` into ``--out`` (default
``outputs/quickstart``). Runs on ``--device`` (default: CUDA when available):
the loss is the same code on either, because draws with ``index=`` compute
where the batch is.

Run: ``python examples/quickstart.py`` (about 25 s on one CPU core).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn
from tqdm import tqdm

import purestep as ps
from purestep import optim, rng


class VelocityMLP(nn.Module):
    """v(x_t, t): a small MLP on (x_t, sin/cos features of t)."""

    def __init__(self, dim: int = 2, hidden: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(dim + 8, hidden),
            nn.SiLU(),
            nn.Linear(hidden, hidden),
            nn.SiLU(),
            nn.Linear(hidden, hidden),
            nn.SiLU(),
            nn.Linear(hidden, dim),
        )

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        freqs = torch.arange(1, 5, dtype=x.dtype, device=x.device) * math.pi
        tf = t[:, None] * freqs
        return self.net(torch.cat([x, tf.sin(), tf.cos()], dim=-1))  # type: ignore[no-any-return]


def eight_gaussians(
    key: torch.Tensor, n: int, *, start: int = 0, device: torch.device | None = None
) -> torch.Tensor:
    """n samples of a mixture of 8 Gaussians on a circle of radius 2 (sample ids start..start+n)."""
    index = torch.arange(start, start + n, device=device)  # the draws compute where index is
    comp = rng.randint(rng.fold_in(key, 0), 0, 8, (n,), index=index)
    angle = comp.to(torch.float32) * (2 * math.pi / 8)
    centers = 2.0 * torch.stack([angle.cos(), angle.sin()], dim=-1)
    return centers + 0.1 * rng.normal(rng.fold_in(key, 1), (n, 2), index=index)


def make_loss(model: nn.Module) -> Any:
    def loss_fn(
        params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x0, idx = batch["x0"], batch["index"]
        t = rng.uniform(rng.fold_in(key, 1), (x0.shape[0],), index=idx)
        eps = rng.normal(rng.fold_in(key, 2), tuple(x0.shape), index=idx)
        x_t = (1 - t[:, None]) * x0 + t[:, None] * eps
        v = ps.call(model, params["student"], x_t, t)
        return ((v - (eps - x0)) ** 2).mean(), {}

    return loss_fn


@torch.no_grad()
def sample(
    model: nn.Module, params: TensorDictBase, key: torch.Tensor, n: int, steps: int
) -> torch.Tensor:
    device = next(iter(params.values(True, True))).device
    x = rng.normal(key, (n, 2), device=device)
    ts = torch.linspace(1.0, 0.0, steps + 1, device=device)
    for t, t_next in itertools.pairwise(ts):
        x = x + (t_next - t) * ps.call(model, params, x, t.expand(n))
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("outputs/quickstart"))
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the model and data live (default: cuda when available)",
    )
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 is fastest for this tiny model)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    # --- the whole training setup -----------------------------------------------------------
    model = VelocityMLP().to(device)
    opt = {
        "student": optim.adamw(
            optim.schedules.warmup_cosine(2e-3, 100, args.steps), weight_decay=0.0
        )
    }
    grad_fn = ps.accumulate(ps.value_and_grad(make_loss(model)), args.accumulate)
    step = ps.with_ema(ps.train_step(grad_fn, opt, donate=True), 0.995, ["student"], start_step=200)
    state = step.prepare(ps.init_state({"student": model}, opt, seed=args.seed))
    data_key = rng.fold_in(rng.key(args.seed), 10_000)
    with (args.out / "metrics.jsonl").open("w") as log:
        for i in (bar := tqdm(range(args.steps), desc="quickstart")):
            batch = {
                "x0": eight_gaussians(data_key, args.batch, start=i * args.batch, device=device)
            }
            state, metrics = step(state, batch)
            if i % 50 == 0 or i == args.steps - 1:
                flat = {k: float(v) for k, v in metrics.flatten_keys("/").items()}
                log.write(json.dumps({"step": i, **flat}) + "\n")
                bar.set_postfix(loss=f"{flat['loss']:.3f}")
    # -----------------------------------------------------------------------------------------

    samples = sample(model, state["ema", "student"], rng.key(args.seed + 1), 2000, 32)
    samples = samples.cpu()
    data = eight_gaussians(rng.key(args.seed + 2), 2000)
    radius = samples.norm(dim=-1)
    summary = {
        "final_loss": flat["loss"],
        "mean_radius": float(radius.mean()),
        "frac_within_0.5_of_circle": float(((radius - 2.0).abs() < 0.5).float().mean()),
        "seconds": time.perf_counter() - t0,
        "device": str(device),
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(8, 4), sharex=True, sharey=True)
        for ax, pts, title in (
            (axes[0], data, "data"),
            (axes[1], samples, "EMA model, 32 Euler steps"),
        ):
            ax.scatter(pts[:, 0], pts[:, 1], s=2, alpha=0.5)
            ax.set_title(title)
            ax.set_aspect("equal")
        fig.tight_layout()
        fig.savefig(args.out / "samples.png", dpi=100)
    except ImportError:
        print("matplotlib not installed: skipping samples.png (pip install -e '.[examples]')")
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out}/metrics.jsonl, summary.json, samples.png")


if __name__ == "__main__":
    main()
