"""optim.mixed_precision: bf16 params with float32 master weights and float32 Adam moments,
against torch's AMP recipe (float32 model, torch.autocast to bf16, torch.optim.AdamW)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torch.nn import functional as F

import purestep as ps
from purestep import checkpoint, optim, testing

LR, WD, STEPS = 1e-2, 0.1, 6


def _model() -> nn.Module:
    g = torch.Generator().manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.SiLU(), nn.Linear(32, 32), nn.SiLU(), nn.Linear(32, 4))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)  # not bf16-representable
    return net


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        {"x": torch.randn(16, 8, generator=g), "y": torch.randn(16, 4, generator=g)}
        for _ in range(STEPS)
    ]


def _torch_amp(net: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The reference: float32 params, autocast to bf16 in the forward, fused float32 AdamW."""
    ref = copy.deepcopy(net)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    for b in _batches():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ref(b["x"])
        F.mse_loss(out.float(), b["y"]).backward()
        opt.step()
    return ref, opt


def _step(net: nn.Module, *, donate: bool = False) -> Any:
    def loss(p: TensorDictBase, b: TensorDictBase, k: torch.Tensor) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast inside the loss
            out = ps.call(net, p["m"], b["x"])
        return F.mse_loss(out.float(), b["y"]), {}

    opt = {"m": optim.mixed_precision(optim.adamw(LR, weight_decay=WD))}
    return ps.train_step(ps.value_and_grad(loss), opt, donate=donate), opt


def _bf16_state(net: nn.Module, opt: dict[str, optim.Transform]) -> TensorDict:
    """The state from the float32 module (so the masters start exact), params cast to bf16."""
    state = ps.init_state({"m": net}, opt, seed=0)
    state.set("params", state["params"].to(torch.bfloat16))
    return state


def test_bf16_params_with_fp32_masters_match_torch_autocast_adamw_bitwise() -> None:
    """Six steps: the float32 masters equal torch's float32 params bitwise, the bf16 params are
    them rounded, the moments are float32 and equal torch's, and the inputs stay unchanged."""
    net = _model()
    ref, ref_opt = _torch_amp(net)
    step, opt = _step(net)
    state = _bf16_state(net, opt)
    assert state["params", "m", "0", "weight"].dtype == torch.bfloat16
    for b in _batches():
        state, _ = step(state, b)
    ref_params = dict(ref.named_parameters())
    masters = state["opt_state", "m", "master"].flatten_keys(".")
    moments = {k: state["opt_state", "m", "inner", k].flatten_keys(".") for k in ("mu", "nu")}
    params = state["params", "m"].flatten_keys(".")
    for name, r in ref_params.items():
        assert torch.equal(masters[name], r.detach()), name
        assert torch.equal(params[name], r.detach().bfloat16()), name
        for key, torch_key in (("mu", "exp_avg"), ("nu", "exp_avg_sq")):
            m = moments[key][name]
            assert m.dtype == torch.float32 and torch.equal(m, ref_opt.state[r][torch_key]), name


def test_without_masters_bf16_adam_drifts_from_the_torch_recipe() -> None:
    """The control: plain adamw on bf16 params (bf16 moments, bf16 rounding of every update)
    does not reproduce the float32 masters, so the bitwise test above can fail."""
    net = _model()
    ref, _ = _torch_amp(net)

    def loss(p: TensorDictBase, b: TensorDictBase, k: torch.Tensor) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ps.call(net, p["m"], b["x"])
        return F.mse_loss(out.float(), b["y"]), {}

    opt = {"m": optim.adamw(LR, weight_decay=WD)}
    step = ps.train_step(ps.value_and_grad(loss), opt)
    state = ps.init_state({"m": copy.deepcopy(net).to(torch.bfloat16)}, opt, seed=0)
    for b in _batches():
        state, _ = step(state, b)
    got = state["params", "m"].flatten_keys(".")
    assert any(not torch.equal(got[n].float(), r.detach()) for n, r in ref.named_parameters())


def test_pure_equals_donated_bitwise_and_the_pure_step_is_pure() -> None:
    """donate=True (params, masters and moments updated in place) == donate=False, bitwise."""
    net = _model()
    pure, opt = _step(net)
    donated, _ = _step(net, donate=True)
    a, b = _bf16_state(net, opt), _bf16_state(net, opt)
    testing.assert_pure(pure, a, TensorDict(_batches()[0], batch_size=[16]))
    for batch in _batches():
        a, _ = pure(a, batch)
        b, _ = donated(b, batch)
    testing.assert_trees_equal(a, b)


def test_subset_of_grads_leaves_other_masters_and_params_alone() -> None:
    """A param without a gradient keeps its bf16 value, its master and its moments."""
    t = optim.mixed_precision(optim.adam(0.1))
    p = TensorDict({"a": torch.ones(2, dtype=torch.bfloat16), "b": torch.ones(3)}, [])
    s = t.init(p)
    g = TensorDict({"a": torch.ones(2, dtype=torch.bfloat16)}, [])
    p2, s2 = t.step(g, s, p)
    assert torch.equal(p2["b"], p["b"]) and torch.equal(s2["master", "b"], s["master", "b"])
    assert not torch.equal(p2["a"], p["a"]) and s2["master", "a"].dtype == torch.float32
    updates, s3 = t.update(g, s, p)
    testing.assert_trees_equal(s3, s2)
    assert torch.equal((p["a"].float() + updates["a"]).bfloat16(), p2["a"])


def test_checkpoint_round_trip_resumes_bitwise(tmp_path: Path) -> None:
    """Save after 3 steps, load into a fresh state, 3 more steps == 6 uninterrupted steps."""
    net = _model()
    step, opt = _step(net)
    full = _bf16_state(net, opt)
    for b in _batches():
        full, _ = step(full, b)
    part = _bf16_state(net, opt)
    for b in _batches()[:3]:
        part, _ = step(part, b)
    checkpoint.save(part, tmp_path / "ck")
    back = checkpoint.load(tmp_path / "ck", like=_bf16_state(net, opt))
    assert back["opt_state", "m", "master", "0", "weight"].dtype == torch.float32
    for b in _batches()[3:]:
        back, _ = step(back, b)
    testing.assert_trees_equal(back, full)


def test_bad_arguments_are_refused_by_name() -> None:
    with pytest.raises(TypeError, match="not a Transform"):
        optim.mixed_precision(lambda g: g)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"floating torch\.dtype"):
        optim.mixed_precision(optim.adam(0.1), master_dtype=torch.int32)
    with pytest.raises(TypeError, match=r"param .*n.* has dtype torch.int64"):
        optim.mixed_precision(optim.adam(0.1)).init(TensorDict({"n": torch.ones(2).long()}, []))


def test_errors_name_the_transform_the_param_and_the_tree_exactly() -> None:
    """Each refusal is the full message: the wrong inner's type, the non-floating param's
    path and dtype, a missing params argument, and the params that differ from the masters."""
    t = optim.mixed_precision(optim.adam(0.1))
    p = TensorDict({"a": torch.ones(2)}, [])
    s = t.init(p)
    cases: list[tuple[Any, type[Exception], str]] = [
        (
            lambda: optim.mixed_precision(lambda g: g),  # type: ignore[arg-type]
            TypeError,
            "mixed_precision: inner is function, not a Transform",
        ),
        (
            lambda: t.init(TensorDict({"n": {"k": torch.ones(2).long()}}, [])),
            TypeError,
            "mixed_precision: param n.k has dtype torch.int64; master weights need floating params",
        ),
        (
            lambda: t.update(p, s, None),
            ValueError,
            "mixed_precision: update needs params (the master copy is per param)",
        ),
        (
            lambda: t.step(
                TensorDict({"b": torch.ones(2)}, []), s, TensorDict({"b": torch.ones(2)}, [])
            ),
            ValueError,
            "the master params keys differ from params: missing b; unexpected a",
        ),
    ]
    for make, exc, message in cases:
        with pytest.raises(exc) as info:
            make()
        assert type(info.value) is exc and str(info.value) == message
    assert t.name == "mixed_precision(adam)"


def test_masters_never_alias_the_params_even_in_the_same_dtype() -> None:
    """With float32 params and float32 masters, init copies the params and a pure step's new
    params are not the new masters: writing into one leaves the other unchanged."""
    t = optim.mixed_precision(optim.sgd(0.5))
    p = TensorDict({"a": torch.ones(2)}, [])
    s = t.init(p)
    p["a"].add_(1.0)
    assert torch.equal(s["master", "a"], torch.ones(2))
    p2, s2 = t.step(TensorDict({"a": torch.ones(2)}, []), s, TensorDict({"a": torch.ones(2)}, []))
    assert torch.equal(p2["a"], torch.full((2,), 0.5))
    p2["a"].add_(1.0)
    assert torch.equal(s2["master", "a"], torch.full((2,), 0.5))


def test_grads_and_updates_are_in_the_master_dtype() -> None:
    """float64 params and grads with float32 masters: the inner optimizer sees float32 grads
    (float32 moments), and update returns float32 updates new_master - params."""
    t = optim.mixed_precision(optim.adam(0.1))
    x = torch.tensor([1.0 + 2.0**-40, 2.0], dtype=torch.float64)  # not float32-representable
    p = TensorDict({"a": x}, [])
    g = TensorDict({"a": torch.tensor([0.5, -0.25], dtype=torch.float64)}, [])
    s = t.init(p)
    updates, s2 = t.update(g, s, p)
    assert s2["inner", "mu", "a"].dtype == torch.float32
    assert s2["inner", "nu", "a"].dtype == torch.float32
    assert updates["a"].dtype == torch.float32
    assert torch.equal(updates["a"], s2["master", "a"] - x.float())
    g_odd = TensorDict({"a": torch.tensor([0.1, 1.0 / 3.0], dtype=torch.float64)}, [])
    as_f32 = TensorDict({"a": g_odd["a"].float()}, [])
    for got, want in zip(t.update(g_odd, s, p), t.update(as_f32, s, p), strict=True):
        testing.assert_trees_equal(got, want)
    sgd = optim.mixed_precision(optim.sgd(0.1))
    assert sgd.step(g_odd, sgd.init(p), p)[1]["master", "a"].dtype == torch.float32
    p3, s3 = t.step(g, s, p)
    assert s3["inner", "mu", "a"].dtype == torch.float32 and p3["a"].dtype == torch.float64


@pytest.mark.parametrize("method", ["step", "update"])
def test_donate_updates_masters_and_moments_in_place_and_is_off_by_default(method: str) -> None:
    """donate=True writes the new masters and the inner moments into the given state; without
    donate (also calling update_fn/step_fn directly) the given state is left unchanged."""
    t = optim.mixed_precision(optim.adam(0.1))
    p = TensorDict({"a": torch.ones(2, dtype=torch.bfloat16)}, [])
    g = TensorDict({"a": torch.ones(2, dtype=torch.bfloat16)}, [])
    s = t.init(p)
    before = s.clone()
    for call in (getattr(t, method), getattr(t, method + "_fn")):
        call(g, s, p.clone())
        testing.assert_trees_equal(s, before)
    _, s2 = getattr(t, method)(g, s, p.clone(), donate=True)
    assert not torch.equal(s["master", "a"], before["master", "a"])
    for key in ("master", ("inner", "mu"), ("inner", "nu")):
        testing.assert_trees_equal(s[key], s2[key])


def test_the_inner_transform_receives_grads_cast_to_the_master_dtype() -> None:
    """Whatever the grads' dtype, ``inner`` gets them in ``master_dtype`` (as the docstring
    says), so a stateless inner transform computes in the master precision: its masters equal
    the same transform run on master-dtype copies of the params and the grads."""
    seen: list[torch.dtype] = []

    def record(
        grads: TensorDictBase, state: TensorDictBase, params: Any, *, donate: bool = False
    ) -> tuple[TensorDict, TensorDict]:
        seen.extend(x.dtype for x in grads.values(True, True))
        return optim.scale_by_schedule(-0.1).update_fn(grads, state, params, donate=donate)

    inner = optim.Transform(init_fn=optim.scale_by_schedule(-0.1).init_fn, update_fn=record)
    gen = torch.Generator().manual_seed(0)
    p = TensorDict({"a": torch.randn(64, generator=gen).to(torch.bfloat16)}, [])
    g = TensorDict({"a": torch.randn(64, generator=gen).to(torch.bfloat16)}, [])
    for method in ("step", "update"):
        t = optim.mixed_precision(inner)
        s = t.init(p)
        _, s2 = getattr(t, method)(g, s, p)
        assert seen == [torch.float32], method
        seen.clear()
        master = TensorDict({"a": p["a"].float()}, [])
        want, _ = inner.step(TensorDict({"a": g["a"].float()}, []), inner.init(master), master)
        seen.clear()
        testing.assert_trees_equal(s2["master"], want)
