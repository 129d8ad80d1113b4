"""The imperative PyTorch loop that purestep steps are compared against, and a purestep twin."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

import purestep as ps

Forward = Callable[..., torch.Tensor]
Loss = Callable[[Forward, dict[str, torch.Tensor]], torch.Tensor]


def imperative(
    model: nn.Module,
    batches: Sequence[dict[str, torch.Tensor]],
    loss: Loss,
    *,
    lr: float = 1e-2,
    k: int = 1,
    optimizer: Callable[..., torch.optim.Optimizer] | None = None,
) -> nn.Module:
    """``zero_grad / forward / backward / AdamW(fused=True).step()`` (k microbatches per step)."""
    make = optimizer or (lambda ps_: torch.optim.AdamW(ps_, lr=lr, fused=True))
    opt = make(model.parameters())
    for batch in batches:
        opt.zero_grad()
        b = next(iter(batch.values())).shape[0]
        start = 0
        for n in ps.step.microbatch_sizes(b, k):
            mb = {key: v[start : start + n] for key, v in batch.items()}
            start += n
            value = loss(model, mb)
            (value * (n / b) if k > 1 else value).backward()
        opt.step()
    return model


def purestep_run(
    model: nn.Module,
    batches: Sequence[dict[str, torch.Tensor]],
    loss: Loss,
    *,
    donate: bool,
    lr: float = 1e-2,
    k: int = 1,
    transform: ps.optim.Transform | None = None,
) -> TensorDictBase:
    """The same training through ``train_step`` (params through ``ps.call``)."""
    opt = {"m": transform or ps.optim.adamw(lr)}

    def loss_fn(params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor) -> Any:
        def fwd(*a: Any, **kw: Any) -> torch.Tensor:
            return ps.call(model, params["m"], *a, **kw)  # type: ignore[no-any-return]

        return loss(fwd, {k_: batch[k_] for k_ in batch.keys() if k_ != "index"}), {}

    grad_fn = ps.value_and_grad(loss_fn)
    if k > 1:
        grad_fn = ps.accumulate(grad_fn, k)
    step = ps.train_step(grad_fn, opt, donate=donate, grad_norm=False)
    state = step.prepare(ps.init_state({"m": model}, opt, seed=0))
    for batch in batches:
        state, _ = step(state, batch)
    return state


def assert_same_as_imperative(
    make: Callable[[], nn.Module],
    batches: Sequence[dict[str, torch.Tensor]],
    loss: Loss,
    *,
    k: int = 1,
    donate: Sequence[bool] = (False, True),
    **kw: Any,
) -> None:
    """Params and persistent buffers after training equal the imperative loop's, bitwise."""
    m0 = make()
    transform = kw.pop("transform", None)
    ref = imperative(copy.deepcopy(m0), batches, loss, k=k, **kw)
    kw.pop("optimizer", None)
    for d in donate:
        state = purestep_run(
            copy.deepcopy(m0), batches, loss, donate=d, k=k, transform=transform, **kw
        )
        for path, p in ps.step.module_tensors(ref):
            if isinstance(p, nn.Parameter):
                got = state["params", "m"].get(path)
            else:
                if ("buffers", "m", *path) not in state.keys(include_nested=True):
                    continue  # a non-persistent buffer: not state
                got = state["buffers", "m"].get(path)
            name = ".".join(path)
            assert got.dtype == p.dtype, name
            assert torch.equal(got, p.detach()), (
                f"donate={d}: {name} differs from the imperative loop by "
                f"{(got.double() - p.detach().double()).abs().max():.3g}"
            )


def randn(*shape: int, seed: int) -> torch.Tensor:
    """A seeded normal tensor (no global RNG)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def regression_batches(
    n: int, b: int, d_in: int, d_out: int, seed: int = 0
) -> list[dict[str, Any]]:
    """``n`` batches of ``{"x": [b, d_in], "y": [b, d_out]}``."""
    return [
        {"x": randn(b, d_in, seed=seed + 2 * i), "y": randn(b, d_out, seed=seed + 2 * i + 1)}
        for i in range(n)
    ]


def mse(fwd: Forward, b: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean squared error of ``fwd(b["x"])`` against ``b["y"]``."""
    return ((fwd(b["x"]) - b["y"]) ** 2).mean()


__all__ = [
    "assert_same_as_imperative",
    "copy",
    "imperative",
    "mse",
    "purestep_run",
    "randn",
    "regression_batches",
]
