"""Every method in ``purestep.methods`` compiled: the same results and the same properties.

The methods' own tests build their steps eagerly; here the same setups (imported
from those test modules) run through ``purestep.compile``. With
``backend="eager"`` (the traced graph run op by op) states and metrics must be
bitwise the eager step's and the property checks must hold; with inductor
(``slow``) within 1e-5 and, bitwise, donate == no-donate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tensordict import TensorDict

import purestep as ps
import test_dmd2
import test_finetune
import test_kd
import test_nft
from _tiny import one_thread  # noqa: F401 (fixture)
from purestep import optim, testing
from purestep.export import module_variables
from purestep.methods import dmd2, finetune, kd, nft
from purestep.testing._compare import assert_trees_close, assert_trees_equal

pytestmark = pytest.mark.usefixtures("one_thread")

EAGER = {"backend": "eager"}


def _same(
    compiled: Any, eager: Any, state: TensorDict, batches: list[TensorDict], **tol: float
) -> None:
    """Both steps from copies of ``state`` over ``batches``: equal states and metrics."""
    cmp = (
        (lambda a, b, what: assert_trees_close(a, b, what=what, **tol))
        if tol
        else (lambda a, b, what: assert_trees_equal(a, b, what=what))
    )
    s_c, s_e = compiled.prepare(state.clone()), eager.prepare(state.clone())
    for i, b in enumerate(batches):
        s_c, m_c = compiled(s_c, b.clone())
        s_e, m_e = eager(s_e, b.clone())
        cmp(m_c, m_e, what=f"metrics of step {i}")
    cmp(s_c, s_e, what="state after the run")


_FAST = {("conditional", True), ("velocity", False)}


@pytest.mark.parametrize(
    ("name", "donate"),
    [
        pytest.param(n, d, marks=() if (n, d) in _FAST else pytest.mark.slow)
        for n in test_finetune.CONFIGS
        for d in (False, True)
    ],
)
def test_finetune_compiled_equals_eager(name: str, donate: bool) -> None:
    """finetune (every config, EMA, donation) compiled == eager, bit for bit; the compiled step is pure."""
    opt = optim.adamw(lr=1e-2)
    net, cfg, state, batches = test_finetune._setup(name, opt)
    make = lambda: finetune.make_step(net, opt, cfg, donate=donate, ema=0.9, accumulate=2)  # noqa: E731
    _same(ps.compile(make(), **EAGER), make(), state, batches)
    if not donate:
        testing.assert_pure(ps.compile(make(), **EAGER), state, batches[0])


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=() if n == "simulate_3step" else pytest.mark.slow)
        for n in test_dmd2.CONFIGS
    ],
)
def test_dmd2_compiled_equals_eager_and_keeps_the_cadence(name: str) -> None:
    """DMD2 (student every 2 steps, critic every step) compiled == eager; cadence and donation hold."""
    opts = test_dmd2._adam_opts()
    student, teacher, cfg, state, batches = test_dmd2._setup(name, opts)

    def make(d: bool = False) -> Any:
        return dmd2.make_step(
            student=student,
            teacher=teacher,
            teacher_params=module_variables(teacher),
            optimizers=opts,
            config=cfg,
            donate=d,
            ema=0.9,
        )

    step = ps.compile(make(), **EAGER)
    _same(step, make(), state, batches)
    testing.assert_cadence(
        step, state, batches, role="student", every=cfg.generator_update_interval
    )
    testing.assert_donation_safe(lambda d: ps.compile(make(d), **EAGER), state, batches)


@pytest.mark.slow
def test_dmd2_compiled_is_accumulation_invariant() -> None:
    """accumulate(k) for k = 1, 2 on the compiled DMD2 step gives the same states and metrics."""
    opts = {"student": optim.sgd(lr=0.1), "critic": optim.sgd(lr=0.1, momentum=0.5)}
    student, teacher, cfg, state, batches = test_dmd2._setup("one_step", opts)
    testing.assert_accumulation_invariant(
        lambda k: ps.compile(
            dmd2.make_step(
                student=student,
                teacher=teacher,
                teacher_params=module_variables(teacher),
                optimizers=opts,
                config=cfg,
                accumulate=k,
            ),
            **EAGER,
        ),
        state,
        batches,
        ks=(1, 2),
        compare="state",
    )


def test_kd_compiled_equals_eager(tmp_path: Path) -> None:
    """kd compiled == eager (with EMA), bit for bit, and pure."""
    data = test_kd._rows(tmp_path)
    student, opt = test_kd.TinyNet(seed=5), optim.adam(lr=1e-2)
    state = kd.init_state(student, opt, seed=0)
    batches = [data[:8], data[8:16]]
    make = lambda: kd.make_step(student, opt, ema=0.9)  # noqa: E731
    _same(ps.compile(make(), **EAGER), make(), state, batches)
    testing.assert_pure(ps.compile(make(), **EAGER), state, batches[0])


def test_nft_outer_step_with_compiled_inner_steps_equals_eager() -> None:
    """NFT: the compiled outer step (inner train steps compiled) == eager; pure, donation-safe, resumable."""
    net = test_nft.VelocityNet()
    decay = nft.ramp_decay(flat_steps=1, rate=0.3, max_decay=0.9)
    prompts = [test_nft._prompts(2), test_nft._prompts(2, 2), test_nft._prompts(2, 4)]
    state = test_nft._state(net)
    compiled = ps.compile(test_nft._make(net, decay=decay, k=2), **EAGER)
    assert isinstance(compiled, nft.NFTStep) and isinstance(compiled.inner, ps.CompiledStep)
    _same(compiled, test_nft._make(net, decay=decay, k=2), state, prompts)
    testing.assert_pure(compiled, state, prompts[0])
    testing.assert_donation_safe(
        lambda d: ps.compile(test_nft._make(net, donate=d, decay=decay), **EAGER), state, prompts
    )
    testing.assert_resume_exact(compiled, state, prompts, save_at=1)


# ----------------------------------------------------------------------------- inductor


@pytest.mark.slow
@pytest.mark.parametrize("method", ["finetune", "dmd2", "nft"])
def test_inductor_compiled_methods_match_eager(method: str) -> None:
    """Inductor-compiled methods: within 1e-5 of eager; donate == no-donate bitwise."""
    if method == "finetune":
        opt = optim.adamw(lr=1e-2)
        net, cfg, state, batches = test_finetune._setup("conditional", opt)

        def make(d: bool = False) -> Any:
            return finetune.make_step(net, opt, cfg, donate=d, ema=0.9)

    elif method == "dmd2":
        opts = test_dmd2._adam_opts()
        student, teacher, cfg2, state, batches = test_dmd2._setup("one_step", opts)

        def make(d: bool = False) -> Any:
            return dmd2.make_step(
                student=student,
                teacher=teacher,
                teacher_params=module_variables(teacher),
                optimizers=opts,
                config=cfg2,
                donate=d,
            )

    else:
        vnet = test_nft.VelocityNet()
        state = test_nft._state(vnet)
        batches = [test_nft._prompts(2), test_nft._prompts(2, 2)]

        def make(d: bool = False) -> Any:
            return test_nft._make(vnet, donate=d)

    _same(ps.compile(make()), make(), state, batches, rtol=1e-5, atol=1e-6)
    testing.assert_donation_safe(lambda d: ps.compile(make(d)), state, batches)
