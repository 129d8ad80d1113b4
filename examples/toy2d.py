"""Toy 2-D: train a flow teacher, distil it (KD 4-step, DMD2 1-step), fine-tune it with NFT.

Stages (each a pure step function over an explicit state, see ``purestep.methods``):

1. ``finetune``: a velocity MLP learns a mixture of 8 Gaussians by flow matching
   (the EMA of its weights is the teacher).
2. ``kd``: the teacher's 32-step ODE trajectories are cached on disk
   (``kd_cache/``, resumable) and a student learns to map the states at
   ``t = 1, 0.75, 0.5, 0.25`` to the trajectory's end; it samples in 4 steps
   with the re-noising sampler (``flow.renoise_sample``).
3. ``dmd2``: a 1-step student distilled by distribution matching against the
   teacher (real score) and a critic (fake score, initialised from the
   teacher). The student starts from the teacher's weights, as in the DMD2
   paper; ``--dmd2-init kd`` starts it from the KD student instead ("ODE init",
   the CausVid recipe).
4. ``nft``: DiffusionNFT fine-tunes the teacher towards a reward (samples in the
   upper half-plane; ``examples/toy2d_nft.py``).

Metric: the sliced Wasserstein-1 distance (SW) of ``n_eval`` generated points to
as many held-out data points; ``sw_data_floor`` is the SW between two
independent data samples of that size (the metric's noise floor).

Writes into ``--out`` (default ``outputs/toy2d``): ``summary.json``,
``samples.png`` (data, teacher and students side by side), ``losses.png``,
``nft_samples.png`` and the KD trajectory cache ``kd_cache/``.

Run: ``python examples/toy2d.py`` (``--quick`` for a smoke run of a few seconds;
``--device cuda`` is the default when a GPU is available).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from tqdm import tqdm

from purestep import optim, rng
from purestep.methods import dmd2, finetune, flow, kd

sys.path.insert(0, str(Path(__file__).resolve().parent))

from toy_common import (
    Timer,
    VelocityMLP,
    eight_gaussians,
    loss_curves,
    override,
    scatter_panels,
    seeded,
    sliced_wasserstein,
    train,
    write_json,
)

FULL: dict[str, Any] = {
    "hidden": 128,
    "depth": 3,
    "batch": 512,
    "teacher_steps": 3000,
    "teacher_lr": 2e-3,
    "ema": 0.995,
    "kd_samples": 8192,
    "kd_steps": 3000,
    "kd_lr": 1e-3,
    "dmd2_steps": 16000,
    "dmd2_student_lr": 2e-3,
    "dmd2_kd_init_student_lr": 1e-4,
    "dmd2_critic_lr": 1e-3,
    "dmd2_interval": 5,
    "nft_steps": 60,
    "n_eval": 16384,
}
QUICK: dict[str, Any] = {
    **FULL,
    "hidden": 32,
    "batch": 64,
    "teacher_steps": 30,
    "kd_samples": 256,
    "kd_steps": 10,
    "dmd2_steps": 10,
    "nft_steps": 2,
    "n_eval": 512,
}

# keys of the example's own draws (the methods fold their purposes into step keys)
(
    DATA,
    HELDOUT,
    EVAL_NOISE,
    SW_DIRS,
    KD_NOISE,
    KD_SHUFFLE,
    FLOOR,
    RENOISE,
    INIT_TEACHER,
    INIT_KD,
) = range(1, 11)
STUDENT_KD_STEPS = (1.0, 0.75, 0.5, 0.25)


def generate(
    model: VelocityMLP,
    params: TensorDictBase,
    noise: torch.Tensor,
    steps: Any,
    renoise_key: torch.Tensor | None = None,
) -> torch.Tensor:
    """Euler ODE sampling, or the students' re-noising sampler with ``renoise_key``."""
    out = flow.sample(model, params, noise, steps, renoise_key=renoise_key)
    assert isinstance(out, torch.Tensor)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="outputs/toy2d", help="output folder")
    ap.add_argument("--quick", action="store_true", help="tiny run (smoke test)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config entry, e.g. --set dmd2_steps=20000 (repeatable)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true", help="hide progress bars")
    ap.add_argument(
        "--dmd2-init",
        choices=("teacher", "kd"),
        default="teacher",
        help="initial weights of the DMD2 student: the teacher's (DMD2) or the KD student's",
    )
    ap.add_argument("--skip-nft", action="store_true", help="skip the NFT stage")
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where models and data live (default: cuda when available)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1 is fastest for these tiny MLPs, and robust on a busy CPU)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = override(QUICK if args.quick else FULL, args.set)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    progress = not args.no_progress
    device = torch.device(args.device)
    root = rng.key(args.seed)
    timer = Timer()
    b = cfg["batch"]
    data_key = rng.fold_in(root, DATA)

    def data_batch(i: int) -> TensorDict:
        x0 = eight_gaussians(data_key, b, offset=i * b, device=device)
        return TensorDict({"x0": x0}, batch_size=[b])

    def model(init: int) -> VelocityMLP:
        m = VelocityMLP(hidden=cfg["hidden"], depth=cfg["depth"]).to(device)
        seeded(m, rng.fold_in(root, init))
        return m

    n_eval = cfg["n_eval"]
    heldout = eight_gaussians(rng.fold_in(root, HELDOUT), n_eval, device=device)
    eval_noise = rng.normal(rng.fold_in(root, EVAL_NOISE), (n_eval, 2), device=device)
    sw_key = rng.fold_in(root, SW_DIRS)

    def sw(x: torch.Tensor) -> float:
        return round(sliced_wasserstein(x, heldout, sw_key), 5)

    curves: dict[str, list[tuple[int, float]]] = {}
    summary: dict[str, Any] = {"config": cfg, "seed": args.seed, "quick": args.quick}
    summary["sw_data_floor"] = sw(eight_gaussians(rng.fold_in(root, FLOOR), n_eval, device=device))
    summary["device"] = str(device)

    # ---------------------------------------------------------------- 1. teacher
    teacher = model(INIT_TEACHER)
    t_opt = optim.adamw(
        lr=optim.schedules.warmup_cosine(
            cfg["teacher_lr"], min(100, cfg["teacher_steps"] - 1), cfg["teacher_steps"]
        ),
        weight_decay=0.0,
    )
    t_step = finetune.make_step(teacher, t_opt, donate=True, ema=cfg["ema"])
    state = finetune.init_state(teacher, t_opt, seed=args.seed)
    state, c = train(
        t_step,
        state,
        data_batch,
        cfg["teacher_steps"],
        desc="teacher (finetune)",
        progress=progress,
    )
    curves["teacher: flow-matching loss"] = c["loss"]
    teacher_params = state["ema", "student"]
    teacher_32 = generate(teacher, teacher_params, eval_noise, flow.timestep_schedule(32))
    teacher_1 = generate(teacher, teacher_params, eval_noise, [1.0, 0.0])
    summary["sw_teacher_32step"] = sw(teacher_32)
    summary["sw_teacher_1step"] = sw(teacher_1)
    panels = [
        ("held-out data", heldout),
        (f"teacher, 32 steps (SW {summary['sw_teacher_32step']:.3f})", teacher_32),
        (f"teacher, 1 step (SW {summary['sw_teacher_1step']:.3f})", teacher_1),
    ]
    timer.lap("teacher")

    # ---------------------------------------------------------------- 2. kd
    cache = out / "kd_cache"
    bar = tqdm(total=1, desc="kd trajectories", disable=not progress, dynamic_ncols=True)

    def on_chunk(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    kd.generate_trajectories(
        teacher,
        cache,
        num_samples=cfg["kd_samples"],
        sample_shape=(2,),
        student_steps=STUDENT_KD_STEPS,
        teacher_steps=32,
        key=rng.fold_in(root, KD_NOISE),
        chunk_size=1024,
        teacher_params=teacher_params,
        progress=on_chunk,
        device=device,
    )
    bar.close()
    traj = kd.load_trajectories(cache).to(device)  # the cache is on disk (CPU tensors)
    k_student = model(INIT_KD)
    k_opt = optim.adam(lr=optim.schedules.cosine_decay(cfg["kd_lr"], cfg["kd_steps"]))
    k_step = kd.make_step(k_student, k_opt, donate=True)
    k_state = kd.init_state(teacher_params, k_opt, seed=args.seed + 2)
    k_batches = kd.batches(traj, b, key=rng.fold_in(root, KD_SHUFFLE))
    k_state, c = train(
        k_step, k_state, k_batches, cfg["kd_steps"], desc="kd 4-step", progress=progress
    )
    curves["kd: 0.5 mse(x0)"] = c["loss"]
    kd_params = k_state["params", "student"]
    kd_4 = generate(
        k_student,
        kd_params,
        eval_noise,
        [*STUDENT_KD_STEPS, 0.0],
        renoise_key=rng.fold_in(root, RENOISE),
    )
    summary["sw_kd_4step"] = sw(kd_4)
    summary["sw_kd_4step_euler"] = sw(
        generate(k_student, kd_params, eval_noise, [*STUDENT_KD_STEPS, 0.0])
    )
    summary["sw_kd_1step"] = sw(generate(k_student, kd_params, eval_noise, [1.0, 0.0]))
    panels.append((f"KD, 4 steps (SW {summary['sw_kd_4step']:.3f})", kd_4))
    timer.lap("kd")

    # ---------------------------------------------------------------- 3. dmd2
    student = model(INIT_KD)  # the architecture; its weights come from the init below
    if args.dmd2_init == "kd":
        s_init, s_lr = kd_params, cfg["dmd2_kd_init_student_lr"]
    else:
        s_init = teacher_params
        s_lr = optim.schedules.cosine_decay(
            cfg["dmd2_student_lr"], cfg["dmd2_steps"] // cfg["dmd2_interval"] + 1
        )
    d_opts = {
        "student": optim.adam(lr=s_lr, betas=(0.0, 0.999)),
        "critic": optim.adam(lr=cfg["dmd2_critic_lr"], betas=(0.0, 0.999)),
    }
    d_cfg = dmd2.DMD2Config(student_steps=(1.0,), generator_update_interval=cfg["dmd2_interval"])
    d_step = dmd2.make_step(
        student=student,
        teacher=teacher,
        teacher_params=teacher_params,
        optimizers=d_opts,
        config=d_cfg,
        donate=True,
        ema=cfg["ema"],
        ema_on_update=False,  # after every step, as when the numbers in docs/methods.md were taken
    )
    d_state = dmd2.init_state(
        student=s_init, critic=teacher_params, optimizers=d_opts, seed=args.seed + 1
    )
    d_state, c = train(
        d_step,
        d_state,
        data_batch,
        cfg["dmd2_steps"],
        desc=f"dmd2 1-step ({args.dmd2_init} init)",
        progress=progress,
        metrics=(("critic", "loss"), ("student", "dmd_g_abs")),
    )
    curves["dmd2: critic flow-matching loss"] = c.get("critic/loss", [])
    curves["dmd2: mean |g| (student steps)"] = c.get("student/dmd_g_abs", [])
    dmd2_1 = generate(student, d_state["ema", "student"], eval_noise, [1.0, 0.0])
    summary["dmd2_init"] = args.dmd2_init
    summary["sw_dmd2_1step"] = sw(dmd2_1)
    panels.append((f"DMD2, 1 step (SW {summary['sw_dmd2_1step']:.3f})", dmd2_1))
    timer.lap("dmd2")

    # ---------------------------------------------------------------- 4. nft
    if not args.skip_nft:
        from toy2d_nft import run_nft  # the NFT stage, also runnable on its own

        nft_out = run_nft(
            teacher,
            teacher_params,
            out_dir=out,
            steps=cfg["nft_steps"],
            progress=progress,
            seed=args.seed + 3,
        )
        summary.update({k: round(float(v), 5) for k, v in nft_out.items()})
        timer.lap("nft")

    # ---------------------------------------------------------------- report
    scatter_panels(panels, out / "samples.png")
    loss_curves({k: v for k, v in curves.items() if v}, out / "losses.png")
    t32 = summary["sw_teacher_32step"]
    for name in ("dmd2_1step", "kd_4step"):
        if f"sw_{name}" in summary:
            summary[f"ratio_{name}_to_teacher_32step"] = round(summary[f"sw_{name}"] / t32, 3)
    summary["wall_time_s"] = {**timer.stages, "total": timer.total()}
    summary["cpu_time_s"] = round(time.process_time(), 1)
    write_json(out / "summary.json", summary)
    print({k: v for k, v in summary.items() if k != "config"})
    return summary


if __name__ == "__main__":
    main()
