"""Property checks that users run on their own step functions.

Each check raises an ``AssertionError`` that names the first diverging key path
and the max abs/rel difference. They work on any ``step(state, batch) ->
(state, metrics)``; checks that compare two variants of a step take a factory
(``make_step(donate)`` / ``make_step(k)``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from purestep._keys import OPT_STATE, PARAMS, STEP
from purestep.step import Batch, as_batch, module_tensors, recording_modules
from purestep.testing._accumulation import assert_accumulation_invariant
from purestep.testing._compare import (
    assert_trees_close,
    assert_trees_equal,
    equal_failures,
    snapshot,
)
from purestep.testing._global_rng import ADVICE, RngWatch
from purestep.testing._steps import StepFn, explain, prepare, run_steps, run_watched

__all__ = [
    "assert_accumulation_invariant",
    "assert_cadence",
    "assert_deterministic",
    "assert_donation_safe",
    "assert_pure",
    "assert_resume_exact",
    "run_steps",
]

SaveFn = Callable[[TensorDictBase, str], Any]
LoadFn = Callable[..., TensorDictBase]


def _donation_hint(step: StepFn) -> str:
    donate = getattr(step, "donate", None)
    if donate is True:
        return (
            ". The step donates its input (donate=True): a donated step reuses the input "
            "state's buffers by design, so it is not pure; check its donate=False build with "
            "assert_pure, and that both agree with assert_donation_safe"
        )
    if donate is None:
        return (
            ". If the step donates its input (built with donate=True), that is by design: "
            "check its donate=False build with assert_pure"
        )
    return ""


def _module_changes(
    modules: dict[int, tuple[nn.Module, dict[tuple[str, ...], torch.Tensor]]],
) -> None:
    for module, snap in modules.values():
        now = dict(module_tensors(module))
        name = type(module).__name__
        if set(now) != set(snap):
            added = sorted(".".join(p) for p in set(now) - set(snap))
            gone = sorted(".".join(p) for p in set(snap) - set(now))
            raise AssertionError(
                f"the step changed module {name}'s own parameters/buffers: added {added}, "
                f"removed {gone}"
            )
        for path, before in snap.items():
            after = now[path]
            same = (
                after.shape == before.shape
                and after.dtype == before.dtype
                and torch.equal(after.detach().cpu(), before.cpu())
            )
            if not same:
                raise AssertionError(
                    f"the step changed module {name}'s own tensor {'.'.join(path)!r}; a pure "
                    "step leaves modules as they are (buffers a forward updates, such as "
                    "BatchNorm statistics, belong in the state: init_state keeps them in "
                    "state['buffers', role] and call swaps them in)"
                )


def assert_pure(
    step: StepFn, state: TensorDictBase, batch: Batch, *, modules: Sequence[nn.Module] = ()
) -> None:
    """Assert that ``step(state, batch)`` leaves ``state``, ``batch``, modules and global RNGs unchanged.

    Also checks that the returned state shares no *modified* buffer with the input
    (the inputs are compared after the step), that calling it twice gives
    the same result (so no hidden state was consumed), that every module the
    step runs through :func:`purestep.call` (and every module in ``modules``,
    e.g. a frozen teacher called directly) still holds bitwise the same
    parameters and buffers afterwards, and that the step did not draw from
    torch's global generators (the CPU one, and CUDA's where initialised):
    randomness comes from the state's key (``call(..., key=)`` restores them).

    A step built with ``donate=True`` reuses its input's buffers by design and
    fails this check (the message says so): check its ``donate=False`` build.

    Raises:
        AssertionError: naming what changed (the key path of the input state or
            batch, the module and tensor, the global generator) or the first
            diverging key path of a second call.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> assert_pure(lambda s, b: (s.apply(lambda t: t + 1), TensorDict({}, [])),
        ...             TensorDict({"w": torch.ones(1)}, []), {"x": torch.ones(2)})
    """
    state = prepare(step, state)
    before_state = snapshot(state)
    batch_td = as_batch(batch)
    before_batch = snapshot(batch_td)
    given = {id(m): (m, {p: t.detach().clone() for p, t in module_tensors(m)}) for m in modules}
    watch = RngWatch()
    with recording_modules() as seen:
        out1, m1 = watch.call("the first call", step, state, batch_td)
    _module_changes({**seen, **given})
    try:
        assert_trees_equal(state, before_state, what="input state after step (step mutated it)")
    except AssertionError as e:
        first, nl, rest = str(e).partition("\n")
        raise AssertionError(f"{first}{_donation_hint(step)}{nl}{rest}") from None
    assert_trees_equal(batch_td, before_batch, what="input batch after step (step mutated it)")
    if watch.consumed:
        raise AssertionError(
            f"the step drew from torch's global RNG: its state changed during "
            f"{watch.consumed[0]}, a side effect that also makes every call differ; {ADVICE}"
        )
    out2, m2 = step(state, batch_td)
    assert_trees_equal(out2, out1, what="second call on the same inputs (hidden state?)")
    assert_trees_equal(m2, m1, what="metrics of a second call on the same inputs")


def assert_deterministic(
    step: StepFn, state: TensorDictBase, batches: Batch | Sequence[Batch], *, runs: int = 2
) -> None:
    """Assert that running ``step`` over ``batches`` from fresh copies of ``state`` is bitwise repeatable.

    Raises:
        AssertionError: naming the run, step and every diverging key path; when
            a step drew from torch's global RNG, the message says so.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> assert_deterministic(lambda s, b: (s, TensorDict({}, [])),
        ...                      TensorDict({"w": torch.ones(1)}, []), {"x": torch.ones(1)})
    """
    seq = [batches] if not isinstance(batches, Sequence) else list(batches)
    state = prepare(step, state)
    watch = RngWatch()
    ref_state, ref_metrics = run_watched(step, snapshot(state), seq, watch, "run 1")
    ref_state = snapshot(ref_state)
    for r in range(1, runs):
        s, ms = run_watched(step, snapshot(state), seq, watch, f"run {r + 1}")
        try:
            assert_trees_equal(s, ref_state, what=f"state of run {r + 1} vs run 1")
            for i, (m, m0) in enumerate(zip(ms, ref_metrics, strict=True)):
                assert_trees_equal(m, m0, what=f"metrics of step {i} in run {r + 1} vs run 1")
        except AssertionError as e:
            raise explain(e, watch) from None


def assert_donation_safe(
    make_step: Callable[[bool], StepFn],
    state: TensorDictBase,
    batches: Batch | Sequence[Batch],
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
) -> None:
    """Assert ``make_step(donate=True)`` and ``make_step(donate=False)`` give equal states and metrics.

    Both run over ``batches`` from separate deep copies of ``state``. Equality is
    bitwise unless tolerances are given. The non-donated run must also leave its
    input unchanged.

    Raises:
        AssertionError: naming every diverging key path of the state (or the
            step's metrics), or the input leaf the donate=False run wrote into;
            when a step drew from torch's global RNG, the message says so.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import purestep as ps
        >>> net = nn.Linear(1, 1)
        >>> opt = {"m": ps.optim.adamw(1e-2)}
        >>> gf = ps.value_and_grad(lambda p, b, k: (ps.call(net, p["m"], b["x"]).mean(), {}))
        >>> assert_donation_safe(lambda d: ps.train_step(gf, opt, donate=d),
        ...                      ps.init_state({"m": net}, opt, seed=0), {"x": torch.ones(2, 1)})
    """
    seq = [batches] if not isinstance(batches, Sequence) else list(batches)
    plain, donated = make_step(False), make_step(True)
    state = prepare(plain, state)
    keep = snapshot(state)
    watch = RngWatch()
    s_plain, m_plain = run_watched(plain, state, seq, watch, "the donate=False run")
    assert_trees_equal(state, keep, what="input state of the donate=False run")
    s_don, m_don = run_watched(donated, snapshot(state), seq, watch, "the donate=True run")
    compare: Callable[..., None]
    if rtol == 0.0 and atol == 0.0:
        compare = assert_trees_equal
    else:

        def compare(a: Any, b: Any, *, what: str) -> None:
            assert_trees_close(a, b, rtol=rtol, atol=atol, what=what)

    try:
        compare(s_don, s_plain, what="state with donate=True vs donate=False")
        for i, (a, b) in enumerate(zip(m_don, m_plain, strict=True)):
            compare(a, b, what=f"metrics of step {i} with donate=True vs donate=False")
    except AssertionError as e:
        raise explain(e, watch) from None


def _torch_save(state: TensorDictBase, path: str) -> None:
    os.makedirs(path, exist_ok=True)
    torch.save(state, os.path.join(path, "state.pt"))


def _torch_load(path: str, *, like: TensorDictBase) -> TensorDictBase:
    del like
    loaded: TensorDictBase = torch.load(os.path.join(path, "state.pt"), weights_only=False)
    return loaded


def assert_resume_exact(
    step: StepFn,
    state: TensorDictBase,
    batches: Sequence[Batch],
    save_at: int,
    *,
    save_fn: SaveFn | None = None,
    load_fn: LoadFn | None = None,
    restart_step: StepFn | None = None,
) -> None:
    """Assert that saving after ``save_at`` steps, loading and continuing equals the uninterrupted run, bitwise.

    Args:
        step: the step function.
        state: the initial state.
        batches: the batches of the whole run.
        save_at: number of steps before the save (``0 <= save_at <= len(batches)``).
        save_fn: ``save_fn(state, directory)`` (default: ``torch.save`` of the state).
        load_fn: ``load_fn(directory, like=state_template) -> state`` (default ``torch.load``).
            ``like`` is the pre-save state's structure, as the DCP adapter needs.
        restart_step: the step used after the restart (default ``step``): pass a
            freshly built step to prove the step object holds no state.

    Raises:
        AssertionError: naming every key path where the resumed run's final
            state differs from the uninterrupted run's, and the leaves where the
            state ``load_fn`` returned differs from the saved one (a lossy
            round trip); when a step drew from torch's global RNG, the message
            says so.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import purestep as ps
        >>> net = nn.Linear(1, 1)
        >>> opt = {"m": ps.optim.adamw(1e-2)}
        >>> gf = ps.value_and_grad(lambda p, b, k: (ps.call(net, p["m"], b["x"]).mean(), {}))
        >>> assert_resume_exact(ps.train_step(gf, opt), ps.init_state({"m": net}, opt, seed=0),
        ...                     [{"x": torch.ones(2, 1)}] * 3, save_at=1)
    """
    if not 0 <= save_at <= len(batches):
        raise ValueError(f"save_at={save_at} is outside [0, {len(batches)}]")
    save = save_fn or _torch_save
    load = load_fn or _torch_load
    state = prepare(step, state)
    watch = RngWatch()
    full, _ = run_watched(step, snapshot(state), batches, watch, "the uninterrupted run")
    full = snapshot(full)
    mid, _ = run_watched(step, snapshot(state), batches[:save_at], watch, "the run before the save")
    like = snapshot(mid)
    with tempfile.TemporaryDirectory() as d:
        target = os.path.join(d, "ckpt")
        save(mid, target)
        del mid
        restored = load(target, like=like)
    loaded = snapshot(restored)
    resumed, _ = run_watched(
        restart_step or step, restored, batches[save_at:], watch, "the resumed run", save_at
    )
    try:
        assert_trees_equal(
            resumed, full, what=f"state resumed after step {save_at} vs uninterrupted"
        )
    except AssertionError as e:
        first, nl, rest = str(e).partition("\n")
        hint = _round_trip_hint(loaded, like)
        raise explain(AssertionError(f"{first}{hint}{nl}{rest}"), watch) from None


def _round_trip_hint(loaded: TensorDictBase, saved: TensorDictBase) -> str:
    """Where the loaded state differs from the saved one ("" when it round-tripped)."""
    try:
        failures = equal_failures(loaded, saved)
    except AssertionError as e:  # key structure differs
        return f". The state returned by load_fn is not the saved one: {e}"
    if not failures:
        return ""
    listed = ", ".join(name for name, _ in failures)
    return (
        f". The state returned by load_fn differs from the saved one at {listed}: the save/load "
        "round trip is lossy"
    )


def assert_cadence(
    step: StepFn,
    state: TensorDictBase,
    batches: Sequence[Batch],
    role: str,
    every: int,
) -> None:
    """Assert ``role``'s params and optimizer state change exactly on steps that are multiples of ``every``.

    Step index ``s`` is ``state["step"]`` before the call. On other steps the
    role's params and opt_state must be bitwise unchanged; on update steps its
    params must change (so its gradient must be non-zero for the given batches).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import purestep as ps
        >>> net = nn.Linear(1, 1)
        >>> opt = {"m": ps.optim.sgd(1e-1)}
        >>> gf = ps.value_and_grad(lambda p, b, k: (ps.call(net, p["m"], b["x"]).mean(), {}))
        >>> assert_cadence(ps.train_step(gf, opt, every={"m": 2}), ps.init_state({"m": net}, opt, seed=0),
        ...                [{"x": torch.ones(2, 1)}] * 4, "m", 2)
    """
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    state = prepare(step, state)
    watch = RngWatch()
    for b in batches:
        s = int(state.get(STEP))
        before = snapshot(_role_view(state, role))
        state, _ = watch.call(f"step {s}", step, state, b)
        after = _role_view(state, role)
        if s % every == 0:
            if _equal(after.get(PARAMS), before.get(PARAMS)):
                raise explain(
                    AssertionError(
                        f"cadence: role {role!r} should update at step {s} (every={every}) but "
                        "its params did not change"
                    ),
                    watch,
                )
        else:
            try:
                assert_trees_equal(after, before, what=f"role {role!r} at step {s}")
            except AssertionError as e:
                raise explain(
                    AssertionError(
                        f"cadence: role {role!r} changed at step {s}, which is not a multiple of "
                        f"every={every}: {e}"
                    ),
                    watch,
                ) from None


def _role_view(state: TensorDictBase, role: str) -> TensorDict:
    out = TensorDict({PARAMS: state.get((PARAMS, role))}, batch_size=[])
    if (OPT_STATE, role) in state.keys(include_nested=True):
        out.set(OPT_STATE, state.get((OPT_STATE, role)))
    return out


def _equal(a: TensorDictBase, b: TensorDictBase) -> bool:
    try:
        assert_trees_equal(a, b)
    except AssertionError:
        return False
    return True
