"""Shared helpers of the checkpoint tests: every dtype, bitwise comparison, small states."""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
    torch.complex128,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint64,
    torch.uint32,
    torch.uint16,
    torch.uint8,
    torch.bool,
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(a: TensorDictBase, b: TensorDictBase) -> bool:
    """Same nested keys, dtypes, shapes and bit patterns (NaN payloads included)."""
    ka = sorted(a.keys(True, True), key=str)
    kb = sorted(b.keys(True, True), key=str)
    return ka == kb and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and torch.equal(_bits(a[k]), _bits(b[k]))
        for k in ka
    )


def _random_tensor(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Arbitrary bit patterns (so NaNs with payloads, infs, -0.0, subnormals all occur)."""
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _train_state(seed: int = 0, step: int = 3) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "params": {
                "student": {
                    "fc": {
                        "weight": torch.randn(4, 3, generator=g),
                        "bias": torch.randn(4, generator=g).bfloat16(),
                    },
                    "head": {"weight": torch.randn(2, 4, generator=g, dtype=torch.float64)},
                },
            },
            "opt_state": {
                "student": {
                    "count": torch.tensor(step, dtype=torch.int64),
                    "lr": torch.tensor(3e-4, dtype=torch.float64),
                }
            },
            "rng": torch.tensor(-(2**62) + 12345 * seed, dtype=torch.int64),
            "step": torch.tensor(step, dtype=torch.int64),
        },
        batch_size=[],
    )


def _small(step: int) -> TensorDict:
    return TensorDict({"w": torch.full((3,), float(step)), "step": torch.tensor(step)}, [])
