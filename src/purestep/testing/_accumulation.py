"""``assert_accumulation_invariant``: ``accumulate(grad_fn, k)`` gives the same gradients for every k.

By default the check compares the *gradients* each optimizer receives (read
before the optimizer applies them, all k from the same state), not the states
after the optimizer: an adaptive optimizer (Adam) divides a leaf's rounding
noise by its own tiny second moment, so a parameter whose true gradient is
exactly zero (a key bias in attention) moves by about ``lr`` in a direction set
by the noise, and the states of two microbatch splits differ by up to ``2 lr``
although the gradients agree to rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import attrs
import torch
from tensordict import TensorDict, TensorDictBase

from purestep import tree
from purestep.optim import Transform
from purestep.step import Batch, TrainStep, as_batch
from purestep.testing._compare import close_failures, report, snapshot
from purestep.testing._global_rng import RngWatch
from purestep.testing._steps import StepFn, explain, prepare, run_watched

__all__ = ["assert_accumulation_invariant"]

_MAX_DEPTH = 6  # wrappers nested around a TrainStep (with_ema, methods' steps)


class _GradRecorder:
    """Optimizers that record the gradients they are given and leave params and state as they are."""

    def __init__(self) -> None:
        self.grads: list[tuple[str, TensorDict]] = []

    def transform(self, role: str, inner: Transform) -> Transform:
        def step_fn(
            grads: TensorDictBase,
            state: TensorDictBase,
            params: TensorDictBase,
            *,
            donate: bool = False,
        ) -> tuple[TensorDict, TensorDict]:
            self.grads.append((role, snapshot(grads)))
            return params, state

        def update_fn(
            grads: TensorDictBase,
            state: TensorDictBase,
            params: TensorDictBase | None,
            *,
            donate: bool = False,
        ) -> tuple[TensorDict, TensorDict]:
            self.grads.append((role, snapshot(grads)))
            return tree.zeros_like(grads), state

        return Transform(
            init_fn=inner.init_fn,
            update_fn=update_fn,
            step_fn=step_fn,
            name=f"gradient recorder of {inner.name}",
            hparams=inner.hparams,
        )


def _recording(step: Any, recorder: _GradRecorder, depth: int = 0) -> Any:
    """``step`` with every ``TrainStep`` inside it recording its gradients (None: no TrainStep)."""
    if isinstance(step, TrainStep):
        return attrs.evolve(
            step,
            optimizers={r: recorder.transform(r, t) for r, t in step.optimizers.items()},
            skip_nonfinite=False,  # record non-finite gradients too
            max_consecutive=None,
        )
    if depth >= _MAX_DEPTH or not attrs.has(type(step)):
        return None
    changes = {}
    for field in attrs.fields(type(step)):
        if not field.init:
            continue
        new = _recording(getattr(step, field.name), recorder, depth + 1)
        if new is not None:
            changes[field.alias or field.name] = new
    return attrs.evolve(step, **changes) if changes else None


def _scale(grads: TensorDictBase) -> float:
    """The largest finite ``|g|`` over the leaves (0.0 for none)."""
    out = 0.0
    for leaf in tree.leaves(grads):
        t = tree.local(leaf).detach()
        if t.numel() == 0 or not (t.is_floating_point() or t.is_complex()):
            continue
        a = t.abs().to(torch.float64)
        a = a[torch.isfinite(a)]
        if a.numel():
            out = max(out, float(a.max()))
    return out


def _problem(
    actual: TensorDictBase, expected: TensorDictBase, rtol: float, atol: float, what: str
) -> str | None:
    """The message for ``actual`` vs ``expected`` (a key-structure difference too), or None."""
    try:
        failures = close_failures(actual, expected, rtol=rtol, atol=atol, what=what)
    except AssertionError as e:  # key structure differs
        return str(e)
    return report(what, failures, f" (rtol={rtol}, atol={atol})") if failures else None


def _grad_failures(
    got: list[tuple[str, TensorDict]],
    ref: list[tuple[str, TensorDict]],
    rtol: float,
    atol: float,
) -> list[str]:
    """Messages for every update whose gradients differ beyond the tolerance, naming every leaf."""
    if [r for r, _ in got] != [r for r, _ in ref]:
        return [
            f"the optimizers were given gradients for roles {[r for r, _ in got]}, "
            f"vs {[r for r, _ in ref]}"
        ]
    out = []
    for n, ((role, g), (_, g0)) in enumerate(zip(got, ref, strict=True)):
        scale = _scale(g0)
        a = TensorDict({role: g}, batch_size=[])
        b = TensorDict({role: g0}, batch_size=[])
        try:
            failures = close_failures(a, b, rtol=rtol, atol=atol * scale, what=f"role {role!r}")
        except AssertionError as e:  # key structure differs
            out.append(str(e))
            continue
        if failures:
            where = f"role {role!r}" if len(ref) == len({r for r, _ in ref}) else f"update {n}"
            out.append(
                report(
                    where,
                    failures,
                    f" (allowed |a - b| <= atol * G + rtol * |b| with rtol={rtol}, atol={atol}, "
                    f"G={scale:.3g} the largest reference gradient of role {role!r})",
                )
            )
    return out


def _compare_grads(
    make_step: Callable[[int], StepFn],
    ref_step: StepFn,
    state: TensorDictBase,
    seq: list[Batch],
    ks: Sequence[int],
    rtol: float,
    atol: float,
    check_metrics: bool,
    watch: RngWatch,
) -> None:
    recorders: dict[int, tuple[_GradRecorder, StepFn]] = {}
    for k in ks:
        recorder = _GradRecorder()
        built = make_step(k)
        recording = _recording(built, recorder)
        if recording is None:
            raise TypeError(
                "assert_accumulation_invariant(compare='grads') reads the gradients each optimizer "
                "is given, so it needs steps built by purestep (train_step, with_ema, "
                f"skip_nonfinite, a method's make_step); make_step({k}) returned "
                f"{type(built).__name__}. Pass compare='state' to compare the states after the "
                "optimizer instead"
            )
        recorders[k] = (recorder, recording)
    compared = 0
    for i, b in enumerate(seq):
        batch = snapshot(as_batch(b))
        got: dict[int, tuple[list[tuple[str, TensorDict]], TensorDictBase]] = {}
        for k, (recorder, recording) in recorders.items():
            recorder.grads.clear()
            _, metrics = watch.call(
                f"step {i} with k={k}", recording, snapshot(state), snapshot(batch)
            )
            got[k] = (list(recorder.grads), snapshot(metrics))
        ref_grads, ref_metrics = got[ks[0]]
        compared += len(ref_grads)
        problems = []
        for k in ks[1:]:
            grads, metrics = got[k]
            for p in _grad_failures(grads, ref_grads, rtol, atol):
                problems.append(f"gradients at step {i} with k={k} vs k={ks[0]}: {p}")
            if check_metrics:
                what = f"metrics of step {i} with k={k} vs k={ks[0]}"
                problem = _problem(metrics, ref_metrics, rtol, atol, what)
                if problem is not None:
                    problems.append(problem)
        if problems:
            raise AssertionError("accumulation invariance: " + "\n".join(problems))
        if i + 1 < len(seq):
            state, _ = watch.call(f"step {i} with k={ks[0]}", ref_step, state, snapshot(batch))
    if compared == 0:
        raise AssertionError(
            "accumulation invariance: no optimizer was given gradients in any step, so "
            "nothing was compared (are the roles due at these steps?)"
        )


def assert_accumulation_invariant(
    make_step: Callable[[int], StepFn],
    state: TensorDictBase,
    batch: Batch | Sequence[Batch],
    *,
    ks: Sequence[int] = (1, 2, 4),
    rtol: float | None = None,
    atol: float | None = None,
    check_metrics: bool = True,
    compare: Literal["grads", "state"] = "grads",
) -> None:
    """Assert that ``make_step(k)`` computes the same gradients (and metrics) for every ``k`` in ``ks``.

    ``make_step(k)`` should build the step with ``accumulate(grad_fn, k)``. The
    first ``k`` is the reference; the others must match within the tolerance
    (float summation order differs between microbatch splits).

    With ``compare="grads"`` (the default) each batch is run by every ``make_step(k)``
    from the same state, with the optimizers replaced by recorders of the
    gradients they are given (before clipping, moments or the learning rate);
    then the reference step advances the state to the next batch. An element
    passes when ``|g_k - g_ref| <= atol * G + rtol * |g_ref|``, where ``G`` is the
    largest ``|g_ref|`` of that role in that update: rounding differences are
    a few ulp of the largest terms summed, so a leaf whose true gradient is
    zero (an attention key bias) differs by noise on the scale of the others.
    Defaults: ``rtol=1e-5, atol=1e-5`` (fp32; loosen them for bf16/fp16). This
    needs steps built by purestep (``train_step``, ``with_ema``,
    ``skip_nonfinite``, the methods' ``make_step``).

    With ``compare="state"`` every step runs over all batches and the final
    states (params, optimizer state, buffers, EMA) are compared element-wise,
    ``|s_k - s_ref| <= atol + rtol * |s_ref|`` (defaults ``rtol=1e-5,
    atol=1e-6``): it also works for steps of your own, but an adaptive
    optimizer turns the rounding noise of zero-gradient leaves into
    differences of about ``lr``.

    Metrics (the loss) are compared with ``rtol`` and ``atol`` in both modes.

    Raises:
        AssertionError: naming the step, ``k`` and every key path that differs
            (with its max abs/rel difference); when a step drew from torch's
            global RNG, the message says so.
        TypeError: ``compare="grads"`` with a step not built by purestep.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import purestep as ps
        >>> net = nn.Linear(2, 1)
        >>> opt = {"m": ps.optim.adamw(1e-1)}
        >>> gf = ps.value_and_grad(lambda p, b, k: (ps.call(net, p["m"], b["x"]).pow(2).mean(), {}))
        >>> assert_accumulation_invariant(lambda k: ps.train_step(ps.accumulate(gf, k), opt),
        ...     ps.init_state({"m": net}, opt, seed=0), {"x": torch.randn(8, 2, generator=torch.Generator().manual_seed(0))})
    """
    seq = [batch] if not isinstance(batch, Sequence) else list(batch)
    if not ks:
        raise ValueError("assert_accumulation_invariant: ks is empty")
    if compare not in ("grads", "state"):
        raise ValueError(
            f"assert_accumulation_invariant: compare must be 'grads' or 'state', got {compare!r}"
        )
    default_atol = 1e-5 if compare == "grads" else 1e-6
    rtol = 1e-5 if rtol is None else rtol
    atol = default_atol if atol is None else atol
    ref_step = make_step(ks[0])
    state = snapshot(prepare(ref_step, state))
    watch = RngWatch()
    try:
        if compare == "grads":
            _compare_grads(make_step, ref_step, state, seq, ks, rtol, atol, check_metrics, watch)
            return
        ref_state, ref_metrics = run_watched(ref_step, snapshot(state), seq, watch, f"k={ks[0]}")
        problems = []
        for k in ks[1:]:
            s, ms = run_watched(make_step(k), snapshot(state), seq, watch, f"k={k}")
            problem = _problem(s, ref_state, rtol, atol, f"state with k={k} vs k={ks[0]}")
            if problem is not None:
                problems.append(problem)
            if not check_metrics:
                continue
            for i, (m, m0) in enumerate(zip(ms, ref_metrics, strict=True)):
                what = f"metrics of step {i} with k={k} vs k={ks[0]}"
                problem = _problem(m, m0, rtol, atol, what)
                if problem is not None:
                    problems.append(problem)
        if problems:
            raise AssertionError("accumulation invariance: " + "\n".join(problems))
    except AssertionError as e:
        raise explain(e, watch) from None
