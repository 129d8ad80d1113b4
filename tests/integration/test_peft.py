"""peft LoRA on GPT-2 trains through purestep exactly as the imperative loop does.

Only the adapters are trainable, so only they are state; the frozen base
weights (tied embeddings included) stay with the module.
"""

from __future__ import annotations

import pytest
import torch
from _lm import VOCAB, enable_checkpointing, lm_loss, token_batches
from torch import nn

import purestep as ps
from purestep import optim, testing

pytestmark = pytest.mark.integration
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

OPT = optim.adamw(1e-2, weight_decay=0.1)


def _lora_gpt2(checkpointing: bool = False) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    base = transformers.GPT2LMHeadModel(config)
    if checkpointing:
        enable_checkpointing(base, reentrant=False)
    lora = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["c_attn", "c_proj"],
        fan_in_fan_out=True,
        init_lora_weights="gaussian",
    )
    model = peft.get_peft_model(base, lora).train()
    with torch.no_grad():  # lora_B starts at zero: give it values so lora_A trains from step 0
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def test_lora_state_holds_only_the_adapters() -> None:
    model = _lora_gpt2()
    state = ps.init_state({"model": model}, {"model": OPT}, seed=0)
    keys = [".".join(k) for k in state["params", "model"].keys(True, True)]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert keys == trainable
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_lora_gpt2_trains_as_the_imperative_loop(checkpointing: bool) -> None:
    testing.assert_matches_imperative(_lora_gpt2(checkpointing), lm_loss, OPT, token_batches(3))
