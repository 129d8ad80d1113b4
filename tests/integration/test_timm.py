"""timm CNNs train through purestep exactly as the imperative loop does.

A ResNet (BatchNorm: running statistics and ``num_batches_tracked`` are
persistent buffers the forward updates, so they are state) and a ConvNeXt
(LayerNorm2d, layer-scale gammas, depthwise 7x7 convs), each on contiguous
and on channels_last weights and input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import TensorDictBase
from torch import nn

import purestep as ps
from purestep import optim, testing

pytestmark = pytest.mark.integration
timm = pytest.importorskip("timm")

OPT = optim.adamw(1e-2, weight_decay=0.1)
LAYOUTS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


def _resnet() -> nn.Module:
    from timm.models.resnet import BasicBlock, ResNet

    torch.manual_seed(0)
    return ResNet(
        BasicBlock,
        layers=(1, 1, 1, 1),
        channels=(8, 8, 16, 16),
        stem_width=8,
        num_classes=5,
        zero_init_last=False,
    ).train()


def _convnext() -> nn.Module:
    from timm.models.convnext import ConvNeXt

    torch.manual_seed(0)
    return ConvNeXt(
        depths=(1, 1, 1, 1), dims=(8, 8, 16, 16), num_classes=5, ls_init_value=0.5
    ).train()


def _batches(n: int = 3, size: int = 32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        {
            "x": torch.randn(4, 3, size, size, generator=g),
            "y": torch.randint(0, 5, (4,), generator=g),
        }
        for _ in range(n)
    ]


def _ce(layout: torch.memory_format) -> Callable[..., torch.Tensor]:
    def loss(forward: Callable[..., Any], batch: TensorDictBase) -> torch.Tensor:
        logits = forward(batch["x"].contiguous(memory_format=layout))
        return nn.functional.cross_entropy(logits, batch["y"])

    return loss


def _to(model: nn.Module, layout: str) -> nn.Module:
    return model.to(memory_format=LAYOUTS[layout]) if layout == "channels_last" else model


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resnet_with_batchnorm_trains_as_the_imperative_loop(layout: str) -> None:
    model = _to(_resnet(), layout)
    testing.assert_matches_imperative(model, _ce(LAYOUTS[layout]), OPT, _batches())


def test_resnet_batchnorm_statistics_are_state_and_the_module_keeps_its_own() -> None:
    model = _resnet()
    state = ps.init_state({"model": model}, {"model": OPT}, seed=0)
    buffers = state["buffers", "model"]
    assert buffers["bn1", "num_batches_tracked"].dtype == torch.int64
    assert torch.equal(buffers["bn1", "running_var"], torch.ones_like(model.bn1.running_var))
    own = model.bn1.running_mean.clone()

    def loss_fn(params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor) -> Any:
        return _ce(torch.contiguous_format)(
            lambda *a: ps.call(model, params["model"], *a), batch
        ), {}

    step = ps.train_step(ps.value_and_grad(loss_fn), {"model": OPT})
    new, _ = step(state, _batches(1)[0])
    assert int(new["buffers", "model", "bn1", "num_batches_tracked"]) == 1
    assert not torch.equal(new["buffers", "model", "bn1", "running_mean"], own)
    assert torch.equal(model.bn1.running_mean, own), "the step wrote into the module's buffer"
    assert int(model.bn1.num_batches_tracked) == 0
    testing.assert_pure(step, state, _batches(1)[0])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_convnext_trains_as_the_imperative_loop(layout: str) -> None:
    model = _to(_convnext(), layout)
    testing.assert_matches_imperative(model, _ce(LAYOUTS[layout]), OPT, _batches())
