"""Checks every transform goes through: purity, donated == pure, chain state, current_lr."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import example, given, settings
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


# Gradient and parameter memory layouts ---------------------------------------------------

LAYOUT_TRANSFORMS = ["adam", "adamw-amsgrad", "sgd-nesterov", "sgd-dampening", "lion"]


def _laid_out(values: torch.Tensor, layout: str) -> torch.Tensor:
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


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(LAYOUT_TRANSFORMS),
    shape=st.tuples(*[st.integers(2, 4)] * 4),
    p_layout=st.sampled_from(["contiguous", "transposed", "channels_last", "sliced"]),
    g_layout=st.sampled_from(["contiguous", "transposed", "channels_last", "sliced", "expanded"]),
    donate=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(
    name="adam", shape=(2, 2, 3, 3), p_layout="sliced", g_layout="expanded", donate=True, seed=0
)  # a sliced param's pure copy must take the donated param's path
def test_step_result_does_not_depend_on_memory_layout_of_params_or_grads(
    name: str, shape: tuple[int, ...], p_layout: str, g_layout: str, donate: bool, seed: int
) -> None:
    """Any layout of the grads (transposed, channels_last, sliced, stride-0 expanded) gives
    bitwise the result of grads stored like their params (what torch.optim gets in .grad,
    and what the fused kernel, which walks memory, needs), and any param layout gives the
    contiguous result up to the rounding of the vector kernels' tail elements."""
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(shape, generator=gen)
    gs = [torch.randn(shape, generator=gen) for _ in range(2)]
    if g_layout == "expanded":
        gs = [g.flatten()[:1].expand(shape).contiguous() for g in gs]
    opt = TRANSFORMS[name]()

    def run(p: torch.Tensor, grads: list[torch.Tensor], d: bool) -> tuple[TensorDict, TensorDict]:
        params = TensorDict({"w": p}, [])
        state = opt.init(params)
        for g in grads:
            params, state = opt.step(TensorDict({"w": g}, []), state, params, donate=d)
        return params, state

    p = _laid_out(p0, p_layout)
    like_p = [torch.empty_like(p).copy_(g) for g in gs] if p_layout != "sliced" else gs
    ref_p, ref_s = run(
        p.clone() if p_layout != "sliced" else _laid_out(p0, p_layout), like_p, False
    )
    got_p, got_s = run(p, [_laid_out(g, g_layout) for g in gs], donate)
    assert torch.equal(got_p["w"], ref_p["w"])
    for path, a, b in zip(tree.paths(ref_s), tree.leaves(ref_s), tree.leaves(got_s), strict=True):
        assert torch.equal(a, b), tree.format_path(path)
    contiguous, _ = run(p0.clone(), [g.clone() for g in gs], False)
    torch.testing.assert_close(got_p["w"], contiguous["w"], rtol=1e-5, atol=1e-6)


def test_a_stride_zero_gradient_of_a_million_elements_updates_every_element() -> None:
    """The case that crashed the fused kernel (it read an expanded grad as 1e6 elements)."""
    n = 1 << 20
    opt = optim.adamw(lr=0.1)
    params = TensorDict({"w": torch.zeros(n)}, [])
    new, _ = opt.step(TensorDict({"w": torch.ones(()).expand(n)}, []), opt.init(params), params)
    ref, _ = opt.step(TensorDict({"w": torch.ones(n)}, []), opt.init(params), params)
    assert torch.equal(new["w"], ref["w"]) and bool((ref["w"] < -0.09).all())


# Params without a gradient ----------------------------------------------------------------

# constant learning rates: with a schedule the lr follows the role's count, not the param's
SPARSE_TRANSFORMS: dict[str, Callable[[], optim.Transform]] = {
    "adam": lambda: optim.adam(lr=0.05, weight_decay=0.1),
    "adamw-amsgrad": lambda: optim.adamw(lr=0.05, amsgrad=True),
    "sgd": lambda: optim.sgd(lr=0.05),
    "sgd-dampening": lambda: optim.sgd(lr=0.05, momentum=0.5, dampening=0.3, weight_decay=0.1),
    "lion": lambda: optim.lion(lr=0.05, weight_decay=0.1),
}


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(sorted(SPARSE_TRANSFORMS)),
    shapes=shapes_st,
    masks=st.lists(st.lists(st.booleans(), min_size=3, max_size=3), min_size=1, max_size=4),
    donate=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_param_left_out_of_grads_is_untouched_and_keeps_its_own_step_count(
    name: str,
    shapes: list[tuple[int, ...]],
    masks: list[list[bool]],
    donate: bool,
    seed: int,
) -> None:
    """With grads for a subset of params, every param evolves exactly as if it were optimised
    alone on the steps where it has a gradient (torch.optim's skip of ``.grad is None``):
    absent params, their moments and their step counts do not change at all."""
    p0, gs = draws(shapes, seed, len(masks), torch.float32)
    opt = SPARSE_TRANSFORMS[name]()
    n = len(tree.leaves(p0))
    params, state = p0.clone(), opt.init(p0)
    for g, mask in zip(gs, masks, strict=True):
        keep = [g_ if mask[i % 3] else None for i, g_ in enumerate(tree.leaves(g))]
        params, state = opt.step(tree.select(g, keep), state, params, donate=donate)
    for i, path in enumerate(tree.paths(p0)):  # each leaf alone, on its own steps
        alone = TensorDict({"w": tree.leaves(p0)[i].clone()}, [])
        s = opt.init(alone)
        for g, mask in zip(gs, masks, strict=True):
            if mask[i % 3]:
                alone, s = opt.step(TensorDict({"w": tree.leaves(g)[i]}, []), s, alone)
        assert torch.equal(tree.leaves(params)[i], alone["w"]), tree.format_path(path)
    assert int(state["count"]) == len(masks)
    assert n == len(tree.leaves(params))
