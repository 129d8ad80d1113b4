"""Checks every transform goes through: purity, donated == pure, chain state, current_lr."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from purestep import optim, tree
from purestep.optim import schedules

SCHED = schedules.warmup_cosine(0.05, 2, 8, init=0.01)

TRANSFORMS: dict[str, Callable[[], optim.Transform]] = {
    "adam": lambda: optim.adam(lr=0.05, weight_decay=0.1),
    "adamw-amsgrad": lambda: optim.adamw(lr=SCHED, amsgrad=True),
    "sgd": lambda: optim.sgd(lr=0.05),
    "sgd-nesterov": lambda: optim.sgd(lr=SCHED, momentum=0.9, nesterov=True, weight_decay=0.1),
    "sgd-dampening": lambda: optim.sgd(lr=0.05, momentum=0.5, dampening=0.3),
    "lion": lambda: optim.lion(lr=SCHED, weight_decay=0.1),
    "clip": lambda: optim.clip_by_global_norm(0.5),
    "scale": lambda: optim.scale_by_schedule(lambda n: -SCHED(n)),
    "chain-clip-adamw": lambda: optim.chain(
        optim.clip_by_global_norm(0.5), optim.adamw(lr=SCHED, weight_decay=0.1)
    ),
    "chain-clip-scale-sgd": lambda: optim.chain(
        optim.clip_by_global_norm(1.0), optim.scale_by_schedule(2.0), optim.sgd(lr=0.01)
    ),
}

shapes_st = st.lists(st.lists(st.integers(1, 4), max_size=3).map(tuple), min_size=1, max_size=3)


def as_tree(tensors: list[torch.Tensor]) -> TensorDict:
    return TensorDict(
        {"body": {f"l{i}": {"w": t} for i, t in enumerate(tensors[:-1])}, "head": tensors[-1]},
        batch_size=[],
    )


def draws(
    shapes: list[tuple[int, ...]], seed: int, n: int, dtype: torch.dtype
) -> tuple[TensorDict, list[TensorDict]]:
    gen = torch.Generator().manual_seed(seed)
    p = as_tree([torch.randn(s, generator=gen).to(dtype) for s in shapes])
    gs = [as_tree([torch.randn(s, generator=gen).to(dtype) for s in shapes]) for _ in range(n)]
    return p, gs


def assert_trees_equal(a: TensorDict, b: TensorDict) -> None:
    assert tree.paths(a) == tree.paths(b)
    for path, x, y in zip(tree.paths(a), tree.leaves(a), tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.device == y.device, path
        assert torch.equal(x, y), f"differs at {tree.format_path(path)}"


def ptrs(*tds: TensorDict) -> set[int]:
    return {t.data_ptr() for td in tds for t in tree.leaves(td) if t.numel()}


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(sorted(TRANSFORMS)),
    shapes=shapes_st,
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_pure_step_and_update_leave_inputs_bitwise_unchanged(
    name: str, shapes: list[tuple[int, ...]], seed: int, dtype: torch.dtype
) -> None:
    """donate=False never writes params, grads or state, and returns no buffer of theirs."""
    opt = TRANSFORMS[name]()
    params, grads = draws(shapes, seed, 3, dtype)
    state = opt.init(params)
    for g in grads[:2]:  # non-zero moments first
        params, state = opt.step(g, state, params)
    g = grads[2]
    before = [tree.clone(td) for td in (params, g, state)]
    outs = [*opt.step(g, state, params), *opt.update(g, state, params)]
    for td, ref in zip((params, g, state), before, strict=True):
        assert_trees_equal(td, ref)
    inputs = ptrs(params, g, state)
    for out in outs:
        assert not inputs & ptrs(out)


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(sorted(TRANSFORMS)),
    shapes=shapes_st,
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_donated_step_equals_pure_step_bitwise(
    name: str, shapes: list[tuple[int, ...]], seed: int, dtype: torch.dtype
) -> None:
    """Six steps with donate=True give bitwise the params and state of donate=False."""
    opt = TRANSFORMS[name]()
    params, grads = draws(shapes, seed, 6, dtype)
    p1, s1 = params, opt.init(params)
    p2, s2 = tree.clone(params), opt.init(params)
    for g in grads:
        p1, s1 = opt.step(g, s1, p1)
        p2, s2 = opt.step(tree.clone(g), s2, p2, donate=True)
    assert_trees_equal(p1, p2)
    assert_trees_equal(s1, s2)


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_donated_step_updates_params_in_their_own_buffers(name: str) -> None:
    """With donate=True the returned params are the input buffers (no new param memory)."""
    opt = TRANSFORMS[name]()
    params, grads = draws([(3, 2), (4,)], 0, 1, torch.float32)
    before = [t.data_ptr() for t in tree.leaves(params)]
    new_p, _ = opt.step(grads[0], opt.init(params), params, donate=True)
    assert [t.data_ptr() for t in tree.leaves(new_p)] == before


def test_chain_state_nests_per_transform_and_current_lr_reads_it() -> None:
    """chain state is {"0": ..., "1": ...}; current_lr finds the lr of the last update."""
    opt = TRANSFORMS["chain-clip-adamw"]()
    params, grads = draws([(2,)], 0, 4, torch.float32)
    state = opt.init(params)
    assert sorted(state.keys()) == ["0", "1"]
    assert float(optim.current_lr(state)) == SCHED(0)  # type: ignore[arg-type]
    for n, g in enumerate(grads):
        params, state = opt.step(g, state, params)
        assert float(optim.current_lr(state)) == SCHED(n)  # type: ignore[arg-type]
        assert int(state["1", "count"]) == n + 1
    assert optim.current_lr(optim.clip_by_global_norm(1.0).init(params)) is None


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
@pytest.mark.parametrize("donate", [False, True])
def test_empty_tree_is_a_no_op(name: str, donate: bool) -> None:
    """A params tree with no leaves steps and updates without error and stays empty."""
    opt = TRANSFORMS[name]()
    empty = TensorDict({}, batch_size=[])
    state = opt.init(empty)
    new_p, _ = opt.step(empty, state, empty, donate=donate)
    upd, _ = opt.update(empty, opt.init(empty), empty, donate=donate)
    assert tree.leaves(new_p) == [] and tree.leaves(upd) == []
