"""The fast paths behind call() and accumulate() behave like the plain ones they replace."""

from __future__ import annotations

import re
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


def test_accumulate_refuses_a_wrapper_that_changes_a_roles_params_count_between_microbatches() -> (
    None
):
    """A grad_fn wrapper giving a role one more param on later microbatches than on the first
    cannot be summed leaf by leaf: accumulate refuses it, naming the role and both counts."""
    s, _t, params, batch = _setup()

    def loss_fn(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor) -> Any:
        return ((ps.call(s, p["s"], b["x"]) - b["y"]) ** 2).mean(), {}

    inner = ps.value_and_grad(loss_fn)
    calls: list[int] = [0]

    def growing(p: TensorDictBase, b: TensorDictBase, key: torch.Tensor, **kw: Any) -> Any:
        fresh = TensorDict({r: p[r].apply(lambda x: x) for r in p.keys()}, [])
        if calls[0]:
            fresh["s", "extra"] = torch.zeros(1)
        calls[0] += 1
        return inner(fresh, b, key, **kw)

    message = "accumulate: role 's' has 7 params on this microbatch, 6 on earlier ones"
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        ps.accumulate(growing, 2)(params, batch, torch.tensor(0), roles=["s"])


class Counting(nn.Module):
    """Counts its forwards in a buffer it reassigns (``self.calls = self.calls + 1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        return self.lin(x) * self.calls  # type: ignore[no-any-return]


class Rewrites(nn.Module):
    """Reassigns slots in forward: a buffer (a tensor), ``scale`` (an ``nn.Parameter``),
    or the buffer to a non-tensor (``bad``)."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self.lin = nn.Linear(2, 2)
        self.scale = nn.Parameter(torch.ones(()))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.what == "bad":
            self._buffers["calls"] = 3.5  # type: ignore[assignment]
            return x
        self.calls = self.calls + self.scale
        if self.what == "parameter":
            self.scale = nn.Parameter(self.scale * 3)
        return self.lin(x) * self.calls  # type: ignore[no-any-return]


@pytest.mark.parametrize("what", ["buffer", "parameter"])
def test_a_slot_reassigned_in_a_plain_call_is_written_into_the_tree_and_the_module_restored(
    what: str,
) -> None:
    """Outside a call_scope, a tensor the module put into a slot during ``call`` replaces that
    leaf in the tree (a new tensor: the caller's old leaf is not overwritten; a Parameter
    detached), every other leaf and the module's own tensors stay the very same objects, and
    a reassigned buffer keeps its graph to the params it was computed from."""
    net, x = Rewrites(what), torch.ones(1, 2)
    td = ps.params_of("r", net)
    td.set("calls", torch.tensor(5.0))
    td.set("scale", torch.tensor(2.0, requires_grad=True))
    before = dict(zip(td.keys(True, True), [td.get(k) for k in td.keys(True, True)], strict=True))
    own = {n: t for n, t in list(net.named_parameters()) + list(net.named_buffers())}
    out = ps.call(net, td, x)
    assert torch.equal(out, (net.lin(x) * 7).detach()), "the call ran with the tree's tensors"
    calls = td["calls"]
    assert calls is not before["calls"] and float(calls.detach()) == 7.0, (
        "the buffer was not written"
    )
    assert float(before["calls"]) == 5.0, "the caller's old leaf was overwritten in place"
    assert calls.grad_fn is not None, "the written buffer lost its graph to the params"
    changed = {"calls"} | ({"scale"} if what == "parameter" else set())
    for key, old in before.items():
        if key not in changed:
            assert td.get(key) is old, f"{key} was replaced"
    if what == "parameter":
        scale = td["scale"]
        assert type(scale) is torch.Tensor and not scale.requires_grad, type(scale)
        assert float(scale) == 6.0 and float(before["scale"].detach()) == 2.0
    now = {n: t for n, t in list(net.named_parameters()) + list(net.named_buffers())}
    assert now.keys() == own.keys() and all(now[n] is own[n] for n in own), "module not restored"


def test_a_slot_set_to_a_non_tensor_in_a_plain_call_is_refused_naming_it() -> None:
    """A module that puts a non-tensor into a buffer slot during ``call`` gets a TypeError
    naming the slot and the type, and its own buffer back."""
    net = Rewrites("bad")
    own = net.calls
    td = TensorDict({"calls": torch.tensor(5.0)}, [])
    with pytest.raises(TypeError) as info:
        ps.call(net, td, torch.ones(1, 2))
    assert str(info.value) == (
        "call: the module set 'calls' to float during the call; expected a tensor"
    )
    assert net.calls is own and float(td["calls"]) == 5.0


def test_swap_and_restore_without_leaves_read_them_from_the_tree() -> None:
    """``plan_for``/``swap``/``restore`` called without the leaves list (as the doc shows):
    the module runs with the tree's tensors and gets its own back; a replaced one is written."""
    from purestep.step import _swap

    bn = nn.BatchNorm1d(1)
    own = bn.running_mean
    td = TensorDict({"running_mean": torch.full((1,), 3.0), "weight": torch.full((1,), 2.0)}, [])
    plan = _swap.plan_for(bn, td)
    assert [p for p in plan.paths] == [("running_mean",), ("weight",)]
    old = _swap.swap(plan, td)
    assert bn.running_mean is td["running_mean"] and bn.weight is td["weight"]
    bn.running_mean = torch.ones(1)
    new = bn.running_mean
    _swap.restore(plan, old, td)
    assert td["running_mean"] is new and bn.running_mean is own
    assert float(td["weight"]) == 2.0 and isinstance(bn.weight, nn.Parameter)


class Nested(nn.Module):
    """Calls its ``inner`` submodule twice through ``ps.call`` with ``inner_td``, in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.inner = nn.Linear(2, 2)
        self.inner_td: TensorDict | None = None
        self.gate: Any = None  # a threading.Event pair (entered, leave) to hold the call open

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            entered, leave = self.gate
            entered.set()
            assert leave.wait(30), "the test never released the call"
        h = self.lin(x)
        assert self.inner_td is not None
        for _ in range(2):
            h = ps.call(self.inner, self.inner_td, h)
        return h  # type: ignore[no-any-return]


def _owned(td: TensorDict, net: nn.Module) -> list[Any]:
    from purestep.step import _swap

    return [_swap._OWNERS.get(i) for i in _swap.plan_for(net, td).dict_ids]


def test_nested_calls_of_a_module_in_one_thread_run_with_the_innermost_tree_and_release_all() -> (
    None
):
    """A module's forward may ``call`` its own submodule (twice, on the same slots): each call
    runs with its tree, the outer call gets its tensors back, and when the outer call returns
    no slot is left owned by the thread (another thread can call the module)."""
    import threading

    net, x = Nested(), torch.ones(1, 2)
    td = ps.params_of("n", net)
    td.apply_(lambda t: t * 2)
    inner = ps.params_of("i", net.inner)
    inner.apply_(lambda t: t + 1)
    net.inner_td = inner
    out = ps.call(net, td, x)
    lin = lambda p, h: h @ p["weight"].T + p["bias"]  # noqa: E731
    want = lin(inner, lin(inner, lin(td["lin"], x)))
    assert torch.equal(out.detach(), want.detach())
    assert _owned(td, net) == [None] * len(_owned(td, net)), "slots left owned after the call"
    errors: list[BaseException] = []

    def other() -> None:
        try:
            ps.call(net, td, x)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    t.join(30)
    assert not errors, errors


def test_a_call_from_another_thread_while_the_module_is_in_use_is_refused_naming_the_owner() -> (
    None
):
    """While one thread is inside ``call`` of a module, ``call`` of it from another thread raises
    ModuleInUseError naming the module and the owning thread (a call of another module is not
    held up); after the first call returns the other thread can call it."""
    import threading

    net, x = Nested(), torch.ones(1, 2)
    td = ps.params_of("n", net)
    net.inner_td = ps.params_of("i", net.inner)
    entered, leave = threading.Event(), threading.Event()
    net.gate = (entered, leave)
    holder = threading.Thread(target=ps.call, args=(net, td, x))
    holder.start()
    try:
        assert entered.wait(30)
        net.gate = None
        other = Net(1)
        ps.call(other, ps.params_of("o", other), torch.ones(1, 3))  # another module: free
        with pytest.raises(ps.step.ModuleInUseError) as info:
            ps.call(net, td, x)
        assert str(info.value) == (
            f"call: Nested is in use by a call in another thread (thread {holder.ident}); a "
            "module holds one set of tensors at a time, so threads that step through the same "
            "module must each use their own copy (copy.deepcopy(module)) or take turns"
        )
    finally:
        leave.set()
        holder.join(30)
    ps.call(net, td, x)


def test_a_plan_is_built_once_per_tree_structure_and_names_the_module_in_its_errors() -> None:
    """``plan_for`` returns the cached plan for every tree of one structure (a new one for a new
    structure); building a plan for a key the module lacks, a slot that holds None, or both
    keys of a tied tensor raises, naming the module type and the keys."""
    from purestep.step import _swap

    net = Net(0)
    a, b = ps.params_of("a", net), ps.params_of("b", net).apply(lambda t: t + 1)
    plan = _swap.plan_for(net, a)
    assert _swap.plan_for(net, b) is plan
    assert _swap.plan_for(net, a.exclude("unused")) is not plan
    holes = nn.Linear(2, 2, bias=False)
    holes.register_buffer("empty", None)
    with pytest.raises(ValueError, match="is None") as none_slot:
        _swap.plan_for(holes, TensorDict({"empty": torch.zeros(1)}, []))
    assert str(none_slot.value) == "call: Linear.empty is None; there is no tensor to replace"
    tied = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    tied[1].weight = tied[0].weight
    both = TensorDict({"0": {"weight": torch.zeros(2, 2)}, "1": {"weight": torch.zeros(2, 2)}}, [])
    with pytest.raises(ValueError, match="tied") as twice:
        _swap.plan_for(tied, both)
    assert str(twice.value) == (
        "call: '0.weight' and '1.weight' name the same tied tensor of Sequential; give it once "
        "(its canonical key is '0.weight')"
    )
    with pytest.raises(KeyError) as info:
        _swap.plan_for(net, TensorDict({"a": {"wieght": torch.zeros(4, 3)}}, []))
    assert info.value.args[0] == (
        "call: Net has no parameter or buffer 'a.wieght' (the tree's keys must follow the "
        "module's named_parameters()/named_buffers() paths)"
    )


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
