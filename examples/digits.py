"""Digits: a class-conditional flow teacher on real 8x8 handwritten digits, distilled by DMD2.

Data: scikit-learn's bundled digits (1797 images, 8x8, 10 classes; the
``examples`` extra), scaled to ``[-1, 1]`` and split into train and held-out
sets. Stages:

1. a small digit classifier is trained on the real training images; its
   penultimate layer is the feature space of the Fréchet distance (FD, as in
   FID) and it scores whether a generated image shows the requested class;
2. ``finetune``: a class-conditional velocity MLP, with label dropout for
   classifier-free guidance (CFG);
3. ``dmd2``: a 1-step conditional student, initialised from the teacher, against
   the CFG teacher (real score) and a critic (fake score).

Writes into ``--out`` (default ``outputs/digits``): ``summary.json`` (FD to the
held-out images of the teacher at 32 and 1 Euler steps and of the DMD2 student,
classifier accuracy per requested class, wall times), image grids
``grid_data.png``, ``grid_teacher_32step.png``, ``grid_teacher_1step.png``,
``grid_dmd2_1step.png`` (one row per class) and ``losses.png``.

Run: ``python examples/digits.py`` (``--quick`` for a smoke run).
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

from purestep import call, init_state, optim, rng, train_step, value_and_grad
from purestep.methods import dmd2, finetune, flow

sys.path.insert(0, str(Path(__file__).resolve().parent))

from toy_common import (
    Timer,
    VelocityMLP,
    gaussian_frechet,
    image_grid,
    loss_curves,
    override,
    seeded,
    shuffled_batches,
    train,
    write_json,
)

FULL: dict[str, Any] = {
    "hidden": 256,
    "depth": 3,
    "batch": 256,
    "clf_steps": 1500,
    "teacher_steps": 6000,
    "teacher_lr": 1e-3,
    "ema": 0.999,
    "cond_dropout": 0.1,
    "guidance": 1.5,
    "dmd2_steps": 12000,
    "dmd2_student_lr": 5e-4,
    "dmd2_critic_lr": 1e-3,
    "dmd2_interval": 3,
    "dmd2_ema": 0.995,
    "n_gen_per_class": 200,
}
QUICK: dict[str, Any] = {
    **FULL,
    "hidden": 64,
    "batch": 64,
    "clf_steps": 20,
    "teacher_steps": 20,
    "dmd2_steps": 10,
    "n_gen_per_class": 10,
}
NUM_CLASSES = 10
NULL = NUM_CLASSES  # the null label of classifier-free guidance
SPLIT, CLF_INIT, CLF_DATA, TEACHER_DATA, DMD2_DATA, GEN_NOISE, TEACHER_INIT = range(1, 8)


class DigitClassifier(nn.Module):
    """64 -> 256 -> 64 (features) -> 10."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.SiLU(), nn.Linear(256, 64), nn.SiLU())
        self.head = nn.Linear(64, NUM_CLASSES)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))  # type: ignore[no-any-return]


def load_digits_split(key: torch.Tensor) -> tuple[TensorDict, TensorDict]:
    """The digits in ``[-1, 1]``, split 80/20 into train and held-out by a keyed permutation."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 8.0 - 1.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = rng.randperm(key, x.shape[0])
    n_train = int(0.8 * x.shape[0])
    tr, te = perm[:n_train], perm[n_train:]
    return (
        TensorDict({"x0": x[tr], "label": y[tr]}, batch_size=[len(tr)]),
        TensorDict({"x0": x[te], "label": y[te]}, batch_size=[len(te)]),
    )


def train_classifier(
    data: TensorDict,
    cfg: dict[str, Any],
    key: torch.Tensor,
    init_key: torch.Tensor,
    progress: bool,
) -> tuple[DigitClassifier, TensorDictBase, list[tuple[int, float]]]:
    """A cross-entropy classifier of the real training digits (AdamW, cosine schedule)."""
    clf = DigitClassifier()
    seeded(clf, init_key)

    def loss_fn(params: TensorDictBase, batch: TensorDictBase, k: torch.Tensor) -> Any:
        logits = call(clf, params["clf"], batch["x0"])
        return nn.functional.cross_entropy(logits, batch["label"]), {}

    opt = {"clf": optim.adamw(lr=optim.schedules.cosine_decay(2e-3, cfg["clf_steps"]))}
    step = train_step(value_and_grad(loss_fn), opt, donate=True)
    state = init_state({"clf": clf}, opt, seed=0)
    batches = shuffled_batches(data, cfg["batch"], key=key)
    state, curves = train(
        step, state, batches, cfg["clf_steps"], desc="classifier", progress=progress
    )
    return clf, state["params", "clf"], curves["loss"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="outputs/digits", help="output folder")
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
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = override(QUICK if args.quick else FULL, args.set)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    progress = not args.no_progress
    root = rng.key(args.seed)
    timer = Timer()
    summary: dict[str, Any] = {"config": cfg, "seed": args.seed, "quick": args.quick}
    curves: dict[str, list[tuple[int, float]]] = {}

    train_data, test_data = load_digits_split(rng.fold_in(root, SPLIT))
    summary["n_train"], summary["n_heldout"] = (
        int(train_data.batch_size[0]),
        int(test_data.batch_size[0]),
    )

    # ---------------------------------------------------------------- classifier
    clf, clf_params, curves["classifier loss"] = train_classifier(
        train_data, cfg, rng.fold_in(root, CLF_DATA), rng.fold_in(root, CLF_INIT), progress
    )

    @torch.no_grad()
    def classify(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with clf_params.to_module(clf):
            return clf.features(x), clf(x).argmax(-1)

    real_feats, real_pred = classify(test_data["x0"])
    summary["classifier_heldout_accuracy"] = round(
        float((real_pred == test_data["label"]).float().mean()), 4
    )
    train_feats, _ = classify(train_data["x0"])
    summary["fd_train_vs_heldout"] = round(gaussian_frechet(train_feats, real_feats), 4)
    timer.lap("classifier")

    # ---------------------------------------------------------------- teacher
    teacher = VelocityMLP(dim=64, hidden=cfg["hidden"], depth=cfg["depth"], num_classes=NUM_CLASSES)
    seeded(teacher, rng.fold_in(root, TEACHER_INIT))
    t_opt = optim.adamw(
        lr=optim.schedules.warmup_cosine(
            cfg["teacher_lr"], min(200, cfg["teacher_steps"] - 1), cfg["teacher_steps"]
        ),
        weight_decay=0.0,
    )
    t_cfg = finetune.FinetuneConfig(
        cond_keys=("label",), cond_dropout=cfg["cond_dropout"], null_cond={"label": NULL}
    )
    t_step = finetune.make_step(teacher, t_opt, t_cfg, donate=True, ema=cfg["ema"])
    t_state = finetune.init_state(teacher, t_opt, seed=args.seed)
    t_state, c = train(
        t_step,
        t_state,
        shuffled_batches(train_data, cfg["batch"], key=rng.fold_in(root, TEACHER_DATA)),
        cfg["teacher_steps"],
        desc="teacher (finetune)",
        progress=progress,
    )
    curves["teacher flow-matching loss"] = c["loss"]
    teacher_params = t_state["ema", "student"]
    timer.lap("teacher")

    # requested classes: n_gen_per_class of each, fixed noise
    n_per = cfg["n_gen_per_class"]
    labels = torch.arange(NUM_CLASSES).repeat_interleave(n_per)
    noise = rng.normal(rng.fold_in(root, GEN_NOISE), (labels.shape[0], 64))
    cond = {"label": labels}
    null = flow.null_condition(cond, {"label": NULL})

    def gen(model: nn.Module, params: TensorDictBase, steps: Any, guidance: float) -> torch.Tensor:
        x = flow.sample(
            model, params, noise, steps, cond=cond, null_cond=null, guidance_scale=guidance
        )
        assert isinstance(x, torch.Tensor)
        return x.clamp(-1, 1)

    def evaluate(name: str, x: torch.Tensor) -> None:
        feats, pred = classify(x)
        summary[f"fd_{name}"] = round(gaussian_frechet(feats, real_feats), 4)
        per_class = (pred == labels).float().reshape(NUM_CLASSES, n_per).mean(1)
        summary[f"accuracy_{name}"] = round(float(per_class.mean()), 4)
        summary[f"accuracy_per_class_{name}"] = [round(float(a), 3) for a in per_class]
        grid = x.reshape(NUM_CLASSES, n_per, 8, 8)[:, :10].reshape(-1, 8, 8)
        image_grid(
            grid,
            out / f"grid_{name}.png",
            nrow=NUM_CLASSES,
            title=f"{name} (FD {summary[f'fd_{name}']:.2f})",
        )

    g = cfg["guidance"]
    evaluate("teacher_32step", gen(teacher, teacher_params, flow.timestep_schedule(32), g))
    evaluate("teacher_1step", gen(teacher, teacher_params, [1.0, 0.0], g))
    summary["guidance_scale"] = g
    data_grid = torch.cat(
        [test_data["x0"][test_data["label"] == c][:10] for c in range(NUM_CLASSES)]
    ).reshape(-1, 8, 8)
    image_grid(data_grid, out / "grid_data.png", nrow=NUM_CLASSES, title="held-out data")
    timer.lap("teacher eval")

    # ---------------------------------------------------------------- dmd2
    student = VelocityMLP(dim=64, hidden=cfg["hidden"], depth=cfg["depth"], num_classes=NUM_CLASSES)
    s_lr = optim.schedules.cosine_decay(
        cfg["dmd2_student_lr"], cfg["dmd2_steps"] // cfg["dmd2_interval"] + 1
    )
    d_opts = {
        "student": optim.adam(lr=s_lr, betas=(0.0, 0.999)),
        "critic": optim.adam(lr=cfg["dmd2_critic_lr"], betas=(0.0, 0.999)),
    }
    d_cfg = dmd2.DMD2Config(
        student_steps=(1.0,),
        guidance_scale=g,
        cond_keys=("label",),
        null_cond={"label": NULL},
        generator_update_interval=cfg["dmd2_interval"],
    )
    d_step = dmd2.make_step(
        student=student,
        teacher=teacher,
        teacher_params=teacher_params,
        optimizers=d_opts,
        config=d_cfg,
        donate=True,
        ema=cfg["dmd2_ema"],
        ema_on_update=False,  # after every step, as when the numbers in docs/methods.md were taken
    )
    d_state = dmd2.init_state(
        student=teacher_params, critic=teacher_params, optimizers=d_opts, seed=args.seed + 1
    )
    d_state, c = train(
        d_step,
        d_state,
        shuffled_batches(train_data, cfg["batch"], key=rng.fold_in(root, DMD2_DATA)),
        cfg["dmd2_steps"],
        desc="dmd2 1-step",
        progress=progress,
        metrics=(("student", "loss"), ("critic", "loss")),
    )
    curves["dmd2 critic loss"] = c.get("critic/loss", [])
    evaluate("dmd2_1step", gen(student, d_state["ema", "student"], [1.0, 0.0], 1.0))
    timer.lap("dmd2")

    # ---------------------------------------------------------------- report
    loss_curves({k: v for k, v in curves.items() if v}, out / "losses.png")
    summary["ratio_fd_dmd2_to_teacher_32step"] = round(
        summary["fd_dmd2_1step"] / summary["fd_teacher_32step"], 3
    )
    summary["wall_time_s"] = {**timer.stages, "total": timer.total()}
    summary["cpu_time_s"] = round(time.process_time(), 1)
    write_json(out / "summary.json", summary)
    print({k: v for k, v in summary.items() if k != "config" and "per_class" not in k})
    return summary


if __name__ == "__main__":
    main()
