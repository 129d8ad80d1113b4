"""Every drawn model trains through purestep exactly as the imperative loop trains it.

The models (``testing.models``) combine the patterns issue 10 found training
silently wrong: tied weights, BatchNorm buffers, channels_last convs, branches
that get no gradient, shared submodules and activation-checkpointed blocks in
both reentrant modes. Each is checked bitwise against ``zero_grad / forward /
backward / torch.optim.*(fused=True).step()`` with ``assert_matches_imperative``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDictBase

from _tiny import one_thread  # noqa: F401 (a fixture)
from purestep import optim, testing
from purestep.testing import DrawnModel, ModelSpec

pytestmark = pytest.mark.usefixtures("one_thread")

OPTIMIZERS = {
    "adamw": optim.adamw(1e-2, weight_decay=0.1),
    "adam": optim.adam(1e-2, weight_decay=0.01),
    "sgd": optim.sgd(0.05, momentum=0.9, weight_decay=0.01),
}


def _mse(forward: Callable[..., Any], batch: TensorDictBase) -> torch.Tensor:
    return ((forward(batch["x"]) - batch["y"]) ** 2).mean()


def _batches(model: DrawnModel, n: int = 3, b: int = 4, seed: int = 0) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(b, *model.batch_fields["x"], generator=g)
        x = x.abs() if i % 2 == 0 else -x.abs()  # "sometimes" branch: used on even steps only
        out.append({"x": x, "y": torch.randn(b, *model.batch_fields["y"], generator=g)})
    return out


@settings(max_examples=30, deadline=None)
@given(
    model=testing.models(),
    opt=st.sampled_from(sorted(OPTIMIZERS)),
    k=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_every_drawn_model_trains_exactly_as_the_imperative_loop(
    model: DrawnModel, opt: str, k: int, seed: int
) -> None:
    """Property: for any drawn model, optimizer and accumulation (k = 1, 2), the purestep
    step (donate=False and True) equals the imperative loop, bitwise, params and buffers,
    after every one of 3 steps."""
    testing.assert_matches_imperative(
        model, _mse, OPTIMIZERS[opt], _batches(model, seed=seed), accumulate=k
    )


FEATURES = {
    "tied": ModelSpec(tied=True),
    "batchnorm": ModelSpec(blocks=("batchnorm", "conv", "batchnorm")),
    "channels_last_input": ModelSpec(blocks=("conv",), layout="channels_last_input"),
    "channels_last": ModelSpec(blocks=("conv",), layout="channels_last"),
    "unused_never": ModelSpec(unused="never"),
    "unused_sometimes": ModelSpec(unused="sometimes"),
    "shared_submodule": ModelSpec(blocks=("conv", "shared")),
    "checkpoint": ModelSpec(blocks=("checkpoint",)),
    "checkpoint_reentrant": ModelSpec(blocks=("checkpoint_reentrant",)),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_each_pattern_alone_trains_exactly_as_the_imperative_loop(feature: str) -> None:
    """One pattern per model, so a regression names the pattern that broke."""
    model = DrawnModel(FEATURES[feature])
    testing.assert_matches_imperative(model, _mse, OPTIMIZERS["adamw"], _batches(model, n=4))


def test_drawn_models_have_the_patterns_they_were_drawn_with() -> None:
    m = DrawnModel(
        ModelSpec(
            blocks=("batchnorm", "checkpoint_reentrant", "conv", "shared"),
            tied=True,
            unused="never",
            layout="channels_last",
        )
    )
    assert m.tied_a.weight is m.tied_b.weight
    assert m.blocks[2] is m.blocks[3]
    assert m.blocks[1].reentrant
    assert m.stem.weight.is_contiguous(memory_format=torch.channels_last)
    assert int(m.blocks[0].num_batches_tracked) == 0
    assert torch.equal(m.blocks[0].running_var, torch.ones(m.spec.channels))
    before = torch.get_rng_state()
    again = DrawnModel(m.spec)
    assert torch.equal(torch.get_rng_state(), before), "building a model used the global RNG"
    for (name, a), b in zip(m.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    out = m(torch.randn(2, *m.batch_fields["x"], generator=torch.Generator().manual_seed(0)))
    out.sum().backward()
    assert m.branch.weight.grad is None
    with pytest.raises(ValueError, match="unknown block kind 'lstm'"):
        ModelSpec(blocks=("lstm",))


class _RenormEmbedding(torch.nn.Module):
    """``nn.Embedding(max_norm=1)`` renormalises the rows it looks up, in place, in forward."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Embedding(10, 4, max_norm=1.0, _weight=torch.randn(10, 4, generator=g))
        self.head = torch.nn.Linear(4, 1, device="meta").to_empty(device="cpu")
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(1, 4, generator=g))
            self.head.bias.zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.emb(ids)).squeeze(-1)
        return out


def test_a_forward_that_writes_into_its_weights_matches_or_is_refused_by_name() -> None:
    """Embedding(max_norm=...) writes into its weight during forward: purestep must either
    train it as the imperative loop does or refuse with an error naming the module."""
    model = _RenormEmbedding()
    g = torch.Generator().manual_seed(1)
    batches = [
        {"ids": torch.randint(0, 10, (4, 3), generator=g), "y": torch.randn(4, 3, generator=g)}
        for _ in range(3)
    ]

    def loss(forward: Callable[..., Any], batch: TensorDictBase) -> torch.Tensor:
        return ((forward(batch["ids"]) - batch["y"]) ** 2).mean()

    try:
        testing.assert_matches_imperative(model, loss, OPTIMIZERS["sgd"], batches)
    except (ValueError, RuntimeError, TypeError) as e:
        refusal = str(e)
    else:
        return
    assert "emb" in refusal, f"refused without naming the module: {refusal}"
