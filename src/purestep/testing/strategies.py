"""Hypothesis strategies for params, batches, hyperparameters, states and models.

Tensor values are generated from a drawn seed with a local ``torch.Generator``
(fast, shrinkable through the seed), never from the global RNG.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from hypothesis import strategies as st
from tensordict import TensorDict
from torch import nn

from purestep.optim import Transform
from purestep.testing._drawn_model import BLOCK_KINDS, LAYOUTS, UNUSED, DrawnModel, ModelSpec

__all__ = [
    "DrawnModel",
    "ModelSpec",
    "adam_hparams",
    "batches",
    "models",
    "param_trees",
    "sgd_hparams",
    "states",
    "tensors",
]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _tensor(seed: int, shape: Sequence[int], dtype: torch.dtype, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tuple(shape), generator=g, dtype=torch.float64) * scale).to(dtype)


@st.composite
def tensors(
    draw: st.DrawFn,
    *,
    shape: Sequence[int] | st.SearchStrategy[tuple[int, ...]] | None = None,
    dtype: torch.dtype | st.SearchStrategy[torch.dtype] = torch.float32,
    scale: float = 1.0,
) -> torch.Tensor:
    """A tensor of normal values times ``scale``; shape and dtype fixed or drawn.

    Example:
        >>> from hypothesis import given
        >>> @given(tensors(shape=(2, 3)))
        ... def test(t):
        ...     assert t.shape == (2, 3)
    """
    if shape is None:
        shape = st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple)
    shp = draw(shape) if isinstance(shape, st.SearchStrategy) else tuple(shape)
    dt = draw(dtype) if isinstance(dtype, st.SearchStrategy) else dtype
    return _tensor(draw(st.integers(0, 2**31 - 1)), shp, dt, scale)


@st.composite
def param_trees(
    draw: st.DrawFn,
    *,
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    min_leaves: int = 1,
    max_leaves: int = 6,
    max_depth: int = 3,
    max_dim: int = 6,
    max_ndim: int = 3,
) -> TensorDict:
    """Nested TensorDicts of mixed shapes (0-d to ``max_ndim``-d) and float dtypes, like module params.

    Example:
        >>> from hypothesis import given
        >>> @given(param_trees(dtypes=(torch.float32, torch.bfloat16)))
        ... def test(p):
        ...     assert len(list(p.keys(True, True))) >= 1
    """
    n = draw(st.integers(min_leaves, max_leaves))
    out = TensorDict({}, batch_size=[])
    used: set[tuple[str, ...]] = set()
    for i in range(n):
        depth = draw(st.integers(1, max_depth))
        prefix = tuple(f"m{draw(st.integers(0, 2))}" for _ in range(depth - 1))
        path = (*prefix, f"w{i}")
        if any(path[: j + 1] in used for j in range(len(path) - 1)):
            path = (f"w{i}",)
        used.add(path)
        shape = tuple(draw(st.lists(st.integers(1, max_dim), min_size=0, max_size=max_ndim)))
        dtype = draw(st.sampled_from(list(dtypes)))
        out.set(path, _tensor(draw(st.integers(0, 2**31 - 1)), shape, dtype, 1.0))
    return out


@st.composite
def batches(
    draw: st.DrawFn,
    B: int | st.SearchStrategy[int] = 8,
    *,
    fields: Mapping[str, Sequence[int]] | None = None,
    dtype: torch.dtype = torch.float32,
) -> TensorDict:
    """A batch TensorDict ``[B]`` with one float field per ``fields`` entry (trailing shapes).

    Default fields: ``{"x": (4,), "y": (1,)}``.

    Example:
        >>> from hypothesis import given
        >>> @given(batches(B=st.integers(2, 6), fields={"x": (3,)}))
        ... def test(b):
        ...     assert b["x"].shape[1:] == (3,)
    """
    b = draw(B) if isinstance(B, st.SearchStrategy) else B
    spec = dict(fields) if fields is not None else {"x": (4,), "y": (1,)}
    data = {
        name: _tensor(draw(st.integers(0, 2**31 - 1)), (b, *trailing), dtype, 1.0)
        for name, trailing in spec.items()
    }
    return TensorDict(data, batch_size=[b])


def adam_hparams(*, amsgrad: bool | None = None) -> st.SearchStrategy[dict[str, Any]]:
    """Keyword arguments for ``optim.adam``/``adamw`` (and ``torch.optim.Adam``/``AdamW``).

    Example:
        >>> from hypothesis import given
        >>> @given(adam_hparams())
        ... def test(h):
        ...     assert 0 <= h["betas"][0] < 1
    """
    return st.fixed_dictionaries(
        {
            "lr": st.floats(1e-5, 1e-1),
            "betas": st.tuples(st.floats(0.0, 0.99), st.floats(0.5, 0.9999)),
            "eps": st.floats(1e-10, 1e-4),
            "weight_decay": st.floats(0.0, 0.1),
            "amsgrad": st.booleans() if amsgrad is None else st.just(amsgrad),
        }
    )


@st.composite
def sgd_hparams(draw: st.DrawFn) -> dict[str, Any]:
    """Valid keyword arguments for ``optim.sgd`` / ``torch.optim.SGD`` (nesterov needs momentum, no dampening).

    Example:
        >>> from hypothesis import given
        >>> @given(sgd_hparams())
        ... def test(h):
        ...     assert not h["nesterov"] or h["momentum"] > 0
    """
    momentum = draw(st.one_of(st.just(0.0), st.floats(0.1, 0.99)))
    nesterov = momentum > 0 and draw(st.booleans())
    dampening = 0.0 if nesterov else draw(st.one_of(st.just(0.0), st.floats(0.0, 0.9)))
    return {
        "lr": draw(st.floats(1e-4, 1e-1)),
        "momentum": momentum,
        "dampening": dampening,
        "nesterov": nesterov,
        "weight_decay": draw(st.one_of(st.just(0.0), st.floats(0.0, 0.1))),
    }


@st.composite
def states(
    draw: st.DrawFn,
    *,
    params: st.SearchStrategy[TensorDict] | None = None,
    optimizer: Transform | Callable[..., Transform] | None = None,
    hparams: st.SearchStrategy[dict[str, Any]] | None = None,
    roles: Sequence[str] = ("student",),
    seed: st.SearchStrategy[int] | None = None,
) -> TensorDict:
    """Training states from :func:`purestep.init_state` over drawn params.

    Args:
        params: strategy for one role's params (default :func:`param_trees`).
        optimizer: a Transform, or a factory called with drawn ``hparams``
            (default ``optim.adamw`` with :func:`adam_hparams`).
        hparams: strategy for the factory's keyword arguments.
        roles: role names; each gets its own drawn params and optimizer state.
        seed: strategy for the root PRNG seed.

    Example:
        >>> from hypothesis import given
        >>> @given(states())
        ... def test(s):
        ...     assert int(s["step"]) == 0
    """
    from purestep import optim
    from purestep.state import init_state

    p_strategy = params if params is not None else param_trees()
    factory = optimizer if optimizer is not None else optim.adamw
    if isinstance(factory, Transform):
        opt = factory
    else:
        kwargs = draw(hparams if hparams is not None else adam_hparams())
        opt = factory(**kwargs)
    role_params: dict[str, nn.Module | TensorDict] = {r: draw(p_strategy) for r in roles}
    return init_state(
        role_params,
        dict.fromkeys(roles, opt),
        seed=draw(seed if seed is not None else st.integers(0, 2**62)),
    )


def _fixed_or_drawn(draw: st.DrawFn, value: Any, options: Sequence[Any]) -> Any:
    if value is None:
        return draw(st.sampled_from(list(options)))
    if isinstance(value, st.SearchStrategy):
        return draw(value)
    return value


@st.composite
def models(
    draw: st.DrawFn,
    *,
    blocks: Sequence[str] | st.SearchStrategy[Sequence[str]] | None = None,
    tied: bool | st.SearchStrategy[bool] | None = None,
    unused: str | st.SearchStrategy[str] | None = None,
    layout: str | st.SearchStrategy[str] | None = None,
    max_blocks: int = 3,
) -> DrawnModel:
    """Small modules with the patterns real models have (a :class:`DrawnModel`).

    Each pattern is drawn unless fixed: conv-stage ``blocks`` (BatchNorm
    buffers, activation-checkpointed blocks in both reentrant modes, a
    submodule used twice, plain convs), ``tied`` weights, an ``unused`` branch
    (``"never"``/``"sometimes"`` gets no gradient), and the conv ``layout``
    (contiguous, channels_last input, channels_last weights and input).
    Weights come from a drawn seed; the global RNG is not used. Train on
    batches with ``batches(B, fields=model.batch_fields)`` (``x``, ``y``).

    Example:
        >>> from hypothesis import given
        >>> @given(models(tied=True))
        ... def test(m):
        ...     assert m.tied_a.weight is m.tied_b.weight
    """
    kinds = (
        draw(st.lists(st.sampled_from(BLOCK_KINDS), max_size=max_blocks))
        if blocks is None
        else (draw(blocks) if isinstance(blocks, st.SearchStrategy) else blocks)
    )
    spec = ModelSpec(
        blocks=tuple(kinds),  # type: ignore[arg-type]  # validated by ModelSpec
        tied=_fixed_or_drawn(draw, tied, (False, True)),
        unused=_fixed_or_drawn(draw, unused, UNUSED),
        layout=_fixed_or_drawn(draw, layout, LAYOUTS),
        channels=draw(st.integers(2, 4)),
        size=draw(st.integers(3, 5)),
        hidden=draw(st.integers(3, 8)),
        outputs=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )
    return DrawnModel(spec)
