"""How :mod:`purestep.rng` runs a draw: its rows and device, and fused kernels or eager ops.

A draw is ``rows x n`` elements on one device (:class:`Rows`). On CUDA it runs
as one fused Triton kernel (:mod:`purestep._rng_triton`) when the ``triton``
package is importable and ``PURESTEP_RNG_TRITON`` is not ``0``; elsewhere, and
inside ``torch.compile`` tracing, as eager int64 tensor ops. The first fused
draw of each kind (draw, dtype, index or not, key placement) is compared once
with the eager path on a small probe draw; a kernel that disagrees, or fails
to build or launch, is switched off for the process with a ``RuntimeWarning``.

Example:
    >>> import torch
    >>> from purestep._rng_dispatch import device_of
    >>> device_of(None, torch.tensor(1), torch.arange(2, device="meta"))
    device(type='meta')
"""

from __future__ import annotations

import importlib
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from purestep import _rng_args as _a

__all__ = ["Core", "Rows", "device_of", "draw", "kernels", "rows_of"]

_TRITON_ENV = "PURESTEP_RNG_TRITON"


@dataclass(frozen=True, slots=True)
class Rows:
    """What a draw needs to know about its rows: ``rows x n`` elements on ``dev``.

    ``key`` is the 0-dim key, on the CPU or on ``dev``; ``index`` is ``None`` (one
    row) or a contiguous 1-D int64 tensor of sample ids on ``dev`` (row ``i`` uses
    ``fold_in(key, index[i])``).
    """

    key: torch.Tensor
    index: torch.Tensor | None
    n: int
    dev: torch.device

    @property
    def numel(self) -> int:
        return self.n if self.index is None else self.index.shape[0] * self.n


def device_of(device: torch.device | str | None, k: torch.Tensor, index: object) -> torch.device:
    """``device``, else ``index``'s device (noise goes where the batch is), else the key's.

    Example:
        >>> device_of(None, torch.tensor(1), None)
        device(type='cpu')
    """
    if device is not None:
        return torch.device(device)
    return index.device if isinstance(index, torch.Tensor) else k.device


def rows_of(
    k: torch.Tensor, dims: tuple[int, ...], index: object, dev: torch.device, fn: str
) -> Rows:
    """The rows of a draw of shape ``dims``: one row of ``prod(dims)``, or ``dims[0]`` rows.

    Example:
        >>> r = rows_of(torch.tensor(5), (4, 3), torch.arange(4), torch.device("cpu"), "demo")
        >>> r.n, r.numel
        (3, 12)
    """
    if k.device.type != "cpu" and k.device != dev:
        k = k.to(dev)
    if index is None:
        return Rows(k, None, math.prod(dims), dev)
    idx = _a.check_index(index, fn)
    if not dims:
        raise ValueError(
            f"{fn}: index needs a shape with a leading (batch) dimension, got shape ()"
        )
    if idx.shape[0] != dims[0]:
        raise ValueError(
            f"{fn}: index has length {idx.shape[0]} but shape {dims} needs shape[0] = {dims[0]}"
        )
    return Rows(k, idx.to(dev).contiguous(), math.prod(dims[1:]), dev)


Core = Callable[[Rows, ModuleType | None], torch.Tensor]
_FUSED: dict[str, object] = {"module": None, "tried": False}
_VERIFIED: set[tuple[object, ...]] = set()


def kernels(dev: torch.device) -> ModuleType | None:
    """The fused-kernel module for draws on ``dev``, or ``None`` for the eager path.

    Only CUDA draws outside ``torch.compile`` tracing use kernels (the compiler
    fuses the eager path itself); ``PURESTEP_RNG_TRITON=0`` turns them off.
    """
    if dev.type != "cuda" or torch.compiler.is_compiling():
        return None
    if not _FUSED["tried"]:
        _FUSED["tried"] = True
        if os.environ.get(_TRITON_ENV, "1") != "0":
            try:
                # import_module, not ``from purestep import``: the latter reads
                # a package attribute first and would bypass sys.modules.
                _FUSED["module"] = importlib.import_module("purestep._rng_triton")
            except ImportError:  # no triton: the eager path
                pass
            except Exception as e:  # a broken triton install: say so once
                _disable(e)
    module = _FUSED["module"]
    return module if isinstance(module, ModuleType) else None


def _disable(error: BaseException) -> None:
    _FUSED["module"] = None
    warnings.warn(
        f"purestep.rng: the fused CUDA kernels are disabled for this process, draws use the "
        f"eager path ({type(error).__name__}: {error})",
        RuntimeWarning,
        stacklevel=3,
    )


def _probe(rows: Rows) -> Rows:
    """A small draw like ``rows`` (same key placement, index or not): 3 x 2049 or 2049."""
    idx = None
    if rows.index is not None:
        idx = torch.arange(3, dtype=torch.int64, device=rows.dev).mul_(2**40 + 7).sub_(3)
    return Rows(rows.key, idx, 2049, rows.dev)


def _verified(rows: Rows, sig: tuple[object, ...], core: Core, kern: ModuleType) -> bool:
    """Whether the kernel agrees with the eager path on a probe draw like ``rows`` (once each)."""
    full = (*sig, rows.index is not None, rows.key.device.type)
    if full in _VERIFIED or (rows.dev.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return True
    probe = _probe(rows)
    got, want = core(probe, kern), core(probe, None)
    if want.is_floating_point() and sig[0] == "normal":
        eps = torch.finfo(want.dtype).eps
        err = (got.double() - want.double()).abs() - 8 * eps * want.double().abs().clamp_min(1)
        ok = got.dtype == want.dtype and bool((err <= 0).all())
    else:
        ok = got.dtype == want.dtype and torch.equal(got, want)
    if not ok:
        _disable(RuntimeError(f"the {sig[0]} kernel disagrees with the eager path ({sig})"))
        return False
    _VERIFIED.add(full)
    return True


def draw(rows: Rows, sig: tuple[object, ...], core: Core) -> torch.Tensor:
    """``core(rows, kernels)`` with the fused kernels when they serve ``rows.dev``, else eager.

    ``sig`` names the kernel family (the draw and its output dtype, not parameter
    values such as ``p`` or bounds): the one-time check runs per ``sig``, index or
    not and key placement, so a draw whose parameters change every step is
    checked once.

    Example:
        >>> import torch
        >>> rows = rows_of(torch.tensor(5), (3,), None, torch.device("cpu"), "demo")
        >>> draw(rows, ("demo",), lambda r, kern: torch.zeros(r.numel)).shape
        torch.Size([3])
    """
    kern = kernels(rows.dev)
    if kern is not None:
        try:
            if _verified(rows, sig, core, kern):
                return core(rows, kern)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # a kernel that fails to build or launch: eager from now on
            _disable(e)
    return core(rows, None)
