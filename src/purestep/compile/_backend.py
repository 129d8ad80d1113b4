"""Compiling a traced core: inductor without dynamo, or any ``torch.compile`` backend.

The traced graph is already one flat aten graph with fixed input order, so
dynamo has nothing left to do but guard every input on every call (a large
share of a small step's time for the hundreds of inputs of a state; figures in
docs/ARCHITECTURE.md, "compile"). ``torch._inductor.standalone_compile`` compiles the
graph with AOTAutograd and inductor directly and returns a plain callable;
the compiled step checks its inputs itself (``_plan.signature``) and keeps
one callable per variant. Inductor's on-disk caches (FX graph and AOTAutograd
caches, on by default) make a second process's compile of the same graph a
cache hit.

``backend="eager"`` runs the traced aten graph op by op without compiling
(the eager step's arithmetic: tests use it to check the compiled step's
plumbing bitwise); any other ``backend`` is called as a ``torch.compile``
backend, ``backend(gm, example_inputs) -> callable``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["Compiled", "compile_graph", "inductor_options"]

Compiled = Callable[..., Sequence[torch.Tensor]]


def inductor_options(
    mode: str | None, options: dict[str, Any] | None
) -> tuple[dict[str, Any], bool]:
    """Inductor config for ``mode`` plus ``options``, and whether the mode asks for CUDA graphs.

    CUDA graphs are taken out of inductor's config: a compiled purestep step
    captures the whole donated step itself (see ``_cudagraph``).

    Example:
        >>> inductor_options("reduce-overhead", None)
        ({}, True)
        >>> inductor_options(None, {"max_autotune": True})
        ({'max_autotune': True}, False)
    """
    opts: dict[str, Any] = dict(torch._inductor.list_mode_options(mode)) if mode else {}
    opts.update(options or {})
    graphs = bool(opts.pop("triton.cudagraphs", False))
    return opts, graphs


def compile_graph(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[torch.Tensor],
    *,
    backend: str | Callable[..., Any],
    options: dict[str, Any],
    dynamic: bool,
) -> Compiled:
    """Compile ``gm`` (a traced core) into ``fn(*inputs) -> outputs``.

    Example:
        >>> from purestep.compile._trace import trace
        >>> t = trace(lambda x: [x + 1], [torch.ones(2)])
        >>> compile_graph(t.gm, [torch.ones(2)], backend="eager", options={}, dynamic=False)(torch.ones(2))[0]
        tensor([2., 2.])
    """
    if backend == "eager":
        return gm
    if backend == "inductor":
        kwargs: dict[str, Any] = {}
        if _takes_donate_graph_module():  # torch >= 2.12: inductor may consume gm (no copy)
            kwargs["donate_graph_module"] = True
        artifact = torch._inductor.standalone_compile(
            gm,
            list(example_inputs),
            dynamic_shapes="from_graph" if dynamic else "from_example_inputs",
            options={"config_patches": options} if options else {},
            **kwargs,
        )
        return artifact
    if isinstance(backend, str):
        raise ValueError(
            f"purestep.compile: backend={backend!r} is not supported; use 'inductor' (the "
            "default), 'eager', or a torch.compile backend callable"
        )
    fn = backend(gm, list(example_inputs))
    return fn  # type: ignore[no-any-return]


@functools.cache
def _takes_donate_graph_module() -> bool:
    return "donate_graph_module" in inspect.signature(torch._inductor.standalone_compile).parameters
