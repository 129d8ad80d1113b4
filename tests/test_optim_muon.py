"""Muon specifics (its row in _optim_rows.py runs it through every shared check, against
torch.optim.Muon + AdamW and Keller Jordan's code): which params are orthogonalised, the
AdamW fallback, refusals, the momentum-buffer aliasing regression, a training step."""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from _imperative import assert_same_as_imperative, mse, randn, regression_batches
from _optim import as_tree, assert_trees_equal, make_data, one_rank_mesh, run_ours
from purestep import optim, tree
from purestep.errors import ScheduleError
from purestep.optim import schedules


def test_use_muon_is_asked_once_per_param_by_path_and_its_answer_is_kept_in_state() -> None:
    """init asks ``use_muon(dotted path, param)`` once per param; a selected param's ``nu`` is
    an empty marker, the others' a zero second moment; ``mu`` and ``steps`` cover every param.
    The default selects every param with ndim >= 2."""
    asked: list[tuple[str, tuple[int, ...]]] = []

    def use(path: str, p: torch.Tensor) -> bool:
        asked.append((path, tuple(p.shape)))
        return p.ndim >= 2 and path != "head"

    params = as_tree([torch.ones(4, 3), torch.ones(3), torch.ones(2, 3, 2), torch.ones(5, 4)])
    state = optim.muon(use_muon=use).init(params)
    assert asked == [
        ("body.l0.w", (4, 3)),
        ("body.l1.w", (3,)),
        ("body.l2.w", (2, 3, 2)),
        ("head", (5, 4)),
    ]
    assert [tuple(t.shape) for t in tree.leaves(state["nu"])] == [(0,), (3,), (0,), (5, 4)]
    assert [tuple(t.shape) for t in tree.leaves(state["mu"])] == [(4, 3), (3,), (2, 3, 2), (5, 4)]
    assert all(t.shape == () for t in tree.leaves(state["steps"]))
    default = optim.muon().init(params)
    assert [tuple(t.shape) for t in tree.leaves(default["nu"])] == [(0,), (3,), (0,), (0,)]


def test_params_use_muon_rejects_step_exactly_as_adamw_with_the_adam_hyperparameters() -> None:
    """The fallback is adamw(adam_lr or lr, adam_betas, adam_eps, adam_weight_decay), bitwise,
    params and state alike (a selected param beside them changes nothing)."""
    init, grads = make_data([(4, 3), (5,), (3, 3)], 1, torch.float32, steps=6)
    hp = {"adam_betas": (0.8, 0.9), "adam_eps": 1e-6, "adam_weight_decay": 0.05}
    for lr, adam_lr in ((0.01, None), (0.01, schedules.linear(0.02, 0.0, 6))):
        ours = optim.muon(
            lr=lr, adam_lr=adam_lr, use_muon=lambda path, p: path == "body.l0.w", **hp
        )
        p1, s1 = run_ours(ours, init, grads, donate=True)
        ref = optim.adamw(lr=adam_lr or lr, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05)
        p2, s2 = run_ours(ref, init[1:], [g[1:] for g in grads], donate=True)
        for i in (1, 2):
            assert torch.equal(tree.leaves(p1)[i], tree.leaves(p2)[i - 1])
            for key in ("mu", "nu", "steps"):
                assert torch.equal(tree.leaves(s1[key])[i], tree.leaves(s2[key])[i - 1]), key


def test_use_muon_errors_name_the_path() -> None:
    """A non-bool answer, or a selected param with fewer than two dims, fails at init naming it."""
    params = as_tree([torch.ones(3, 2), torch.ones(4)])
    with pytest.raises(TypeError, match=r"use_muon\('body\.l0\.w', param\) returned 1"):
        optim.muon(use_muon=lambda path, p: 1).init(params)  # type: ignore[arg-type, return-value]
    with pytest.raises(
        ValueError,
        match=r"^muon: use_muon selected params at head of shape \(4,\); "
        r"Muon orthogonalises matrices \(ndim >= 2\)$",
    ):
        optim.muon(use_muon=lambda path, p: True).init(params)


def test_bf16_momentum_buffer_without_nesterov_is_the_average_of_the_grads() -> None:
    """Regression (pytorch/pytorch#194664): Newton–Schulz must not normalise the momentum
    buffer in place (``x.bfloat16()`` *is* the bf16 buffer when nesterov=False)."""
    init, grads = make_data([(4, 3)], 2, torch.bfloat16, steps=3)
    _, state = run_ours(optim.muon(lr=0.1, nesterov=False, momentum=0.9), init, grads, donate=True)
    buf = torch.zeros(4, 3, dtype=torch.bfloat16)
    for gs in grads:
        buf.lerp_(gs[0], 1 - 0.9)
    assert torch.equal(tree.leaves(state["mu"])[0], buf)


def test_an_adam_lr_schedule_that_goes_negative_raises_before_anything_changes() -> None:
    """adam_lr is checked at every update's count, naming it, before any buffer is written
    (donated ones included); purestep's own schedules are refused when muon is built."""
    with pytest.raises(ScheduleError, match=r"adam_lr: the schedule linear.* at count 3"):
        optim.muon(lr=0.01, adam_lr=schedules.linear(0.1, -0.1, 4))
    opt = optim.muon(lr=0.01, adam_lr=lambda n: 0.1 - 0.05 * n)  # opaque: checked per update
    init, grads = make_data([(3, 2), (4,)], 0, torch.float32, steps=4)
    params, state = run_ours(opt, init, grads[:3], donate=True)
    before = [tree.clone(params), tree.clone(state)]
    with pytest.raises(
        ScheduleError, match=r"muon \(adam_lr\): the learning rate at update 3 is -0\.05"
    ):
        opt.step(as_tree(grads[3]), state, params, donate=True)
    assert tree.leaves(before[0]) and all(
        torch.equal(a, b) for a, b in zip(tree.leaves(before[1]), tree.leaves(state), strict=True)
    )
    assert all(
        torch.equal(a, b) for a, b in zip(tree.leaves(before[0]), tree.leaves(params), strict=True)
    )


@pytest.mark.parametrize("shape", [(8, 32), (32, 8), (16, 16)])
def test_the_update_is_nearly_orthogonal(shape: tuple[int, int]) -> None:
    """One step from zero momentum (no Nesterov, no decay, lr 1) moves a matrix by ``-ratio * O``
    with O's singular values in [0.5, 1.5] (Keller Jordan: S' ~ U(0.5, 1.5)), fp32 and bf16."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    g = g + 4 * torch.eye(*shape)  # well conditioned: 5 iterations lift every singular value
    for ns_dtype in (torch.float32, torch.bfloat16):
        opt = optim.muon(lr=1.0, momentum=0.0, nesterov=False, weight_decay=0.0, ns_dtype=ns_dtype)
        params = TensorDict({"w": torch.zeros(shape)}, [])
        new, _ = opt.step(TensorDict({"w": g}, []), opt.init(params), params)
        ratio = max(1, shape[0] / shape[1]) ** 0.5
        s = torch.linalg.svdvals(-new["w"] / ratio)
        assert float(s.min()) >= 0.5 and float(s.max()) <= 1.5, (ns_dtype, s)


class MuonWithAdamW:
    """torch.optim.Muon on the 2-D params and AdamW(fused) on the others, as one optimizer."""

    def __init__(self, params: Iterator[nn.Parameter]) -> None:
        ps = list(params)
        self.opts = [
            torch.optim.Muon([p for p in ps if p.ndim == 2], lr=0.02, weight_decay=0.1),
            torch.optim.AdamW(
                [p for p in ps if p.ndim != 2],
                lr=0.02,
                betas=(0.9, 0.95),
                eps=1e-10,
                weight_decay=0.0,
                fused=True,
            ),
        ]

    def zero_grad(self) -> None:
        for o in self.opts:
            o.zero_grad()

    def step(self) -> None:
        for o in self.opts:
            o.step()


def test_train_step_with_muon_equals_the_imperative_loop_bitwise() -> None:
    """train_step(muon) on an MLP equals zero_grad / backward / torch Muon + AdamW, bitwise."""

    def make() -> nn.Module:
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 6))
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.copy_(0.5 * randn(*p.shape, seed=i))
        return model

    assert_same_as_imperative(
        make,
        regression_batches(4, 8, 6, 6),
        mse,
        transform=optim.muon(lr=0.02),
        optimizer=MuonWithAdamW,
    )


@pytest.fixture
def world1() -> Iterator[Any]:
    with one_rank_mesh() as mesh:
        yield mesh


def test_sharded_dtensor_params_are_refused_and_replicated_ones_match_plain(world1: Any) -> None:
    """Newton–Schulz needs the whole matrix: a sharded (FSDP-like) param selected for Muon
    fails at init, or at a step or an update with state from plain params, with the whole
    message naming its path and placements; left to AdamW
    it trains; a replicated one equals the plain run."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(1)
    w, gw = torch.randn(4, 3, generator=gen), torch.randn(4, 3, generator=gen)
    opt = optim.muon(lr=0.02)
    sharded = TensorDict({"enc": {"w": distribute_tensor(w.clone(), world1, [Shard(0)])}}, [])
    refused = re.escape(
        "muon: params at enc.w is a DTensor placed as (Shard(dim=0),); Newton–Schulz needs the "
        "whole matrix on each rank, which this implementation does not gather: leave it to the "
        "AdamW fallback (use_muon=...) or replicate it"
    )
    with pytest.raises(ValueError, match=f"^{refused}$"):
        opt.init(sharded)
    plain = TensorDict({"enc": {"w": w.clone()}}, [])
    grads = TensorDict({"enc": {"w": distribute_tensor(gw.clone(), world1, [Shard(0)])}}, [])
    for method in (opt.step, opt.update):
        with pytest.raises(ValueError, match=f"^{refused}$"):
            method(grads, opt.init(plain), sharded)
    adam_only = optim.muon(lr=0.02, use_muon=lambda path, p: False)
    new, _ = adam_only.step(grads, adam_only.init(sharded), sharded)
    assert new["enc", "w"].placements == (Shard(0),)
    replicated = TensorDict({"enc": {"w": distribute_tensor(w.clone(), world1, [Replicate()])}}, [])
    rgrads = TensorDict({"enc": {"w": distribute_tensor(gw.clone(), world1, [Replicate()])}}, [])
    got, _ = opt.step(rgrads, opt.init(replicated), replicated)
    ref, _ = opt.step(TensorDict({"enc": {"w": gw.clone()}}, []), opt.init(plain), plain)
    assert torch.equal(got["enc", "w"].full_tensor(), ref["enc", "w"])


def test_muon_without_arguments_takes_torch_muons_defaults() -> None:
    """``muon()`` builds with ``torch.optim.Muon``'s defaults (read back from the built
    hyperparameters: the signature alone would not show what the body passes on)."""
    theirs = inspect.signature(torch.optim.Muon.__init__).parameters
    hp = optim.muon().hparams
    shared = [k for k, p in theirs.items() if hasattr(hp, k) and p.default is not None]
    assert "lr" in shared and "momentum" in shared
    for k in shared:
        assert getattr(hp, k) == theirs[k].default, k
    assert hp == optim.MuonHParams()


def test_hyperparameter_errors_name_the_field_and_the_bound() -> None:
    """Refusals name the field; ns_steps is in [1, 100): 99 builds, 100 is refused."""
    with pytest.raises(TypeError, match=r"^momentum must be a real number, got 'x'$"):
        optim.muon(momentum="x")  # type: ignore[arg-type]
    assert optim.muon(ns_steps=99).hparams.ns_steps == 99
    with pytest.raises(ValueError, match=r"^ns_steps must be in \[1, 100\), got 100$"):
        optim.muon(ns_steps=100)


def test_lr_errors_name_muon() -> None:
    """lr errors raised by the shared kernel machinery name the optimizer: an opaque lr
    schedule that goes negative by init (it reads a value that changed after muon was built)
    or at a later update."""
    config = {"lr": 0.01}
    opt = optim.muon(lr=lambda n: config["lr"])
    config["lr"] = -1.0
    params = TensorDict({"w": torch.ones(3, 2)}, [])
    with pytest.raises(ScheduleError, match=r"^muon: the learning rate at update 0 is -1\.0;"):
        opt.init(params)
    opt = optim.muon(lr=lambda n: 0.1 - 0.05 * n)
    params, state = run_ours(opt, [torch.ones(3, 2)], [[torch.ones(3, 2)]] * 2, donate=True)
    params, state = opt.step(as_tree([torch.ones(3, 2)]), state, params)  # lr 0 at update 2
    with pytest.raises(ScheduleError, match=r"^muon: the learning rate at update 3 is -0\.05"):
        opt.step(as_tree([torch.ones(3, 2)]), state, params)


def test_with_no_param_selected_muon_is_adamw_with_the_adam_hyperparameters() -> None:
    """use_muon selecting nothing leaves only the AdamW fallback: every param and moment,
    matrices included, is bitwise adamw's (no param is orthogonalised)."""
    init, grads = make_data([(4, 3), (5,), (2, 3, 2)], 4, torch.float32, steps=3)
    ours = optim.muon(lr=0.01, adam_betas=(0.8, 0.9), use_muon=lambda path, p: False)
    ref = optim.adamw(lr=0.01, betas=(0.8, 0.9), eps=1e-10, weight_decay=0.0)
    p1, s1 = run_ours(ours, init, grads, donate=False)
    p2, s2 = run_ours(ref, init, grads, donate=False)
    for a, b in zip(tree.leaves(p1), tree.leaves(p2), strict=True):
        assert torch.equal(a, b)
    for key in ("mu", "nu", "steps"):
        for a, b in zip(tree.leaves(s1[key]), tree.leaves(s2[key]), strict=True):
            assert torch.equal(a, b), key


def test_a_donated_update_keeps_the_moments_in_their_own_buffers() -> None:
    """update(..., donate=True) advances ``mu``, ``nu`` and ``steps`` in the state's own
    buffers, to the values of the pure update (which writes none of them)."""
    init, grads = make_data([(4, 3), (3,)], 2, torch.float32, steps=1)
    opt = optim.muon(lr=0.05)
    params = as_tree(init)
    pure_upd, pure_state = opt.update(as_tree(grads[0]), opt.init(params), params)
    state = opt.init(params)
    before = {k: [t.data_ptr() for t in tree.leaves(state[k]) if t.numel()] for k in ("mu", "nu")}
    upd, new_state = opt.update(as_tree(grads[0]), state, params, donate=True)
    for k, ptrs in before.items():
        assert [t.data_ptr() for t in tree.leaves(new_state[k]) if t.numel()] == ptrs, k
    assert_trees_equal(upd, pure_upd)
    assert_trees_equal(new_state, pure_state)
