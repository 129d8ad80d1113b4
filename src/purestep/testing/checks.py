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

from purestep.step import Batch, as_batch, module_tensors, recording_modules
from purestep.testing._compare import assert_trees_close, assert_trees_equal, snapshot

__all__ = [
    "assert_accumulation_invariant",
    "assert_cadence",
    "assert_deterministic",
    "assert_donation_safe",
    "assert_pure",
    "assert_resume_exact",
    "run_steps",
]

StepFn = Callable[[TensorDictBase, Batch], tuple[TensorDictBase, TensorDictBase]]
SaveFn = Callable[[TensorDictBase, str], Any]
LoadFn = Callable[..., TensorDictBase]


def _prepare(step: StepFn, state: TensorDictBase) -> TensorDictBase:
    prep = getattr(step, "prepare", None)
    return prep(state) if prep is not None else state


def run_steps(
    step: StepFn, state: TensorDictBase, batches: Sequence[Batch]
) -> tuple[TensorDictBase, list[TensorDictBase]]:
    """Run ``step`` over ``batches`` from ``state``; returns the final state and all metrics.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> step = lambda s, b: (s, TensorDict({}, []))
        >>> final, ms = run_steps(step, TensorDict({"x": torch.ones(1)}, []), [{}, {}])
        >>> len(ms)
        2
    """
    metrics = []
    for b in batches:
        state, m = step(state, b)
        metrics.append(m)
    return state, metrics


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
    """Assert that ``step(state, batch)`` leaves ``state``, ``batch`` and modules unchanged.

    Also checks that the returned state shares no *modified* buffer with the input
    (the inputs are compared after the step), that calling it twice gives
    the same result (so no hidden state was consumed), and that every module the
    step runs through :func:`purestep.call` (and every module in ``modules``,
    e.g. a frozen teacher called directly) still holds bitwise the same
    parameters and buffers afterwards.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> assert_pure(lambda s, b: (s.apply(lambda t: t + 1), TensorDict({}, [])),
        ...             TensorDict({"w": torch.ones(1)}, []), {"x": torch.ones(2)})
    """
    state = _prepare(step, state)
    before_state = snapshot(state)
    batch_td = as_batch(batch)
    before_batch = snapshot(batch_td)
    batch_keys = list(batch_td.keys())
    given = {id(m): (m, {p: t.detach().clone() for p, t in module_tensors(m)}) for m in modules}
    with recording_modules() as seen:
        out1, m1 = step(state, batch_td)
    _module_changes({**seen, **given})
    assert_trees_equal(state, before_state, what="input state after step (step mutated it)")
    assert_trees_equal(batch_td, before_batch, what="input batch after step (step mutated it)")
    if list(batch_td.keys()) != batch_keys:
        raise AssertionError(
            f"step added keys to the input batch: {sorted(set(batch_td.keys()) - set(batch_keys))}"
        )
    out2, m2 = step(state, batch_td)
    assert_trees_equal(out2, out1, what="second call on the same inputs (hidden state?)")
    assert_trees_equal(m2, m1, what="metrics of a second call on the same inputs")


def assert_deterministic(
    step: StepFn, state: TensorDictBase, batches: Batch | Sequence[Batch], *, runs: int = 2
) -> None:
    """Assert that running ``step`` over ``batches`` from fresh copies of ``state`` is bitwise repeatable.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> assert_deterministic(lambda s, b: (s, TensorDict({}, [])),
        ...                      TensorDict({"w": torch.ones(1)}, []), {"x": torch.ones(1)})
    """
    seq = [batches] if not isinstance(batches, Sequence) else list(batches)
    state = _prepare(step, state)
    ref_state, ref_metrics = run_steps(step, snapshot(state), [snapshot(as_batch(b)) for b in seq])
    ref_state = snapshot(ref_state)
    for r in range(1, runs):
        s, ms = run_steps(step, snapshot(state), [snapshot(as_batch(b)) for b in seq])
        assert_trees_equal(s, ref_state, what=f"state of run {r + 1} vs run 1")
        for i, (m, m0) in enumerate(zip(ms, ref_metrics, strict=True)):
            assert_trees_equal(m, m0, what=f"metrics of step {i} in run {r + 1} vs run 1")


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
    state = _prepare(plain, state)
    keep = snapshot(state)
    s_plain, m_plain = run_steps(plain, state, seq)
    assert_trees_equal(state, keep, what="input state of the donate=False run")
    s_don, m_don = run_steps(donated, snapshot(state), seq)
    compare: Callable[..., None]
    if rtol == 0.0 and atol == 0.0:
        compare = assert_trees_equal
    else:

        def compare(a: Any, b: Any, *, what: str) -> None:
            assert_trees_close(a, b, rtol=rtol, atol=atol, what=what)

    compare(s_don, s_plain, what="state with donate=True vs donate=False")
    for i, (a, b) in enumerate(zip(m_don, m_plain, strict=True)):
        compare(a, b, what=f"metrics of step {i} with donate=True vs donate=False")


def assert_accumulation_invariant(
    make_step: Callable[[int], StepFn],
    state: TensorDictBase,
    batch: Batch | Sequence[Batch],
    *,
    ks: Sequence[int] = (1, 2, 4),
    rtol: float = 1e-5,
    atol: float = 1e-6,
    check_metrics: bool = True,
) -> None:
    """Assert that ``make_step(k)`` gives the same state (and metrics) for every ``k`` in ``ks``.

    ``make_step(k)`` should build the step with ``accumulate(grad_fn, k)``. The
    first ``k`` is the reference; the others must match within ``rtol``/``atol``
    (float summation order differs between microbatch splits).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import purestep as ps
        >>> net = nn.Linear(2, 1)
        >>> opt = {"m": ps.optim.sgd(1e-1)}
        >>> gf = ps.value_and_grad(lambda p, b, k: (ps.call(net, p["m"], b["x"]).pow(2).mean(), {}))
        >>> assert_accumulation_invariant(lambda k: ps.train_step(ps.accumulate(gf, k), opt),
        ...     ps.init_state({"m": net}, opt, seed=0), {"x": torch.randn(8, 2, generator=torch.Generator().manual_seed(0))})
    """
    seq = [batch] if not isinstance(batch, Sequence) else list(batch)
    if not ks:
        raise ValueError("assert_accumulation_invariant: ks is empty")
    ref_step = make_step(ks[0])
    state = _prepare(ref_step, state)
    ref_state, ref_metrics = run_steps(ref_step, snapshot(state), seq)
    for k in ks[1:]:
        s, ms = run_steps(make_step(k), snapshot(state), seq)
        assert_trees_close(
            s, ref_state, rtol=rtol, atol=atol, what=f"state with k={k} vs k={ks[0]}"
        )
        if check_metrics:
            for i, (m, m0) in enumerate(zip(ms, ref_metrics, strict=True)):
                assert_trees_close(
                    m, m0, rtol=rtol, atol=atol, what=f"metrics of step {i} with k={k} vs k={ks[0]}"
                )


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
    state = _prepare(step, state)
    full, _ = run_steps(step, snapshot(state), [snapshot(as_batch(b)) for b in batches])
    full = snapshot(full)
    mid, _ = run_steps(step, snapshot(state), [snapshot(as_batch(b)) for b in batches[:save_at]])
    like = snapshot(mid)
    with tempfile.TemporaryDirectory() as d:
        target = os.path.join(d, "ckpt")
        save(mid, target)
        del mid
        restored = load(target, like=like)
    resumed, _ = run_steps(
        restart_step or step, restored, [snapshot(as_batch(b)) for b in batches[save_at:]]
    )
    assert_trees_equal(resumed, full, what=f"state resumed after step {save_at} vs uninterrupted")


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
    state = _prepare(step, state)
    for b in batches:
        s = int(state.get("step"))
        before = snapshot(_role_view(state, role))
        state, _ = step(state, b)
        after = _role_view(state, role)
        if s % every == 0:
            if _equal(after.get("params"), before.get("params")):
                raise AssertionError(
                    f"cadence: role {role!r} should update at step {s} (every={every}) but its "
                    "params did not change"
                )
        else:
            try:
                assert_trees_equal(after, before, what=f"role {role!r} at step {s}")
            except AssertionError as e:
                raise AssertionError(
                    f"cadence: role {role!r} changed at step {s}, which is not a multiple of "
                    f"every={every}: {e}"
                ) from None


def _role_view(state: TensorDictBase, role: str) -> TensorDict:
    out = TensorDict({"params": state.get(("params", role))}, batch_size=[])
    if ("opt_state", role) in state.keys(include_nested=True):
        out.set("opt_state", state.get(("opt_state", role)))
    return out


def _equal(a: TensorDictBase, b: TensorDictBase) -> bool:
    try:
        assert_trees_equal(a, b)
    except AssertionError:
        return False
    return True
