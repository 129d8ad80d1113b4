"""Helpers shared by the optimizer tests (imported as ``_optim``; tests/ is on sys.path).

Parameters are lists of tensors laid into a nested tree by :func:`as_tree`;
references (torch.optim, per-tensor code) see the same list in the same order.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import strategies as st
from tensordict import TensorDict

from purestep import optim, tree

STEPS = 50

# up to four tensors of up to three dims, sizes 0..5 (empty tensors included)
shapes_st = st.lists(st.lists(st.integers(0, 5), max_size=3).map(tuple), min_size=1, max_size=4)

EXACT = {"rtol": 0.0, "atol": 0.0}


def as_tree(tensors: list[torch.Tensor]) -> TensorDict:
    """Nested like a module: ``{"body": {"l0": {"w": t0}, ...}, "head": t_last}``.

    Leaves come back from ``tree.leaves`` in list order; :func:`paths` names them.
    """
    body = {f"l{i}": {"w": t} for i, t in enumerate(tensors[:-1])}
    return TensorDict({"body": body, "head": tensors[-1]}, batch_size=[])


def paths(n: int) -> list[str]:
    """The dotted paths of :func:`as_tree`'s ``n`` leaves."""
    return [f"body.l{i}.w" for i in range(n - 1)] + ["head"]


def make_data(
    shapes: list[tuple[int, ...]], seed: int, dtype: torch.dtype, steps: int = STEPS
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Initial params and ``steps`` lists of grads, standard normal, from one seed."""
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(steps)]
    return init, grads


def run_ours(
    opt: optim.Transform,
    init: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    *,
    donate: bool,
) -> tuple[TensorDict, TensorDict]:
    """``opt.step`` over every list of grads, from fresh copies of ``init``."""
    params = as_tree([t.clone() for t in init])
    state = opt.init(params)
    for gs in grads:
        params, state = opt.step(as_tree([g.clone() for g in gs]), state, params, donate=donate)
    return params, state


def run_updates(
    opt: optim.Transform,
    init: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    *,
    donate: bool,
) -> tuple[TensorDict, TensorDict]:
    """optax style: ``params = apply_updates(params, opt.update(...))`` over every list of grads."""
    params = as_tree([t.clone() for t in init])
    state = opt.init(params)
    for gs in grads:
        upd, state = opt.update(as_tree([g.clone() for g in gs]), state, params, donate=donate)
        params = optim.apply_updates(params, upd)
    return params, state


def assert_trees_equal(a: TensorDict, b: TensorDict) -> None:
    """Same paths, dtypes, devices and bitwise values."""
    assert tree.paths(a) == tree.paths(b)
    for path, x, y in zip(tree.paths(a), tree.leaves(a), tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.device == y.device, path
        assert torch.equal(x, y), f"differs at {tree.format_path(path)}"


def ptrs(*tds: TensorDict) -> set[int]:
    """The data pointers of every non-empty leaf."""
    return {t.data_ptr() for td in tds for t in tree.leaves(td) if t.numel()}


def run_torch(
    build: Callable[[list[torch.nn.Parameter], list[str]], list[torch.optim.Optimizer]],
    init: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    shape: Callable[[str, torch.Tensor], tuple[int, ...]] = lambda path, t: tuple(t.shape),
) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """The imperative loop: ``.grad = g``, ``opt.step()`` for every optimizer ``build`` returns.

    Empty tensors are left out (a matrix optimizer cannot scale an ``(n, 0)``
    matrix); ``shape`` gives the shape torch sees a param as (e.g. a conv
    filter as its ``(shape[0], -1)`` matrix). Returns the final params and
    each param's ``optimizer.state`` (``{}`` for those left out), in ``init``'s shapes.
    """
    names = paths(len(init))
    live = [i for i, t in enumerate(init) if t.numel()]
    ps = [torch.nn.Parameter(init[i].clone().reshape(shape(names[i], init[i]))) for i in live]
    opts = build(ps, [names[i] for i in live]) if ps else []
    for gs in grads:
        for p, i in zip(ps, live, strict=True):
            p.grad = gs[i].clone().reshape(p.shape)
        for o in opts:
            o.step()
    out = [t.clone() for t in init]
    states: list[dict[str, Any]] = [{} for _ in init]
    for p, i in zip(ps, live, strict=True):
        out[i] = p.detach().reshape(init[i].shape)
        for o in opts:
            if p in o.state:
                states[i] = {
                    k: v.reshape(init[i].shape) if isinstance(v, torch.Tensor) and v.ndim else v
                    for k, v in o.state[p].items()
                }
    return out, states


def laid_out(values: torch.Tensor, layout: str) -> torch.Tensor:
    """A tensor equal to ``values`` (4-D) stored in the given memory layout."""
    if layout == "contiguous":
        return values.clone()
    if layout == "transposed":
        return values.permute(3, 2, 1, 0).contiguous().permute(3, 2, 1, 0)
    if layout == "channels_last":
        return values.contiguous(memory_format=torch.channels_last)
    if layout == "sliced":
        big = torch.zeros(*values.shape[:-1], values.shape[-1] + 3, dtype=values.dtype)
        big[..., 1 : 1 + values.shape[-1]] = values
        return big[..., 1 : 1 + values.shape[-1]]
    if layout == "expanded":  # stride 0 along every dim: all elements share one value
        return values.flatten()[:1].reshape(1, 1, 1, 1).expand(values.shape)
    raise AssertionError(layout)


@contextlib.contextmanager
def one_rank_mesh() -> Iterator[Any]:
    """A one-rank gloo process group and CPU device mesh, for DTensor leaves (skips if unavailable)."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    from torch.distributed.device_mesh import init_device_mesh

    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1)
        try:
            yield init_device_mesh("cpu", (1,))
        finally:
            dist.destroy_process_group()


def run_torch_masked(
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    init: list[torch.Tensor],
    grads: list[list[torch.Tensor | None]],
) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """torch.optim over ``grads`` where ``None`` leaves that param's ``.grad`` None (skipped)."""
    ps = [torch.nn.Parameter(t.clone()) for t in init]
    opt = make(ps)
    for gs in grads:
        for p, g in zip(ps, gs, strict=True):
            p.grad = None if g is None else g.clone()
        opt.step()
    return [p.detach() for p in ps], [opt.state.get(p, {}) for p in ps]


def run_ours_masked(
    opt: optim.Transform,
    init: list[torch.Tensor],
    grads: list[list[torch.Tensor | None]],
    donate: bool,
) -> tuple[TensorDict, TensorDict]:
    """``opt.step`` over ``grads``, a ``None`` grad's param left out of the grads tree."""
    params = as_tree([t.clone() for t in init])
    state = opt.init(params)
    names = tree.paths(params)
    for gs in grads:
        sub = [(path, g.clone()) for path, g in zip(names, gs, strict=True) if g is not None]
        params, state = opt.step(tree.unflatten(sub), state, params, donate=donate)
    return params, state


def masked_grads(
    data: st.DataObject, shapes: list[tuple[int, ...]], dtype: torch.dtype, steps: int
) -> tuple[list[torch.Tensor], list[list[torch.Tensor | None]]]:
    """Initial params and ``steps`` lists of grads, some params without a gradient in a step."""
    seed = data.draw(st.integers(0, 2**16), label="seed")
    init, full = make_data(shapes, seed, dtype, steps=steps)
    masks = data.draw(
        st.lists(
            st.lists(st.booleans(), min_size=len(shapes), max_size=len(shapes)),
            min_size=steps,
            max_size=steps,
        ),
        label="masks",
    )
    return init, [
        [g if m else None for g, m in zip(gs, ms, strict=True)]
        for gs, ms in zip(full, masks, strict=True)
    ]
