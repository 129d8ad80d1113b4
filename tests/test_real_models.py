"""Module patterns of real models train exactly as the imperative loop trains them.

Each test compares purestep's ``train_step`` (pure and donated) with ``zero_grad /
forward / backward / torch.optim.AdamW(fused=True).step()`` on the same module,
init and batches, bitwise (fp32, CPU), or checks the clear error promised where
a pattern cannot be supported. Real-library models (transformers, diffusers,
timm, peft) are in tests/integration.
"""

from __future__ import annotations

import copy
import os
import threading
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torch.utils.checkpoint import checkpoint

import purestep as ps
from _imperative import assert_same_as_imperative, mse, randn, regression_batches
from purestep import testing

BATCHES = regression_batches(4, 4, 6, 6)


# 1. tied and shared parameters ---------------------------------------------------------


class TiedLM(nn.Module):
    """An embedding and an output head sharing one weight (GPT-2's ``tie_word_embeddings``)."""

    def __init__(self, vocab: int = 11, d: int = 6) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.mix(self.wte(ids))))  # type: ignore[no-any-return]


def _lm_batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [{"ids": torch.randint(0, 11, (4, 5), generator=g)} for _ in range(4)]


def _lm_loss(fwd: Any, b: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = fwd(b["ids"][:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, 11), b["ids"][:, 1:].reshape(-1))


def test_tied_parameter_is_one_state_leaf_under_its_first_name() -> None:
    """A tied weight appears once in the state, under named_parameters()'s (first) name."""
    state = ps.init_state({"m": TiedLM()}, {}, seed=0)
    assert sorted(".".join(p) for p in state["params", "m"].keys(True, True)) == [
        "mix.bias",
        "mix.weight",
        "wte.weight",
    ]


def test_tied_weights_train_as_the_imperative_loop() -> None:
    """Every aliased slot gets the state's tensor; gradients of both uses sum into one leaf."""
    torch.manual_seed(0)
    assert_same_as_imperative(TiedLM, _lm_batches(), _lm_loss)
    assert_same_as_imperative(TiedLM, _lm_batches(), _lm_loss, k=2)


def test_call_fills_every_aliased_slot_and_restores_the_tie() -> None:
    """Inside call both slots hold the given tensor; afterwards both hold the module's own again."""
    net = TiedLM()
    w = torch.zeros_like(net.wte.weight)
    seen: list[bool] = []
    handle = net.lm_head.register_forward_pre_hook(
        lambda m, a: seen.append(m.weight is w and net.wte.weight is w)
    )
    ps.call(net, TensorDict({"wte": {"weight": w}}, []), torch.zeros(1, 2, dtype=torch.long))
    handle.remove()
    assert seen == [True]
    assert net.lm_head.weight is net.wte.weight and isinstance(net.wte.weight, nn.Parameter)


def _generic_params(kind: str, td: TensorDict) -> Any:
    """``td`` as a ``TensorDictParams`` (not a plain TensorDict) or as it is (``kind`` names which)."""
    from tensordict import TensorDictParams

    return TensorDictParams(td, no_convert=True) if kind == "params" else td


@pytest.mark.parametrize("given", ["wte", "lm_head"])
@pytest.mark.parametrize("kind", ["params", "hooked"])
def test_the_generic_path_fills_every_tied_slot_like_the_modules_own_forward(
    kind: str, given: str
) -> None:
    """Params that take the generic path (a ``TensorDictParams``, or any tree while a module
    parameter-registration hook is set) fill both tied slots, under either key of the tie:
    output and gradients equal the module's own forward with that weight and the plain path."""
    torch.manual_seed(5)
    net = TiedLM()
    ref = copy.deepcopy(net)
    w = torch.randn(11, 6)
    with torch.no_grad():
        ref.wte.weight.copy_(w)
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    ref(ids).pow(2).sum().backward()

    def run(generic: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        leaves = [w.clone().requires_grad_(), net.mix.weight.detach().clone().requires_grad_()]
        td = TensorDict({given: {"weight": leaves[0]}, "mix": {"weight": leaves[1]}}, [])
        seen: list[bool] = []
        pre = net.lm_head.register_forward_pre_hook(
            lambda m, a: seen.append(m.weight is leaves[0] and net.wte.weight is leaves[0])
        )
        hook = (
            nn.modules.module.register_module_parameter_registration_hook(lambda m, n, p: None)
            if generic and kind == "hooked"
            else None
        )
        try:
            out = ps.call(net, _generic_params(kind, td) if generic else td, ids)
        finally:
            if hook is not None:
                hook.remove()
            pre.remove()
        assert seen == [True], "a tied slot did not hold the given tensor"
        out.pow(2).sum().backward()
        return out.detach(), [t.grad for t in leaves]

    out, grads = run(generic=True)
    assert torch.equal(out, ref(ids).detach())
    assert torch.equal(grads[0], ref.wte.weight.grad)  # both uses of the tie summed
    assert torch.equal(grads[1], ref.mix.weight.grad)
    plain_out, plain_grads = run(generic=False)
    assert torch.equal(out, plain_out) and all(map(torch.equal, grads, plain_grads))
    assert net.lm_head.weight is net.wte.weight and isinstance(net.wte.weight, nn.Parameter)
    assert not torch.equal(net.wte.weight, w)  # the module's own weight is back


def test_giving_a_tied_tensor_twice_is_an_error_naming_both_paths() -> None:
    """Two keys for one tied parameter is ambiguous: the error names both and the canonical key."""
    net = TiedLM()
    td = TensorDict(
        {"wte": {"weight": torch.zeros(11, 6)}, "lm_head": {"weight": torch.ones(11, 6)}}, []
    )
    with pytest.raises(
        ValueError, match=r"'wte\.weight' and 'lm_head\.weight'.*canonical key is 'wte\.weight'"
    ):
        ps.call(net, td, torch.zeros(1, 2, dtype=torch.long))


def test_a_key_that_is_no_parameter_is_a_key_error() -> None:
    """call is strict about keys: a typo is named, not silently ignored."""
    with pytest.raises(KeyError, match=r"has no parameter or buffer 'mix\.wieght'"):
        ps.call(
            TiedLM(),
            TensorDict({"mix": {"wieght": torch.zeros(6, 6)}}, []),
            torch.zeros(1, 2, dtype=torch.long),
        )


class Albert(nn.Module):
    """One block applied three times (ALBERT-style parameter sharing across layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(6, 6)
        self.layers = nn.ModuleList([self.block] * 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_a_submodule_reused_several_times_trains_as_the_imperative_loop() -> None:
    """A shared submodule is one set of leaves; its gradients sum over the three uses."""
    torch.manual_seed(1)
    assert_same_as_imperative(Albert, BATCHES, mse)
    assert [".".join(p) for p in ps.params_of("m", Albert()).keys(True, True)] == [
        "block.weight",
        "block.bias",
    ]


def test_retying_a_module_after_the_first_call_is_seen() -> None:
    """A module re-tied after a call gets a fresh layout: the new alias is filled too."""
    net = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False))
    params = TensorDict({"0": {"weight": torch.eye(3)}}, [])
    x = torch.ones(1, 3)
    ps.call(net, params, x)
    net[1].weight = net[0].weight  # tie now
    out = ps.call(net, params, x)
    assert torch.equal(out, x)  # identity twice: both slots hold the given eye(3)


# 2. activation checkpointing -----------------------------------------------------------


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 6)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=self.reentrant)
        return self.c(h)  # type: ignore[no-any-return]


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("k", [1, 2])
def test_activation_checkpointing_recomputes_with_the_swapped_params(
    reentrant: bool, k: int
) -> None:
    """The swap stays in place until the gradients are computed (both checkpoint kinds)."""
    torch.manual_seed(2)
    assert_same_as_imperative(lambda: Checkpointed(reentrant), BATCHES, mse, k=k)


def test_reentrant_checkpointing_leaves_other_tensors_grads_alone() -> None:
    """The backward without inputs= (reentrant checkpoints) puts foreign .grad back as it was."""
    net = Checkpointed(reentrant=True)
    teacher = nn.Linear(6, 6)  # frozen by omission: requires_grad=True, called directly
    before = teacher.weight.grad

    def loss_fn(params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor) -> Any:
        return ((ps.call(net, params["m"], batch["x"]) - teacher(batch["x"])) ** 2).mean(), {}

    grads, _ = ps.value_and_grad(loss_fn)(
        TensorDict({"m": ps.params_of("m", net)}, []), TensorDict(BATCHES[0], [4]), ps.rng.key(0)
    )
    assert teacher.weight.grad is before is None
    assert len(list(grads["m"].keys(True, True))) == 6


class _Role(nn.Module):
    """``c(checkpoint(tanh(b(tanh(a(x))))))``: with a reentrant, a non-reentrant or no checkpoint."""

    def __init__(self, d: int, mode: str) -> None:
        super().__init__()
        self.a = nn.Linear(3, d)
        self.b = nn.Linear(d, d)
        self.c = nn.Linear(d, 2)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.mode == "none":
            h = torch.tanh(self.b(h))
        else:
            reentrant = self.mode == "reentrant"
            h = checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=reentrant)
        return self.c(h)  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["none", "plain", "reentrant"])
@pytest.mark.parametrize("per_role", [False, True])
@settings(max_examples=4, deadline=None)
@example(live=("a", "b"), d=2, b=3, foreign_grad=True, seed=0)
@given(
    live=st.sampled_from([("a", "b"), ("a",), ("b",)]),
    d=st.integers(1, 4),
    b=st.integers(1, 5),
    foreign_grad=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_value_and_grad_equals_torch_autograd_for_every_role_and_checkpoint_kind(
    mode: str,
    per_role: bool,
    live: tuple[str, ...],
    d: int,
    b: int,
    foreign_grad: bool,
    seed: int,
) -> None:
    """Two roles whose losses reach each other's params, through a reentrant, a non-reentrant
    or no checkpoint: each live role's grads are exactly torch.autograd.grad of its loss (the
    shared scalar, or its own entry of {role: loss}) over its params, twice in a row (the
    second call reuses what the first learned); no other role gets grads; a tensor outside
    the params keeps its .grad as it was (the very tensor, unless a reentrant checkpoint makes
    the backward run without inputs=); the metrics hold every detached loss."""
    torch.manual_seed(seed)
    nets = {"a": _Role(d, mode), "b": _Role(d, mode)}
    refs = copy.deepcopy(nets)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 3, generator=g)
    teacher = torch.randn(b, 2, generator=g).requires_grad_(True)
    before = torch.randn(b, 2, generator=g) if foreign_grad else None
    teacher.grad = None if before is None else before.clone()
    held = teacher.grad

    def losses(ya: torch.Tensor, yb: torch.Tensor, t: torch.Tensor) -> dict[str, torch.Tensor]:
        both = ya * yb  # one node on both roles' paths: backward runs it for each role
        return {"a": both.mean() + (ya * t).sum(), "b": (both * both).mean() - yb.sum()}

    def loss_fn(p: TensorDictBase, bt: TensorDictBase, key: torch.Tensor) -> Any:
        ya, yb = ps.call(nets["a"], p["a"], bt["x"]), ps.call(nets["b"], p["b"], bt["x"])
        out = losses(ya, yb, teacher)
        return (out if per_role else out["a"] * out["b"]), {"n": ya.shape[0]}

    params = TensorDict({r: ps.params_of(r, n) for r, n in nets.items()}, [])
    grad_fn = ps.value_and_grad(loss_fn)
    batch = TensorDict({"x": x}, [b])
    runs = [grad_fn(params, batch, ps.rng.key(0), roles=list(live)) for _ in range(2)]

    want: dict[str, dict[str, torch.Tensor]] = {}
    for role in live:  # the reference: backward() on fresh copies of the modules
        ref = copy.deepcopy(refs)
        out = losses(ref["a"](x), ref["b"](x), teacher.detach().requires_grad_(True))
        (out[role] if per_role else out["a"] * out["b"]).backward()
        want[role] = {n: p.grad for n, p in ref[role].named_parameters() if p.grad is not None}
    ref_loss = losses(refs["a"](x), refs["b"](x), teacher.detach())
    for grads, metrics in runs:
        assert sorted(grads.keys()) == sorted(live)
        for role in live:
            got = {".".join(k): v for k, v in grads[role].items(True, True)}
            assert sorted(got) == sorted(want[role])
            for name, w in want[role].items():
                torch.testing.assert_close(got[name], w, rtol=1e-6, atol=1e-7)
        if per_role:
            assert sorted(metrics.keys()) == ["a", "b", "n"]  # every loss given, live or not
            for role in ("a", "b"):
                torch.testing.assert_close(metrics[role, "loss"], ref_loss[role].detach())
        else:
            torch.testing.assert_close(metrics["loss"], (ref_loss["a"] * ref_loss["b"]).detach())
        assert int(metrics["n"]) == b
    if before is None:
        assert teacher.grad is None
    else:
        assert teacher.grad is not None and torch.equal(teacher.grad, before)
        # only a reentrant checkpoint needs the backward without inputs= (that puts it back)
        reached = not per_role or "a" in live  # the teacher is in a's loss only
        assert (teacher.grad is held) is (mode != "reentrant" or not reached)
    for net in nets.values():
        assert all(p.grad is None for p in net.parameters())


def test_the_graph_walk_for_reentrant_checkpoints_visits_each_node_once() -> None:
    """The walk that looks for reentrant checkpoints and foreign leaves yields every autograd
    node once, however many paths lead to it (a chain of squares has 2**depth paths)."""
    from purestep.step import _grad

    p = torch.ones(2, requires_grad=True)
    y = p
    for _ in range(6):
        y = y * y  # one MulBackward0 whose two inputs are the same node
    nodes = list(_grad._walk_graph([y.sum(), y.mean()]))
    names = sorted(type(n).__name__ for n in nodes)
    assert names == sorted(
        ["SumBackward0", "MeanBackward0", "AccumulateGrad"] + ["MulBackward0"] * 6
    )
    assert len({id(n) for n in nodes}) == len(nodes)
    (leaf,) = _grad._foreign_leaves([y.sum(), y.mean()], set())
    assert leaf is p
    assert _grad._foreign_leaves([y.sum()], {id(p)}) == []


def test_recomputing_a_module_called_with_two_param_sets_raises() -> None:
    """A checkpointed module called twice with different tensors cannot recompute both: error."""
    net = Checkpointed(reentrant=False)

    def loss_fn(params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor) -> Any:
        a = ps.call(net, params["m"], batch["x"])
        b = ps.call(net, params["m"].apply(lambda t: t * 2), batch["x"])
        return (a * b).mean(), {}

    with pytest.raises(RuntimeError, match="recomputed during backward"):
        ps.value_and_grad(loss_fn)(
            TensorDict({"m": ps.params_of("m", net)}, []),
            TensorDict(BATCHES[0], [4]),
            ps.rng.key(0),
        )


# 3. gradient layouts -------------------------------------------------------------------


class ChannelsLast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.conv2 = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(memory_format=torch.channels_last)
        return self.conv2(torch.tanh(self.conv(x)))  # type: ignore[no-any-return]


def test_channels_last_convolutions_train_as_the_imperative_loop() -> None:
    """Conv grads on channels_last inputs come back channels_last; the optimizer gets the
    parameter's layout (the fused kernel pairs elements by memory offset)."""
    torch.manual_seed(3)
    batches = [
        {"x": randn(2, 3, 8, 8, seed=i), "y": randn(2, 2, 6, 6, seed=10 + i)} for i in range(3)
    ]
    assert_same_as_imperative(ChannelsLast, batches, mse)


def test_a_loss_that_reduces_a_parameter_directly_trains_as_the_imperative_loop() -> None:
    """``loss + 0 * p.sum()`` and ``p.sum()`` give stride-0 gradients; they reach the kernel
    with the parameter's strides."""
    torch.manual_seed(4)

    class Direct(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6)
            self.scale = nn.Parameter(torch.ones(300, 300))  # large: a wrong pairing shows

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + 0.001 * self.scale.sum() + 0 * self.lin.weight.sum()

    assert_same_as_imperative(Direct, BATCHES, mse)


# 4. params without a gradient ----------------------------------------------------------


class LayerDrop(nn.Module):
    """Blocks that some steps skip (the batch says which): their params get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if not bool(skip[0, i]):
                x = x + torch.tanh(block(x))
        return x


def _layerdrop_batches() -> list[dict[str, torch.Tensor]]:
    out = []
    for i, b in enumerate(regression_batches(6, 4, 6, 6, seed=7)):
        skip = torch.zeros(4, 3, dtype=torch.bool)
        skip[:, i % 3] = True
        if i == 0:
            skip[:, 2] = True  # block 2 first trains at step 1: its own step count starts late
        out.append({**b, "skip": skip})
    return out


def _layerdrop_loss(fwd: Any, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((fwd(b["x"], b["skip"]) - b["y"]) ** 2).mean()


def test_params_without_gradient_are_skipped_as_torch_optim_skips_them() -> None:
    """No decay, no moment or step-count change for a param with no gradient (AdamW)."""
    torch.manual_seed(5)
    assert_same_as_imperative(LayerDrop, _layerdrop_batches(), _layerdrop_loss)


def test_sgd_starts_a_late_params_momentum_buffer_like_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGD with dampening: a param's first update sets its buffer to ``d`` (torch's
    ``momentum_buffer is None``), whenever that is. torch's fused SGD cannot run this
    (it fails on a late param), so the foreach paths are compared, bitwise."""
    from purestep.optim import _sgd

    monkeypatch.setattr(_sgd, "fused_supported", lambda device, dtype, **kw: False)
    torch.manual_seed(5)
    hp = {"lr": 0.1, "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.01}
    assert_same_as_imperative(
        LayerDrop,
        _layerdrop_batches(),
        _layerdrop_loss,
        transform=ps.optim.sgd(**hp),
        optimizer=lambda p: torch.optim.SGD(p, **hp, foreach=True),
    )


def test_a_param_reached_by_one_microbatch_only_accumulates_like_dot_grad() -> None:
    """With accumulate, a param that only microbatch 2 reaches gets that microbatch's gradient."""
    torch.manual_seed(6)
    batches = []
    for b in regression_batches(3, 4, 6, 6, seed=9):
        skip = torch.zeros(4, 3, dtype=torch.bool)
        skip[:2, 1] = True  # block 1 is skipped by the first microbatch only
        batches.append({**b, "skip": skip})
    assert_same_as_imperative(LayerDrop, batches, _layerdrop_loss, k=2)


def test_a_param_that_never_gets_a_gradient_keeps_its_state_exactly() -> None:
    """An unused param's value, moments and step count stay bitwise as they were."""
    net = nn.ModuleDict({"used": nn.Linear(2, 2), "unused": nn.Linear(2, 2)})
    opt = {"m": ps.optim.adamw(1e-2, weight_decay=0.1)}
    step = ps.train_step(
        ps.value_and_grad(lambda p, b, k: (ps.call(net["used"], p["m", "used"], b["x"]).sum(), {})),
        opt,
    )
    state = ps.init_state({"m": net}, opt, seed=0)
    before = testing.snapshot(state)
    for _ in range(3):
        state, _ = step(state, {"x": torch.ones(2, 2)})
    for key in ("params",), ("opt_state", "mu"), ("opt_state", "nu"), ("opt_state", "steps"):
        testing.assert_trees_equal(
            state.get(
                (*key, "m", "unused") if key == ("params",) else (key[0], "m", key[1], "unused")
            ),
            before.get(
                (*key, "m", "unused") if key == ("params",) else (key[0], "m", key[1], "unused")
            ),
        )
    assert int(state["opt_state", "m", "count"]) == 3


# 5. buffers ----------------------------------------------------------------------------


def _bn_net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 6))


@pytest.mark.parametrize("k", [1, 2])
def test_batchnorm_buffers_are_state_and_train_as_the_imperative_loop(k: int) -> None:
    """Running statistics (int64 num_batches_tracked too) live in state['buffers'] and evolve
    exactly as the module's own do in the imperative loop, also microbatch by microbatch."""
    torch.manual_seed(7)
    batches = regression_batches(4, 8, 6, 6, seed=11)
    assert_same_as_imperative(_bn_net, batches, mse, k=k)
    state = ps.init_state({"m": _bn_net()}, {}, seed=0)
    assert state["buffers", "m", "1", "num_batches_tracked"].dtype == torch.int64


def test_buffer_updates_never_reach_the_module_or_the_input_state() -> None:
    """The pure step returns new statistics; the module and the input state keep theirs."""
    net = _bn_net()
    own = {k: v.clone() for k, v in net.state_dict().items()}
    opt = {"m": ps.optim.adamw(1e-2)}
    step = ps.train_step(
        ps.value_and_grad(lambda p, b, k: (mse(lambda x: ps.call(net, p["m"], x), b), {})), opt
    )
    state = ps.init_state({"m": net}, opt, seed=0)
    testing.assert_pure(step, state, BATCHES[0])
    new, _ = step(state, regression_batches(1, 8, 6, 6)[0])
    assert not torch.equal(
        new["buffers", "m", "1", "running_mean"], state["buffers", "m", "1", "running_mean"]
    )
    assert int(new["buffers", "m", "1", "num_batches_tracked"]) == 1
    for k, v in net.state_dict().items():
        assert torch.equal(v, own[k]), k


def test_assert_pure_fails_when_a_step_changes_a_modules_own_tensors() -> None:
    """A loss that runs a BatchNorm module directly (its own buffers) is caught by assert_pure."""
    net, frozen_bn = nn.Linear(6, 6), nn.BatchNorm1d(6)
    opt = {"m": ps.optim.sgd(0.1)}

    def loss_fn(p: TensorDictBase, b: TensorDictBase, k: torch.Tensor) -> Any:
        return frozen_bn(ps.call(net, p["m"], b["x"])).pow(2).mean(), {}

    step = ps.train_step(ps.value_and_grad(loss_fn), opt)
    state = ps.init_state({"m": net}, opt, seed=0)
    with pytest.raises(AssertionError, match=r"BatchNorm1d's own tensor 'running_mean'"):
        testing.assert_pure(step, state, BATCHES[0], modules=[frozen_bn])


def test_buffers_round_trip_resume_and_ema() -> None:
    """Resume-exactness covers buffers; with_ema(buffers=True) averages float buffers and copies
    integer ones; variables() gives the tree to evaluate with."""
    net = _bn_net()
    opt = {"m": ps.optim.adamw(1e-2)}
    gf = ps.value_and_grad(lambda p, b, k: (mse(lambda x: ps.call(net, p["m"], x), b), {}))
    step = ps.with_ema(ps.train_step(gf, opt), 0.5, ["m"], buffers=True)
    state = step.prepare(ps.init_state({"m": net}, opt, seed=0))
    batches = regression_batches(4, 8, 6, 6, seed=3)
    testing.assert_resume_exact(step, state, batches, save_at=2)
    new, _ = step(state, batches[0])
    run_mean = new["buffers", "m", "1", "running_mean"]
    ema_mean = new["ema_buffers", "m", "1", "running_mean"]
    torch.testing.assert_close(
        ema_mean, 0.5 * state["buffers", "m", "1", "running_mean"] + 0.5 * run_mean
    )
    assert int(new["ema_buffers", "m", "1", "num_batches_tracked"]) == 1
    v = ps.variables(new, "m", ema=True)
    assert v["1", "running_mean"] is ema_mean and v["0", "weight"] is new["ema", "m", "0", "weight"]
    out = ps.call(net.eval(), ps.variables(new, "m"), torch.ones(2, 6))
    net.train()
    expected = copy.deepcopy(net).eval()
    expected.load_state_dict(
        {".".join(p): t for p, t in ps.variables(new, "m").items(True, True)}, strict=True
    )
    assert torch.equal(out, expected(torch.ones(2, 6)))


# 6. compiled modules -------------------------------------------------------------------


def test_compiled_modules_have_the_same_keys_and_accept_plain_states() -> None:
    """init_state/params_of unwrap torch.compile; call(compiled, state of the plain model) runs."""
    net = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    compiled = torch.compile(net, backend="eager")
    plain_keys = list(ps.params_of("m", net).keys(True, True))
    assert list(ps.params_of("m", compiled).keys(True, True)) == plain_keys
    params = ps.params_of("m", net).apply(torch.zeros_like)
    out = ps.call(compiled, params, torch.ones(2, 3))
    assert torch.equal(out, torch.zeros(2, 1))
    inner = nn.Sequential(net[0], torch.compile(nn.Sequential(net[1], net[2]), backend="eager"))
    assert [".".join(p) for p in ps.params_of("m", inner).keys(True, True)] == [
        "0.weight",
        "0.bias",
        "1.1.weight",
        "1.1.bias",
    ]


def test_compiled_module_trains_as_the_compiled_imperative_loop_without_recompiles() -> None:
    """model.compile(): bitwise equal to the compiled imperative loop, 0 graph breaks, 1 compile."""
    torch._dynamo.reset()
    torch.manual_seed(8)

    def make() -> nn.Module:
        net = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
        net.compile(backend="aot_eager")
        return net

    from torch._dynamo.utils import counters

    counters.clear()
    assert_same_as_imperative(make, BATCHES, mse, donate=(True,))
    assert counters["stats"]["unique_graphs"] <= 2  # one for each of the two runs' modules
    assert not counters["graph_break"]


class _ScaledLM(TiedLM):
    """TiedLM with a keyword-only argument, to see that call passes keyword arguments on."""

    def forward(self, ids: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return super().forward(ids) * scale


@pytest.mark.skipif(
    "MUTANT_UNDER_TEST" in os.environ,
    reason="dynamo cannot trace mutmut's trampolines (an 'Unsupported method call' on the "
    "unmutated code too), so under mutmut this test would fail for every mutant",
)
def test_call_inside_a_compiled_function_fills_the_tie_and_passes_keyword_arguments() -> None:
    """``ps.call`` traced by torch.compile (a compiled loss) runs through ``functional_call``:
    a weight given under one key of a tie fills both slots, params not given stay the
    module's own, keyword arguments reach the forward, and the module is left as it was."""
    torch._dynamo.reset()
    torch.manual_seed(9)
    net = _ScaledLM()
    ref = copy.deepcopy(net)
    w = torch.randn(11, 6)
    with torch.no_grad():
        ref.wte.weight.copy_(w)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    traced: list[bool] = []

    def loss(p: TensorDictBase, ids: torch.Tensor) -> torch.Tensor:
        traced.append(torch.compiler.is_compiling())
        return ps.call(net, p, ids, scale=2.0)  # type: ignore[no-any-return]

    from torch._dynamo.utils import counters

    counters.clear()
    out = torch.compile(loss, backend="eager")(TensorDict({"wte": {"weight": w}}, []), ids)
    assert traced == [True], "the call was not traced"
    # traced to the end: no frame fell back to eager (where call would swap instead), and the
    # graph breaks only at call's context-variable reads (the scope, the recorder)
    assert not counters["unimplemented"], list(counters["unimplemented"])
    assert all("ContextVar" in reason for reason in counters["graph_break"]), list(
        counters["graph_break"]
    )
    assert torch.equal(out, ref(ids, scale=2.0))
    assert not torch.equal(out, ref(ids))  # the keyword argument mattered
    assert net.lm_head.weight is net.wte.weight and not torch.equal(net.wte.weight, w)


def test_call_while_tracing_fills_the_tie_and_passes_keyword_arguments_eagerly_emulated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The traced path of ``ps.call`` (``torch.compiler.is_compiling()`` true: no swap, a
    ``functional_call`` over the flattened params), run eagerly with tracing emulated, so it
    is checked under mutmut too (whose trampolines dynamo cannot trace): a weight given under
    one key of a tie fills both slots, params not given stay the module's own, nested keys
    are flattened to dotted names, keyword arguments reach the forward, the gradient reaches
    the given tensor, and the module is left as it was."""
    torch.manual_seed(9)
    net = _ScaledLM()
    ref = copy.deepcopy(net)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    w = torch.randn(11, 6, requires_grad=True)
    with torch.no_grad():
        ref.wte.weight.copy_(w)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    out = ps.call(net, TensorDict({"wte": {"weight": w}}, []), ids, scale=2.0)
    monkeypatch.undo()
    torch.testing.assert_close(out, ref(ids, scale=2.0), rtol=0, atol=0)
    assert not torch.equal(out, ref(ids))  # the keyword argument mattered
    (g,) = torch.autograd.grad(out.square().sum(), [w])
    ref.zero_grad()
    ref(ids, scale=2.0).square().sum().backward()
    assert ref.wte.weight.grad is not None
    torch.testing.assert_close(g, ref.wte.weight.grad, rtol=1e-6, atol=1e-6)
    assert net.lm_head.weight is net.wte.weight
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k


# 7. module randomness (dropout) --------------------------------------------------------


class Dropping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x))  # type: ignore[no-any-return]


def _dropout_step(net: nn.Module, k: int = 1) -> Any:
    opt = {"m": ps.optim.adamw(1e-2)}

    def loss_fn(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        out = ps.call(net, p["m"], b["x"], key=ps.rng.fold_in(key, 7))
        return ((out - b["y"]) ** 2).mean(), {}

    gf = ps.value_and_grad(loss_fn)
    return ps.train_step(ps.accumulate(gf, k) if k > 1 else gf, opt), ps.init_state(
        {"m": net}, opt, seed=0
    )


def test_dropout_keyed_by_the_step_key_is_deterministic_and_resume_exact() -> None:
    """call(..., key=) seeds torch's global generator for the call and restores it afterwards."""
    step, state = _dropout_step(Dropping())
    g_before = torch.get_rng_state()
    testing.assert_deterministic(step, state, BATCHES)
    testing.assert_resume_exact(step, state, BATCHES, save_at=2)
    assert torch.equal(torch.get_rng_state(), g_before)


def test_dropout_masks_differ_between_steps_and_microbatches() -> None:
    """The key folds in the step (different masks per step) and the microbatch number."""
    net = Dropping()
    masks: list[torch.Tensor] = []
    net.drop.register_forward_hook(lambda m, a, out: masks.append(out == 0))
    step, state = _dropout_step(net, k=2)
    batch = regression_batches(1, 8, 6, 6)[0]
    state, _ = step(state, batch)
    state, _ = step(state, batch)
    assert len(masks) == 4
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[0], masks[2])


def test_a_non_key_key_argument_is_refused_with_a_hint() -> None:
    """key= is purestep's PRNG key; a module argument named key gets a clear error."""
    with pytest.raises(TypeError, match="pass it positionally"):
        ps.call(
            nn.Linear(2, 2), ps.params_of("m", nn.Linear(2, 2)), torch.ones(1, 2), key=torch.ones(3)
        )


_KEY_HINT = (
    "call: key= is the PRNG key that seeds module randomness (a 0-dim int64 CPU tensor from "
    "purestep.rng), got {}. To pass an argument named 'key' to the module's forward "
    "(nn.MultiheadAttention), pass it positionally"
)


@pytest.mark.parametrize(
    ("key", "what"),
    [
        (torch.tensor(3.0), "a torch.float32 tensor of shape () on cpu"),
        (torch.tensor([3, 4]), "a torch.int64 tensor of shape (2,) on cpu"),
        (torch.tensor(3, device="meta"), "a torch.int64 tensor of shape () on meta"),
        (3, "int"),
    ],
    ids=["float", "shape", "meta", "int"],
)
def test_a_key_of_the_wrong_dtype_shape_device_or_type_is_refused_naming_what_it_got(
    key: Any, what: str
) -> None:
    """Each way a key= can be wrong on its own is refused; the message says what was given."""
    lin = nn.Linear(2, 2)
    with pytest.raises(TypeError) as info:
        ps.call(lin, ps.params_of("m", lin), torch.ones(1, 2), key=key)
    assert str(info.value) == _KEY_HINT.format(what)
    out = ps.call(lin, ps.params_of("m", lin), torch.ones(1, 2), key=ps.rng.key(3))
    assert torch.equal(out, lin(torch.ones(1, 2)))  # a real key is accepted


def test_a_keyed_cpu_call_leaves_a_gpu_whose_cuda_is_not_initialised_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With one GPU present but CUDA not initialised (a CPU job on a GPU machine), call(key=)
    forks only the CPU generator: it never initialises CUDA (no CUDA context is created)."""

    def lazy_init() -> None:
        raise AssertionError("call(key=) initialised CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "_lazy_init", lazy_init)
    net = Dropping()
    x = torch.ones(4, 6)
    a = ps.call(net, ps.params_of("m", net), x, key=ps.rng.key(1))
    b = ps.call(net, ps.params_of("m", net), x, key=ps.rng.key(1))
    assert torch.equal(a, b) and bool((a == 0).any())  # keyed dropout ran, on the CPU


class _SeedProbe(nn.Module):
    """Records the seed of torch's CPU generator each forward sees."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.seeds: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seeds.append(torch.initial_seed())
        return self.lin(x)  # type: ignore[no-any-return]


def test_a_keyed_call_seeds_torchs_generator_with_a_value_fixed_by_key_and_microbatch() -> None:
    """The seed call(key=) gives torch's global generator is a fixed function of the key and
    the microbatch number (pinned: a checkpoint resumed under another release draws the same
    dropout masks), its own derivation (a dropout tag folded in: never the seed of a plain
    ``fold_in(key, microbatch)``), and the same through the plain and the generic path."""
    from tensordict import TensorDictParams

    net = _SeedProbe()
    params = ps.params_of("m", net)
    key = ps.rng.key(1)
    ps.call(net, params, torch.ones(1, 2), key=key)
    ps.call(net, TensorDictParams(params, no_convert=True), torch.ones(1, 2), key=key)
    with ps.call_scope():
        ps.call(net, params, torch.ones(1, 2), key=key)
    pinned = -7611044674484175349 % 2**64  # int(fold_in(key(1), 0x6D6F6475, 0)), as uint64
    assert net.seeds == [pinned] * 3
    assert pinned != int(ps.rng.fold_in(key, 0)) % 2**64


def test_a_parameter_registration_hook_sees_what_call_puts_in_place_and_takes_back() -> None:
    """While a global parameter-registration hook is set (a library that tracks or moves
    parameters), call registers the given tensor through it, then the module's own back."""
    lin = nn.Linear(2, 2)
    own = lin.weight
    w = torch.zeros(2, 2)
    seen: list[tuple[nn.Module, str, torch.Tensor]] = []
    hook = nn.modules.module.register_module_parameter_registration_hook(
        lambda m, n, p: seen.append((m, n, p))
    )
    try:
        out = ps.call(lin, TensorDict({"weight": w}, []), torch.ones(1, 2))
    finally:
        hook.remove()
    assert torch.equal(out, lin.bias.detach()[None])  # the given (zero) weight was used
    assert [(m, n) for m, n, _ in seen] == [(lin, "weight"), (lin, "weight")]
    assert torch.equal(seen[0][2], w) and seen[1][2] is own and lin.weight is own


def test_a_loss_calling_a_module_another_thread_is_running_is_refused_naming_it() -> None:
    """value_and_grad's loss (a call_scope) calling a module that another thread's call is
    running raises ModuleInUseError naming the module and that thread; once that call is
    done, the same loss runs."""
    net = nn.Linear(3, 1)
    params = TensorDict({"m": ps.params_of("m", net)}, [])
    started, finish = threading.Event(), threading.Event()
    holder: list[int] = []

    def pause(m: nn.Module, a: Any) -> None:
        if holder and threading.get_ident() == holder[0]:
            started.set()
            assert finish.wait(10)

    net.register_forward_pre_hook(pause)

    def other() -> None:
        holder.append(threading.get_ident())
        ps.call(net, params["m"], torch.ones(2, 3))

    def loss_fn(p: TensorDictBase, b: TensorDictBase, k: torch.Tensor) -> Any:
        return ps.call(net, p["m"], b["x"]).sum(), {}

    t = threading.Thread(target=other)
    t.start()
    try:
        assert started.wait(10)
        vg = ps.value_and_grad(loss_fn)
        with pytest.raises(ps.step.ModuleInUseError) as info:
            vg(params, {"x": torch.ones(2, 3)}, ps.rng.key(0))
    finally:
        finish.set()
        t.join()
    assert str(info.value) == (
        f"call: Linear is in use by a call in another thread (thread {holder[0]}); a module "
        "holds one set of tensors at a time, so threads that step through the same module "
        "must each use their own copy (copy.deepcopy(module)) or take turns"
    )
    grads, _ = vg(params, {"x": torch.ones(2, 3)}, ps.rng.key(0))
    assert torch.equal(grads["m", "weight"], torch.full((1, 3), 2.0))


class _Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n = self.n + 1  # reassigns its buffer (a new tensor each call)
        return x


class _CallsItsPart(nn.Module):
    """A forward that runs a submodule through ``ps.call`` with its subtree of the params."""

    def __init__(self) -> None:
        super().__init__()
        self.part = _Counter()
        self.params: TensorDictBase | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.params is not None
        return ps.call(self.part, self.params["part"], x)  # type: ignore[no-any-return]


def test_a_buffer_a_nested_call_writes_into_the_params_survives_the_outer_call() -> None:
    """A reassigned buffer that a call nested in the forward wrote into the params tree stays
    there when the outer call (same tree, same slot) puts the module's own tensors back."""
    net = _CallsItsPart()
    params = TensorDict({"part": {"n": torch.zeros(())}}, [])
    net.params = params
    ps.call(net, params, torch.ones(1))
    assert float(params["part", "n"]) == 1.0
    assert float(net.part.n) == 0.0  # the module keeps none of it


# 8. a forward that writes into its weights ---------------------------------------------


class Renorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6, max_norm=0.5)  # renormalises looked-up rows in place
        self.out = nn.Linear(6, 6)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids))  # type: ignore[no-any-return]


def _renorm_batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    return [
        {"x": torch.randint(0, 10, (4,), generator=g), "y": randn(4, 6, seed=i)} for i in range(4)
    ]


def test_a_forward_that_renormalises_its_weights_trains_as_the_imperative_loop() -> None:
    """nn.Embedding(max_norm): the pure step runs it on a copy and hands the renormalised
    weight to the optimizer, as the imperative loop's in-place write does."""
    torch.manual_seed(9)
    assert_same_as_imperative(Renorm, _renorm_batches(), mse)
    assert_same_as_imperative(Renorm, _renorm_batches(), mse, k=2)


def test_a_pure_step_never_writes_into_its_input_whatever_the_module_does() -> None:
    """assert_pure holds for a module that writes into its weights during forward."""
    net = Renorm()
    opt = {"m": ps.optim.adamw(1e-2)}
    step = ps.train_step(
        ps.value_and_grad(lambda p, b, k: (mse(lambda x: ps.call(net, p["m"], x), b), {})), opt
    )
    state = ps.init_state({"m": net}, opt, seed=0)
    with torch.no_grad():
        state["params", "m", "emb", "weight"].mul_(10)  # rows far above max_norm
    for batch in _renorm_batches():
        testing.assert_pure(step, state, batch)
        state, _ = step(state, batch)


# 9. threads ----------------------------------------------------------------------------


def test_two_threads_stepping_through_one_module_never_mix_silently() -> None:
    """Each concurrent step either equals its single-threaded result or raises ModuleInUseError."""
    net = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])
    opt = {"m": ps.optim.adamw(1e-2)}

    def loss_fn(p: TensorDictBase, b: TensorDictBase, k: torch.Tensor) -> Any:
        return mse(lambda x: ps.call(net, p["m"], x), b), {}

    step = ps.train_step(ps.value_and_grad(loss_fn), opt)
    states = [ps.init_state({"m": net}, opt, seed=s) for s in range(2)]
    for i, s in enumerate(states):
        gen = torch.Generator().manual_seed(i)
        for t in s["params", "m"].values(True, True):
            t.add_(torch.randn(t.shape, generator=gen))
    batch = regression_batches(1, 4, 16, 16)[0]
    expected = [step(s, batch)[0] for s in states]
    outcomes: list[str] = []

    def work(i: int) -> None:
        for _ in range(10):
            try:
                got, _ = step(states[i], batch)
            except ps.step.ModuleInUseError:
                outcomes.append("refused")
                continue
            testing.assert_trees_equal(got["params"], expected[i]["params"])
            outcomes.append("equal")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outcomes) == 20  # every step either equal or refused (an assertion would be lost)
