"""``purestep.compile(step)``: a step built by purestep as one compiled graph per variant."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, overload

import attrs
import torch
from tensordict import TensorDict, TensorDictBase

from purestep import rng, tree
from purestep._keys import EMA, EMA_BUFFERS, OPT_STATE, PARAMS, RNG, SKIP, STEP
from purestep.compile import _ops
from purestep.compile._backend import Compiled, compile_graph, inductor_options
from purestep.compile._core import OutSpec, Phase, core_fn
from purestep.compile._cudagraph import Capturer, CudaCapturer, StepGraph, used_inputs
from purestep.compile._kernels import HostScalars, OpaquePlan, Plan, plan_for
from purestep.compile._plan import Guard, Layout, Parts, decompose, layout_of
from purestep.compile._result import Results, finish, skipped, write_params
from purestep.compile._trace import Traced, trace
from purestep.step import (
    Batch,
    EMAStep,
    Step,
    TrainStep,
    as_batch,
    is_bound,
    with_index,
)

__all__ = ["CompileStats", "CompiledStep", "compile"]

_KWARGS = ("backend", "options")


@attrs.frozen
class CompileStats:
    """What a compiled step has compiled and run (see :meth:`CompiledStep.stats`).

    Attributes:
        calls: steps run.
        compiles: graphs traced and compiled (one per variant, two for a
            variant of a step that skips non-finite updates).
        recompiles: compiles for a variant whose due roles and EMA phase had
            been compiled before (a new batch shape, dtype or state layout).
        graphs: distinct variants cached now.
        variants: one line per cached variant: due roles, EMA phase, graph part.
        trace_s: seconds spent tracing, per compile, in order.
        compile_s: seconds spent compiling, per compile, in order.
        specialized: for ``dynamic=True``, where a batch size was fixed anyway
            (``file:line``), per compile that had one.
        cudagraph_captures: whole-step CUDA graphs captured (``mode="reduce-overhead"``).
        cudagraph_skipped: per graph that runs without a CUDA graph although the
            mode asks for one, why.
    """

    calls: int
    compiles: int
    recompiles: int
    graphs: int
    variants: tuple[str, ...]
    trace_s: tuple[float, ...]
    compile_s: tuple[float, ...]
    specialized: tuple[str, ...]
    cudagraph_captures: int
    cudagraph_skipped: tuple[str, ...]


@attrs.define
class _Entry:
    """One compiled graph."""

    traced: Traced
    fn: Compiled
    spec: OutSpec
    guard: Guard
    graph: StepGraph | None = None


@attrs.define
class _Variants:
    """The graphs compiled for one input structure: its optimizer plans and a graph per flags."""

    plans: dict[str, Plan]
    entries: dict[Hashable, list[_Entry]] = attrs.field(factory=dict)


@attrs.define
class _Counters:
    calls: int = 0
    compiles: int = 0
    recompiles: int = 0
    trace_s: list[float] = attrs.field(factory=list)
    compile_s: list[float] = attrs.field(factory=list)
    specialized: list[str] = attrs.field(factory=list)
    seen: set[Hashable] = attrs.field(factory=set)
    cudagraph_skipped: list[str] = attrs.field(factory=list)


def _check_kwargs(kwargs: dict[str, Any]) -> None:
    bad = sorted(set(kwargs) - set(_KWARGS))
    if bad:
        raise TypeError(
            f"purestep.compile: unsupported torch.compile arguments {bad}; supported: "
            f"mode, dynamic, {', '.join(_KWARGS)} (the step is always one full graph per variant)"
        )


class CompiledStep:
    """The step returned by :func:`compile` (see there). Call it like the step it compiles."""

    def __init__(
        self,
        step: Any,
        *,
        mode: str | None = None,
        dynamic: bool = False,
        backend: str | Callable[..., Any] = "inductor",
        options: dict[str, Any] | None = None,
        capturer: Capturer | None = None,
    ) -> None:
        self._parts: Parts = decompose(step)
        self._mode = mode
        self._dynamic = bool(dynamic)
        self._backend = backend
        self._options, self._cudagraphs = inductor_options(mode, options)
        self._capturer = capturer  # None: CUDA graphs on CUDA (tests pass an emulation)
        self._cache: dict[Hashable, _Variants] = {}
        self._handles: list[int] = []
        self._counters = _Counters()
        self._finalizer = weakref.finalize(self, _release_all, self._handles)

    # ------------------------------------------------------------------ public

    @property
    def step(self) -> Any:
        """The step this compiles."""
        return self._parts.outer

    @property
    def donate(self) -> bool:
        """Whether the step reuses its input state's buffers (as the compiled step)."""
        return self._parts.train.donate

    def prepare(self, state: TensorDictBase) -> TensorDict:
        """The compiled step's ``prepare``: adds the keys it keeps (EMA, skip counters)."""
        return self._parts.outer.prepare(state)

    def stats(self) -> CompileStats:
        """Counts of compiles and calls so far.

        Example:
            >>> import purestep as ps
            >>> gf = ps.value_and_grad(lambda p, b, k: (p["m", "w"].sum(), {}))
            >>> c = ps.compile(ps.train_step(gf, {"m": ps.optim.sgd(0.1)}))
            >>> c.stats().compiles
            0
        """
        c = self._counters
        return CompileStats(
            calls=c.calls,
            compiles=c.compiles,
            recompiles=c.recompiles,
            graphs=sum(len(es) for v in self._cache.values() for es in v.entries.values()),
            variants=tuple(
                _describe(k, f)
                for k, v in self._cache.items()
                for f, es in v.entries.items()
                for _ in es
            ),
            trace_s=tuple(c.trace_s),
            compile_s=tuple(c.compile_s),
            specialized=tuple(c.specialized),
            cudagraph_captures=sum(
                e.graph.captures
                for v in self._cache.values()
                for es in v.entries.values()
                for e in es
                if e.graph is not None
            ),
            cudagraph_skipped=tuple(c.cudagraph_skipped),
        )

    def __call__(self, state: TensorDictBase, batch: Batch) -> tuple[TensorDict, TensorDict]:
        parts = self._parts
        train = parts.train
        if not self._prepared(state):
            state = parts.outer.prepare(state)
        batch_td = with_index(as_batch(batch))
        step = int(state.get(STEP))
        roles = train.due_roles(step)
        self._check_functional(state)
        ema_copy = tuple(
            tuple(
                "skip" if step % layer.period(r) else "copy" if step < layer.start_step else "avg"
                for r in layer.roles
            )
            for layer in parts.emas
        )
        key = rng.fold_in(state.get(RNG), state.get(STEP))
        if self._cudagraphs and self.donate:
            first = tree.first_leaf(batch_td)
            if first is not None and first.device.type == "cuda":
                key = key.to(first.device)  # a CUDA graph reads no host tensor
        self._counters.calls += 1
        ema_buf = parts.ema_buffer_roles
        lay = layout_of(state, batch_td, key, roles, parts.ema_roles, ema_buffer_roles=ema_buf)
        if not train.skip_nonfinite:
            res, host = self._run("all", lay, roles, ema_copy)
            return finish(parts, state, res, host, res.metrics(), res.norms(), res.buffers())
        res, _ = self._run("grads", lay, roles, ema_copy)
        metrics = res.metrics()
        if not bool(res.take("finite")[0]):
            return skipped(parts, state, metrics, step)
        new_bufs = res.buffers()
        if res.spec.written:
            state = write_params(state, res, self.donate)
        grads = {r: res.take(("grads", r)) for r in res.spec.updated}
        grads_like = {r: res.spec.grads[r].build(g) for r, g in grads.items()}
        norms = res.norms()
        lay2 = layout_of(
            state,
            batch_td,
            key,
            roles,
            parts.ema_roles,
            grads,
            grads_like,
            ema_buffer_roles=ema_buf,
            new_buffers=new_bufs,
        )
        res2, host = self._run("apply", lay2, roles, ema_copy)
        return finish(parts, state, res2, host, metrics, norms, new_bufs)

    # ------------------------------------------------------------------ internals

    def _prepared(self, state: TensorDictBase) -> bool:
        """Whether ``prepare`` would return ``state`` as it is (checked without walking the tree)."""
        keys = state.keys()
        if PARAMS not in keys or OPT_STATE not in keys:
            return False
        params, opt = state.get(PARAMS).keys(), state.get(OPT_STATE).keys()
        train = self._parts.train
        if any(r not in params or r not in opt for r in train.optimizers):
            return False
        if train.skip_nonfinite and SKIP not in keys:
            return False
        for group, roles in (
            (EMA, self._parts.ema_roles),
            (EMA_BUFFERS, self._parts.ema_buffer_roles),
        ):
            if roles and (
                group not in keys or any(r not in state.get(group).keys() for r in roles)
            ):
                return False
        return all(r in params for r in self._parts.ema_roles)

    def _check_functional(self, state: TensorDictBase) -> None:
        params = state.get(PARAMS)
        for role in params.keys():
            if is_bound(params.get(role)):
                raise ValueError(
                    f"purestep.compile: role {role!r} is bound to a module (FSDP); compiled "
                    "steps support functional roles only (run bound roles eagerly)"
                )

    def _plans(self, lay: Layout, roles: Sequence[str]) -> dict[str, Plan]:
        plans: dict[str, Plan] = {}
        for r in roles:
            opt, params = lay.groups["opt", r], lay.groups[PARAMS, r]
            assert opt.tree is not None and params.tree is not None
            transform = self._parts.train.optimizers[r]
            handle = _ops.register(transform, params.tree, opt.tree, r)
            self._handles.append(handle)
            plans[r] = plan_for(transform, opt.tree, params.slice(lay.leaves), handle)
        return plans

    def _run(
        self, phase: Phase, lay: Layout, roles: Sequence[str], ema_copy: tuple[tuple[str, ...], ...]
    ) -> tuple[Results, dict[str, HostScalars]]:
        if phase == "grads":
            ema_copy = ()  # the grads do not depend on the EMA phase
        base = (phase, tuple(roles), ema_copy, self.donate)
        vkey = (base, lay.structure())
        variants = self._cache.get(vkey)
        if variants is None:
            variants = _Variants(self._plans(lay, roles) if phase != "grads" else {})
        host: dict[str, HostScalars] = {}
        if phase != "grads":
            for r in roles:
                host[r] = variants.plans[r].host(lay.groups["opt", r].slice(lay.leaves))
                lay.add_list(("scalars", r), host[r].inputs)
        flags = tuple((r, h.flags) for r, h in host.items())
        entry = next(
            (
                e
                for e in variants.entries.get(flags, ())
                if e.guard.check(lay.leaves) and e.traced.fits(lay.leaves)
            ),
            None,
        )
        if entry is None:
            entry = self._compile(phase, lay, roles, ema_copy, base, variants.plans, dict(flags))
            self._cache[vkey] = variants
            variants.entries.setdefault(flags, []).append(entry)
        outs = entry.graph(*lay.leaves) if entry.graph is not None else entry.fn(*lay.leaves)
        return Results(lay, entry.spec, outs, self._small), host

    def _small(self, ts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Metrics and norms, cloned out of a CUDA graph's memory (its next replay overwrites it)."""
        return [t.clone() for t in ts] if self._cudagraphs else ts

    def _compile(
        self,
        phase: Phase,
        lay: Layout,
        roles: Sequence[str],
        ema_copy: tuple[tuple[str, ...], ...],
        base: Hashable,
        plans: dict[str, Plan],
        flags: dict[str, Hashable],
    ) -> _Entry:
        spec = OutSpec()

        def subset(role: str, grads_like: TensorDictBase) -> Plan:
            opt, params = lay.groups["opt", role], lay.groups[PARAMS, role]
            assert opt.tree is not None and params.tree is not None
            transform = self._parts.train.optimizers[role]
            h = _ops.register(transform, params.tree, opt.tree, role, grads=grads_like)
            self._handles.append(h)
            return OpaquePlan(h)

        fn = core_fn(
            self._parts,
            lay,
            roles=roles,
            ema_copy=ema_copy,
            plans=plans,
            flags=flags,
            phase=phase,
            spec=spec,
            subset=subset,
        )
        dyn = None
        if self._dynamic:
            b = lay.groups["batch"]
            dyn = [b.start <= i < b.start + b.count for i in range(len(lay.leaves))]
        t0 = time.perf_counter()
        traced = trace(fn, lay.leaves, dynamic=dyn)
        t1 = time.perf_counter()
        compiled = compile_graph(
            traced.gm,
            lay.leaves,
            backend=self._backend,
            options=self._options,
            dynamic=self._dynamic,
        )
        t2 = time.perf_counter()
        c = self._counters
        c.compiles += 1
        if base in c.seen:
            c.recompiles += 1
        c.seen.add(base)
        c.trace_s.append(t1 - t0)
        c.compile_s.append(t2 - t1)
        if traced.specialized:
            c.specialized.append(traced.specialized)
        for r in spec.updated if phase != "grads" else ():  # opt leaves a donated step sets anew
            opt = lay.groups["opt", r]
            assert opt.tree is not None
            paths = tree.paths(opt.tree)
            fresh = {i for i, (kind, _) in enumerate(spec.sources["opt", r]) if kind == "out"}
            fresh.update(i for i, _ in plans[r].host(opt.slice(lay.leaves)).replace)
            spec.replaced[r] = [(i, paths[i]) for i in sorted(fresh)]
        guard = Guard.of(lay.leaves, traced.dynamic)
        guard.check(lay.leaves)
        graph = self._step_graph(compiled, traced, lay, plans, phase) if self._cudagraphs else None
        return _Entry(traced=traced, fn=compiled, spec=spec, guard=guard, graph=graph)

    def _step_graph(
        self, fn: Compiled, traced: Traced, lay: Layout, plans: dict[str, Plan], phase: Phase
    ) -> StepGraph | None:
        """The variant under a whole-step CUDA graph, or None (the reason goes to the stats)."""
        why = self._no_graph(traced, lay, plans, phase)
        if why is not None:
            self._counters.cudagraph_skipped.append(f"{phase}: {why}")
            return None
        used = used_inputs(traced.gm)
        copied_groups = {"key", "batch"}
        static: list[int] = []
        copied: list[int] = []
        for name, g in lay.groups.items():
            kind = name[0] if isinstance(name, tuple) else name
            idx = [i for i in range(g.start, g.start + g.count) if i in set(used)]
            (copied if kind in copied_groups or kind == "scalars" else static).extend(idx)
        return StepGraph(fn, static, copied, self._capturer or CudaCapturer())

    def _no_graph(
        self, traced: Traced, lay: Layout, plans: dict[str, Plan], phase: Phase
    ) -> str | None:
        if not self.donate:
            return "the step does not donate its state (outputs of a CUDA graph are overwritten by its next replay)"
        if self._dynamic:
            return "dynamic=True (a CUDA graph has fixed shapes)"
        for r, plan in plans.items():
            if not plan.capturable:
                name = self._parts.train.optimizers[r].name
                return f"role {r!r}: optimizer {name} reads its count on the host (no device-scalar kernel)"
        if self._capturer is not None:
            return None
        devices = {lay.leaves[i].device for i in used_inputs(traced.gm)}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            return f"inputs on {sorted(str(d) for d in devices)} (CUDA graphs need one CUDA device)"
        return None


def _describe(vkey: Hashable, flags: Hashable) -> str:
    base: tuple[Any, ...] = vkey[0]  # type: ignore[index]
    phase, roles, ema_copy, donate = base
    ema = "" if not ema_copy else f", ema {[list(m) for m in ema_copy]}"
    fl = [f"{r}: {f}" for r, f in flags if f != ()]  # type: ignore[attr-defined]
    extra = f", flags {fl}" if fl else ""
    return f"{phase}: roles {list(roles)}{ema}{extra}{', donated' if donate else ''}"


def _release_all(handles: list[int]) -> None:
    for h in handles:
        _ops.release(h)


@overload
def compile(
    step: TrainStep | EMAStep, *, mode: str | None = None, dynamic: bool = False, **kw: Any
) -> CompiledStep: ...


@overload
def compile(step: Step, *, mode: str | None = None, dynamic: bool = False, **kw: Any) -> Step: ...


def compile(
    step: Any,
    *,
    mode: str | None = None,
    dynamic: bool = False,
    **torch_compile_kwargs: Any,
) -> Step:
    """Compile a whole training step: forward, backward, grad norms, optimizers, EMA, metrics.

    ``step`` is built by :func:`~purestep.train_step` (with ``accumulate``,
    ``every``, any optimizer, clipping), optionally wrapped by
    :func:`~purestep.with_ema` / :func:`~purestep.skip_nonfinite`; the result
    has the same signature, ``prepare`` and results (see the README's
    "Compiled steps" for the tolerance and what is bitwise). A composite step
    with a ``map_inner(fn)`` method (the NFT outer step) gets its inner train
    steps compiled; its own orchestration (sampling, the old-policy update)
    stays eager.

    The host reads ``state["step"]`` (a CPU scalar: no device sync), picks the
    due roles and derives the step key, as the eager step does; the graph gets
    every state and batch leaf as a flat input and returns the new ones. One
    graph is compiled per *variant*: per distinct set of due roles (``every``),
    EMA phase (before/after ``start_step``) and input layout (shapes, dtypes,
    devices). A step with ``skip_nonfinite`` compiles two graphs per variant
    (grads, then updates) and reads the finite flag in between, as the eager
    step does. Nothing recompiles in steady state; :meth:`CompiledStep.stats`
    gives the counts.

    Args:
        step: the step to compile.
        mode: a ``torch.compile`` mode. ``"reduce-overhead"`` (or any mode with
            CUDA graphs) captures the donated step in a CUDA graph on CUDA (see
            the README); on CPU it compiles as the default mode.
        dynamic: keep the batch size symbolic, so a new batch size reuses the
            graph when the step allows it (``stats().specialized`` names the
            line that fixed it otherwise).
        **torch_compile_kwargs: ``backend`` (``"inductor"``, the default;
            ``"eager"`` runs the traced graph uncompiled; or a ``torch.compile``
            backend callable) and ``options`` (inductor config).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import purestep as ps
        >>> net = nn.Linear(2, 1)
        >>> def loss_fn(params, batch, key):
        ...     return ((ps.call(net, params["m"], batch["x"]) - batch["y"]) ** 2).mean(), {}
        >>> opt = {"m": ps.optim.adamw(lr=1e-2)}
        >>> step = ps.compile(ps.train_step(ps.value_and_grad(loss_fn), opt), backend="eager")
        >>> state = ps.init_state({"m": net}, opt, seed=0)
        >>> state, metrics = step(state, {"x": torch.ones(4, 2), "y": torch.zeros(4, 1)})
        >>> int(state["step"]), step.stats().compiles
        (1, 1)
    """
    _check_kwargs(torch_compile_kwargs)
    if isinstance(step, CompiledStep):
        return step
    map_inner = getattr(step, "map_inner", None)
    if callable(map_inner) and not isinstance(step, TrainStep | EMAStep):
        out: Step = map_inner(
            lambda inner: compile(inner, mode=mode, dynamic=dynamic, **torch_compile_kwargs)
        )
        return out
    return CompiledStep(step, mode=mode, dynamic=dynamic, **torch_compile_kwargs)
