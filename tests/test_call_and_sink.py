"""The fast paths behind call() and accumulate() behave like the plain ones they replace."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

import purestep as ps
from purestep.step import _grad


class Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 2)
        self.unused = nn.Linear(2, 2)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))  # type: ignore[no-any-return]


def _setup() -> tuple[Net, Net, TensorDict, TensorDict]:
    s, t = Net(0), Net(1)
    params = TensorDict({"s": ps.params_of("s", s), "t": ps.params_of("t", t)}, [])
    g = torch.Generator().manual_seed(2)
    batch = TensorDict(
        {"x": torch.randn(7, 3, generator=g), "y": torch.randn(7, 2, generator=g)}, [7]
    )
    return s, t, params, batch


def test_call_with_frozen_params_builds_no_graph() -> None:
    """Params that do not require grad (a frozen teacher) are used as they are: no autograd graph."""
    net = Net(0)
    out = ps.call(net, ps.params_of("t", net), torch.ones(2, 3))
    assert not out.requires_grad


def test_call_restores_the_modules_own_parameters_even_on_error() -> None:
    """After call() (also one that raises) the module holds exactly its own Parameter objects."""
    net = Net(0)
    own = [id(p) for p in net.parameters()]
    params = ps.params_of("s", net).apply(lambda t: t.requires_grad_())
    ps.call(net, params, torch.ones(2, 3))
    with pytest.raises(RuntimeError):
        ps.call(net, params, torch.ones(2, 5))  # wrong input width
    assert [id(p) for p in net.parameters()] == own
    assert all(isinstance(p, nn.Parameter) for p in net.parameters())


def test_call_output_and_grads_equal_to_module_call() -> None:
    """call() gives the same output and grads as TensorDict.to_module."""
    net = Net(0)
    p1 = ps.params_of("s", net).apply(lambda t: t.requires_grad_())
    p2 = ps.params_of("s", net).apply(lambda t: t.requires_grad_())
    x = torch.ones(2, 3)
    y1 = ps.call(net, p1, x)
    with p2.to_module(net):
        y2 = net(x)
    assert torch.equal(y1, y2)
    g1 = torch.autograd.grad(y1.sum(), list(p1.values(True, True)), allow_unused=True)
    g2 = torch.autograd.grad(y2.sum(), list(p2.values(True, True)), allow_unused=True)
    for a, b in zip(g1, g2, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def _run(
    loss_kind: str, k: int, roles: list[str] | None, sink: bool, mp: pytest.MonkeyPatch
) -> Any:
    s, t, params, batch = _setup()

    def loss_fn(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        ls = ((ps.call(s, p["s"], b["x"]) - b["y"]) ** 2).mean()
        lt = ((ps.call(t, p["t"], b["x"]) + b["y"]) ** 2).mean()
        if loss_kind == "single":
            return ls + lt, {"m": ls.detach()}
        return {"s": ls, "t": lt}, {}

    if not sink:
        mp.setattr(_grad, "take_sink", lambda: None)
    return ps.accumulate(ps.value_and_grad(loss_fn), k)(params, batch, torch.tensor(0), roles=roles)


@pytest.mark.parametrize("loss_kind", ["single", "per_role"])
@pytest.mark.parametrize("k", [2, 3, 7])
@pytest.mark.parametrize("roles", [None, ["s"]])
def test_accumulating_in_grad_attributes_equals_summing_grad_lists(
    loss_kind: str, k: int, roles: list[str] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grad sink (autograd accumulates into reused leaves' .grad) == collecting then adding.

    The sink scales each microbatch's loss by its weight, the grad-list path the
    grads, so they agree to float rounding (batch of 7: the weights are not powers of two).
    """
    g1, m1 = _run(loss_kind, k, roles, True, monkeypatch)
    with monkeypatch.context() as mp:
        g0, m0 = _run(loss_kind, k, roles, False, mp)
    assert sorted(g0.keys(True, True)) == sorted(g1.keys(True, True))
    for key in g0.keys(True, True):
        torch.testing.assert_close(g1[key], g0[key], rtol=1e-6, atol=1e-7, msg=str(key))
    for key in m0.keys(True, True):
        assert torch.equal(m0[key], m1[key]), key
    assert ("s", "unused", "weight") not in g1.keys(True, True)  # no gradient reaches it


@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_accumulate_is_bitwise_equal_to_the_imperative_accumulation_loop(k: int) -> None:
    """accumulate(value_and_grad(loss), k) == ``(loss_i * n_i / B).backward()`` into ``.grad``."""
    s, _t, params, batch = _setup()

    def loss_fn(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        return ((ps.call(s, p["s"], b["x"]) - b["y"]) ** 2).mean(), {}

    grads, _ = ps.accumulate(ps.value_and_grad(loss_fn), k)(
        params, batch, torch.tensor(0), roles=["s"]
    )
    b = batch.batch_size[0]
    start = 0
    for n in ps.step.microbatch_sizes(b, k):
        x, y = batch["x"][start : start + n], batch["y"][start : start + n]
        start += n
        loss = ((s(x) - y) ** 2).mean()
        (loss * (n / b) if k > 1 else loss).backward()
    for name, p in s.named_parameters():
        got = grads["s"].get(tuple(name.split(".")), None)
        if p.grad is None:  # no gradient reached it: none in purestep either
            assert got is None, name
            continue
        assert torch.equal(got, p.grad), f"{name}: max diff {(got - p.grad).abs().max()}"


def test_a_leaf_reached_on_some_microbatches_only_accumulates_exactly_those() -> None:
    """Grads of a layer used on odd microbatches only equal the imperative loop's, bitwise."""
    s, _t, params, batch = _setup()

    def loss_fn(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        odd = ps.step.current_microbatch().index % 2 == 1
        h = ps.call(s, p["s"], b["x"])
        if odd:
            h = h + ps.call(s.unused, p["s", "unused"], h)
        return ((h - b["y"]) ** 2).mean(), {}

    k = 4
    grads, _ = ps.accumulate(ps.value_and_grad(loss_fn), k)(
        params, batch, torch.tensor(0), roles=["s"]
    )
    b = batch.batch_size[0]
    start = 0
    for i, n in enumerate(ps.step.microbatch_sizes(b, k)):
        x, y = batch["x"][start : start + n], batch["y"][start : start + n]
        start += n
        h = s(x)
        if i % 2 == 1:
            h = h + s.unused(h)
        (((h - y) ** 2).mean() * (n / b)).backward()
    for name, p in s.named_parameters():
        assert p.grad is not None
        got = grads["s"].get(tuple(name.split(".")))
        assert torch.equal(got, p.grad), name


def test_call_with_some_params_keeps_the_modules_parameter_order() -> None:
    """Swapping only some parameters in and out leaves named_parameters() in its order."""
    lin = nn.Linear(2, 3)
    before = [n for n, _ in lin.named_parameters()]
    w = torch.zeros(3, 2)
    ps.call(lin, TensorDict({"weight": w}, []), torch.ones(1, 2))
    assert [n for n, _ in lin.named_parameters()] == before == ["weight", "bias"]
    assert lin.weight is not w and isinstance(lin.weight, nn.Parameter)


def test_accumulate_through_a_wrapper_that_rebuilds_params_each_call_sums_every_microbatch() -> (
    None
):
    """A grad_fn wrapper giving new params objects per microbatch still accumulates them all, bitwise."""
    s, _t, params, batch = _setup()

    def loss_fn(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        return ((ps.call(s, p["s"], b["x"]) - b["y"]) ** 2).mean(), {}

    inner = ps.value_and_grad(loss_fn)

    def rebuilding(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor, **kw: Any) -> Any:
        fresh = TensorDict({r: p[r].apply(lambda x: x) for r in p.keys()}, [])
        assert fresh["s"] is not p["s"]
        return inner(fresh, b, key, **kw)

    for k in (2, 3, 7):
        want, _ = ps.accumulate(inner, k)(params, batch, torch.tensor(0), roles=["s"])
        got, _ = ps.accumulate(rebuilding, k)(params, batch, torch.tensor(0), roles=["s"])
        for key in want.keys(True, True):
            assert torch.equal(got[key], want[key]), (k, key)


class Counting(nn.Module):
    """Counts its forwards in a buffer it reassigns (``self.calls = self.calls + 1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        return self.lin(x) * self.calls  # type: ignore[no-any-return]


def test_a_buffer_reassigned_inside_a_call_scope_is_written_into_the_tree_at_close() -> None:
    """In a call_scope the module holds the reassigned buffer until the scope closes; then it
    is written into the tree and the module gets its own buffer back."""
    net, x = Counting(), torch.ones(1, 2)
    td = TensorDict({"calls": torch.tensor(5.0)}, [])
    with ps.call_scope():
        out = ps.call(net, td, x)
        assert float(net.calls) == 6.0 and float(td["calls"]) == 5.0  # held, not yet written
    assert torch.equal(out, net.lin(x) * 6)
    assert float(td["calls"]) == 6.0
    assert float(net.calls) == 0.0 and net._buffers["calls"] is net.calls


def test_a_module_first_called_after_another_in_a_call_scope_gets_its_buffer_written() -> None:
    """The slots of a module first called after another one in the scope are held too, and the
    buffer it reassigned is written into its own tree when the scope closes."""
    other, net, x = nn.Linear(2, 2), Counting(), torch.ones(1, 2)
    td = TensorDict({"calls": torch.tensor(5.0)}, [])
    with ps.call_scope():
        ps.call(other, ps.params_of("o", other), x)
        out = ps.call(net, td, x)
    assert torch.equal(out, net.lin(x) * 6)
    assert float(td["calls"]) == 6.0 and float(net.calls) == 0.0


def test_a_second_tree_in_one_call_scope_gets_its_reassigned_buffer_when_its_call_returns() -> None:
    """A second call of the module in the scope with another tree's tensors runs with those,
    writes the buffer it reassigned into that tree on return, and gives the slot back to the
    first call's tensors; the first tree gets its buffer when the scope closes."""
    net, x = Counting(), torch.ones(1, 2)
    first = TensorDict({"calls": torch.tensor(5.0)}, [])
    second = TensorDict({"calls": torch.tensor(10.0)}, [])
    with ps.call_scope():
        a = ps.call(net, first, x)
        b = ps.call(net, second, x)
        assert float(second["calls"]) == 11.0  # written on return
        assert float(net.calls) == 6.0 and float(first["calls"]) == 5.0  # the first call's
    assert torch.equal(a, net.lin(x) * 6) and torch.equal(b, net.lin(x) * 11)
    assert (float(first["calls"]), float(second["calls"])) == (6.0, 11.0)
    assert float(net.calls) == 0.0


def test_a_module_called_twice_with_one_tree_in_a_call_scope_sees_its_reassigned_buffer() -> None:
    """Calling a module twice with the same tree inside a call_scope (as a loss inside
    value_and_grad may) behaves as plain PyTorch: the second call sees the buffer the first
    reassigned, the tree ends with the last value, and no conflict is recorded."""
    net, x = Counting(), torch.ones(1, 2)
    td = TensorDict({"calls": torch.tensor(5.0)}, [])
    with ps.call_scope() as scope:
        a = ps.call(net, td, x)
        b = ps.call(net, td, x)
        assert not scope.conflicts
    assert torch.equal(a, net.lin(x) * 6) and torch.equal(b, net.lin(x) * 7)
    assert float(td["calls"]) == 7.0 and float(net.calls) == 0.0
    plain = Counting()
    plain.load_state_dict(net.state_dict())
    plain.calls = torch.tensor(5.0)
    assert torch.equal(plain(x), a) and torch.equal(plain(x), b) and float(plain.calls) == 7.0


@pytest.mark.parametrize("donate", [False, True])
def test_a_train_step_whose_loss_calls_a_buffer_reassigning_module_twice_equals_torch(
    donate: bool,
) -> None:
    """A train step whose loss calls a module that reassigns a buffer twice (inside
    value_and_grad's call_scope) gives the loss, updated params and final buffer of the same
    step run imperatively on the module (before the fix the second call saw the stale buffer
    and the state kept the first call's value)."""
    net, x = Counting(), torch.ones(3, 2)
    opts = {"m": ps.optim.sgd(0.1)}

    def loss_fn(p: Any, batch: Any, key: Any) -> Any:
        return (ps.call(net, p["m"], batch["x"]) + ps.call(net, p["m"], batch["x"])).sum(), {}

    state = ps.init_state({"m": net}, opts, seed=0)
    out, metrics = ps.train_step(ps.value_and_grad(loss_fn), opts, donate=donate)(state, {"x": x})
    plain = Counting()
    plain.load_state_dict(net.state_dict())
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1)
    loss = (plain(x) + plain(x)).sum()
    loss.backward()
    sgd.step()
    assert torch.equal(metrics["loss"], loss.detach())
    assert torch.equal(out["params", "m", "lin", "weight"], plain.lin.weight.detach())
    assert torch.equal(out["params", "m", "lin", "bias"], plain.lin.bias.detach())
    assert float(out["buffers", "m", "calls"]) == 2.0 == float(plain.calls)


class Scaled(nn.Module):
    """A linear layer and dropout whose forward takes a keyword argument."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return self.drop(self.lin(x)) * scale  # type: ignore[no-any-return]


@pytest.mark.parametrize("own", [False, True], ids=["tree", "own_parameters"])
def test_call_passes_positional_and_keyword_arguments_with_and_without_a_key(own: bool) -> None:
    """call forwards *args and **kwargs to the module, keyed or not, for a tree of tensors and
    for the module's own nn.Parameters (a bound role, run as it is); a key makes dropout a
    function of the key."""
    net, x = Scaled(), torch.ones(8, 4)
    params = TensorDict(dict(net.named_parameters()), []) if own else ps.params_of("m", net)
    net.eval()
    assert torch.equal(ps.call(net, params, x, scale=3.0), net.lin(x) * 3.0)
    net.train()
    a = ps.call(net, params, x, key=ps.rng.key(1), scale=3.0)
    b = ps.call(net, params, x, key=ps.rng.key(1), scale=3.0)
    c = ps.call(net, params, x, key=ps.rng.key(2), scale=3.0)
    assert torch.equal(a, b) and not torch.equal(a, c)
    kept = a != 0
    assert bool(kept.any()) and not bool(kept.all())
    assert torch.equal(a[kept], (net.lin(x) * 6.0)[kept])  # dropout(0.5) keeps x2, times scale


def test_recording_modules_snapshots_each_module_once_before_its_first_call() -> None:
    """Every module call runs inside the block is recorded under its own id, with its tensors
    as they were at its first call (later changes do not replace the snapshot)."""
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    x = torch.ones(1, 2)
    with ps.step.recording_modules() as seen:
        ps.call(a, ps.params_of("a", a), x)
        before = a.weight.detach().clone()
        with torch.no_grad():
            a.weight.add_(1.0)
        ps.call(a, ps.params_of("a", a), x)
        ps.call(b, ps.params_of("b", b), x)
    assert sorted(seen) == sorted([id(a), id(b)])
    assert seen[id(a)][0] is a and seen[id(b)][0] is b
    assert torch.equal(seen[id(a)][1][("weight",)], before)
    assert torch.equal(seen[id(b)][1][("bias",)], b.bias.detach())
