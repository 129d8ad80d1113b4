"""Token batches and the causal-LM loss shared by the transformers and peft tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDictBase

VOCAB, SEQ, BATCH = 64, 8, 4


def token_batches(n: int = 3, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` batches of ``BATCH`` random sequences of ``SEQ`` token ids (a local generator)."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)} for _ in range(n)]


def lm_loss(forward: Callable[..., Any], batch: TensorDictBase) -> torch.Tensor:
    """Next-token cross-entropy computed by the model itself (``labels=input_ids``)."""
    ids = batch["input_ids"]
    loss: torch.Tensor = forward(input_ids=ids, labels=ids).loss
    return loss


def enable_checkpointing(model: Any, *, reentrant: bool) -> None:
    """HF activation checkpointing on every layer (``gradient_checkpointing_enable`` before v5)."""
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        assert model.is_activation_checkpointing
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        assert model.is_gradient_checkpointing
