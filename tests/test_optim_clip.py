"""clip_by_global_norm, chain, scale_by_schedule, and DTensor leaves (the generic transform
checks, e.g. purity and donation, run on them in test_optim_table.py)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from _optim import as_tree, assert_trees_equal, one_rank_mesh
from purestep import optim, tree
from purestep.optim import schedules


def randn_list(
    shapes: list[tuple[int, ...]], gen: torch.Generator, scale: float = 1.0
) -> list[torch.Tensor]:
    return [torch.randn(s, generator=gen) * scale for s in shapes]


shapes_st = st.lists(st.lists(st.integers(1, 5), max_size=3).map(tuple), min_size=1, max_size=4)


@settings(max_examples=30, deadline=None)
@given(
    shapes=shapes_st,
    max_norm=st.floats(0.01, 10.0),
    scale=st.floats(0.01, 10.0),
    seed=st.integers(0, 2**31 - 1),
    donate=st.booleans(),
)
def test_clip_matches_torch_clip_grad_norm(
    shapes: list[tuple[int, ...]], max_norm: float, scale: float, seed: int, donate: bool
) -> None:
    """Clipped grads and the logged norm equal torch.nn.utils.clip_grad_norm_'s."""
    gen = torch.Generator().manual_seed(seed)
    grads = randn_list(shapes, gen, scale)
    ps = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for p, g in zip(ps, grads, strict=True):
        p.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(ps, max_norm)
    clip = optim.clip_by_global_norm(max_norm)
    g_td = as_tree([g.clone() for g in grads])
    out, state = clip.update(g_td, clip.init(g_td), donate=donate)
    torch.testing.assert_close(state["norm"], total)
    assert state["norm"].dtype == torch.float32
    for a, p in zip(tree.leaves(out), ps, strict=True):
        torch.testing.assert_close(a, p.grad)
    if donate:
        assert out is g_td
    else:
        for a, g in zip(tree.leaves(g_td), grads, strict=True):
            assert torch.equal(a, g)


@pytest.mark.parametrize("donate", [False, True])
def test_chain_clip_adamw_matches_torch(donate: bool) -> None:
    """chain(clip_by_global_norm, adamw) equals clip_grad_norm_ + AdamW over 30 steps."""
    gen = torch.Generator().manual_seed(7)
    shapes = [(8, 5), (5,), (3, 3, 2)]
    init = randn_list(shapes, gen)
    ps = [torch.nn.Parameter(t.clone()) for t in init]
    topt = torch.optim.AdamW(ps, lr=0.01, weight_decay=0.05)
    opt = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(lr=0.01, weight_decay=0.05))
    params = as_tree([t.clone() for t in init])
    state = opt.init(params)
    for _ in range(30):
        grads = randn_list(shapes, gen, 2.0)
        for p, g in zip(ps, grads, strict=True):
            p.grad = g.clone()
        total = torch.nn.utils.clip_grad_norm_(ps, 0.5)
        topt.step()
        params, state = opt.step(as_tree(grads), state, params, donate=donate)
        torch.testing.assert_close(state["0", "norm"], total)
    for a, p in zip(tree.leaves(params), ps, strict=True):
        torch.testing.assert_close(a, p.detach())
    assert float(optim.current_lr(state)) == 0.01  # type: ignore[arg-type]
    assert opt.name == "chain(clip_by_global_norm, adamw)"


def test_clip_leaves_small_grads_unchanged() -> None:
    """Grads whose global norm is below max_norm are returned unchanged (scale 1)."""
    g = as_tree([torch.tensor([0.3, 0.4])])
    out, state = optim.clip_by_global_norm(1.0).update(g, TensorDict({}, []))
    assert torch.equal(out["head"], g["head"])
    assert float(state["norm"]) == pytest.approx(0.5)


@pytest.mark.parametrize("donate", [False, True])
def test_scale_by_schedule_multiplies_by_schedule_of_count(donate: bool) -> None:
    """Update n is multiplied by schedule(n); count increments; a float is a constant."""
    sched = schedules.linear(-1.0, -0.2, 4)
    t = optim.scale_by_schedule(sched)
    g = as_tree([torch.ones(3), torch.full((2,), 2.0)])
    state = t.init(g)
    for n in range(6):
        src = tree.clone(g)
        out, state = t.update(src, state, donate=donate)
        for a, b in zip(tree.leaves(out), tree.leaves(g), strict=True):
            torch.testing.assert_close(a, b * sched(n))
        assert int(state["count"]) == n + 1
        if not donate:
            assert_trees_equal(src, g)
    out, _ = optim.scale_by_schedule(-0.5).update(g, optim.scale_by_schedule(-0.5).init(g))
    assert torch.equal(out["head"], torch.full((2,), -1.0))


def test_chain_of_scale_by_schedule_is_sgd_with_schedule() -> None:
    """scale_by_schedule(-lr(n)) on raw grads is plain SGD with that schedule."""
    lr = schedules.cosine_decay(0.1, 10)
    t = optim.scale_by_schedule(lambda n: -lr(n))
    ref = optim.sgd(lr=lr)
    gen = torch.Generator().manual_seed(0)
    p1 = p2 = as_tree(randn_list([(4,), (2, 2)], gen))
    s1, s2 = t.init(p1), ref.init(p2)
    for _ in range(12):
        g = as_tree(randn_list([(4,), (2, 2)], gen))
        p1, s1 = t.step(g, s1, p1)
        p2, s2 = ref.step(g, s2, p2)
    for a, b in zip(tree.leaves(p1), tree.leaves(p2), strict=True):
        torch.testing.assert_close(a, b)


def test_chain_state_nests_per_transform_and_current_lr_reads_it() -> None:
    """chain state is {"0": ..., "1": ...}; current_lr finds the lr of the last update."""
    sched = schedules.warmup_cosine(0.05, 2, 8, init=0.01)
    opt = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(lr=sched, weight_decay=0.1))
    gen = torch.Generator().manual_seed(0)
    params = as_tree(randn_list([(2,)], gen))
    state = opt.init(params)
    assert sorted(state.keys()) == ["0", "1"]
    assert float(optim.current_lr(state)) == sched(0)  # type: ignore[arg-type]
    for n in range(4):
        params, state = opt.step(as_tree(randn_list([(2,)], gen)), state, params)
        assert float(optim.current_lr(state)) == sched(n)  # type: ignore[arg-type]
        assert int(state["1", "count"]) == n + 1
    assert optim.current_lr(optim.clip_by_global_norm(1.0).init(params)) is None


@pytest.mark.parametrize("max_norm", [0.0, -1.0, float("inf")])
def test_bad_max_norm_fails_at_construction_naming_the_field(max_norm: float) -> None:
    """max_norm must be a finite number > 0; the error starts with the field's name."""
    with pytest.raises(ValueError, match=r"^max_norm"):
        optim.clip_by_global_norm(max_norm)


@pytest.fixture
def world1() -> Iterator[Any]:
    with one_rank_mesh() as mesh:
        yield mesh


@pytest.mark.parametrize("donate", [False, True])
def test_dtensor_leaves_match_plain_tensors(world1: Any, donate: bool) -> None:
    """With sharded DTensor params/grads, chain(clip, adamw) step and update equal the plain run."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(6, 3, generator=gen), torch.randn(3, generator=gen)
    gw, gb = torch.randn(6, 3, generator=gen), torch.randn(3, generator=gen)

    def sharded(x: torch.Tensor) -> torch.Tensor:
        return distribute_tensor(x.clone(), world1, [Shard(0)])

    opt = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(lr=0.1))
    plain_p = TensorDict({"w": w.clone(), "b": b.clone()}, [])
    plain_g = TensorDict({"w": gw.clone(), "b": gb.clone()}, [])
    dist_p = TensorDict({"w": sharded(w), "b": b.clone()}, [])
    dist_g = TensorDict({"w": sharded(gw), "b": gb.clone()}, [])
    ref_p, ref_s = opt.step(plain_g, opt.init(plain_p), plain_p)
    state = opt.init(dist_p)
    assert isinstance(state["1", "mu", "w"], DTensor)
    new_p, new_s = opt.step(dist_g, state, dist_p, donate=donate)
    assert isinstance(new_p["w"], DTensor)
    torch.testing.assert_close(new_p["w"].full_tensor(), ref_p["w"])
    torch.testing.assert_close(new_p["b"], ref_p["b"])
    torch.testing.assert_close(new_s["0", "norm"], ref_s["0", "norm"])
    if not donate:
        upd, _ = opt.update(dist_g, opt.init(dist_p), dist_p)
        assert isinstance(upd["w"], DTensor)
        ref_u, _ = opt.update(plain_g, opt.init(plain_p), plain_p)
        torch.testing.assert_close(upd["w"].full_tensor(), ref_u["w"])


@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
def test_dtensor_params_with_a_strided_local_shard_step_like_the_plain_shard(
    world1: Any, name: str
) -> None:
    """A DTensor param whose local shard is a sliced view (not dense) goes through the pure
    step, the donated step and update like that shard as a plain tensor: the pure path
    copies it as a DTensor (a plain strided copy of a DTensor cannot be made)."""
    from torch.distributed.tensor import DTensor, Shard

    gen = torch.Generator().manual_seed(3)
    local = torch.randn(4, 7, generator=gen)[:, 1:5]
    before = local.clone()
    grad = torch.randn(4, 4, generator=gen)
    make = {
        "adamw": lambda: optim.adamw(lr=0.1, weight_decay=0.1),
        "sgd": lambda: optim.sgd(lr=0.1, momentum=0.9),
        "lion": lambda: optim.lion(lr=0.1),
    }[name]

    def dt(x: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(x, world1, [Shard(0)], run_check=False)

    opt = make()
    ref_p = TensorDict({"w": local.clone()}, [])
    want, _ = opt.step(TensorDict({"w": grad.clone()}, []), opt.init(ref_p), ref_p)
    want_u, _ = opt.update(TensorDict({"w": grad.clone()}, []), opt.init(ref_p), ref_p)
    for donate in (False, True):
        params = TensorDict({"w": dt(local.clone() if donate else local)}, [])
        grads = TensorDict({"w": dt(grad.clone())}, [])
        new_p, _ = opt.step(grads, opt.init(params), params, donate=donate)
        assert isinstance(new_p["w"], DTensor)
        torch.testing.assert_close(new_p["w"].full_tensor(), want["w"], rtol=0, atol=0)
    assert torch.equal(local, before)  # the pure step left it alone
    params = TensorDict({"w": dt(local)}, [])
    upd, _ = opt.update(TensorDict({"w": dt(grad.clone())}, []), opt.init(params), params)
    torch.testing.assert_close(upd["w"].full_tensor(), want_u["w"], rtol=0, atol=0)


def test_clip_init_state_is_a_float32_zero_norm_and_update_does_not_donate_by_default() -> None:
    """init gives a float32 scalar norm of 0 on the params' device whatever the default
    dtype; update without donate leaves the caller's grads untouched."""
    params = as_tree([torch.zeros(2, dtype=torch.float64)])
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        state = optim.clip_by_global_norm(1.0).init(params)
    finally:
        torch.set_default_dtype(old)
    assert state["norm"].dtype == torch.float32
    assert state["norm"].device == torch.device("cpu")
    assert float(state["norm"]) == 0.0
    g = as_tree([torch.tensor([3.0, 4.0])])
    before = g["head"].clone()
    out, _ = optim.clip_by_global_norm(1.0).update(g, state)
    assert torch.equal(g["head"], before)
    assert torch.allclose(out["head"], before / (5.0 + 1e-6))


@pytest.mark.parametrize("bad", ["0.5", None, True, [0.5]])
def test_scale_by_schedule_refuses_a_factor_that_is_neither_a_number_nor_callable(
    bad: object,
) -> None:
    """A string, None, a bool or a list is refused when built, with the whole message."""
    with pytest.raises(
        TypeError,
        match=r"^schedule must be a callable count -> value or a number, got "
        + re.escape(repr(bad))
        + "$",
    ):
        optim.scale_by_schedule(bad)  # type: ignore[arg-type]


def test_scale_by_schedule_refuses_grads_that_do_not_match_the_params() -> None:
    """update with params checks the grads against them, naming the path and both shapes:
    the method and the ``update_fn`` it holds (called directly, as a custom combinator may)."""
    t = optim.scale_by_schedule(-1.0)
    params = TensorDict({"w": torch.ones(2)}, [])
    for update in (t.update, t.update_fn):
        with pytest.raises(
            ValueError, match=r"^grads at w has shape \(3,\), but params has shape \(2,\)$"
        ):
            update(TensorDict({"w": torch.ones(3)}, []), t.init(params), params)


def test_scale_by_schedule_is_named_and_keeps_its_schedule() -> None:
    """Its name (as chain reports it) and its hparams, the schedule itself."""
    sched = schedules.linear(-1.0, 0.0, 4)
    t = optim.scale_by_schedule(sched)
    assert t.hparams is sched
    assert optim.chain(optim.clip_by_global_norm(1.0), t).name == (
        "chain(clip_by_global_norm, scale_by_schedule)"
    )


def test_clip_state_lives_on_the_params_device_and_on_the_cpu_for_empty_params() -> None:
    """init puts ``norm`` on the first leaf's device (here meta, as for deferred-init params),
    and on the CPU for params without leaves, whatever the default device."""
    clip = optim.clip_by_global_norm(1.0)
    meta = TensorDict({"w": torch.empty(3, device="meta")}, [])
    assert clip.init(meta)["norm"].device == torch.device("meta")
    with torch.device("meta"):
        state = clip.init(TensorDict({}, []))
    assert state["norm"].device == torch.device("cpu")
    assert float(state["norm"]) == 0.0


@pytest.mark.parametrize("scale", [1e-7, 1e-6, 3e-6])
def test_clip_coefficient_is_max_norm_over_norm_plus_eps_for_tiny_norms(scale: float) -> None:
    """With norms near the 1e-6 epsilon, the scale is ``max_norm / (norm + 1e-6)`` (capped at 1),
    as torch.nn.utils.clip_grad_norm_: the epsilon is added, never subtracted."""
    gen = torch.Generator().manual_seed(3)
    grads = randn_list([(4,), (2, 3)], gen, scale)
    max_norm = scale / 2
    ps = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(ps, grads, strict=True):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(ps, max_norm)
    clip = optim.clip_by_global_norm(max_norm)
    g_td = as_tree([g.clone() for g in grads])
    out, state = clip.update(g_td, clip.init(g_td))
    norm = float(state["norm"])
    for a, g, p in zip(tree.leaves(out), grads, ps, strict=True):  # relative: values ~1e-7
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=0.0)
        torch.testing.assert_close(a, g * min(1.0, max_norm / (norm + 1e-6)), rtol=1e-5, atol=0.0)


def test_clip_update_fn_called_directly_does_not_donate_and_checks_grads_against_params() -> None:
    """The raw ``update_fn`` (what chain and purestep.compile call) defaults to
    ``donate=False``: the caller's grads are untouched; and it refuses grads whose shape
    differs from the params', naming the key and both shapes."""
    clip = optim.clip_by_global_norm(1.0)
    g = as_tree([torch.tensor([3.0, 4.0])])
    before = g["head"].clone()
    out, _ = clip.update_fn(g, clip.init(g), None)
    assert torch.equal(g["head"], before)
    assert out["head"] is not g["head"]
    params = as_tree([torch.zeros(3)])
    with pytest.raises(
        ValueError, match=r"^grads at head has shape \(2,\), but params has shape \(3,\)$"
    ):
        clip.update_fn(g, clip.init(params), params)


def test_clip_keeps_its_validated_hyperparameters() -> None:
    """``hparams`` is the validated ClipHParams (read by purestep.compile and reprs)."""
    assert optim.clip_by_global_norm(0.5).hparams == optim.ClipHParams(max_norm=0.5)
