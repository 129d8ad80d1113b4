"""Steps and batches shared by the compile tests (imported as ``_compile_cases``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

import purestep as ps
from purestep import optim, rng

OPTIMIZERS: dict[str, Callable[[], optim.Transform]] = {
    "adamw_schedule": lambda: optim.adamw(optim.schedules.linear(1e-2, 1e-3, 5)),
    "adam_amsgrad_l2": lambda: optim.adam(1e-2, amsgrad=True, weight_decay=0.1),
    "sgd_nesterov": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd_dampening": lambda: optim.sgd(0.05, momentum=0.5, dampening=0.3),
    "sgd": lambda: optim.sgd(0.1),
    "lion": lambda: optim.lion(1e-3),
    "clip_adamw": lambda: optim.chain(optim.clip_by_global_norm(0.05), optim.adamw(1e-2)),
    "clip_clip_sgd": lambda: optim.chain(
        optim.clip_by_global_norm(1.0), optim.clip_by_global_norm(0.1), optim.sgd(0.1, momentum=0.9)
    ),
    "clip_scale": lambda: optim.chain(
        optim.clip_by_global_norm(1.0), optim.scale_by_schedule(lambda n: -0.1 / (n + 1))
    ),
}


class Net(nn.Module):
    """A 2-layer MLP with dropout-free tanh: ``[B, 3] -> [B, 2]``."""

    def __init__(self, seed: int, hidden: int = 6) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.inp = nn.Linear(3, hidden)
        self.out = nn.Linear(hidden, 2)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(0.5 * torch.randn(p.shape, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))  # type: ignore[no-any-return]


NETS = {"a": Net(1), "b": Net(2)}


def loss_fn(per_role: bool) -> Callable[..., Any]:
    """A loss over roles ``a`` and ``b`` with per-sample noise from the step key.

    ``per_role``: ``{role: loss}`` (each role its own loss, ``b``'s only when live).
    """

    def loss(
        params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        noise = rng.normal(rng.fold_in(key, 7), batch["y"].shape, index=batch["index"])
        ya = ps.call(NETS["a"], params["a"], batch["x"])
        la = ((ya - batch["y"] + 0.1 * noise) ** 2).mean()
        live = ps.live_roles()
        if "b" not in params.keys():
            return la, {"ya": ya.mean()}
        if per_role and live is not None and "b" not in live:
            return {"a": la}, {"ya": ya.mean()}
        yb = ps.call(NETS["b"], params["b"], batch["x"] * 0.5)
        lb = ((yb - ya.detach()) ** 2).mean()
        if per_role:
            return {"a": la, "b": lb}, {"ya": ya.mean()}
        return la + lb, {"ya": ya.mean()}

    return loss


def make_step(
    opts: dict[str, str],
    *,
    donate: bool = False,
    k: int = 1,
    every: dict[str, int] | None = None,
    ema: bool = False,
    skip: bool = False,
    per_role: bool = False,
    grad_norm: bool = True,
) -> Any:
    """``train_step`` over roles ``a`` / ``b`` with the named optimizers and wrappers."""
    gf = ps.value_and_grad(loss_fn(per_role))
    if k > 1:
        gf = ps.accumulate(gf, k)
    transforms = {r: OPTIMIZERS[name]() for r, name in opts.items()}
    step: Any = ps.train_step(gf, transforms, every=every, donate=donate, grad_norm=grad_norm)
    if ema:
        step = ps.with_ema(step, 0.9, list(opts), start_step=1)
    if skip:
        step = ps.skip_nonfinite(step, max_consecutive=3)
    return step


def make_state(opts: dict[str, str], seed: int = 0) -> TensorDict:
    """The initial state of :func:`make_step` with these optimizers."""
    transforms = {r: OPTIMIZERS[name]() for r, name in opts.items()}
    return ps.init_state({r: NETS[r] for r in opts}, transforms, seed=seed)


def batches(n: int, b: int = 6, seed: int = 0, nan_at: int | None = None) -> list[TensorDict]:
    """``n`` batches of ``b`` samples; batch ``nan_at`` has a NaN target (a non-finite loss)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        y = torch.randn(b, 2, generator=g)
        if i == nan_at:
            y[0, 0] = float("nan")
        out.append(TensorDict({"x": torch.randn(b, 3, generator=g), "y": y}, batch_size=[b]))
    return out


class BNNet(nn.Module):
    """Linear -> BatchNorm1d -> tanh -> Linear: buffers (running stats) updated by the forward."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.inp = nn.Linear(3, 6)
        self.bn = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 2)
        with torch.no_grad():
            for p in (self.inp.weight, self.out.weight):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.bn(self.inp(x))))  # type: ignore[no-any-return]


class Renorm(nn.Module):
    """``nn.Embedding(max_norm=...)`` renormalises looked-up rows of its weight in place."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.emb = nn.Embedding(10, 6, max_norm=0.5)
        self.out = nn.Linear(6, 2)
        with torch.no_grad():
            self.emb.weight.copy_(3.0 * torch.randn(10, 6, generator=g))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids))  # type: ignore[no-any-return]


def module_step(
    net: nn.Module,
    opt: str,
    *,
    donate: bool = False,
    k: int = 1,
    ema_buffers: bool = False,
    skip: bool = False,
) -> Any:
    """A one-role step over ``net`` (input ``batch["x"]``, MSE to ``batch["y"]``)."""

    def loss(params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor) -> Any:
        return ((ps.call(net, params["m"], batch["x"]) - batch["y"]) ** 2).mean(), {}

    gf = ps.value_and_grad(loss)
    if k > 1:
        gf = ps.accumulate(gf, k)
    step: Any = ps.train_step(gf, {"m": OPTIMIZERS[opt]()}, donate=donate)
    if ema_buffers:
        step = ps.with_ema(step, 0.8, ["m"], buffers=True)
    if skip:
        step = ps.skip_nonfinite(step)
    return step
