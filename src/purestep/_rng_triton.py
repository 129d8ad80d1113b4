"""Fused Triton kernels for :mod:`purestep.rng`: each CUDA draw is one kernel launch.

The eager path of :mod:`purestep.rng` evaluates splitmix64 as about a dozen int64
elementwise kernels over the whole draw (each a full memory pass); these kernels
evaluate the same formulas per element in registers: the row key
(``fold_in(key, index[row])`` when there is an index), the word
``mix(rowkey + (j + 1) * G)`` in uint64 arithmetic, and the draw, then write the
result once. They compute exactly the documented formulas, so integer, uniform
and bernoulli draws are bitwise equal to the eager path; ``normal`` uses CUDA's
libdevice ``logf``/``cosf``/``sinf`` and IEEE ``sqrt`` (the functions eager CUDA
calls), and agrees with the CPU within the tolerance stated in :mod:`purestep.rng`.

Layout: a draw is ``rows`` rows of ``n`` elements (``rows = len(index)``, or 1
without an index). Program ``pid`` handles block ``pid % nb`` of row
``pid // nb`` (``nb`` blocks per row), so the row is known per program, with no
per-element division. ``normal`` works on pairs: each lane draws two words and
writes both Box-Muller outputs.

The key never leaves the host when it is a CPU tensor: its value is a kernel
argument, so a CPU key with a CUDA ``index`` costs no host-device copy or sync.
Imported lazily by :mod:`purestep.rng` on the first CUDA draw; it needs the
``triton`` package (shipped with CUDA builds of PyTorch). Under
``TRITON_INTERPRET=1`` (set before this module is imported) the kernels run on
CPU tensors through Triton's interpreter, which the test suite uses to check
them against the eager path without a GPU.

Example:
    >>> from purestep import _rng_triton  # doctest: +SKIP
    >>> # _rng_triton.uniform(...) is called by purestep.rng.uniform on CUDA
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

__all__ = [
    "CPU_KEY_BY_POINTER",
    "INTERPRETED",
    "WIDE_AT",
    "bernoulli",
    "normal",
    "randint",
    "uniform",
    "words",
]

try:  # CUDA's libm as Triton externs (triton >= 3.0; older releases kept it under cuda/)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the triton release
    from triton.language.extra.cuda import libdevice

_G = tl.constexpr(0x9E3779B97F4A7C15)
_M1 = tl.constexpr(0xBF58476D1CE4E5B9)
_M2 = tl.constexpr(0x94D049BB133111EB)
_FOLD = tl.constexpr(0xD1B54A32D192ED03)
_TWO_PI_53 = tl.constexpr(2.0 * math.pi * 2.0**-53)
_TWO_PI_24 = tl.constexpr(2.0 * math.pi * 2.0**-24)

_MAX_BLOCK = 1024
WIDE_AT = 2**31
"""Launches whose programs or offsets reach this use int64 offset arithmetic (else int32)."""
CPU_KEY_BY_POINTER = False
"""Tests only: under the interpreter (CPU tensors), pass a CPU key by pointer as a device key."""
# scalar arguments never specialised on their value (no recompiles for a key of 1 or n of 16)
_WORDS_ARGS = ["key", "n", "nb", "lo", "span", "thresh"]
_NORMAL_ARGS = ["key", "n", "nb", "pairs"]


# --------------------------------------------------------------------------- device code


@triton.jit
def _mix(z):  # type: ignore[no-untyped-def]
    """splitmix64's finaliser on uint64 (wrapping multiplies, logical shifts)."""
    z = (z ^ (z >> 30)) * _M1
    z = (z ^ (z >> 27)) * _M2
    return z ^ (z >> 31)


@triton.jit
def _block(  # type: ignore[no-untyped-def]
    key,
    key_ptr,
    idx_ptr,
    nb,
    KEY_PTR: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    WIDE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """This program's row, the row's key (uint64) and the block's lane offsets in the row."""
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    row = pid // nb
    lanes = (pid - row * nb) * BLOCK + tl.arange(0, BLOCK)
    if KEY_PTR:  # noqa: SIM108 (a static branch; Triton compiles one side)
        k = tl.load(key_ptr).to(tl.uint64, bitcast=True)
    else:
        k = key.to(tl.uint64)
    if HAS_INDEX:
        d = tl.load(idx_ptr + row).to(tl.uint64, bitcast=True)
        k = _mix(k ^ _mix(d ^ _FOLD))
    return row, k, lanes


@triton.jit(do_not_specialize=_WORDS_ARGS)
def _words_kernel(  # type: ignore[no-untyped-def]
    out_ptr,
    key,
    key_ptr,
    idx_ptr,
    n,
    nb,
    lo,
    span,
    thresh,
    MODE: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,
    KEY_PTR: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    WIDE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One word per element. MODE 0: raw words; 1: uniform; 2: randint; 3: bernoulli."""
    row, k, j = _block(key, key_ptr, idx_ptr, nb, KEY_PTR, HAS_INDEX, WIDE, BLOCK)
    w = _mix(k + (j.to(tl.uint64) + 1) * _G)
    if MODE == 0:
        val = w.to(tl.int64, bitcast=True)
    elif MODE == 1:  # top D bits * 2**-D: exact in float64 (D = 53) or float32 (D <= 24)
        if D == 53:
            val = (w >> 11).to(tl.int64).to(tl.float64) * (2.0**-53)
        else:
            val = (w >> (64 - D)).to(tl.int32).to(tl.float32) * (2.0**-D)
    elif MODE == 2:  # lo + (w >> 1) mod span
        val = ((w >> 1).to(tl.int64) % span) + lo
    else:  # top53(w) * 2**-53 < p  <=>  top53(w) < thresh = ceil(p * 2**53)
        val = (w >> 11).to(tl.int64) < thresh
    if HALF:  # into float16/bfloat16 through float32, as torch converts integers
        val = val.to(tl.float32)
    tl.store(out_ptr + row * n + j, val.to(out_ptr.dtype.element_ty), mask=j < n)


@triton.jit(do_not_specialize=_NORMAL_ARGS)
def _normal_kernel(  # type: ignore[no-untyped-def]
    out_ptr,
    key,
    key_ptr,
    idx_ptr,
    n,
    nb,
    pairs,
    D: tl.constexpr,
    KEY_PTR: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    WIDE: tl.constexpr,
    PRECISE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Box-Muller on the word pairs ``(2m, 2m + 1)``: lane ``m`` writes ``z_2m`` and ``z_2m+1``."""
    row, k, m = _block(key, key_ptr, idx_ptr, nb, KEY_PTR, HAS_INDEX, WIDE, BLOCK)
    c = (2 * m).to(tl.uint64) + 1
    w0 = _mix(k + c * _G)
    w1 = _mix(k + (c + 1) * _G)
    if D == 53:
        v = ((1 << 53) - (w0 >> 11).to(tl.int64)).to(tl.float64) * (2.0**-53)  # (0, 1]
        theta = (w1 >> 11).to(tl.int64).to(tl.float64) * _TWO_PI_53
    else:
        v = ((1 << 24) - (w0 >> 40).to(tl.int32)).to(tl.float32) * (2.0**-24)
        theta = (w1 >> 40).to(tl.int32).to(tl.float32) * _TWO_PI_24
    if PRECISE:  # CUDA's logf/cosf/sinf and IEEE sqrt: what eager CUDA computes
        r = libdevice.sqrt_rn(libdevice.log(v) * -2.0)
        z0 = libdevice.cos(theta) * r
        z1 = libdevice.sin(theta) * r
    else:  # the interpreter (numpy)
        r = tl.sqrt(tl.log(v) * -2.0)
        z0 = tl.cos(theta) * r
        z1 = tl.sin(theta) * r
    ty = out_ptr.dtype.element_ty
    out = out_ptr + row * n + 2 * m
    tl.store(out, z0.to(ty), mask=m < pairs)
    tl.store(out + 1, z1.to(ty), mask=(m < pairs) & (2 * m + 1 < n))


INTERPRETED = not isinstance(_mix, triton.runtime.JITFunction)
"""Whether the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``; numpy maths,
which has no libdevice: ``normal`` then uses ``tl.log``/``tl.cos``/``tl.sin``)."""


# --------------------------------------------------------------------------- host side


def _block_size(lanes: int) -> int:
    """Lanes per program: 64, 256 or 1024, the smallest that holds a row (1024 for long rows).

    Three sizes bound the kernel variants Triton compiles (each once per process,
    cached on disk) while short rows (one timestep per sample) waste few lanes.
    """
    return next(b for b in (64, 256, _MAX_BLOCK) if lanes <= b or b == _MAX_BLOCK)


def _launch(
    kernel: Any,
    out: torch.Tensor,
    key: torch.Tensor,
    index: torch.Tensor | None,
    n: int,
    lanes: int,
    **kwargs: Any,
) -> torch.Tensor:
    """Run ``kernel`` over ``rows x lanes`` lanes writing ``out`` (``rows x n`` elements).

    A CPU key goes by value (``int`` of a CPU tensor: no copy, no device sync); a
    key on ``out``'s device goes by pointer.
    """
    if out.numel() == 0:
        return out
    rows = 1 if index is None else index.shape[0]
    block = _block_size(lanes)
    nb = triton.cdiv(lanes, block)
    wide = rows * nb >= WIDE_AT or rows * (n + 2 * block) >= WIDE_AT
    if key.device.type == "cpu" and not (CPU_KEY_BY_POINTER and out.device.type == "cpu"):
        kval, kptr, by_ptr = int(key), out, False
    elif key.device == out.device:
        kval, kptr, by_ptr = 0, key, True
    else:
        raise ValueError(f"rng: a key on {key.device} cannot feed a draw on {out.device}")
    args = (out, kval, kptr, out if index is None else index, n, nb)
    flags = {"KEY_PTR": by_ptr, "HAS_INDEX": index is not None, "WIDE": wide, "BLOCK": block}
    if out.device.type == "cuda":
        with torch.cuda.device(out.device):
            kernel[(rows * nb,)](*args, **kwargs, **flags)
    else:  # Triton's interpreter (tests)
        kernel[(rows * nb,)](*args, **kwargs, **flags)
    return out


def _word_draw(
    out: torch.Tensor,
    key: torch.Tensor,
    index: torch.Tensor | None,
    n: int,
    mode: int,
    *,
    d: int = 0,
    lo: int = 0,
    span: int = 1,
    thresh: int = 0,
) -> torch.Tensor:
    half = out.dtype in (torch.float16, torch.bfloat16)
    return _launch(
        _words_kernel, out, key, index, n, n,
        lo=lo, span=span, thresh=thresh, MODE=mode, D=d, HALF=half,
    )  # fmt: skip


def words(out: torch.Tensor, key: torch.Tensor, index: torch.Tensor | None, n: int) -> torch.Tensor:
    """The raw words ``bits(rowkey, j)``, as int64, into ``out`` (``randperm``'s sort keys).

    Args:
        out: a contiguous tensor of ``rows * n`` elements (``rows = len(index)`` or 1).
        key: the 0-dim int64 key (on the CPU, or on ``out``'s device).
        index: ``None`` or a contiguous 1-D int64 tensor of sample ids on ``out``'s device.
        n: elements per row.
    """
    return _word_draw(out, key, index, n, 0)


def uniform(
    out: torch.Tensor, key: torch.Tensor, index: torch.Tensor | None, n: int, d: int
) -> torch.Tensor:
    """``top(w, d) * 2**-d`` (computed in float64 for ``d = 53``, else float32) into ``out``."""
    return _word_draw(out, key, index, n, 1, d=d)


def randint(
    out: torch.Tensor, key: torch.Tensor, index: torch.Tensor | None, n: int, lo: int, span: int
) -> torch.Tensor:
    """``lo + (w >> 1) mod span`` into ``out`` (converted to its dtype as torch converts)."""
    return _word_draw(out, key, index, n, 2, lo=lo, span=span)


def bernoulli(
    out: torch.Tensor, key: torch.Tensor, index: torch.Tensor | None, n: int, p: float
) -> torch.Tensor:
    """``top(w, 53) * 2**-53 < p`` into ``out``, as the exact integer test ``top53 < ceil(p 2**53)``."""
    return _word_draw(out, key, index, n, 3, thresh=math.ceil(p * 2.0**53))  # p 2**53 is exact


def normal(
    out: torch.Tensor, key: torch.Tensor, index: torch.Tensor | None, n: int, d: int
) -> torch.Tensor:
    """Standard normals (Box-Muller in float64 with ``d = 53``, else float32 with ``d = 24``)."""
    pairs = (n + 1) // 2
    return _launch(
        _normal_kernel, out, key, index, n, pairs, pairs=pairs, D=d, PRECISE=not INTERPRETED
    )
