"""``purestep.compile``: the compiled step equals the eager one, recompiles only when it must.

Most tests run the traced graph with ``backend="eager"`` (the aten graph op by
op, no inductor): they check the compiled step's tracing, flattening, optimizer
plans and bookkeeping *bitwise* against the eager step in a fraction of a
second per graph. ``test_inductor_*`` compile with inductor (tens of seconds
cold on this machine); the ones marked ``slow`` run with ``pytest -m slow``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import purestep as ps
from _compile_cases import NETS, OPTIMIZERS, batches, make_state, make_step
from _tiny import one_thread  # noqa: F401 (fixture)
from purestep import optim, testing
from purestep.compile import TraceError
from purestep.testing._compare import assert_trees_close, assert_trees_equal

pytestmark = pytest.mark.usefixtures("one_thread")

EAGER = {"backend": "eager"}


def _run(step: Any, state: TensorDict, bs: list[TensorDict]) -> tuple[TensorDict, list[TensorDict]]:
    state = step.prepare(state)
    ms = []
    for b in bs:
        state, m = step(state, b)
        ms.append(m)
    return state, ms


def _assert_same_run(
    compiled: Any, eager: Any, state: TensorDict, bs: list[TensorDict], **tol: float
) -> None:
    s_c, m_c = _run(compiled, state.clone(), bs)
    s_e, m_e = _run(eager, state.clone(), bs)
    if tol:
        assert_trees_close(s_c, s_e, what="compiled vs eager state", **tol)
    else:
        assert_trees_equal(s_c, s_e, what="compiled vs eager state")
    for i, (a, b) in enumerate(zip(m_c, m_e, strict=True)):
        if tol:
            assert_trees_close(a, b, what=f"compiled vs eager metrics of step {i}", **tol)
        else:
            assert_trees_equal(a, b, what=f"compiled vs eager metrics of step {i}")


config = st.fixed_dictionaries(
    {
        "opts": st.fixed_dictionaries(
            {"a": st.sampled_from(sorted(OPTIMIZERS)), "b": st.sampled_from(sorted(OPTIMIZERS))}
        ),
        "donate": st.booleans(),
        "k": st.sampled_from([1, 2, 3]),
        "every": st.sampled_from([None, {"b": 2}, {"a": 3, "b": 2}]),
        "ema": st.booleans(),
        "skip": st.booleans(),
        "per_role": st.booleans(),
        "grad_norm": st.booleans(),
    }
)


# no shrinking: each example traces up to ~8 graphs, and the failing config is printed anyway
@settings(max_examples=5, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(cfg=config)
def test_compiled_step_equals_eager_step_bitwise_for_every_composition(cfg: dict[str, Any]) -> None:
    """Traced with ``backend="eager"``, any composition's states and metrics equal the eager step's, bit for bit.

    Compositions: any optimizer per role (fused Adam/SGD plans, clip chains,
    opaque lion / scale_by_schedule), accumulate k, every, EMA with a start
    step, skip_nonfinite (one batch has a NaN target), per-role losses,
    donation, grad_norm on/off.
    """
    bs = batches(4, nan_at=2 if cfg["skip"] else None)
    state = make_state(cfg["opts"])
    _assert_same_run(ps.compile(make_step(**cfg), **EAGER), make_step(**cfg), state, bs)


def test_tensor_lr_kernels_equal_the_float_lr_kernels() -> None:
    """The fused kernels with a tensor learning rate (the compiled plans) give the float-lr bits."""
    from purestep.compile._kernels import fused_adam_, fused_sgd_

    g = torch.Generator().manual_seed(0)
    for lr in (1e-3, 0.0123456789):
        for decoupled in (False, True):
            p = [torch.randn(33, 7, generator=g), torch.randn(5, generator=g)]
            gr = [torch.randn_like(t) for t in p]
            m1 = [torch.randn_like(t) for t in p]
            v1 = [torch.rand_like(t) for t in p]
            p2, m2, v2 = [t.clone() for t in p], [t.clone() for t in m1], [t.clone() for t in v1]
            fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
            step = torch.tensor(3.0)
            fused(p, gr, m1, v1, [], [step] * 2, lr=lr, beta1=0.9, beta2=0.99,
                  weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)  # fmt: skip
            fused_adam_(p2, gr, m2, v2, [], [step] * 2, torch.tensor(lr, dtype=torch.float64),
                        0.9, 0.99, 0.1, 1e-8, False, decoupled)  # fmt: skip
            for a, b in zip(p + m1 + v1, p2 + m2 + v2, strict=True):
                assert torch.equal(a, b)
        p = [torch.randn(33, 7, generator=g)]
        buf = [torch.randn_like(p[0])]
        q, qbuf = [p[0].clone()], [buf[0].clone()]
        gr = [torch.randn_like(p[0])]
        torch._fused_sgd_(p, gr, buf, weight_decay=0.01, momentum=0.9, lr=lr, dampening=0.0,
                          nesterov=True, maximize=False, is_first_step=False)  # fmt: skip
        fused_sgd_(q, gr, qbuf, torch.tensor(lr, dtype=torch.float64), 0.01, 0.9, 0.0, True, False)
        assert torch.equal(p[0], q[0]) and torch.equal(buf[0], qbuf[0])


OPTS = {"a": "clip_adamw", "b": "sgd_nesterov"}


def test_property_checks_pass_on_compiled_steps() -> None:
    """assert_pure / deterministic / donation_safe / accumulation_invariant / resume_exact / cadence on compiled steps."""
    state = make_state(OPTS)
    bs = batches(4)
    step = ps.compile(make_step(OPTS, ema=True, every={"b": 2}), **EAGER)
    testing.assert_pure(step, state, bs[0])
    testing.assert_deterministic(step, state, bs)
    testing.assert_donation_safe(
        lambda d: ps.compile(make_step(OPTS, donate=d, ema=True), **EAGER), state, bs
    )
    testing.assert_accumulation_invariant(  # a compiled step's grads are inside its graph
        lambda k: ps.compile(make_step(OPTS, k=k), **EAGER),
        state,
        bs[:2],
        ks=(1, 2, 3),
        compare="state",
    )
    testing.assert_resume_exact(step, state, bs, save_at=2)
    testing.assert_cadence(step, state, bs, role="b", every=2)


def test_one_graph_per_set_of_due_roles_and_no_recompiles_over_100_steps() -> None:
    """every={'b': 2, 'a': 3}: one graph per distinct due-role set, compiled on its first step, none after."""
    opts = {"a": "sgd", "b": "adamw_schedule"}
    step = ps.compile(make_step(opts, every={"a": 3, "b": 2}, donate=True), **EAGER)
    state = step.prepare(make_state(opts))
    b = batches(1)[0]
    seen: set[frozenset[str]] = set()
    for s in range(100):
        due = frozenset(r for r, n in (("a", 3), ("b", 2)) if s % n == 0)
        before = step.stats().compiles
        state, _ = step(state, b)
        # s = 0 is {a, b}; empty due sets still run the forward (metrics) in their own graph
        assert step.stats().compiles == before + (due not in seen), (s, due)
        seen.add(due)
    stats = step.stats()
    assert stats.calls == 100
    assert stats.compiles == stats.graphs == len(seen) == 4  # {a,b}, {}, {b}, {a}
    assert stats.recompiles == 0


def test_a_new_batch_shape_recompiles_once() -> None:
    """A changed batch size compiles one more graph (a recompile), then runs without compiling."""
    opts = {"a": "adamw_schedule"}
    step = ps.compile(make_step(opts), **EAGER)
    state = step.prepare(make_state(opts))
    for b in batches(3, b=6) + batches(3, b=4) + batches(2, b=6):
        state, _ = step(state, b)
    stats = step.stats()
    assert (stats.compiles, stats.recompiles, stats.graphs) == (2, 1, 2)


def test_dynamic_batch_size_reuses_one_graph() -> None:
    """dynamic=True: batch sizes 6, 4 and 9 run on the graph compiled for 6, with eager's results."""
    opts = {"a": "adamw_schedule"}
    step = ps.compile(make_step(opts), dynamic=True, **EAGER)
    eager = make_step(opts)
    bs = batches(2, b=6) + batches(2, b=4, seed=1) + batches(1, b=9, seed=2)
    _assert_same_run(step, eager, make_state(opts), bs)
    stats = step.stats()
    assert (stats.compiles, stats.recompiles, stats.specialized) == (1, 0, ()), stats


def test_dynamic_with_accumulate_names_the_line_that_fixed_the_batch_size() -> None:
    """accumulate(k) splits on the host, so each batch size compiles once and stats name where."""
    opts = {"a": "sgd"}
    step = ps.compile(make_step(opts, k=2), dynamic=True, **EAGER)
    state = step.prepare(make_state(opts))
    for b in batches(2, b=6) + batches(2, b=4):
        state, _ = step(state, b)
    stats = step.stats()
    assert stats.compiles == 2
    assert stats.specialized and all(".py:" in s for s in stats.specialized), stats.specialized


def test_skipped_step_leaves_params_and_optimizer_state_untouched_and_raises_after_max() -> None:
    """A NaN loss skips the update (state unchanged but step and skip counters); 4 in a row raise."""
    opts = {"a": "clip_adamw"}
    step = ps.compile(make_step(opts, skip=True, ema=True), **EAGER)
    state = step.prepare(make_state(opts))
    bad = batches(1, nan_at=0)[0]
    new, m = step(state, bad)
    assert bool(m["skipped"]) and int(new["skip", "total"]) == 1 and int(new["step"]) == 1
    assert_trees_equal(new["params"], state["params"], what="params after a skipped step")
    assert_trees_equal(new["opt_state"], state["opt_state"], what="opt_state after a skipped step")
    assert_trees_equal(new["ema"], state["ema"], what="ema after a skipped step")
    for _ in range(2):
        new, _ = step(new, bad)
    with pytest.raises(ps.NonFiniteError, match="4 consecutive"):
        step(new, bad)


def test_errors_name_the_problem() -> None:
    """Unsupported steps, arguments and host reads of traced values fail with clear messages."""
    with pytest.raises(TypeError, match="compiles steps built by train_step"):
        ps.compile(lambda s, b: (s, TensorDict({}, [])))
    with pytest.raises(TypeError, match=r"unsupported torch.compile arguments \['fullgraph'\]"):
        ps.compile(make_step({"a": "sgd"}), fullgraph=True)
    bad_backend = ps.compile(make_step({"a": "sgd"}), backend="nope")
    with pytest.raises(ValueError, match="backend='nope'"):
        bad_backend(make_state({"a": "sgd"}), batches(1)[0])

    net = NETS["a"]

    def host_read(params: Any, batch: Any, key: Any) -> Any:
        loss = ps.call(net, params["a"], batch["x"]).pow(2).mean()
        if loss > 1.0:  # a host read of a traced value
            loss = loss * 0.5
        return loss, {}

    opt = {"a": optim.sgd(0.1)}
    step = ps.compile(ps.train_step(ps.value_and_grad(host_read), opt), **EAGER)
    with pytest.raises(
        TraceError, match=r"reads a tensor's value on the host at .*test_compile.py"
    ):
        step(ps.init_state({"a": net}, opt, seed=0), batches(1)[0])

    def keyed_dropout(params: Any, batch: Any, key: Any) -> Any:
        return ps.call(net, params["a"], batch["x"], key=key).pow(2).mean(), {}

    step = ps.compile(ps.train_step(ps.value_and_grad(keyed_dropout), opt), **EAGER)
    with pytest.raises(TraceError, match=r"call\(\.\.\., key=\) seeds torch's generator"):
        step(ps.init_state({"a": net}, opt, seed=0), batches(1)[0])


# ----------------------------------------------------------------------------- inductor


def test_inductor_compiled_step_matches_eager_without_recompiles() -> None:
    """Inductor (one graph): within 1e-5 of eager over 3 steps, compiled once.

    The representative inductor check of the default run (one inductor compile,
    about 45 s of CPU time cold here, minutes of wall time on a shared machine); the
    slow tests compile every optimizer kind, EMA, skipping, accumulation, and
    check donation safety and the other properties on inductor-compiled steps.
    """
    opts = {"a": "clip_adamw"}
    compiled = ps.compile(make_step(opts, donate=True))
    eager = make_step(opts, donate=True)
    _assert_same_run(compiled, eager, make_state(opts), batches(3), rtol=1e-5, atol=1e-6)
    stats = compiled.stats()
    assert (stats.compiles, stats.recompiles, stats.graphs) == (1, 0, 1), stats


@pytest.mark.slow
def test_inductor_ema_accumulate_and_skip_match_eager() -> None:
    """Inductor with EMA (both phases), accumulate(2) and skip_nonfinite: within 1e-5 of eager."""
    opts = {"a": "clip_adamw", "b": "sgd_nesterov"}
    kw: dict[str, Any] = {"k": 2, "ema": True, "skip": True, "every": {"b": 2}}
    _assert_same_run(
        ps.compile(make_step(opts, **kw)),
        make_step(opts, **kw),
        make_state(opts),
        batches(4, nan_at=2),
        rtol=1e-5,
        atol=1e-6,
    )


# ----------------------------------------------------------------------------- CUDA graphs


def _graph_step(opts: dict[str, str], cap: Any, **kw: Any) -> Any:
    return ps.CompiledStep(
        make_step(opts, **kw), mode="reduce-overhead", backend="eager", capturer=cap
    )


def test_whole_step_graph_replays_equal_the_eager_step_and_capture_once_per_variant() -> None:
    """mode='reduce-overhead' (CUDA graphs emulated on CPU): eager's bits; one capture per graph.

    Also: metrics of a step keep their values after later replays (they are
    cloned out of the graph's memory), and a state with other buffers (a
    fresh copy) is captured anew once, with the same results.
    """
    from purestep.compile._cudagraph import EmulatedCapturer

    opts = {"a": "clip_adamw", "b": "sgd_nesterov"}
    kw: dict[str, Any] = {"donate": True, "ema": True, "k": 2, "every": {"b": 2}, "skip": True}
    cap = EmulatedCapturer()
    step = _graph_step(opts, cap, **kw)
    bs = batches(8, nan_at=5)
    _assert_same_run(step, make_step(opts, **kw), make_state(opts), bs)
    st = step.stats()
    # graphs: grads {a,b}, grads {a}, apply {a,b} x ema copy/lerp, apply {a}; each warmed, then captured
    assert st.cudagraph_skipped == () and st.cudagraph_captures == cap.captures == st.graphs - 1
    s = step.prepare(make_state(opts))
    s, m0 = step(s, bs[0])
    kept = m0.clone()
    for b in bs[1:4]:
        s, _ = step(s, b)
    assert_trees_equal(m0, kept, what="metrics of step 0 after 3 more replays")
    before = cap.captures
    s, _ = step(s.clone(), bs[4])  # other buffers: captured anew
    assert cap.captures > before


def test_whole_step_graph_is_skipped_with_a_reason() -> None:
    """Not donated, a host-reading optimizer, or tensors on the CPU: no CUDA graph, and the stats say why."""
    from purestep.compile._cudagraph import EmulatedCapturer

    b = batches(1)[0]
    cases = [
        (_graph_step({"a": "adamw_schedule"}, EmulatedCapturer()), "does not donate"),
        (_graph_step({"a": "lion"}, EmulatedCapturer(), donate=True), "optimizer lion reads"),
        (
            ps.compile(make_step({"a": "sgd"}, donate=True), mode="reduce-overhead", **EAGER),
            "CUDA graphs need one CUDA device",
        ),
    ]
    for (step, why), opt in zip(cases, ("adamw_schedule", "lion", "sgd"), strict=True):
        step(make_state({"a": opt}), b)
        assert any(why in r for r in step.stats().cudagraph_skipped), step.stats().cudagraph_skipped


@pytest.mark.parametrize("donate", [False, True])
def test_buffers_and_params_written_by_the_forward_equal_eager(donate: bool) -> None:
    """BatchNorm buffers in state (with their EMA) and an Embedding(max_norm) writing its weight: eager's bits.

    Also with skip_nonfinite (the buffers and written params cross from the first
    graph to the second on the host) and accumulation.
    """
    from _compile_cases import BNNet, Renorm, module_step

    g = torch.Generator().manual_seed(0)
    bn_batches = [
        TensorDict({"x": torch.randn(8, 3, generator=g), "y": torch.randn(8, 2, generator=g)}, [8])
        for _ in range(3)
    ]
    ids_batches = [
        TensorDict(
            {"x": torch.randint(0, 10, (6,), generator=g), "y": torch.randn(6, 2, generator=g)}, [6]
        )
        for _ in range(3)
    ]
    for net, bs in ((BNNet(), bn_batches), (Renorm(), ids_batches)):
        opt = {"m": OPTIMIZERS["adamw_schedule"]()}
        state = ps.init_state({"m": net}, opt, seed=0)
        for kw in ({"ema_buffers": isinstance(net, BNNet), "k": 2}, {"skip": True}):
            make = lambda kw=kw, net=net: module_step(net, "adamw_schedule", donate=donate, **kw)  # noqa: E731
            _assert_same_run(ps.compile(make(), **EAGER), make(), state, bs)


@pytest.mark.slow
def test_inductor_compiled_steps_pass_the_property_checks() -> None:
    """Inductor: pure, deterministic, donation-safe, resume-exact (bitwise), accumulation-invariant."""
    opts = {"a": "clip_adamw", "b": "lion"}
    state = make_state(opts)
    bs = batches(3)
    step = ps.compile(make_step(opts, ema=True, every={"b": 2}))
    testing.assert_pure(step, state, bs[0])
    testing.assert_donation_safe(
        lambda d: ps.compile(make_step(opts, donate=d, ema=True, every={"b": 2})), state, bs
    )
    testing.assert_deterministic(step, state, bs)
    testing.assert_resume_exact(step, state, bs, save_at=1)
    testing.assert_accumulation_invariant(
        lambda k: ps.compile(make_step(opts, k=k)), state, bs[:2], ks=(1, 2), compare="state"
    )
    assert step.stats().recompiles == 0


@pytest.mark.slow
@pytest.mark.parametrize("opt", ["adam_amsgrad_l2", "sgd_nesterov", "clip_clip_sgd", "clip_scale"])
def test_inductor_every_optimizer_matches_eager(opt: str) -> None:
    """Inductor-compiled steps with each optimizer kind stay within 1e-5 of eager; skip and accumulate too."""
    opts = {"a": opt}
    kw: dict[str, Any] = {"k": 2, "skip": True, "donate": True}
    _assert_same_run(
        ps.compile(make_step(opts, **kw)),
        make_step(opts, **kw),
        make_state(opts),
        batches(4, nan_at=1),
        rtol=1e-5,
        atol=1e-6,
    )
