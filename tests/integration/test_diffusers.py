"""diffusers models train through purestep exactly as the imperative loop does.

A ``UNet2DModel`` on channels_last input (its conv weight gradients come back
channels_last), with contiguous and with channels_last weights, and a
``DiTTransformer2DModel`` (adaLN-zero, class labels): tiny configs, random
weights, epsilon-prediction MSE.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
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


def _dit() -> nn.Module:
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
    ).eval()  # eval: its label dropout draws from the global RNG in train mode
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return model


@pytest.mark.parametrize("kind", ["dit", "unet"])
def test_flow_adapt_meets_the_flow_contract_and_samplers_use_its_scale(
    kind: str, tmp_path: Path
) -> None:
    """flow.adapt(model, timestep_scale=1000, output="sample", cond_map=...): its velocity is
    model(x, 1000 t, ...).sample; flow.sample uses the scale with no t_scale; finetune trains it
    purely and its export loads into the diffusers model, which save_pretrained round-trips."""
    from purestep import export
    from purestep.methods import finetune, flow

    model = _dit() if kind == "dit" else _unet().eval()
    channels, cond = (4, ("label",)) if kind == "dit" else (3, ())
    cmap = {"label": "class_labels"} if kind == "dit" else {}
    adapted = flow.adapt(model, timestep_scale=1000.0, output="sample", cond_map=cmap)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, channels, 8, 8, generator=g)
    t = torch.tensor([0.25, 0.9])
    c = {"label": torch.tensor([1, 7])} if cond else {}
    raw = {"class_labels": c["label"]} if cond else {}
    with torch.no_grad():
        assert torch.equal(adapted(x, t, **c), model(x, t * 1000.0, **raw).sample)
        got = flow.sample(adapted, None, x, flow.timestep_schedule(2), cond=c)
        x1 = x + (0.0 - 1.0) * model(x, torch.full((2,), 1000.0), **raw).sample  # one Euler step
        assert torch.allclose(
            flow.sample(adapted, None, x, [1.0, 0.0], cond=c), x1, rtol=1e-6, atol=1e-6
        )
        assert got.shape == x.shape
    opt = optim.adam(1e-3)
    step = finetune.make_step(adapted, opt, finetune.FinetuneConfig(cond_keys=cond))
    state = finetune.init_state(adapted, opt, seed=0)
    batch = {"x0": torch.randn(2, channels, 8, 8, generator=g), **c}
    testing.assert_pure(step, state, batch)
    state, _ = step(state, batch)
    export.load_params(adapted, state["params", "student"])
    testing.assert_trees_equal(
        {k: v for k, v in model.state_dict().items() if k in dict(model.named_parameters())},
        dict(state["params", "student", "model"].flatten_keys(".").items()),
    )
    model.save_pretrained(tmp_path / "m")
    back = type(model).from_pretrained(tmp_path / "m")
    testing.assert_trees_equal(dict(back.state_dict()), dict(model.state_dict()))
