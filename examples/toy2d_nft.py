"""Toy 2-D DiffusionNFT: fine-tune a flow model on 8 Gaussians towards the upper half-plane.

The reward of a sample ``(x, y)`` is ``sigmoid(REWARD_SHARPNESS * y)`` (maximum 1):
the policy should move its mass to the upper half-plane while a KL term keeps
its velocity field near the frozen reference (the initial model). Teacher =
reference = initial student = initial old policy. Rollouts and evaluation use
the same few-step Euler sampler.

:func:`run_nft` is the NFT stage, also used by ``examples/toy2d.py``. Run
standalone (``python examples/toy2d_nft.py --out DIR``) it first trains an
8-Gaussian teacher with :mod:`purestep.methods.finetune`, then writes
``DIR/summary.json`` (rewards before/after, KL, wall times) and
``DIR/nft_samples.png`` (samples before and after).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from purestep import optim, rng, tree
from purestep.methods import finetune, flow, nft

sys.path.insert(0, str(Path(__file__).resolve().parent))

from toy_common import (
    Timer,
    VelocityMLP,
    eight_gaussians,
    scatter_panels,
    train,
    write_json,
)

REWARD_SHARPNESS = 4.0
REWARD_MAX = 1.0
SAMPLE_STEPS = 8  # Euler steps of the rollout / evaluation sampler
N_EVAL = 4096
NFT: dict[str, Any] = {
    "prompts": 16,  # groups per outer step (unconditional: every group is the same "prompt")
    "group_size": 16,
    "minibatch_size": 128,
    "inner_epochs": 2,
    "lr": 3e-4,
    "beta": 1.0,
    "adv_clip": 5.0,
    "kl_weight": 5e-2,
    "decay": {"flat_steps": 0, "rate": 0.01, "max_decay": 0.5},
}
# keys of the example's own draws (the method folds its purposes into step keys)
EVAL_NOISE, KL_KEY, TEACHER_DATA = 1, 2, 3


def reward_fn(x0: torch.Tensor, prompt: TensorDictBase) -> torch.Tensor:
    """``sigmoid(k * y)``: close to 1 in the upper half-plane, 0 in the lower."""
    del prompt
    return torch.sigmoid(REWARD_SHARPNESS * x0[:, 1])


def _generate(model: nn.Module, params: TensorDictBase, noise: torch.Tensor) -> torch.Tensor:
    out = flow.sample(model, params, noise, flow.timestep_schedule(SAMPLE_STEPS))
    assert isinstance(out, torch.Tensor)
    return out


def velocity_kl(
    model: nn.Module,
    params: TensorDictBase,
    reference: TensorDictBase,
    x0: torch.Tensor,
    key: torch.Tensor,
) -> float:
    """``E mean_d (v_params - v_ref)^2`` over forward-process points of ``x0`` (uniform ``t``).

    The same quantity as the ``kl`` term of the NFT loss, evaluated on ``x0``.
    """
    idx = torch.arange(x0.shape[0], device=x0.device)
    t = flow.sample_timesteps(flow.purpose_key(key, flow.Purpose.TIMESTEP), x0.shape[0], index=idx)
    eps = flow.noise_like(flow.purpose_key(key, flow.Purpose.NOISE), x0, idx)
    x_t = flow.interpolate(x0, eps, t)
    with torch.no_grad():
        v = flow.predict_velocity(model, params, x_t, t)
        v_ref = flow.predict_velocity(model, reference, x_t, t)
    return float((v - v_ref).square().mean())


def run_nft(
    teacher_model: nn.Module,
    teacher_params: TensorDictBase,
    *,
    out_dir: str | Path,
    steps: int,
    progress: bool = True,
    seed: int = 0,
) -> dict[str, float]:
    """Fine-tune ``teacher_model`` (with ``teacher_params``) by NFT towards the upper half-plane.

    Args:
        teacher_model: a velocity model ``forward(x_t, t) -> v`` on 2-D points.
        teacher_params: its params (the reference, and the initial student and old policy).
        out_dir: where ``nft_samples.png`` is written.
        steps: outer NFT steps.
        progress: show a tqdm bar.
        seed: the NFT state's seed (evaluation noise is drawn from it too).

    Returns:
        ``nft_reward_before`` / ``nft_reward_after`` (mean reward of ``N_EVAL``
        samples from the same noise, before and after), ``nft_reward_max``,
        ``nft_gap_closed`` (``(after - before) / (max - before)``), ``nft_kl``
        (:func:`velocity_kl` of the final student on its own samples) and
        ``nft_wall_s``. Runs with one intra-op thread (restored afterwards):
        on a small MLP that is several times faster than two on a busy 2-core CPU.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is fastest, and immune to CPU contention
    try:
        return _run_nft(teacher_model, teacher_params, Path(out_dir), steps, progress, seed)
    finally:
        torch.set_num_threads(threads)


def _run_nft(
    teacher_model: nn.Module,
    teacher_params: TensorDictBase,
    out: Path,
    steps: int,
    progress: bool,
    seed: int,
) -> dict[str, float]:
    t0 = time.perf_counter()
    reference = tree.clone(teacher_params)
    opt = optim.adamw(NFT["lr"], weight_decay=0.0)
    step = nft.make_step(
        teacher_model,
        reward_fn,
        opt,
        reference_params=reference,
        sample_shape=(2,),
        config=nft.NFTConfig(
            beta=NFT["beta"], adv_clip=NFT["adv_clip"], kl_weight=NFT["kl_weight"]
        ),
        group_size=NFT["group_size"],
        sample_steps=SAMPLE_STEPS,
        inner_epochs=NFT["inner_epochs"],
        minibatch_size=NFT["minibatch_size"],
        decay=nft.ramp_decay(**NFT["decay"]),
        donate=True,
    )
    state = step.prepare(nft.init_state(tree.clone(teacher_params), opt, seed=seed))
    device = tree.leaves(teacher_params)[0].device  # NFT runs where the teacher's params are
    root = rng.key(seed)
    noise = rng.normal(rng.fold_in(root, EVAL_NOISE), (N_EVAL, 2), device=device)
    before_x = _generate(teacher_model, reference, noise)
    before = float(reward_fn(before_x, TensorDict({}, [N_EVAL])).mean())
    p = NFT["prompts"]

    def prompts(i: int) -> TensorDict:
        return TensorDict({"index": torch.arange(i * p, (i + 1) * p, device=device)}, [p])

    state, _ = train(
        step,
        state,
        prompts,
        steps,
        desc="nft",
        progress=progress,
        log_every=5,
        metrics=(("rollout", "reward"), ("student", "kl")),
    )
    student = state["params", "student"]
    after_x = _generate(teacher_model, student, noise)
    after = float(reward_fn(after_x, TensorDict({}, [N_EVAL])).mean())
    kl = velocity_kl(teacher_model, student, reference, after_x, rng.fold_in(root, KL_KEY))
    scatter_panels(
        [
            (f"before NFT (reward {before:.3f})", before_x),
            (f"after NFT (reward {after:.3f})", after_x),
        ],
        out / "nft_samples.png",
    )
    gap = REWARD_MAX - before
    return {
        "nft_reward_before": before,
        "nft_reward_after": after,
        "nft_reward_max": REWARD_MAX,
        "nft_gap_closed": (after - before) / gap if gap > 0 else 1.0,
        "nft_kl": kl,
        "nft_wall_s": time.perf_counter() - t0,
    }


def train_teacher(
    *,
    steps: int,
    seed: int,
    progress: bool,
    hidden: int = 128,
    batch: int = 512,
    device: torch.device | str = "cpu",
) -> tuple[VelocityMLP, TensorDictBase]:
    """A flow-matching teacher on 8 Gaussians (``finetune`` with an EMA of the weights)."""
    model = VelocityMLP(hidden=hidden, depth=3).to(device)
    opt = optim.adamw(
        lr=optim.schedules.warmup_cosine(2e-3, min(100, steps - 1), steps), weight_decay=0.0
    )
    step = finetune.make_step(model, opt, donate=True, ema=0.995)
    state = finetune.init_state(model, opt, seed=seed)
    data_key = rng.fold_in(rng.key(seed), TEACHER_DATA)

    def data(i: int) -> TensorDict:
        x0 = eight_gaussians(data_key, batch, offset=i * batch, device=device)
        return TensorDict({"x0": x0}, [batch])

    state, _ = train(step, state, data, steps, desc="teacher (finetune)", progress=progress)
    return model, state["ema", "student"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="outputs/toy2d_nft", help="output folder")
    ap.add_argument("--steps", type=int, default=60, help="outer NFT steps")
    ap.add_argument("--teacher-steps", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true", help="hide progress bars")
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where models and data live (default: cuda when available)",
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # small MLPs: one thread is fastest on CPU
    timer = Timer()
    progress = not args.no_progress
    model, params = train_teacher(
        steps=args.teacher_steps, seed=args.seed, progress=progress, device=args.device
    )
    timer.lap("teacher")
    summary: dict[str, Any] = {
        "nft_config": NFT,
        "sample_steps": SAMPLE_STEPS,
        "reward": f"sigmoid({REWARD_SHARPNESS} * y)",
    }
    result = run_nft(
        model, params, out_dir=out, steps=args.steps, progress=progress, seed=args.seed + 3
    )
    timer.lap("nft")
    summary.update({k: round(v, 5) for k, v in result.items()})
    summary["nft_target_met"] = result["nft_gap_closed"] >= 0.5
    summary["wall_time_s"] = {**timer.stages, "total": timer.total()}
    write_json(out / "summary.json", summary)
    print({k: v for k, v in summary.items() if k != "nft_config"})
    return summary


if __name__ == "__main__":
    main()
