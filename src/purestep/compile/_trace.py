"""Tracing a step's core into an aten graph: ``make_fx`` over fake tensors.

Why not dynamo (``torch.compile`` of the step itself): the eager step keeps
per-call context in ``contextvars`` (live roles, the current microbatch, the
accumulation sink), builds TensorDicts, swaps tensors into module slots and
calls ``torch.autograd.grad`` / ``backward``. Dynamo breaks the graph on the
first ``ContextVar.get`` (measured: torch 2.13, "Dynamo does not know how to
trace method `get` of class `ContextVar`") and on ``autograd.grad`` unless a
private flag is set. ``make_fx`` instead *runs* that Python once over fake
tensors and records every aten op, autograd's backward included: the eager
code is traced as is (trace times: docs/ARCHITECTURE.md, "compile").

The price: Python control flow is evaluated once, so the graph is specialised
on every Python value the step reads (the host decisions in ``_plan`` make
those explicit), and a loss that reads a tensor's *value* on the host cannot
be traced (a clear error says where). The traced tensors are ``FakeTensor``s,
so code that has a host fast path for plain tensors checks the exact type
(``rng.fold_in`` does). ``torch.compiler.is_compiling()`` stays False:
TensorDict has ~160 branches on it (measured: with it set, the eager DMD2 step
diverges from itself by 3 % on its second step), and the eager code is what
is traced.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch.fx.experimental.proxy_tensor import make_fx

__all__ = ["TraceError", "Traced", "trace"]

_FAKE_ERRORS = {
    "UnsupportedOperatorException",
    "DynamicOutputShapeException",
    "UnsupportedFakeTensorException",
    "DataDependentOutputException",
}


class TraceError(RuntimeError):
    """A step could not be traced into one graph (the message says where and why)."""


@attrs.frozen
class Traced:
    """A traced core.

    Attributes:
        gm: the aten graph (``gm(*leaves) -> list[Tensor]``).
        guard: with a dynamic batch, the compiled check of the batch leaves'
            shapes against the graph's shape guards (``None`` when static).
        dynamic: indices of the inputs whose leading dim is symbolic.
        specialized: where a dynamic batch size was specialised (``file:line``), if it was.
    """

    gm: torch.fx.GraphModule
    guard: Any
    dynamic: tuple[int, ...]
    specialized: str | None

    def fits(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Whether ``inputs`` satisfy the graph's shape guards (always True when static)."""
        if self.guard is None:
            return True
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

        env = {"L": {f"t{j}": inputs[i] for j, i in enumerate(self.dynamic)}}
        return bool(eval(self.guard, SYMPY_INTERP, env))


def _user_frame(tb: Any) -> str:
    """The innermost frame outside torch and tensordict: where the user's code was."""
    frames = traceback.extract_tb(tb)
    for fr in reversed(frames):
        f = fr.filename.replace("\\", "/")
        if "/torch/" not in f and "/tensordict/" not in f and "/purestep/compile/" not in f:
            return f"{fr.filename}:{fr.lineno} ({fr.line})"
    return "unknown location"


def _any_frame(tb: Any) -> str:
    """Every frame's file, one per line (to find where a trace failed)."""
    return "\n".join(fr.filename.replace("\\", "/") for fr in traceback.extract_tb(tb))


def _fake_inputs(mode: Any, inputs: Sequence[torch.Tensor], dynamic: Sequence[bool]) -> list[Any]:
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    out = []
    for t, dyn in zip(inputs, dynamic, strict=True):
        if dyn and t.dim() > 0:
            sizes = [DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (t.dim() - 1)
            ctx: Any = StatelessSymbolicContext(dynamic_sizes=sizes)
            out.append(mode.from_tensor(t, symbolic_context=ctx))
        else:
            out.append(mode.from_tensor(t, static_shapes=True))
    return out


def _specialized(shape_env: Any) -> str | None:
    """``file:line`` of the first guard that fixed a symbolic size to a constant."""
    for g in getattr(shape_env, "guards", []):
        expr = g.expr
        if getattr(expr, "is_Equality", False) and any(a.is_number for a in expr.args):
            loc = getattr(g.sloc, "framework_loc", None) or getattr(g.sloc, "maybe_user_loc", None)
            if loc is None:
                return "unknown location"
            if isinstance(loc, str):
                return loc
            return f"{getattr(loc, 'filename', '?')}:{getattr(loc, 'lineno', '?')}"
    return None


def trace(
    fn: Callable[..., list[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    *,
    dynamic: Sequence[bool] | None = None,
) -> Traced:
    """Trace ``fn(*inputs)`` into an aten graph over fake copies of ``inputs``.

    Args:
        fn: a function of tensors returning a list of tensors.
        inputs: example inputs (real tensors; only their metadata is used).
        dynamic: per input, whether its leading dim is symbolic (the batch dim
            with ``dynamic=True``); default all static.

    Raises:
        TraceError: ``fn`` reads a tensor's value on the host, or uses an op
            that cannot run on fake tensors; the message names the user frame.

    Example:
        >>> t = trace(lambda x: [x * 2], [torch.ones(3)])
        >>> t.gm(torch.ones(3))[0]
        tensor([2., 2., 2.])
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    dyn = list(dynamic) if dynamic is not None else [False] * len(inputs)
    shape_env = ShapeEnv() if any(dyn) else None
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=shape_env)
    fakes = _fake_inputs(mode, inputs, dyn)
    try:
        with mode:
            gm = make_fx(fn, tracing_mode="real", record_stack_traces=False)(*fakes)
    except Exception as e:
        name = type(e).__name__
        where = _user_frame(e.__traceback__)
        if (
            "DataDependent" in name or "GuardOnData" in name
        ) and "/purestep/step/_call.py" in _any_frame(e.__traceback__):
            raise TraceError(
                "purestep.compile: call(..., key=) seeds torch's generator for module dropout "
                "from the key on the host, which a traced step cannot do; compile steps whose "
                "modules draw no random numbers, or draw noise with purestep.rng in the loss"
            ) from e
        if "DataDependent" in name or "GuardOnData" in name:
            raise TraceError(
                "purestep.compile: the step reads a tensor's value on the host at "
                f"{where}; a compiled step traces the step once, so values must stay on "
                "device (use torch.where instead of `if tensor:`, keep scalars as tensors)"
            ) from e
        if name in _FAKE_ERRORS:
            raise TraceError(
                f"purestep.compile: the step calls an op that cannot be traced at {where}: "
                f"{name}: {e}"
            ) from e
        raise  # the step's own errors (bad loss, missing keys) surface as in eager
    if shape_env is None:
        return Traced(gm=gm, guard=None, dynamic=(), specialized=None)
    dyn_idx = tuple(i for i, d in enumerate(dyn) if d)
    # guards on the dynamic inputs only (every other input is static and matched by the
    # caller), static dims included: a size fixed while tracing shows up as `size == 6`
    code = shape_env.produce_guards_expression([fakes[i] for i in dyn_idx], ignore_static=False)
    return Traced(
        gm=gm,
        guard=compile(code, "<purestep.compile guards>", "eval") if code else None,
        dynamic=dyn_idx,
        specialized=_specialized(shape_env),
    )
