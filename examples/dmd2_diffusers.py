"""DMD2 on a diffusers DiT: the train-a-teacher-then-distil recipe of docs/methods.md, end to end.

A tiny class-conditional ``diffusers.DiTTransformer2DModel`` (random weights
drawn through :mod:`purestep.rng`; nothing is downloaded) on scikit-learn's
8x8 digits (the ``examples`` and ``integration`` extras). Stages:

1. a digit classifier on the real training images (``examples/digits.py``'s);
   its penultimate layer is the feature space of the Fréchet distance (FD);
2. the teacher: ``methods.finetune`` (flow matching, label dropout for
   classifier-free guidance, EMA) through ``flow.adapt`` (timestep x 1000,
   ``.sample``, ``label -> class_labels``), run by ``loop.run`` with
   checkpoints and ``resume="latest"``;
3. ``methods.dmd2``: a 1-step student and the critic start from the teacher's
   EMA weights; the student's learning-rate schedule is sized in method steps
   (``optim.schedules.in_steps``), its EMA moves on its own updates;
   ``loop.run`` with checkpoints, ``resume="latest"`` and an ``eval_fn`` that
   logs the FD and a sample grid (``loop.Image``: ``images/eval_samples_*.png``);
4. export: the EMA student is written into the diffusers module
   (``export.load_params``), saved with ``save_pretrained``, reloaded with
   ``from_pretrained`` and sampled again (the same images, bitwise).

Preemption: ``--preempt-at N`` sends this process SIGTERM during DMD2 step N;
the loop finishes the step, saves, prints how to resume and exits with 143.
Running the same command again (without ``--preempt-at``) resumes every stage
from its newest checkpoint; the result is bitwise that of an uninterrupted run
(``summary.json``'s ``student_sha256``).

Writes into ``--out`` (default ``outputs/dmd2_diffusers``): ``summary.json``
(FD of the 1-step student against the 32-step teacher's samples and of each
against the held-out digits, the export check, wall times), ``teacher/`` and
``dmd2/`` (checkpoints, ``metrics.jsonl``, ``images/``), ``student_diffusers/``
(the ``save_pretrained`` directory) and ``grid_*.png``.

Run: ``python examples/dmd2_diffusers.py`` (``--smoke`` for a tiny run,
``--device cuda``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

import purestep as ps
from purestep import export, loop, optim, rng
from purestep.methods import dmd2, finetune, flow

sys.path.insert(0, str(Path(__file__).resolve().parent))

from digits import DigitClassifier, load_digits_split, train_classifier
from toy_common import (
    Timer,
    gaussian_frechet,
    image_grid,
    override,
    seeded,
    shuffled_batches,
    write_json,
)

FULL: dict[str, Any] = {
    "layers": 2,
    "heads": 4,
    "head_dim": 16,
    "batch": 64,
    "clf_steps": 600,
    "teacher_steps": 1500,
    "teacher_lr": 1e-3,
    "teacher_ema": 0.995,
    "cond_dropout": 0.1,
    "guidance": 1.5,
    "dmd2_steps": 1200,
    "dmd2_student_lr": 2e-4,
    "dmd2_critic_lr": 4e-4,
    "dmd2_interval": 3,
    "dmd2_ema": 0.99,
    "dmd2_ema_start": 150,
    "save_every": 400,
    "eval_every": 400,
    "n_gen_per_class": 50,
}
SMOKE: dict[str, Any] = {
    **FULL,
    "layers": 1,
    "heads": 2,
    "batch": 32,
    "clf_steps": 10,
    "teacher_steps": 8,
    "dmd2_steps": 9,
    "dmd2_ema_start": 3,
    "save_every": 3,
    "eval_every": 3,
    "n_gen_per_class": 4,
}
NUM_CLASSES = 10
NULL = NUM_CLASSES  # the DiT's label table has a null row (its CFG embedding) at index 10
SPLIT, CLF_INIT, CLF_DATA, TEACHER_DATA, DMD2_DATA, GEN_NOISE, TEACHER_INIT, STUDENT_INIT = range(
    1, 9
)


def import_diffusers() -> Any:
    """``import diffusers`` (offline), also next to a torchvision wheel whose compiled ops do not load.

    diffusers imports peft -> transformers -> torchvision. PyPI's torchvision
    wheels are CUDA builds; next to a CPU build of torch their import fails on
    ``register_fake("torchvision::nms")``. As in ``tests/integration/conftest.py``,
    the two op schemas that import needs are declared only in that case (calling
    the ops still raises; diffusers' DiT does not).
    """
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")  # random weights only: never reach for the hub
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    if importlib.util.find_spec("torchvision") is not None:
        try:
            import torchvision
        except RuntimeError as e:
            if "torchvision::nms does not exist" not in str(e):
                raise
            for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
                del sys.modules[name]
            lib = torch.library.Library("torchvision", "FRAGMENT")
            lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            import_diffusers.schemas = lib  # type: ignore[attr-defined]  # keep them alive
            import torchvision  # noqa: F401
    import diffusers

    return diffusers


def build_dit(diffusers: Any, cfg: dict[str, Any], key: torch.Tensor, device: str) -> nn.Module:
    """A tiny class-conditional DiT on ``[B, 1, 8, 8]`` (2x2 patches), weights drawn from ``key``.

    diffusers draws its initial weights from torch's global RNG; every Linear,
    Embedding and Conv2d is redrawn here through :mod:`purestep.rng` (PyTorch's
    default scheme), so the model is a function of the seed alone. It stays in
    ``eval()``: in train mode its label dropout would draw from the global RNG
    (``finetune``'s ``cond_dropout`` is keyed instead).
    """
    dit = diffusers.DiTTransformer2DModel(
        num_attention_heads=cfg["heads"],
        attention_head_dim=cfg["head_dim"],
        in_channels=1,
        out_channels=1,
        num_layers=cfg["layers"],
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=NUM_CLASSES,
        norm_num_groups=1,
    )
    with torch.no_grad():
        seeded(dit, key)
        for i, mod in enumerate(m for m in dit.modules() if isinstance(m, nn.Conv2d)):
            bound = 1.0 / mod.weight[0].numel() ** 0.5
            for j, p in enumerate((mod.weight, mod.bias)):
                if p is not None:
                    k = rng.fold_in(rng.fold_in(key, 10_000 + i), j)
                    p.copy_(rng.uniform(k, p.shape, low=-bound, high=bound))
    return dit.to(device).eval()  # type: ignore[no-any-return]


def adapted(dit: nn.Module) -> nn.Module:
    """The flow contract ``forward(x_t, t, label=...) -> velocity`` around a diffusers DiT."""
    return flow.adapt(
        dit, timestep_scale=1000.0, output="sample", cond_map={"label": "class_labels"}
    )


class Batches:
    """Shuffled batches of ``data`` (``toy_common.shuffled_batches``), re-iterable for ``loop.run``.

    With ``preempt_at=n`` the process sends itself SIGTERM while batch ``n`` is
    handed out (the loop finishes that step, saves and exits), a stand-in for a
    scheduler's preemption.
    """

    def __init__(
        self, data: TensorDictBase, batch: int, key: torch.Tensor, preempt_at: int | None = None
    ) -> None:
        self.data, self.batch, self.key, self.preempt_at = data, batch, key, preempt_at

    def __iter__(self) -> Iterator[TensorDictBase]:
        for i, b in enumerate(shuffled_batches(self.data, self.batch, key=self.key)):
            if i == self.preempt_at:
                os.kill(os.getpid(), signal.SIGTERM)
            yield b


def digest(params: TensorDictBase) -> str:
    """SHA-256 of a TensorDict's leaves (sorted keys, CPU bytes): bitwise identity in one string."""
    h = hashlib.sha256()
    flat = params.flatten_keys(".")
    for k in sorted(flat.keys()):
        h.update(k.encode())
        h.update(flat[k].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="outputs/dmd2_diffusers", help="output folder")
    ap.add_argument("--smoke", "--quick", action="store_true", help="tiny run (smoke test)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config entry, e.g. --set dmd2_steps=3000 (repeatable)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preempt-at", type=int, default=None, help="SIGTERM during DMD2 step N")
    ap.add_argument("--no-progress", action="store_true", help="hide progress bars")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    diffusers = import_diffusers()
    cfg = override(SMOKE if args.smoke else FULL, args.set)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = args.device
    progress = not args.no_progress
    root = rng.key(args.seed)
    timer = Timer()
    cpu: dict[str, float] = {}

    def lap(name: str) -> None:  # wall and CPU seconds of a stage (CPU: robust on a shared machine)
        timer.lap(name)
        cpu[name] = round(time.process_time() - sum(cpu.values()), 2)

    summary: dict[str, Any] = {"config": cfg, "seed": args.seed, "smoke": args.smoke, "device": dev}

    train_cpu, test_cpu = load_digits_split(rng.fold_in(root, SPLIT))

    def images(td: TensorDict) -> TensorDict:  # [N, 64] -> [N, 1, 8, 8] on the device
        return TensorDict(
            {"x0": td["x0"].reshape(-1, 1, 8, 8), "label": td["label"]}, batch_size=td.batch_size
        ).to(dev)

    train_data = images(train_cpu)

    # ---------------------------------------------------------------- classifier (FD features)
    clf, clf_params, _ = train_classifier(
        train_cpu, cfg, rng.fold_in(root, CLF_DATA), rng.fold_in(root, CLF_INIT), progress
    )

    @torch.no_grad()
    def features(x: torch.Tensor) -> torch.Tensor:
        with clf_params.to_module(clf):
            return DigitClassifier.features(clf, x.reshape(-1, 64).float().cpu())

    real_feats = features(test_cpu["x0"])
    lap("classifier")

    # requested samples: n_gen_per_class of each class, fixed noise
    n_per = cfg["n_gen_per_class"]
    labels = torch.arange(NUM_CLASSES, device=dev).repeat_interleave(n_per)
    noise = rng.normal(rng.fold_in(root, GEN_NOISE), (labels.shape[0], 1, 8, 8), device=dev)
    cond = {"label": labels}
    null = flow.null_condition(cond, {"label": NULL})

    def gen(model: nn.Module, params: TensorDictBase | None, steps: Any, g: float) -> torch.Tensor:
        x = flow.sample(model, params, noise, steps, cond=cond, null_cond=null, guidance_scale=g)
        assert isinstance(x, torch.Tensor)
        return x.clamp(-1, 1)

    def grid(x: torch.Tensor) -> torch.Tensor:  # up to 8 samples of each class, a row per class
        k = min(n_per, 8)
        return x.reshape(NUM_CLASSES, n_per, 1, 8, 8)[:, :k].reshape(-1, 1, 8, 8)

    # ---------------------------------------------------------------- teacher: finetune
    teacher = adapted(build_dit(diffusers, cfg, rng.fold_in(root, TEACHER_INIT), dev))
    t_opt = optim.adamw(
        lr=optim.schedules.warmup_cosine(
            cfg["teacher_lr"], min(100, cfg["teacher_steps"] - 1), cfg["teacher_steps"]
        ),
        weight_decay=0.0,
    )
    t_cfg = finetune.FinetuneConfig(
        cond_keys=("label",), cond_dropout=cfg["cond_dropout"], null_cond={"label": NULL}
    )
    t_step = finetune.make_step(teacher, t_opt, t_cfg, donate=True, ema=cfg["teacher_ema"])
    t_state = loop.run(
        t_step,
        finetune.init_state(teacher, t_opt, seed=args.seed),
        Batches(train_data, cfg["batch"], rng.fold_in(root, TEACHER_DATA)),
        num_steps=cfg["teacher_steps"],
        checkpoint_dir=out / "teacher",
        save_every=cfg["save_every"],
        resume="latest",
        log_every=max(1, cfg["teacher_steps"] // 50),
        progress=progress,
        desc="teacher (finetune)",
    )
    teacher_vars = ps.variables(t_state, "student", ema=True)  # the trained (EMA) weights
    lap("teacher")

    g = cfg["guidance"]
    x_teacher = gen(teacher, teacher_vars, flow.timestep_schedule(32), g)
    teacher_feats = features(x_teacher)
    summary["fd_teacher_32step_vs_heldout"] = round(gaussian_frechet(teacher_feats, real_feats), 4)
    x_teacher1 = gen(teacher, teacher_vars, [1.0, 0.0], g)
    summary["fd_teacher_1step_vs_teacher_32step"] = round(
        gaussian_frechet(features(x_teacher1), teacher_feats), 4
    )
    lap("teacher eval")

    # ---------------------------------------------------------------- dmd2
    student = adapted(build_dit(diffusers, cfg, rng.fold_in(root, STUDENT_INIT), dev))
    n, every = cfg["dmd2_steps"], cfg["dmd2_interval"]
    s_lr = optim.schedules.in_steps(
        optim.schedules.cosine_decay(cfg["dmd2_student_lr"], n), every=every
    )  # sized in method steps: the student updates every `every` steps
    d_opts = {
        "student": optim.adam(lr=s_lr, betas=(0.0, 0.999)),
        "critic": optim.adam(lr=cfg["dmd2_critic_lr"], betas=(0.0, 0.999)),
    }
    d_cfg = dmd2.DMD2Config(
        student_steps=(1.0,),
        guidance_scale=g,
        cond_keys=("label",),
        null_cond={"label": NULL},
        generator_update_interval=every,
    )
    d_step = dmd2.make_step(
        student=student,
        teacher=teacher,
        teacher_params=teacher_vars,
        optimizers=d_opts,
        config=d_cfg,
        donate=True,
        ema=cfg["dmd2_ema"],  # per student update (ema_on_update defaults on with every > 1)
        ema_start_step=cfg["dmd2_ema_start"],
    )

    def eval_student(state: TensorDictBase) -> dict[str, Any]:
        x = gen(student, ps.variables(state, "student", ema=True), [1.0, 0.0], 1.0)
        return {
            "fd_vs_teacher_32step": gaussian_frechet(features(x), teacher_feats),
            "samples": loop.Image(grid(x), ncol=min(n_per, 8)),
        }

    d_state = loop.run(
        d_step,
        dmd2.init_state(
            student=teacher_vars, critic=teacher_vars, optimizers=d_opts, seed=args.seed + 1
        ),
        Batches(train_data, cfg["batch"], rng.fold_in(root, DMD2_DATA), args.preempt_at),
        num_steps=n,
        checkpoint_dir=out / "dmd2",
        save_every=cfg["save_every"],
        resume="latest",
        log_every=max(1, n // 50),
        eval_fn=eval_student,
        eval_every=cfg["eval_every"],
        progress=progress,
        desc="dmd2 1-step",
    )
    student_vars = ps.variables(d_state, "student", ema=True)
    x_student = gen(student, student_vars, [1.0, 0.0], 1.0)
    student_feats = features(x_student)
    summary["fd_student_1step_vs_teacher_32step"] = round(
        gaussian_frechet(student_feats, teacher_feats), 4
    )
    summary["fd_student_1step_vs_heldout"] = round(gaussian_frechet(student_feats, real_feats), 4)
    summary["student_sha256"] = digest(student_vars)
    lap("dmd2")

    # ---------------------------------------------------------------- export and reload
    export.load_params(student, student_vars)  # the EMA student into the diffusers module
    student.model.save_pretrained(out / "student_diffusers")
    reloaded = diffusers.DiTTransformer2DModel.from_pretrained(out / "student_diffusers")
    x_back = gen(adapted(reloaded.to(dev).eval()), None, [1.0, 0.0], 1.0)
    summary["export_reload_max_abs_diff"] = float((x_back - x_student).abs().max())
    if not torch.equal(x_back, x_student):
        raise RuntimeError("the reloaded student's samples differ from the trained student's")
    lap("export")

    # ---------------------------------------------------------------- report
    data_x = torch.cat(
        [test_cpu["x0"][test_cpu["label"] == c][:8] for c in range(NUM_CLASSES)]
    ).reshape(-1, 8, 8)
    image_grid(data_x, out / "grid_data.png", nrow=NUM_CLASSES, title="held-out data")
    for name, x in (
        ("teacher_32step", x_teacher),
        ("teacher_1step", x_teacher1),
        ("student_1step", x_student),
    ):
        image_grid(grid(x)[:, 0].cpu(), out / f"grid_{name}.png", nrow=NUM_CLASSES, title=name)
    summary["ratio_fd_student_to_teacher_1step"] = round(
        summary["fd_student_1step_vs_teacher_32step"]
        / max(summary["fd_teacher_1step_vs_teacher_32step"], 1e-12),
        3,
    )
    summary["wall_time_s"] = {**timer.stages, "total": timer.total()}
    summary["cpu_time_s"] = {**cpu, "total": round(time.process_time(), 1)}
    write_json(out / "summary.json", summary)
    print({k: v for k, v in summary.items() if k != "config"})
    return summary


if __name__ == "__main__":
    main()
