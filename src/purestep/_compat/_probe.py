"""The probe-and-choose machinery every guarded internal in :mod:`purestep._compat` goes through.

:func:`_choose` binds a name once, at import: the internal when its probe passes
(and ``PURESTEP_COMPAT=public`` is not set), else the public path, recorded in
:data:`FALLBACKS` with one :class:`CompatWarning`. The probe helpers here
(:func:`_probe_tensors`, :func:`_same`, :func:`_clone`) are shared by the
``_foreach_*`` and fused-kernel probes.

Example:
    >>> import torch
    >>> from purestep._compat._probe import _same
    >>> nan = float("nan")
    >>> _same([torch.tensor([nan, 1.0])], [torch.tensor([nan, 1.0])])
    True
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

FORCE_PUBLIC: bool = os.environ.get("PURESTEP_COMPAT", "").strip().lower() == "public"
"""True when ``PURESTEP_COMPAT=public`` was set at import: every internal uses its fallback."""

FALLBACKS: dict[str, str] = {}
"""Internal name -> why its public fallback is in use (empty when every probe passed)."""


class CompatWarning(RuntimeWarning):
    """A private torch/tensordict internal is unavailable or changed; a public path is used."""


def _choose(name: str, probe: Callable[[], Any], fast: Callable[[], Any], public: Any) -> Any:
    """``fast()`` if ``probe()`` passes (and fallbacks are not forced), else ``public``.

    ``probe`` raises (any exception) or returns False when the internal is missing
    or misbehaves. A failed probe warns once, naming ``name``.
    """
    try:
        ok = probe() is not False
        why = "" if ok else "its probe gave an unexpected result"
    except Exception as e:  # any failure means "do not use it"
        ok, why = False, f"{type(e).__name__}: {e}"
    if ok and not FORCE_PUBLIC:
        return fast()
    if not ok:
        FALLBACKS[name] = why
        warnings.warn(
            f"purestep: {name} is unavailable or changed in torch {torch.__version__} "
            f"({why}); using its public fallback. This affects speed, not correctness.",
            CompatWarning,
            stacklevel=2,
        )
    else:
        FALLBACKS[name] = "forced by PURESTEP_COMPAT=public"
    return public


def _probe_tensors(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [
        torch.tensor([0.5, -1.25, 2.0], dtype=dtype),
        torch.tensor([[3.0, -0.75], [1.5, 0.25]], dtype=dtype),
    ]


def _clone(ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in ts]


def _same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """Bitwise equal values (NaN where the other has NaN), dtypes and shapes."""
    return len(a) == len(b) and all(
        x.dtype == y.dtype
        and x.shape == y.shape
        and torch.equal(x.isnan(), y.isnan())
        and torch.equal(x.nan_to_num(), y.nan_to_num())
        for x, y in zip(a, b, strict=True)
    )
