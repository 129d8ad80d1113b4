"""diffusers models train through purestep exactly as the imperative loop does.

A ``UNet2DModel`` on channels_last input (its conv weight gradients come back
channels_last), with contiguous and with channels_last weights, and a
``DiTTransformer2DModel`` (adaLN-zero, class labels): tiny configs, random
weights, epsilon-prediction MSE.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import TensorDictBase
from torch import nn

from purestep import optim, testing

pytestmark = pytest.mark.integration
diffusers = pytest.importorskip("diffusers")

OPT = optim.adamw(1e-2, weight_decay=0.1)
CHANNELS_LAST = torch.channels_last


def _image_batches(n: int, *, channels: int, size: int, classes: int = 0) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        b: dict[str, Any] = {
            "x": torch.randn(4, channels, size, size, generator=g),
            "noise": torch.randn(4, channels, size, size, generator=g),
            "t": torch.randint(0, 1000, (4,), generator=g),
        }
        if classes:
            b["label"] = torch.randint(0, classes, (4,), generator=g)
        out.append(b)
    return out


def _unet(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return diffusers.UNet2DModel(
        sample_size=8,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
        attention_head_dim=8,
    ).train()


def _eps_loss(label: bool, layout: torch.memory_format) -> Callable[..., torch.Tensor]:
    def loss(forward: Callable[..., Any], batch: TensorDictBase) -> torch.Tensor:
        x_t = (batch["x"] + batch["noise"]).contiguous(memory_format=layout)
        kwargs = {"class_labels": batch["label"]} if label else {}
        pred = forward(x_t, batch["t"], **kwargs).sample
        return ((pred - batch["noise"]) ** 2).mean()

    return loss


@pytest.mark.parametrize("weights", ["contiguous", "channels_last"])
def test_unet2d_on_channels_last_input_trains_as_the_imperative_loop(weights: str) -> None:
    model = _unet()
    if weights == "channels_last":
        model = model.to(memory_format=CHANNELS_LAST)
        assert model.conv_in.weight.is_contiguous(memory_format=CHANNELS_LAST)
    testing.assert_matches_imperative(
        model, _eps_loss(False, CHANNELS_LAST), OPT, _image_batches(3, channels=3, size=8)
    )


def test_dit_transformer_trains_as_the_imperative_loop() -> None:
    torch.manual_seed(0)
    model = diffusers.DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=10,
        norm_num_groups=4,
    ).train()
    for module in model.modules():  # label dropout for classifier-free guidance: global RNG
        if isinstance(module, diffusers.models.embeddings.LabelEmbedding):
            module.dropout_prob = 0.0
    # adaLN-zero starts with zero gates; perturb them so every weight gets a gradient at step 0
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    testing.assert_matches_imperative(
        model,
        _eps_loss(True, torch.contiguous_format),
        OPT,
        _image_batches(3, channels=4, size=8, classes=10),
    )
