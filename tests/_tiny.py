"""Models and fixtures shared by the method tests (imported as ``_tiny``; tests/ is on sys.path)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one intra-op thread (and robustly on a busy machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class TinyNet(nn.Module):
    """v(x_t, t[, label]): a 2-layer MLP, conditional when ``classes`` is set."""

    def __init__(self, hidden: int = 8, classes: int | None = None, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(classes + 1, hidden) if classes is not None else None
        self.inp = nn.Linear(3, hidden)
        self.out = nn.Linear(hidden, 2)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(0.5 * torch.randn(p.shape, generator=g))

    def forward(
        self, x: torch.Tensor, t: torch.Tensor, label: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = self.inp(torch.cat([x, t[:, None].to(x.dtype)], 1))
        if self.emb is not None:
            assert label is not None
            h = h + self.emb(label)
        return self.out(torch.tanh(h))  # type: ignore[no-any-return]


class WritesLater(nn.Module):
    """Scales ``a`` in place on every call, and ``b`` and ``c`` too from call ``later`` on.

    A forward that writes its own weights (under ``no_grad``) only on some calls: the
    first pure call cannot learn every weight it will write.
    """

    def __init__(self, later: int) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.b = nn.Parameter(torch.linspace(-1.0, 1.0, 3))
        self.c = nn.Parameter(torch.linspace(1.0, 2.0, 3))
        self.calls = 0
        self.later = later

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        with torch.no_grad():
            self.a.mul_(0.9)
            if self.calls >= self.later:
                self.b.mul_(0.5)
                self.c.mul_(0.5)
        return ((self.a * x + self.b * self.c) ** 2).mean()


def without_donate(gf: Any) -> Callable[..., Any]:
    """A user's grad_fn that takes ``buffers=`` but not ``donate=`` (so it never donates):
    the weights its forward writes come back beside the buffers."""

    def grad_fn(
        params: TensorDictBase,
        batch: TensorDictBase,
        key: torch.Tensor,
        *,
        roles: Any = None,
        buffers: TensorDictBase | None = None,
    ) -> tuple[TensorDict, TensorDict]:
        return gf(params, batch, key, roles=roles, buffers=buffers)  # type: ignore[no-any-return]

    return grad_fn
