"""Shared pieces of the toy examples: data, a velocity MLP, metrics, a loop and plots.

Everything random goes through :mod:`purestep.rng` (explicit keys, per-sample
``index``), so every example is a deterministic function of its seed.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from purestep import loop, plot, rng

StepFn = Callable[[TensorDictBase, Any], tuple[TensorDictBase, TensorDictBase]]


# --------------------------------------------------------------------------- model


class VelocityMLP(nn.Module):
    """``v(x_t, t[, label])``: an MLP on ``x_t``, Fourier features of ``t`` and a label embedding.

    Args:
        dim: data dimension.
        hidden: hidden width.
        depth: number of hidden layers.
        num_classes: with a value, ``forward`` takes ``label`` (an int64 ``[B]``
            in ``[0, num_classes]``; ``num_classes`` itself is the null class
            used by classifier-free guidance).
        t_freqs: number of sin/cos frequency pairs for ``t``.
    """

    def __init__(
        self,
        dim: int = 2,
        hidden: int = 256,
        depth: int = 3,
        num_classes: int | None = None,
        t_freqs: int = 8,
    ) -> None:
        super().__init__()
        self.t_freqs = t_freqs
        self.num_classes = num_classes
        emb = 0
        if num_classes is not None:
            emb = hidden
            self.label_emb = nn.Embedding(num_classes + 1, emb)
        layers: list[nn.Module] = [nn.Linear(dim + 2 * t_freqs + emb, hidden), nn.SiLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(hidden, hidden), nn.SiLU()]
        layers.append(nn.Linear(hidden, dim))
        self.net = nn.Sequential(*layers)

    def forward(
        self, x: torch.Tensor, t: torch.Tensor, label: torch.Tensor | None = None
    ) -> torch.Tensor:
        freqs = (2.0 ** torch.arange(self.t_freqs, dtype=x.dtype, device=x.device)) * math.pi / 2
        tf = t.to(x.dtype)[:, None] * freqs
        feats = [x, tf.sin(), tf.cos()]
        if self.num_classes is not None:
            if label is None:
                raise ValueError("VelocityMLP: this model is conditional; pass label=")
            feats.append(self.label_emb(label))
        return self.net(torch.cat(feats, dim=-1))  # type: ignore[no-any-return]


@torch.no_grad()
def seeded(module: nn.Module, key: torch.Tensor) -> nn.Module:
    """Re-initialise ``module``'s parameters from ``key`` (PyTorch's default scheme), in place.

    ``nn.Linear`` weights and biases are uniform in ``+-1/sqrt(fan_in)`` (what
    ``reset_parameters`` gives), ``nn.Embedding`` weights standard normal, each
    drawn with :mod:`purestep.rng` from ``fold_in(key, i)`` for the ``i``-th
    parameter, so a model's initial weights are a function of the seed alone
    (module constructors draw from torch's global RNG).
    """
    i = 0
    for mod in module.modules():
        if isinstance(mod, nn.Linear):
            bound = 1.0 / math.sqrt(mod.in_features)
            for p in (mod.weight, mod.bias):
                if p is not None:
                    k = rng.fold_in(key, i)
                    p.copy_(rng.uniform(k, p.shape, low=-bound, high=bound, device=p.device))
                    i += 1
        elif isinstance(mod, nn.Embedding):
            w = mod.weight
            w.copy_(rng.normal(rng.fold_in(key, i), w.shape, device=w.device))
            i += 1
    return module


# --------------------------------------------------------------------------- data


def eight_gaussians(
    key: torch.Tensor,
    n: int,
    *,
    radius: float = 2.0,
    std: float = 0.15,
    offset: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``n`` points of a mixture of 8 Gaussians on a circle; point ``i`` depends on ``(key, offset + i)``.

    The mixture's means are ``radius * (cos(k pi/4), sin(k pi/4))``. The points are
    drawn on ``device`` (default CPU); the same on every device up to ``normal``'s last bits.
    """
    idx = torch.arange(offset, offset + n, dtype=torch.int64, device=device)
    comp = rng.randint(rng.fold_in(key, 1), 0, 8, (n,), index=idx)
    angle = comp.to(torch.float32) * (math.pi / 4)
    centers = radius * torch.stack([angle.cos(), angle.sin()], dim=1)
    return centers + std * rng.normal(rng.fold_in(key, 2), (n, 2), index=idx)


def shuffled_batches(
    data: TensorDictBase, batch_size: int, *, key: torch.Tensor
) -> Iterator[TensorDictBase]:
    """Batches of ``data`` (a TensorDict ``[N]``) in a keyed random order, epoch after epoch.

    Epoch ``e`` is ``rng.randperm(fold_in(key, e), N)``; the last partial batch
    of an epoch is dropped. Each batch carries ``index``: unique global ids in
    the stream, for per-sample noise.
    """
    n = int(data.batch_size[0])
    dev = data.device or next(iter(data.values(True, True))).device  # order and ids go with data
    epoch = 0
    while True:
        perm = rng.randperm(rng.fold_in(key, epoch), n, device=dev)
        for start in range(0, n - batch_size + 1, batch_size):
            out = data[perm[start : start + batch_size]]
            ids = torch.arange(start, start + batch_size, dtype=torch.int64, device=dev)
            out.set("index", ids.add_(epoch * n))
            yield out
        epoch += 1


# --------------------------------------------------------------------------- metrics


def sliced_wasserstein(
    a: torch.Tensor, b: torch.Tensor, key: torch.Tensor, *, n_proj: int = 256
) -> float:
    """Sliced Wasserstein-1 distance between two equal-size point clouds ``[N, D]``.

    The mean over ``n_proj`` random unit directions of the 1-D Wasserstein-1
    distance of the projections (mean absolute difference of sorted values).
    """
    if a.shape != b.shape:
        raise ValueError(f"sliced_wasserstein: shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    d = rng.normal(key, (a.shape[1], n_proj), dtype=torch.float64, device=a.device)
    d = d / d.norm(dim=0, keepdim=True)
    pa = torch.sort(a.double() @ d, dim=0).values
    pb = torch.sort(b.double() @ d, dim=0).values
    return float((pa - pb).abs().mean())  # one host read per evaluation


def gaussian_frechet(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fréchet distance between Gaussian fits of two feature sets ``[N, D]`` (as in FID)."""
    a, b = a.double(), b.double()
    mu_a, mu_b = a.mean(0), b.mean(0)
    ca, cb = torch.cov(a.T), torch.cov(b.T)
    # tr sqrt(ca cb) = sum sqrt(eig(sqrt(ca) cb sqrt(ca))), computed on symmetric matrices
    ea, va = torch.linalg.eigh(ca)
    sa = va @ torch.diag(ea.clamp_min(0).sqrt()) @ va.T
    m = sa @ cb @ sa
    em = torch.linalg.eigvalsh((m + m.T) / 2).clamp_min(0)
    tr = float(torch.trace(ca) + torch.trace(cb) - 2 * em.sqrt().sum())
    return float((mu_a - mu_b).square().sum()) + tr


# --------------------------------------------------------------------------- loop


def train(
    step: StepFn,
    state: TensorDictBase,
    batches: Iterator[Any] | Callable[[int], Any],
    steps: int,
    *,
    desc: str,
    progress: bool = True,
    log_every: int = 10,
    metrics: Sequence[str | tuple[str, ...]] = ("loss",),
) -> tuple[TensorDictBase, dict[str, list[tuple[int, float]]]]:
    """Run ``steps`` steps with ``purestep.loop.run``; returns the final state and metric curves.

    ``batches`` is an iterator or a function ``step_index -> batch``. The curves
    hold ``(step, mean since the previous point)`` every ``log_every`` steps for
    each requested metric key present in the step's metrics (nested keys as
    tuples, named ``a/b``).
    """
    curves: dict[str, list[tuple[int, float]]] = {}
    wanted = {k if isinstance(k, str) else "/".join(k) for k in metrics}

    def sink(s: int, record: Mapping[str, float]) -> None:
        for name, v in record.items():
            if name in wanted:
                curves.setdefault(name, []).append((s, v))

    data: Iterable[Any] = (batches(i) for i in itertools.count()) if callable(batches) else batches
    state = loop.run(
        step,
        state,
        data,
        num_steps=int(state.get("step")) + steps,
        checkpoint_dir=None,
        log_every=log_every,
        sinks=[sink],
        progress=progress,
        desc=desc,
    )
    return state, curves


class Timer:
    """Wall-clock seconds per named stage."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.stages: dict[str, float] = {}
        self._last = self.t0

    def lap(self, name: str) -> float:
        now = time.perf_counter()
        self.stages[name] = round(now - self._last, 2)
        self._last = now
        return self.stages[name]

    def total(self) -> float:
        return round(time.perf_counter() - self.t0, 2)


def override(cfg: Mapping[str, Any], assignments: Sequence[str]) -> dict[str, Any]:
    """``cfg`` with ``KEY=VALUE`` overrides, each value parsed as the type of the entry it replaces."""
    out = dict(cfg)
    for item in assignments:
        key, sep, value = item.partition("=")
        if not sep or key not in out:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE with KEY one of {sorted(out)}")
        out[key] = type(out[key])(float(value)) if isinstance(out[key], int | float) else value
    return out


def write_json(path: Path, obj: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- plots


def scatter_panels(
    panels: Sequence[tuple[str, torch.Tensor]],
    path: Path,
    *,
    lim: float = 3.2,
    max_points: int = 4000,
) -> None:
    """One row of 2-D scatter plots, one per ``(title, points [N, 2])``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(3.0 * len(panels), 3.2), squeeze=False)
    for ax, (title, pts) in zip(axes[0], panels, strict=True):
        p = pts[:max_points].detach().cpu().numpy()
        ax.scatter(p[:, 0], p[:, 1], s=1.5, alpha=0.5, linewidths=0)
        ax.set_title(title, fontsize=9)
        ax.set_xlim(-lim, lim)
        ax.set_ylim(-lim, lim)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def loss_curves(curves: Mapping[str, Sequence[tuple[int, float]]], path: Path) -> None:
    """One subplot per curve (``name -> [(step, value)]``), log-scaled when all values are positive."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(curves)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.0 * cols, 2.8 * rows), squeeze=False)
    for ax, (name, pts) in zip(axes.flat, curves.items(), strict=False):
        xs = [p[0] for p in pts]
        ys = [p[1] for p in pts]
        ax.plot(xs, ys, lw=1)
        if ys and min(ys) > 0:
            ax.set_yscale("log")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def image_grid(images: torch.Tensor, path: Path, *, nrow: int, title: str | None = None) -> None:
    """Save a grid of grayscale images ``[N, H, W]`` (values in ``[-1, 1]``) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = images.shape[0]
    ncol = math.ceil(n / nrow)
    canvas = plot.image_grid(images, ncol=ncol, pad=1).float() / 255  # the library's tiling
    fig, ax = plt.subplots(figsize=(ncol * 0.35 + 0.2, nrow * 0.35 + (0.4 if title else 0.2)))
    ax.imshow(canvas.numpy(), cmap="gray_r", vmin=0, vmax=1, interpolation="nearest")
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def as_batch(**tensors: torch.Tensor) -> TensorDict:
    """A TensorDict batch ``[B]`` from tensors with a common leading dim."""
    b = next(iter(tensors.values())).shape[0]
    return TensorDict(dict(tensors), batch_size=[b])
