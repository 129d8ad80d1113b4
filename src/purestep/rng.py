"""Explicit, counter-based PRNG keys: no global RNG, no ``torch.Generator``.

A *key* is an int64 tensor that holds 64 random bits. Keys are derived with
:func:`key`, :func:`fold_in` and :func:`split`; draws (:func:`uniform`,
:func:`normal`, :func:`randint`, :func:`randperm`, :func:`bernoulli`) are pure
functions of a 0-dim key, a shape and a dtype. The same key gives the same draws
on every run, on CPU and CUDA, whatever else happens in the program. With
``index`` (a tensor of global sample ids) row ``i`` of a draw comes from
``fold_in(key, index[i])``, so a sample's values never depend on which other
samples share its batch (accumulation and data-parallel sharding see the same
noise per sample).

The generator (pinned by ``tests/test_rng.py``; changing it changes every draw)
----------------------------------------------------------------------------
All arithmetic is on unsigned 64-bit words modulo ``2**64``; torch stores them
as int64 in two's complement (int64 ``*`` wraps, right shifts below are
*logical*). ``mix`` is the splitmix64 finaliser::

    G = 0x9E3779B97F4A7C15
    mix(z): z ^= z >> 30; z *= 0xBF58476D1CE4E5B9
            z ^= z >> 27; z *= 0x94D049BB133111EB
            z ^= z >> 31

    key(seed)      = mix(seed + G)           # the first splitmix64 output for state `seed`
    fold_in(k, d)  = mix(k ^ mix(d ^ F))     # F = 0xD1B54A32D192ED03; data fold left to right
    split(k, n)[i] = fold_in(mix(k ^ S), i)  # S = 0x5851F42D4C957F2D (domain salt)
    bits(k, j)     = mix(k + (j + 1) * G)    # the j-th splitmix64 output for state `k`

``fold_in(k, d)`` is a bijection in ``d`` for a fixed ``k`` (and in ``k`` for a
fixed ``d``), so the children of one key never collide. The datum is hashed
with ``F`` rather than with ``key``'s ``+ G``: otherwise ``fold_in(key(s), s)``
would be 0 for every ``s`` and ``fold_in(key(a), b) == fold_in(key(b), a)``.
The salt ``S`` keeps ``split(k, n)[i]`` apart from ``fold_in(k, i)``.

Draws. A draw of shape ``s`` from key ``k`` flattens ``s`` row-major; element
``j`` takes its bits from word ``w_j = bits(k, j)``. With ``index`` the draw is
done row by row: row ``i`` is the draw of shape ``s[1:]`` from key
``fold_in(k, index[i])``. With ``top(w, d) = w >> (64 - d)`` (the top ``d``
bits) and ``D`` the significand digits of the dtype (53 float64, 24 float32,
11 float16, 8 bfloat16):

* ``uniform``: ``u_j = top(w_j, D) * 2**-D``, in ``[0, 1)`` exactly in the
  target dtype (so never 1.0); then ``low + (high - low) * u`` computed in
  float32 (float64 for float64) and clamped below ``high``. Draws of one key in
  different dtypes are truncations of the same number.
* ``normal``: Box–Muller on pairs. Elements ``2m`` and ``2m + 1`` use
  ``v = (2**D - top(w_2m, D)) * 2**-D`` in ``(0, 1]`` and
  ``u = top(w_2m+1, D) * 2**-D``: ``r = sqrt(-2 ln v)``, ``z_2m = r cos(2 pi u)``,
  ``z_2m+1 = r sin(2 pi u)``, then ``mean + std * z``. ``D = 53`` in float64 for
  float64, else ``D = 24`` in float32 (then cast). So ``|z| <= 5.77`` for
  32-bit and smaller dtypes and ``|z| <= 8.57`` for float64 (the normal tails
  beyond have probability about ``8e-9`` and ``1e-17``).
* ``randint(low, high)``: ``low + (w_j >> 1) mod (high - low)``. The modulo
  bias is below ``(high - low) / 2**63`` (under ``1.2e-7`` for ranges up to ``2**40``).
* ``randperm(n)``: the stable argsort of the words ``w_0 .. w_{n-1}`` read as
  signed int64 (ties have probability ``< n**2 / 2**65``; they keep index order).
* ``bernoulli(p)``: ``top(w_j, 53) * 2**-53 < p`` in float64.

Integer results and ``uniform``/``bernoulli`` are bit-identical on CPU and
CUDA; ``normal`` agrees up to the last bits of ``log``/``cos``/``sin``.
Streams of two distinct keys overlap only if the keys differ by a multiple
``t * G`` with ``|t|`` below the draw length: probability about
``n_keys**2 * length / 2**64``.

Example:
    >>> import torch
    >>> from purestep import rng
    >>> k = rng.key(0)
    >>> step_key = rng.fold_in(k, 7)              # the key of step 7
    >>> noise_key, t_key = rng.split(step_key, 2)
    >>> x = rng.normal(noise_key, (4, 3), index=torch.tensor([10, 11, 12, 13]))
    >>> torch.equal(x[1], rng.normal(rng.fold_in(noise_key, 11), (3,)))
    True
    >>> torch.equal(x, rng.normal(noise_key, (4, 3), index=torch.tensor([10, 11, 12, 13])))
    True
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch

__all__ = [
    "ShapeLike",
    "bernoulli",
    "fold_in",
    "key",
    "normal",
    "randint",
    "randperm",
    "split",
    "uniform",
]

ShapeLike = int | Sequence[int]

_U64 = 1 << 64
_I64_MIN = -(1 << 63)
_I64_MAX = (1 << 63) - 1


def _signed(u: int) -> int:
    """The int64 two's-complement value of the unsigned 64-bit word ``u mod 2**64``."""
    u %= _U64
    return u - _U64 if u > _I64_MAX else u


_G = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
_FOLD_SALT = _signed(0xD1B54A32D192ED03)
_SPLIT_SALT = _signed(0x5851F42D4C957F2D)
_CPU_CHUNK = 1 << 17  # elements per in-cache block when mixing on CPU
_DIGITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


# --------------------------------------------------------------------------- mixing


def _srl_into(z: torch.Tensor, s: int, out: torch.Tensor) -> torch.Tensor:
    """``out = z >> s`` as a logical (unsigned) shift: int64 ``>>`` is arithmetic."""
    torch.bitwise_right_shift(z, s, out=out)
    return out.bitwise_and_((1 << (64 - s)) - 1)


def _mix_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser, in place on a contiguous int64 tensor."""
    tmp = torch.empty_like(z)
    z.bitwise_xor_(_srl_into(z, 30, tmp)).mul_(_M1)
    z.bitwise_xor_(_srl_into(z, 27, tmp)).mul_(_M2)
    return z.bitwise_xor_(_srl_into(z, 31, tmp))


def _mix_blocks_(z: torch.Tensor) -> torch.Tensor:
    """:func:`_mix_` over a contiguous tensor, block by block on CPU (stays in cache)."""
    flat = z.view(-1)
    if z.device.type != "cpu" or flat.numel() <= _CPU_CHUNK:
        _mix_(flat)
        return z
    for start in range(0, flat.numel(), _CPU_CHUNK):
        _mix_(flat[start : start + _CPU_CHUNK])
    return z


def _bits(keys: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """Words ``bits(k, j) = mix(k + (j + 1) * G)`` for ``j < n``: shape ``(*keys.shape, n)``."""
    counters = torch.arange(1, n + 1, dtype=torch.int64, device=device).mul_(_G)
    out = torch.empty((*keys.shape, n), dtype=torch.int64, device=device)
    torch.add(keys.unsqueeze(-1), counters, out=out)
    return _mix_blocks_(out)


def _top(words: torch.Tensor, d: int) -> torch.Tensor:
    """The top ``d`` bits of each word, as a non-negative int64 below ``2**d``."""
    return torch.bitwise_right_shift(words, 64 - d).bitwise_and_((1 << d) - 1)


# --------------------------------------------------------------------------- validation


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype}, device={x.device})"
    return f"{type(x).__name__} {x!r}"


def _as_int(x: object, what: str, lo: int, hi: int) -> int:
    """``x`` as a Python int in ``[lo, hi]``; ``what`` names the argument in errors."""
    if isinstance(x, bool | torch.Tensor):
        raise TypeError(f"{what} must be an int, got {_describe(x)}")
    try:
        v = operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be an int, got {_describe(x)}") from None
    if not lo <= v <= hi:
        raise ValueError(f"{what} must be in [{lo}, {hi}], got {v}")
    return v


def _check_key(k: object, fn: str, *, scalar: bool) -> torch.Tensor:
    if not isinstance(k, torch.Tensor) or k.dtype != torch.int64 or (scalar and k.dim() != 0):
        need = "a 0-dim int64 tensor" if scalar else "an int64 tensor"
        hint = f"; make one with rng.key({k!r})" if isinstance(k, int) else ""
        raise TypeError(
            f"{fn}: key must be {need} (from rng.key/fold_in/split), got {_describe(k)}{hint}"
        )
    return k


def _shape(shape: ShapeLike, fn: str) -> tuple[int, ...]:
    if isinstance(shape, torch.Tensor | str):
        raise TypeError(f"{fn}: shape must be an int or a sequence of ints, got {_describe(shape)}")
    dims = [shape] if not isinstance(shape, Sequence) else list(shape)
    return tuple(_as_int(d, f"{fn}: shape {tuple(dims)!r} entry", 0, _I64_MAX) for d in dims)


def _device(device: torch.device | str | None, k: torch.Tensor) -> torch.device:
    return k.device if device is None else torch.device(device)


def _check_index(index: object, fn: str) -> torch.Tensor:
    if not isinstance(index, torch.Tensor) or index.dtype != torch.int64 or index.dim() != 1:
        raise TypeError(
            f"{fn}: index must be a 1-D int64 tensor of sample ids, got {_describe(index)}"
        )
    return index


def _row_keys(
    k: torch.Tensor, shape: tuple[int, ...], index: object, dev: torch.device, fn: str
) -> tuple[torch.Tensor, int]:
    """Keys of the rows and the words per row: ``(k, numel)`` or ``(fold_in(k, index), numel / B)``."""
    k = k.to(dev)
    if index is None:
        return k, math.prod(shape)
    idx = _check_index(index, fn)
    if not shape:
        raise ValueError(
            f"{fn}: index needs a shape with a leading (batch) dimension, got shape ()"
        )
    if idx.shape[0] != shape[0]:
        raise ValueError(
            f"{fn}: index has length {idx.shape[0]} but shape {shape} needs shape[0] = {shape[0]}"
        )
    return fold_in(k, idx.to(dev)), math.prod(shape[1:])


def _broadcasts_to(src: tuple[int, ...], dst: tuple[int, ...]) -> bool:
    """Whether a tensor of shape ``src`` broadcasts to exactly ``dst``."""
    if len(src) > len(dst):
        return False
    return all(a in (1, b) for a, b in zip(reversed(src), reversed(dst), strict=False))


def _float_dtype(dtype: torch.dtype | None, fn: str) -> torch.dtype:
    dt = torch.get_default_dtype() if dtype is None else dtype
    if dt not in _DIGITS:
        raise TypeError(f"{fn}: dtype must be one of {sorted(map(str, _DIGITS))}, got {dt}")
    return dt


def _finite(x: object, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        raise ValueError(f"{what} must be a finite float, got {_describe(x)}")
    return float(x)


# --------------------------------------------------------------------------- keys


def key(seed: int) -> torch.Tensor:
    """The root key for ``seed``: a 0-dim int64 CPU tensor, ``mix(seed + G)``.

    Args:
        seed: an int in ``[-2**63, 2**64)``, taken modulo ``2**64``.

    Example:
        >>> k = key(0)
        >>> k.shape, k.dtype, k.device
        (torch.Size([]), torch.int64, device(type='cpu'))
        >>> torch.equal(key(0), key(0)), torch.equal(key(0), key(1))
        (True, False)
    """
    s = _as_int(seed, "key: seed", _I64_MIN, _U64 - 1)
    return _mix_(torch.tensor(_signed(s + _G), dtype=torch.int64))


def _mix_int(z: int) -> int:
    """:func:`_mix_` on one unsigned 64-bit word held in a Python int."""
    z ^= z >> 30
    z = (z * _M1) % _U64
    z ^= z >> 27
    z = (z * _M2) % _U64
    return z ^ (z >> 31)


def _host_scalar(d: object) -> bool:
    """An int, or a 0-dim int64 CPU tensor (whose value can be read without a device sync)."""
    if isinstance(d, torch.Tensor):
        return d.dim() == 0 and d.dtype == torch.int64 and d.device.type == "cpu"
    return isinstance(d, int) and not isinstance(d, bool)


def _datum(d: object, i: int, dev: torch.device) -> torch.Tensor:
    if isinstance(d, torch.Tensor):
        if d.dtype != torch.int64:
            raise TypeError(
                f"fold_in: data[{i}] must be an int or an int64 tensor, got {_describe(d)}"
            )
        return d.to(dev)
    v = _as_int(d, f"fold_in: data[{i}]", _I64_MIN, _U64 - 1)
    return torch.tensor(_signed(v), dtype=torch.int64, device=dev)


def fold_in(key: torch.Tensor, *data: int | torch.Tensor) -> torch.Tensor:
    """Derive a key from ``key`` and integer data: ``mix(key ^ mix(d ^ F))`` per datum.

    Key and data broadcast together, so a 1-D int64 tensor of sample ids gives one
    key per sample. The result lives on ``key``'s device (data are moved there).
    With no data it returns a copy of ``key``.

    Args:
        key: an int64 tensor of keys (any shape, any device).
        *data: ints in ``[-2**63, 2**64)`` or int64 tensors, folded left to right.

    Example:
        >>> k = key(0)
        >>> torch.equal(fold_in(k, 1, 2), fold_in(fold_in(k, 1), 2))
        True
        >>> fold_in(k, torch.arange(3)).shape
        torch.Size([3])
        >>> torch.equal(fold_in(k, torch.arange(3))[2], fold_in(k, 2))
        True
    """
    k = _check_key(key, "fold_in", scalar=False)
    if k.dim() == 0 and k.device.type == "cpu" and all(_host_scalar(d) for d in data):
        # one key on the host (the step key): the same words in Python ints, ~10x faster
        z = int(k) % _U64
        for i, d in enumerate(data):
            v = (
                int(d)
                if isinstance(d, torch.Tensor)
                else _as_int(d, f"fold_in: data[{i}]", _I64_MIN, _U64 - 1)
            )
            z = _mix_int(z ^ _mix_int((v ^ _FOLD_SALT) % _U64))
        return torch.tensor(_signed(z), dtype=torch.int64)
    out = k.clone()
    for i, d in enumerate(data):
        t = _datum(d, i, k.device)
        out = _mix_(torch.bitwise_xor(out, _mix_(torch.bitwise_xor(t, _FOLD_SALT))))
    return out


def split(key: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` new keys from ``key``, shape ``(*key.shape, n)``; ``split(k, n)[i]`` is a key.

    The children are distinct from each other and from ``fold_in(key, i)``.
    ``split(k, m)[:n]`` equals ``split(k, n)`` for ``m >= n``.

    Example:
        >>> a, b = split(key(0), 2)
        >>> torch.equal(a, b), a.shape
        (False, torch.Size([]))
        >>> torch.equal(split(key(0), 5)[:2], split(key(0), 2))
        True
    """
    k = _check_key(key, "split", scalar=False)
    m = _as_int(n, "split: n", 0, _I64_MAX)
    salted = _mix_(torch.bitwise_xor(k, _SPLIT_SALT))
    return fold_in(salted.unsqueeze(-1), torch.arange(m, dtype=torch.int64, device=k.device))


# --------------------------------------------------------------------------- draws


def uniform(
    key: torch.Tensor,
    shape: ShapeLike,
    *,
    low: float = 0.0,
    high: float = 1.0,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Uniform floats in ``[low, high)`` (never ``high``, in every float dtype).

    Args:
        key: a 0-dim int64 key.
        shape: the output shape.
        low: inclusive lower bound.
        high: exclusive upper bound, ``> low``.
        dtype: float64, float32, float16 or bfloat16; default ``torch.get_default_dtype()``.
        device: where to compute; default ``key``'s device.
        index: int64 sample ids of length ``shape[0]``: row ``i`` is drawn from
            ``fold_in(key, index[i])``.

    Example:
        >>> u = uniform(key(0), (2, 3))
        >>> bool(((u >= 0) & (u < 1)).all())
        True
        >>> uniform(key(0), 3, low=-1.0, high=1.0, dtype=torch.float16).dtype
        torch.float16
    """
    k = _check_key(key, "uniform", scalar=True)
    dims = _shape(shape, "uniform")
    dt = _float_dtype(dtype, "uniform")
    lo, hi = _finite(low, "uniform: low"), _finite(high, "uniform: high")
    if not lo < hi:
        raise ValueError(f"uniform: need low < high, got low={lo}, high={hi}")
    dev = _device(device, k)
    keys, n = _row_keys(k, dims, index, dev, "uniform")
    d = _DIGITS[dt]
    cdt = torch.float64 if dt == torch.float64 else torch.float32
    u = _top(_bits(keys, n, dev), d).to(cdt).mul_(2.0**-d)
    if (lo, hi) != (0.0, 1.0):
        u = u.mul_(hi - lo).add_(lo).to(dt)
        top = torch.tensor(hi, dtype=torch.float64).to(dt)
        if float(top) >= hi:
            top = torch.nextafter(top, torch.tensor(-math.inf, dtype=dt))
        u = u.clamp_max_(float(top))
    return u.to(dt).reshape(dims)


def normal(
    key: torch.Tensor,
    shape: ShapeLike,
    *,
    mean: float = 0.0,
    std: float = 1.0,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Normal floats (Box–Muller on pairs of words; see the module docstring).

    Args:
        key: a 0-dim int64 key.
        shape: the output shape.
        mean: the mean.
        std: the standard deviation, ``>= 0``.
        dtype: float64, float32, float16 or bfloat16; default ``torch.get_default_dtype()``.
        device: where to compute; default ``key``'s device.
        index: int64 sample ids of length ``shape[0]``: row ``i`` is drawn from
            ``fold_in(key, index[i])``.

    Example:
        >>> z = normal(key(0), (1000,), dtype=torch.float64)
        >>> abs(float(z.mean())) < 0.2, 0.8 < float(z.std()) < 1.2
        (True, True)
    """
    k = _check_key(key, "normal", scalar=True)
    dims = _shape(shape, "normal")
    dt = _float_dtype(dtype, "normal")
    mu, sigma = _finite(mean, "normal: mean"), _finite(std, "normal: std")
    if sigma < 0:
        raise ValueError(f"normal: std must be >= 0, got {sigma}")
    dev = _device(device, k)
    keys, n = _row_keys(k, dims, index, dev, "normal")
    cdt, d = (torch.float64, 53) if dt == torch.float64 else (torch.float32, 24)
    pairs = (n + 1) // 2
    words = _bits(keys, 2 * pairs, dev).view(*keys.shape, pairs, 2)
    scale = 2.0**-d
    v = _top(words[..., 0], d).neg_().add_(1 << d).to(cdt).mul_(scale)  # in (0, 1]
    theta = _top(words[..., 1], d).to(cdt).mul_(2.0 * math.pi * scale)
    r = v.log_().mul_(-2.0).sqrt_()
    z = torch.stack((torch.cos(theta).mul_(r), theta.sin_().mul_(r)), dim=-1)
    z = z.view(*keys.shape, 2 * pairs)[..., :n]
    if (mu, sigma) != (0.0, 1.0):
        z = z.mul(sigma).add_(mu)
    return z.to(dt).reshape(dims)


def randint(
    key: torch.Tensor,
    low: int,
    high: int,
    shape: ShapeLike,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Uniform integers in ``[low, high)``: ``low + (word >> 1) mod (high - low)``.

    Args:
        key: a 0-dim int64 key.
        low: inclusive lower bound.
        high: exclusive upper bound; ``0 < high - low < 2**63``.
        shape: the output shape.
        dtype: default int64; any integer or float dtype that holds ``[low, high)``.
        device: where to compute; default ``key``'s device.
        index: int64 sample ids of length ``shape[0]``: row ``i`` is drawn from
            ``fold_in(key, index[i])``.

    Example:
        >>> x = randint(key(0), 0, 10, (5,))
        >>> x.dtype, bool(((x >= 0) & (x < 10)).all())
        (torch.int64, True)
    """
    k = _check_key(key, "randint", scalar=True)
    lo = _as_int(low, "randint: low", _I64_MIN, _I64_MAX)
    hi = _as_int(high, "randint: high", _I64_MIN, _I64_MAX)
    if not lo < hi:
        raise ValueError(f"randint: need low < high, got low={lo}, high={hi}")
    if hi - lo > _I64_MAX:
        raise ValueError(f"randint: high - low must be < 2**63, got {hi - lo}")
    dims = _shape(shape, "randint")
    dt = torch.int64 if dtype is None else dtype
    if dt == torch.bool or dt.is_complex:
        raise TypeError(f"randint: dtype must be an integer or float dtype, got {dt}")
    if not dt.is_floating_point:
        info = torch.iinfo(dt)
        if lo < info.min or hi - 1 > info.max:
            raise ValueError(
                f"randint: [{lo}, {hi}) does not fit dtype {dt} [{info.min}, {info.max}]"
            )
    dev = _device(device, k)
    keys, n = _row_keys(k, dims, index, dev, "randint")
    x = _top(_bits(keys, n, dev), 63).remainder_(hi - lo).add_(lo)
    return x.to(dt).reshape(dims)


def randperm(
    key: torch.Tensor,
    n: int,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """A random permutation of ``0 .. n-1``: the stable argsort of ``n`` words.

    With ``index`` (length ``B``) the result has shape ``(B, n)`` and row ``i`` is
    ``randperm(fold_in(key, index[i]), n)``.

    Args:
        key: a 0-dim int64 key.
        n: the permutation length, ``>= 0``.
        dtype: default int64; an integer dtype that holds ``n - 1``.
        device: where to compute; default ``key``'s device.
        index: int64 sample ids: one permutation per sample.

    Example:
        >>> p = randperm(key(0), 5)
        >>> sorted(p.tolist())
        [0, 1, 2, 3, 4]
        >>> randperm(key(0), 5, index=torch.arange(3)).shape
        torch.Size([3, 5])
    """
    k = _check_key(key, "randperm", scalar=True)
    m = _as_int(n, "randperm: n", 0, _I64_MAX)
    dt = torch.int64 if dtype is None else dtype
    if dt == torch.bool or dt.is_complex or dt.is_floating_point:
        raise TypeError(f"randperm: dtype must be an integer dtype, got {dt}")
    if m > 0 and m - 1 > torch.iinfo(dt).max:
        raise ValueError(f"randperm: n={m} does not fit dtype {dt}")
    dev = _device(device, k)
    dims = (m,) if index is None else (_check_index(index, "randperm").shape[0], m)
    keys, per_row = _row_keys(k, dims, index, dev, "randperm")
    return torch.argsort(_bits(keys, per_row, dev), dim=-1, stable=True).to(dt)


def bernoulli(
    key: torch.Tensor,
    p: float | torch.Tensor,
    shape: ShapeLike,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bernoulli draws: 1 where ``uniform53 < p``, else 0 (so ``p=0`` gives 0, ``p=1`` gives 1).

    Args:
        key: a 0-dim int64 key.
        p: a float in ``[0, 1]`` or a float tensor broadcastable to ``shape``
            (its values are not checked: ``p <= 0`` gives 0, ``p >= 1`` gives 1,
            NaN gives 0).
        shape: the output shape.
        dtype: default ``p.dtype`` for a float tensor ``p``, else
            ``torch.get_default_dtype()``; ``torch.bool`` gives a mask.
        device: where to compute; default ``key``'s device.
        index: int64 sample ids of length ``shape[0]``: row ``i`` is drawn from
            ``fold_in(key, index[i])``.

    Example:
        >>> bernoulli(key(0), 0.0, (3,))
        tensor([0., 0., 0.])
        >>> bernoulli(key(0), torch.tensor([0.0, 1.0]), (2, 2), dtype=torch.bool)
        tensor([[False,  True],
                [False,  True]])
    """
    k = _check_key(key, "bernoulli", scalar=True)
    dims = _shape(shape, "bernoulli")
    if isinstance(p, torch.Tensor):
        if not p.dtype.is_floating_point:
            raise TypeError(f"bernoulli: p must be a float or a float tensor, got {_describe(p)}")
        if not _broadcasts_to(tuple(p.shape), dims):
            raise ValueError(
                f"bernoulli: p of shape {tuple(p.shape)} does not broadcast to shape {dims}"
            )
        dt = p.dtype if dtype is None else dtype
    else:
        pv = _finite(p, "bernoulli: p")
        if not 0.0 <= pv <= 1.0:
            raise ValueError(f"bernoulli: p must be in [0, 1], got {pv}")
        dt = torch.get_default_dtype() if dtype is None else dtype
    dev = _device(device, k)
    keys, n = _row_keys(k, dims, index, dev, "bernoulli")
    u = _top(_bits(keys, n, dev), 53).to(torch.float64).mul_(2.0**-53).reshape(dims)
    thresh = p.to(device=dev, dtype=torch.float64) if isinstance(p, torch.Tensor) else pv
    return torch.lt(u, thresh).to(dt)
