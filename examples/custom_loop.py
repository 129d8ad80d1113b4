"""The training that ``purestep.loop.run`` does, written by hand.

For users who embed steps in loops of their own: the state is one TensorDict,
the step a pure function, and a checkpoint is ``checkpoint.save(state, dir)``.
Everything a resume needs is in the state, except the data position, which
here is the step itself (batch ``s`` is ``data[s % len(data)]``).

    python examples/custom_loop.py --out /tmp/custom --steps 300
    # interrupted (Ctrl-C, a crash)? the same command resumes from the newest checkpoint
    python examples/custom_loop.py --out /tmp/custom2 --steps 300 --compare

``--compare`` also trains with ``loop.run`` (into ``OUT/loop``) and checks that
both final states are bitwise equal (use a fresh ``--out``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

import purestep as ps
from purestep import checkpoint, loop
from purestep.testing import assert_trees_equal

try:
    from tqdm.auto import tqdm
except ImportError:  # the progress bar is optional
    tqdm = None


def make_data(n_batches: int = 16, batch: int = 32) -> list[dict[str, torch.Tensor]]:
    """A fixed regression task: y = sin(3 x0) + x1^2 plus noise, from an explicit generator."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n_batches):
        x = torch.rand(batch, 2, generator=g) * 2 - 1
        y = torch.sin(3 * x[:, :1]) + x[:, 1:] ** 2 + 0.05 * torch.randn(batch, 1, generator=g)
        out.append({"x": x, "y": y})
    return out


def build(total_steps: int) -> tuple[Any, TensorDict]:
    """The step (AdamW, warmup-cosine lr, gradient clipping) and the initial state."""
    g = torch.Generator().manual_seed(1)
    net = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 1))
    params = TensorDict.from_module(net).apply(lambda p: torch.randn(p.shape, generator=g) * 0.3)

    def loss_fn(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        pred = ps.call(net, p["net"], b["x"])
        return ((pred - b["y"]) ** 2).mean(), {}

    lr = ps.optim.schedules.warmup_cosine(1e-2, 20, total_steps)
    opt = {"net": ps.optim.chain(ps.optim.clip_by_global_norm(1.0), ps.optim.adamw(lr))}
    step = ps.train_step(ps.value_and_grad(loss_fn), opt)
    return step, ps.init_state({"net": params}, opt, seed=0)


def as_floats(metrics: TensorDictBase) -> dict[str, float]:
    """Nested metrics as ``{"a/b": float}`` (this reads them to the host)."""
    return {
        "/".join(k) if isinstance(k, tuple) else k: float(v)
        for k, v in metrics.items(include_nested=True, leaves_only=True)
    }


def train(out: Path, total_steps: int, save_every: int, log_every: int) -> TensorDictBase:
    step, state = build(total_steps)
    data = make_data()
    state = step.prepare(state)  # fix the state's structure before loading into it
    newest = checkpoint.latest(out)
    if newest is not None:
        state = checkpoint.load(newest, like=state)
    start = int(state["step"])
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "metrics.jsonl"
    if log_path.exists():  # drop records of steps that will be replayed
        records = [r for r in loop.read_metrics(log_path) if r["step"] <= start]
        log_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    bar = tqdm(total=total_steps, initial=start) if tqdm is not None else None
    with open(log_path, "a") as log:
        for s in range(start, total_steps):
            state, metrics = step(state, data[s % len(data)])
            done = s + 1
            if done % log_every == 0 or done == total_steps:
                # the last step's values; loop.run logs the mean over the interval instead
                record = {"step": done, **as_floats(metrics)}
                log.write(json.dumps(record) + "\n")
                log.flush()
                if bar is not None:
                    bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
            if done % save_every == 0 or done == total_steps:
                checkpoint.save(state, checkpoint.step_dir(out, done), overwrite=True)
                checkpoint.prune(out, keep_last=3)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/custom_loop"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--compare", action="store_true", help="also run loop.run and compare")
    args = ap.parse_args()
    state = train(args.out, args.steps, args.save_every, args.log_every)
    print(
        f"step {int(state['step'])}, checkpoints: {[p.name for p in checkpoint.checkpoints(args.out)]}"
    )
    if args.compare:
        step, init = build(args.steps)
        ref = loop.run(
            step,
            init,
            make_data(),
            num_steps=args.steps,
            checkpoint_dir=args.out / "loop",
            save_every=args.save_every,
            log_every=args.log_every,
        )
        assert_trees_equal(state, ref, what="hand-written loop vs loop.run")
        print("hand-written loop == loop.run (bitwise)")


if __name__ == "__main__":
    main()
