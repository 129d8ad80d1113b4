"""Hugging Face transformers models train through purestep exactly as the imperative loop does.

Tiny configs (2 layers, hidden 32, sequences of 8, batches of 4), random weights,
dropout 0 for the bitwise comparisons: GPT-2 with tied and untied embeddings, a
Llama and a Qwen2 with tied embeddings and rotary buffers, GPT-2 with
activation checkpointing (``gradient_checkpointing_enable()``, reentrant and not), and GPT-2 with dropout
0.1 keyed through ``call(..., key=)``.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from _lm import VOCAB, enable_checkpointing, lm_loss, token_batches
from tensordict import TensorDictBase
from torch import nn

import purestep as ps
from purestep import optim, testing

pytestmark = pytest.mark.integration
transformers = pytest.importorskip("transformers")

OPT = optim.adamw(1e-2, weight_decay=0.1)


def _gpt2(*, tied: bool = True, dropout: float = 0.0, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=tied,
    )
    return transformers.GPT2LMHeadModel(config).train()


def _rotary_lm(family: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 16,
        "tie_word_embeddings": True,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs)).train()
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kwargs)).train()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gpt2_trains_as_the_imperative_loop(tied: bool) -> None:
    model = _gpt2(tied=tied)
    assert (model.lm_head.weight is model.transformer.wte.weight) == tied
    testing.assert_matches_imperative(model, lm_loss, OPT, token_batches(4))


def test_gpt2_tied_embeddings_are_one_state_leaf() -> None:
    """The tied lm_head is not a second leaf: it is trained through the embedding's leaf."""
    model = _gpt2(tied=True)
    state = ps.init_state({"model": model}, {"model": OPT}, seed=0)
    keys = {".".join(k) for k in state["params", "model"].keys(True, True)}
    assert "transformer.wte.weight" in keys
    assert "lm_head.weight" not in keys
    assert len(keys) == len(list(model.parameters()))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_rotary_lm_with_tied_embeddings_trains_as_the_imperative_loop(family: str) -> None:
    """Tied embeddings; rotary inv_freq is a non-persistent buffer (not state, not touched)."""
    model = _rotary_lm(family)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    testing.assert_matches_imperative(model, lm_loss, OPT, token_batches(3))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gpt2_with_gradient_checkpointing_trains_as_the_imperative_loop(reentrant: bool) -> None:
    """The recompute in backward must see the swapped-in params, not the module's own."""
    model = _gpt2(tied=True)
    enable_checkpointing(model, reentrant=reentrant)
    testing.assert_matches_imperative(model, lm_loss, OPT, token_batches(3))


def test_gpt2_with_gradient_checkpointing_and_accumulation() -> None:
    model = _gpt2(tied=True)
    enable_checkpointing(model, reentrant=False)
    testing.assert_matches_imperative(model, lm_loss, OPT, token_batches(3), accumulate=2)


def _dropout_step(model: nn.Module, donate: bool = False) -> ps.TrainStep:
    def loss_fn(params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor) -> Any:
        forward = functools.partial(ps.call, model, params["model"], key=key)
        return lm_loss(forward, batch), {}

    return ps.train_step(ps.value_and_grad(loss_fn), {"model": OPT}, donate=donate)


def test_gpt2_dropout_keyed_by_the_step_key_is_deterministic_and_resume_exact() -> None:
    model = _gpt2(dropout=0.1)
    step = _dropout_step(model)
    state = ps.init_state({"model": model}, {"model": OPT}, seed=0)
    batches = token_batches(4)
    testing.assert_deterministic(step, state, batches)
    testing.assert_resume_exact(step, state, batches, save_at=2)
    testing.assert_donation_safe(lambda d: _dropout_step(model, d), state, batches)
    testing.assert_pure(step, state, batches[0])


def test_gpt2_dropout_ignores_and_restores_the_global_rng() -> None:
    """The same state and batch give the same step whatever the global seed; the global
    generator is unchanged afterwards; and dropout is really active (it depends on the key)."""
    model = _gpt2(dropout=0.1)
    step = _dropout_step(model)
    state = ps.init_state({"model": model}, {"model": OPT}, seed=0)
    batch = token_batches(1)[0]
    outs = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        before = torch.get_rng_state()
        outs.append(step(state, batch))
        assert torch.equal(torch.get_rng_state(), before), "call(key=) left the global RNG moved"
    testing.assert_trees_equal(outs[0][0], outs[1][0], what="state under two global seeds")
    other = ps.init_state({"model": model}, {"model": OPT}, seed=1)
    loss_other = step(other, batch)[1]["loss"]
    assert not torch.equal(outs[0][1]["loss"], loss_other), "the loss does not depend on the key"
    model.eval()
    try:
        loss_eval = step(state, batch)[1]["loss"]
    finally:
        model.train()
    assert not torch.equal(outs[0][1]["loss"], loss_eval), "dropout was not active"
