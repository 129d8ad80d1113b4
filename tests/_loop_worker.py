"""A training run under ``purestep.loop.run``, as a script the fault tests start and kill.

It prints, flushed, one line per event the parent may kill at:

* ``STEP <s>``: the log record of step ``s`` was written (``log_every=1``);
* ``SAVE_START <s>``: ``checkpoint.save`` of step ``s`` was entered;
* ``RENAME``: the ``--pause-at-rename``-th checkpoint is fully written in its
  scratch directory and about to be renamed into place; the worker then
  sleeps, so a kill lands exactly between writing and publishing.

On completion it writes the final state with ``torch.save`` to ``--out`` and
prints ``DONE``; on SIGTERM it exits with :class:`purestep.loop.Preempted`'s
status (143). The model, data and step are built by the functions below, which
the tests import to run the uninterrupted reference in process.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

import purestep as ps
from purestep import loop, rng
from purestep.distributed import _ckpt_fs
from purestep.distributed import checkpoint as ckpt

NUM_BATCHES = 7  # not a divisor of the run lengths: passes end mid-interval


def make_batches() -> list[dict[str, torch.Tensor]]:
    """Seven fixed regression batches (x: [8, 4], y: [8, 1])."""
    g = torch.Generator().manual_seed(1234)
    return [
        {"x": torch.randn(8, 4, generator=g), "y": torch.randn(8, 1, generator=g)}
        for _ in range(NUM_BATCHES)
    ]


class ShuffledData:
    """A stateful iterable: every pass visits the batches in a fresh order from its own generator.

    The order of later passes depends on the generator's state, which only
    ``state_dict``/``load_state_dict`` carry: a process built with a different
    ``seed`` reproduces an interrupted run's batches only if its state is restored.
    """

    def __init__(self, batches: list[dict[str, torch.Tensor]], seed: int) -> None:
        self.batches = batches
        self._gen = torch.Generator().manual_seed(seed)
        self._perm: torch.Tensor | None = None
        self._pos = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self._perm is None or self._pos >= len(self._perm):
            self._perm = torch.randperm(len(self.batches), generator=self._gen)
            self._pos = 0
        while self._pos < len(self._perm):
            i = int(self._perm[self._pos])
            self._pos += 1
            yield self.batches[i]

    def state_dict(self) -> dict[str, Any]:
        return {"gen": self._gen.get_state(), "perm": self._perm, "pos": self._pos}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._gen.set_state(sd["gen"])
        self._perm, self._pos = sd["perm"], sd["pos"]


def make_data(kind: str, seed: int = 0) -> Any:
    """``"list"``: the batches as a list; ``"stateful"``: a :class:`ShuffledData` over them."""
    return make_batches() if kind == "list" else ShuffledData(make_batches(), seed)


def _gather(t: torch.Tensor) -> torch.Tensor:
    """``t`` from every rank, concatenated along dim 0 (a data-parallel global batch)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def build(num_steps: int, *, gather: bool = False) -> tuple[Any, Any]:
    """A 4-16-1 tanh MLP trained with AdamW (warmup-cosine lr) on noisy inputs: (step, state).

    ``gather``: the loss is over every rank's batch, so all ranks keep the same state
    (what data parallelism does), which depends on every rank's data position.
    """
    g = torch.Generator().manual_seed(0)
    params = TensorDict(
        {
            "w1": torch.randn(16, 4, generator=g) * 0.5,
            "b1": torch.zeros(16),
            "w2": torch.randn(1, 16, generator=g) * 0.25,
            "b2": torch.zeros(1),
        },
        [],
    )

    def loss_fn(p: Any, b: Any, key: torch.Tensor) -> Any:
        x = b["x"] + 0.01 * rng.normal(key, b["x"].shape, index=b["index"])
        y = b["y"]
        if gather:
            x, y = _gather(x), _gather(y)
        h = torch.tanh(x @ p["mlp", "w1"].T + p["mlp", "b1"])
        pred = h @ p["mlp", "w2"].T + p["mlp", "b2"]
        return ((pred - y) ** 2).mean(), {}

    opt = {"mlp": ps.optim.adamw(ps.optim.schedules.warmup_cosine(3e-2, 3, num_steps))}
    step = ps.train_step(ps.value_and_grad(loss_fn), opt)
    return step, ps.init_state({"mlp": params}, opt, seed=7)


def distributed_run(
    root: str,
    num_steps: int,
    data_seed: int,
    *,
    total: int = 8,
    term_at: int = 0,
    term_ranks: tuple[int, ...] = (1,),
) -> dict[str, Any]:
    """A task for ``WorkerPool``: ``run`` on every rank, each with its own stateful data shard.

    ``term_at``: the ranks in ``term_ranks`` (rank 1 alone by default) send themselves
    SIGTERM during step ``term_at``'s evaluation; every rank must stop after that step.
    Returns ``{"state", "preempted", "signum"}`` (plain tensors; the step and signal of
    the ``Preempted`` raised, or None).
    """
    r = dist.get_rank()
    step, state = build(total, gather=True)
    data = ShuffledData(make_batches()[r::2], seed=data_seed + r)

    def eval_fn(s: Any) -> dict[str, float]:
        if term_at and r in term_ranks and int(s["step"]) == term_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return {}

    try:
        final = loop.run(
            step,
            state,
            data,
            num_steps=num_steps,
            checkpoint_dir=root,
            save_every=2,
            progress=False,
            eval_fn=eval_fn,
            eval_every=1,
        )
    except loop.Preempted as e:
        return {
            "state": e.state.apply(lambda t: t.clone()),
            "preempted": e.step,
            "signum": e.signum,
        }
    return {"state": final, "preempted": None, "signum": None}


def timeouts_seen(root: str) -> dict[str, float]:
    """A task for ``WorkerPool``: the collective timeouts before, during and after
    ``run(collective_timeout=7)`` (default group, and purestep's checkpoint group)."""
    from purestep.distributed import _ckpt_group, timeouts

    def seconds(group: Any = None) -> float:
        t = timeouts.get_timeout(group)
        assert t is not None
        return t.total_seconds()

    r = dist.get_rank()
    seen = {"before": seconds()}
    step, state = build(4, gather=True)

    def eval_fn(s: Any) -> dict[str, float]:
        seen["during"] = seconds()
        seen["checkpoint group"] = seconds(_ckpt_group._group())
        return {}

    loop.run(
        step,
        state,
        ShuffledData(make_batches()[r::2], seed=r),
        num_steps=2,
        checkpoint_dir=root,
        save_every=1,
        progress=False,
        eval_fn=eval_fn,
        eval_every=1,
        collective_timeout=7,
    )
    seen["after"] = seconds()
    return seen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-steps", type=int, required=True)
    ap.add_argument("--save-every", type=int, required=True)
    ap.add_argument("--data", choices=["list", "stateful"], default="list")
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--pause-at-rename", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)

    real_save = ckpt.save

    def save(state: Any, path: Any, **kw: Any) -> Any:
        print(f"SAVE_START {int(state['step'])}", flush=True)
        return real_save(state, path, **kw)

    ckpt.save = save  # type: ignore[assignment]
    real_rename = _ckpt_fs.rename_noreplace
    renames = 0

    def rename(src: Any, dst: Any) -> None:
        nonlocal renames
        if ".tmp-" in os.path.basename(os.fspath(src)):  # publishing a scratch directory
            renames += 1
            if renames == args.pause_at_rename:
                print("RENAME", flush=True)
                time.sleep(60)
        real_rename(src, dst)

    _ckpt_fs.rename_noreplace = rename  # type: ignore[assignment]

    step, state = build(args.num_steps)
    final = loop.run(
        step,
        state,
        make_data(args.data, args.data_seed),
        num_steps=args.num_steps,
        checkpoint_dir=args.dir,
        save_every=args.save_every,
        keep_last=2,
        sinks=("jsonl", lambda s, m: print(f"STEP {s}", flush=True)),
        progress=False,
    )
    torch.save(final, args.out)
    print("DONE", flush=True)


if __name__ == "__main__":
    sys.exit(main())
