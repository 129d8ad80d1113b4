"""Train a small transformer denoiser with FSDP2 (finetune or DMD2), checkpoint, resume.

Run on CPU (gloo) or, unchanged, on GPUs (nccl; ``--device`` defaults to cuda when available)::

    torchrun --nproc-per-node 2 examples/fsdp_train.py --steps 20 --save-every 10
    torchrun --nproc-per-node 2 examples/fsdp_train.py --steps 40 --resume latest
    torchrun --nproc-per-node 2 examples/fsdp_train.py --method dmd2 --ckpt-dir outputs/fsdp_dmd2

What it shows:

* ``fsdp.bind(model, shard=[Block])`` shards each transformer block, then the
  root; the state's params *are* the sharded DTensor parameters, and the step
  donates (``donate=True``) so the fused optimizer updates them in place.
* Data parallelism with world-size-independent results: every rank builds the
  same global batch (sample ``i`` drawn from ``fold_in(data_key, i)``), and
  ``fsdp.shard_batch`` keeps this rank's slice with its global sample ids in
  ``batch["index"]``, so the per-sample noise is the same on any world size.
* ``purestep.loop.run`` logs (rank 0, ``metrics.jsonl``; the metrics are already
  averaged over ranks), saves atomic DCP checkpoints every ``--save-every``
  steps, and resumes from ``--resume latest`` bit-exactly (same world size) or
  resharded (another world size).
* DMD2: student and critic are both bound; the frozen teacher is a plain module
  (replicated, not state). Here the teacher is a fresh model from its own seed
  (a demo of the mechanics; in practice load a trained one).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _denoiser import Block, Denoiser, DenoiserConfig, init_weights, sample_sequences
from tensordict import TensorDictBase

import purestep as ps
from purestep import loop, optim, rng
from purestep.distributed import fsdp
from purestep.methods import dmd2, finetune


class SyntheticData:
    """Global batch ``s`` = samples ``s * B .. s * B + B - 1`` of the synthetic distribution,
    sharded to this rank. Re-iterable and stateful (the loop checkpoints its position)."""

    def __init__(
        self, cfg: DenoiserConfig, global_batch: int, seed: int, device: torch.device, mesh: Any
    ) -> None:
        self.cfg, self.global_batch, self.device, self.mesh = cfg, global_batch, device, mesh
        self.key = rng.fold_in(rng.key(seed), 0xDA7A)
        self.position = 0

    def __iter__(self) -> Iterator[TensorDictBase]:
        while True:
            ids = torch.arange(self.global_batch, device=self.device)
            ids.add_(self.position * self.global_batch)
            x0 = sample_sequences(self.key, ids, self.cfg, device=self.device)
            self.position += 1
            # every rank builds the same global batch; shard_batch assigns the per-step sample
            # ids (index = arange(B)) before slicing, so noise does not depend on world size
            yield fsdp.shard_batch({"x0": x0}, self.mesh)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.position = int(sd["position"])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--method", choices=["finetune", "dmd2"], default="finetune")
    p.add_argument("--steps", type=int, default=20, help="train until state['step'] == steps")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--ckpt-dir", default="outputs/fsdp_train")
    p.add_argument("--resume", default="latest", help="'latest', 'none' or a checkpoint directory")
    p.add_argument("--accumulate", type=int, default=1, help="microbatches per step")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda (nccl, one GPU per rank) or cpu (gloo); default: cuda when available",
    )
    return p.parse_args()


def main() -> None:
    args = parse_args()
    cuda = args.device == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    cfg = DenoiserConfig(width=args.width, depth=args.depth)

    def model(seed: int) -> Denoiser:
        return init_weights(Denoiser(cfg), seed, device=device)

    student = model(args.seed)
    binding = fsdp.bind(student, shard=[Block])
    clip = optim.clip_by_global_norm(1.0)  # global norm over all shards
    if args.method == "finetune":
        opts = {"student": optim.chain(clip, optim.adamw(args.lr))}
        state = ps.init_state({"student": binding}, opts, seed=args.seed)
        step = finetune.make_step(student, opts["student"], accumulate=args.accumulate, donate=True)
    else:
        teacher = model(args.seed + 1).requires_grad_(False)  # frozen, replicated, not state
        critic = model(args.seed + 1)  # the fake score starts as the teacher
        critic_binding = fsdp.bind(critic, mesh=binding.mesh, shard=[Block])
        opts = {
            "student": optim.chain(clip, optim.adamw(args.lr)),
            "critic": optim.chain(clip, optim.adamw(args.lr, betas=(0.0, 0.999))),
        }
        state = ps.init_state({"student": binding, "critic": critic_binding}, opts, seed=args.seed)
        step = dmd2.make_step(
            student=student,
            teacher=teacher,
            teacher_params=ps.export.module_variables(teacher),  # its weights: the module's own
            critic=critic,
            optimizers=opts,
            config=dmd2.DMD2Config(generator_update_interval=2, rollout="data"),
            accumulate=args.accumulate,
            donate=True,
        )
    data = SyntheticData(cfg, args.global_batch, args.seed, device, binding.mesh)
    resume = None if args.resume == "none" else args.resume
    state = loop.run(
        step,
        state,
        data,
        num_steps=args.steps,
        checkpoint_dir=args.ckpt_dir,
        save_every=args.save_every,
        resume=resume,
        log_every=args.log_every,
        progress=False,
        sinks=["jsonl", _print_sink],  # called on rank 0 only
    )
    params = fsdp.gather(state["params", "student"])  # a collective: every rank calls it
    if dist.get_rank() == 0:
        norm = torch.stack([p.float().norm() for p in params.values(True, True)]).norm()
        print(f"done: step {int(state['step'])}, student param norm {float(norm):.6f}")
        print(f"checkpoints in {Path(args.ckpt_dir).resolve()}")
    dist.barrier()  # both ranks reach teardown together (gloo dislikes a peer leaving early)
    dist.destroy_process_group()


def _print_sink(step: int, metrics: Mapping[str, float]) -> None:
    items = ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))
    print(f"step {step}: {items}", flush=True)


if __name__ == "__main__":
    main()
