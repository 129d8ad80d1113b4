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

Devices. A draw computes on ``device`` when given, else on ``index``'s device
when there is an index (so noise lands where the batch is), else on the key's
device. Keys normally live on the CPU (``state["rng"]``): a CPU key feeding a
CUDA draw is read on the host, so it costs no copy and no device sync.
Integer results and ``uniform``/``bernoulli`` are bit-identical on every device;
``normal`` agrees to within the last bits of ``log``/``cos``/``sin``:
``|z_a - z_b| <= 8 * eps * max(1, |z|)`` between any two devices, with ``eps``
the result dtype's machine epsilon (``2**-23`` for float32). Measured on CPU
(4M float32 values): within ``1.7 * eps * max(1, |z|)`` of the formula evaluated
in float64; CUDA's ``logf`` (1 ulp) and ``sinf``/``cosf`` (2 ulp) keep it
within the bound. On CUDA each draw is one fused Triton kernel
(``purestep._rng_triton``) computing the same formulas, when the ``triton``
package is importable; the first CUDA draw of each kind in a process is checked
once against the eager path (one host sync), which replaces the kernel for the
rest of the process, with a warning, if they ever disagree. Each kernel variant
(draw, dtype, row length class) compiles once on first use (Triton caches it on
disk). Inside ``torch.compile`` tracing draws are eager ops, which the compiler
fuses itself. Set ``PURESTEP_RNG_TRITON=0`` to always use the eager path.
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
from types import ModuleType

import torch

from purestep import _rng_args as _a
from purestep._rng_args import DIGITS, I64_MAX, I64_MIN, U64, ShapeLike, as_int, signed
from purestep._rng_dispatch import Core, Rows, device_of, draw, rows_of

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

_G = signed(0x9E3779B97F4A7C15)
_M1 = signed(0xBF58476D1CE4E5B9)
_M2 = signed(0x94D049BB133111EB)
_FOLD_SALT = signed(0xD1B54A32D192ED03)
_SPLIT_SALT = signed(0x5851F42D4C957F2D)
_CPU_CHUNK = 1 << 17  # elements per in-cache block when mixing on CPU


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


# --------------------------------------------------------------------------- rows


def _row_keys(rows: Rows) -> torch.Tensor:
    """The rows' keys on ``rows.dev`` (eager path): ``key``, or ``fold_in(key, index)``.

    A CPU key joins device arithmetic as a host scalar (its value is read on the
    CPU): no host-to-device copy, so no device sync.
    """
    k, dev = rows.key, rows.dev
    host = k.device.type == "cpu" and dev.type != "cpu" and not torch.compiler.is_compiling()
    if rows.index is None:
        if k.device == dev:
            return k
        return torch.full((), int(k), dtype=torch.int64, device=dev) if host else k.to(dev)
    z = _mix_(torch.bitwise_xor(rows.index, _FOLD_SALT))
    return _mix_(z.bitwise_xor_(int(k) if host else k.to(dev)))


def _words(rows: Rows) -> torch.Tensor:
    """The eager words of every row: shape ``(n,)`` or ``(rows, n)``."""
    return _bits(_row_keys(rows), rows.n, rows.dev)


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
    s = as_int(seed, "key: seed", I64_MIN, U64 - 1)
    return _mix_(torch.tensor(signed(s + _G), dtype=torch.int64))


def _mix_int(z: int) -> int:
    """:func:`_mix_` on one unsigned 64-bit word held in a Python int."""
    z ^= z >> 30
    z = (z * _M1) % U64
    z ^= z >> 27
    z = (z * _M2) % U64
    return z ^ (z >> 31)


def _host_scalar(d: object) -> bool:
    """An int, or a 0-dim int64 CPU tensor (whose value can be read without a device sync)."""
    if isinstance(d, torch.Tensor):
        return (
            type(d) is torch.Tensor  # not a traced (fake) tensor
            and d.dim() == 0
            and d.dtype == torch.int64
            and d.device.type == "cpu"
        )
    return isinstance(d, int) and not isinstance(d, bool)


def _datum(d: object, i: int, dev: torch.device) -> torch.Tensor:
    if isinstance(d, torch.Tensor):
        if d.dtype != torch.int64:
            raise TypeError(
                f"fold_in: data[{i}] must be an int or an int64 tensor, got {_a.describe(d)}"
            )
        return d.to(dev)
    v = as_int(d, f"fold_in: data[{i}]", I64_MIN, U64 - 1)
    return torch.tensor(signed(v), dtype=torch.int64, device=dev)


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
    k = _a.check_key(key, "fold_in", scalar=False)
    if (
        type(k) is torch.Tensor  # a traced (fake) key has no value to read
        and k.dim() == 0
        and k.device.type == "cpu"
        and all(_host_scalar(d) for d in data)
    ):
        # one key on the host (the step key): the same words in Python ints, ~10x faster
        z = int(k) % U64
        for i, d in enumerate(data):
            v = (
                int(d)
                if isinstance(d, torch.Tensor)
                else as_int(d, f"fold_in: data[{i}]", I64_MIN, U64 - 1)
            )
            z = _mix_int(z ^ _mix_int((v ^ _FOLD_SALT) % U64))
        return torch.tensor(signed(z), dtype=torch.int64)
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
    k = _a.check_key(key, "split", scalar=False)
    m = as_int(n, "split: n", 0, I64_MAX)
    salted = _mix_(torch.bitwise_xor(k, _SPLIT_SALT))
    return fold_in(salted.unsqueeze(-1), torch.arange(m, dtype=torch.int64, device=k.device))


# --------------------------------------------------------------------------- draws


def _uniform_core(dt: torch.dtype, direct: bool) -> Core:
    """``top(w, D) * 2**-D`` per element, flat; in ``dt`` if ``direct``, else in float32/64."""
    d = DIGITS[dt]
    cdt = torch.float64 if dt == torch.float64 else torch.float32

    def core(rows: Rows, kern: ModuleType | None) -> torch.Tensor:
        if kern is not None:
            out = torch.empty(rows.numel, dtype=dt if direct else cdt, device=rows.dev)
            return kern.uniform(out, rows.key, rows.index, rows.n, d)  # type: ignore[no-any-return]
        u = _top(_words(rows), d).to(cdt).mul_(2.0**-d).view(-1)
        return u.to(dt) if direct else u

    return core


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
        device: where to compute; default ``index``'s device, else ``key``'s.
        index: int64 sample ids of length ``shape[0]``: row ``i`` is drawn from
            ``fold_in(key, index[i])``.

    Example:
        >>> u = uniform(key(0), (2, 3))
        >>> bool(((u >= 0) & (u < 1)).all())
        True
        >>> uniform(key(0), 3, low=-1.0, high=1.0, dtype=torch.float16).dtype
        torch.float16
    """
    k = _a.check_key(key, "uniform", scalar=True)
    dims = _a.shape(shape, "uniform")
    dt = _a.float_dtype(dtype, "uniform")
    lo, hi = _a.finite(low, "uniform: low"), _a.finite(high, "uniform: high")
    if not lo < hi:
        raise ValueError(f"uniform: need low < high, got low={lo}, high={hi}")
    rows = rows_of(k, dims, index, device_of(device, k, index), "uniform")
    direct = (lo, hi) == (0.0, 1.0)
    u = draw(rows, ("uniform", dt, direct), _uniform_core(dt, direct))
    if not direct:
        u = u.mul_(hi - lo).add_(lo).to(dt)
        top = torch.tensor(hi, dtype=torch.float64).to(dt)
        if float(top) >= hi:
            top = torch.nextafter(top, torch.tensor(-math.inf, dtype=dt))
        u = u.clamp_max_(float(top))
    return u.reshape(dims)


def _normal_core(dt: torch.dtype, direct: bool) -> Core:
    """Box-Muller per pair of words, flat; in ``dt`` if ``direct``, else in float32/64."""
    cdt, d = (torch.float64, 53) if dt == torch.float64 else (torch.float32, 24)

    def core(rows: Rows, kern: ModuleType | None) -> torch.Tensor:
        if kern is not None:
            out = torch.empty(rows.numel, dtype=dt if direct else cdt, device=rows.dev)
            return kern.normal(out, rows.key, rows.index, rows.n, d)  # type: ignore[no-any-return]
        pairs = (rows.n + 1) // 2
        keys = _row_keys(rows)
        words = _bits(keys, 2 * pairs, rows.dev).view(*keys.shape, pairs, 2)
        scale = 2.0**-d
        v = _top(words[..., 0], d).neg_().add_(1 << d).to(cdt).mul_(scale)  # in (0, 1]
        theta = _top(words[..., 1], d).to(cdt).mul_(2.0 * math.pi * scale)
        r = v.log_().mul_(-2.0).sqrt_()
        z = torch.stack((torch.cos(theta).mul_(r), theta.sin_().mul_(r)), dim=-1)
        z = z.view(*keys.shape, 2 * pairs)[..., : rows.n].reshape(-1)
        return z.to(dt) if direct else z

    return core


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
        device: where to compute; default ``index``'s device, else ``key``'s.
        index: int64 sample ids of length ``shape[0]``: row ``i`` is drawn from
            ``fold_in(key, index[i])``.

    Example:
        >>> z = normal(key(0), (1000,), dtype=torch.float64)
        >>> abs(float(z.mean())) < 0.2, 0.8 < float(z.std()) < 1.2
        (True, True)
    """
    k = _a.check_key(key, "normal", scalar=True)
    dims = _a.shape(shape, "normal")
    dt = _a.float_dtype(dtype, "normal")
    mu, sigma = _a.finite(mean, "normal: mean"), _a.finite(std, "normal: std")
    if sigma < 0:
        raise ValueError(f"normal: std must be >= 0, got {sigma}")
    rows = rows_of(k, dims, index, device_of(device, k, index), "normal")
    direct = (mu, sigma) == (0.0, 1.0)
    z = draw(rows, ("normal", dt, direct), _normal_core(dt, direct))
    if not direct:
        z = z.mul_(sigma).add_(mu).to(dt)
    return z.reshape(dims)


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
        device: where to compute; default ``index``'s device, else ``key``'s.
        index: int64 sample ids of length ``shape[0]``: row ``i`` is drawn from
            ``fold_in(key, index[i])``.

    Example:
        >>> x = randint(key(0), 0, 10, (5,))
        >>> x.dtype, bool(((x >= 0) & (x < 10)).all())
        (torch.int64, True)
    """
    k = _a.check_key(key, "randint", scalar=True)
    lo = as_int(low, "randint: low", I64_MIN, I64_MAX)
    hi = as_int(high, "randint: high", I64_MIN, I64_MAX)
    if not lo < hi:
        raise ValueError(f"randint: need low < high, got low={lo}, high={hi}")
    if hi - lo > I64_MAX:
        raise ValueError(f"randint: high - low must be < 2**63, got {hi - lo}")
    dims = _a.shape(shape, "randint")
    dt = torch.int64 if dtype is None else dtype
    if dt == torch.bool or dt.is_complex:
        raise TypeError(f"randint: dtype must be an integer or float dtype, got {dt}")
    if not dt.is_floating_point:
        info = torch.iinfo(dt)
        if lo < info.min or hi - 1 > info.max:
            raise ValueError(
                f"randint: [{lo}, {hi}) does not fit dtype {dt} [{info.min}, {info.max}]"
            )

    def core(rows: Rows, kern: ModuleType | None) -> torch.Tensor:
        if kern is not None:
            out = torch.empty(rows.numel, dtype=dt, device=rows.dev)
            return kern.randint(out, rows.key, rows.index, rows.n, lo, hi - lo)  # type: ignore[no-any-return]
        return _top(_words(rows), 63).remainder_(hi - lo).add_(lo).to(dt).view(-1)

    rows = rows_of(k, dims, index, device_of(device, k, index), "randint")
    return draw(rows, ("randint", dt), core).reshape(dims)


def _randperm_core(rows: Rows, kern: ModuleType | None) -> torch.Tensor:
    """The stable argsort of each row's words: shape ``(n,)`` or ``(rows, n)``."""
    if kern is not None:
        words = torch.empty(rows.numel, dtype=torch.int64, device=rows.dev)
        words = kern.words(words, rows.key, rows.index, rows.n)
        words = words.view(-1, rows.n) if rows.index is not None else words
    else:
        words = _words(rows)
    return torch.argsort(words, dim=-1, stable=True)


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
        device: where to compute; default ``index``'s device, else ``key``'s.
        index: int64 sample ids: one permutation per sample.

    Example:
        >>> p = randperm(key(0), 5)
        >>> sorted(p.tolist())
        [0, 1, 2, 3, 4]
        >>> randperm(key(0), 5, index=torch.arange(3)).shape
        torch.Size([3, 5])
    """
    k = _a.check_key(key, "randperm", scalar=True)
    m = as_int(n, "randperm: n", 0, I64_MAX)
    dt = torch.int64 if dtype is None else dtype
    if dt == torch.bool or dt.is_complex or dt.is_floating_point:
        raise TypeError(f"randperm: dtype must be an integer dtype, got {dt}")
    if m > 0 and m - 1 > torch.iinfo(dt).max:
        raise ValueError(f"randperm: n={m} does not fit dtype {dt}")
    dims = (m,) if index is None else (_a.check_index(index, "randperm").shape[0], m)
    rows = rows_of(k, dims, index, device_of(device, k, index), "randperm")
    return draw(rows, ("randperm",), _randperm_core).to(dt)


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
        device: where to compute; default ``index``'s device, else ``key``'s.
        index: int64 sample ids of length ``shape[0]``: row ``i`` is drawn from
            ``fold_in(key, index[i])``.

    Example:
        >>> bernoulli(key(0), 0.0, (3,))
        tensor([0., 0., 0.])
        >>> bernoulli(key(0), torch.tensor([0.0, 1.0]), (2, 2), dtype=torch.bool)
        tensor([[False,  True],
                [False,  True]])
    """
    k = _a.check_key(key, "bernoulli", scalar=True)
    dims = _a.shape(shape, "bernoulli")
    if isinstance(p, torch.Tensor):
        if not p.dtype.is_floating_point:
            raise TypeError(f"bernoulli: p must be a float or a float tensor, got {_a.describe(p)}")
        if not _a.broadcasts_to(tuple(p.shape), dims):
            raise ValueError(
                f"bernoulli: p of shape {tuple(p.shape)} does not broadcast to shape {dims}"
            )
        dt = p.dtype if dtype is None else dtype
    else:
        pv = _a.finite(p, "bernoulli: p")
        if not 0.0 <= pv <= 1.0:
            raise ValueError(f"bernoulli: p must be in [0, 1], got {pv}")
        dt = torch.get_default_dtype() if dtype is None else dtype
    rows = rows_of(k, dims, index, device_of(device, k, index), "bernoulli")
    if isinstance(p, torch.Tensor):
        u = draw(rows, ("uniform", torch.float64, True), _uniform_core(torch.float64, True))
        return torch.lt(u.reshape(dims), p.to(device=rows.dev, dtype=torch.float64)).to(dt)

    def core(rows: Rows, kern: ModuleType | None) -> torch.Tensor:
        if kern is not None:
            out = torch.empty(rows.numel, dtype=dt, device=rows.dev)
            return kern.bernoulli(out, rows.key, rows.index, rows.n, pv)  # type: ignore[no-any-return]
        u = _top(_words(rows), 53).to(torch.float64).mul_(2.0**-53)
        return torch.lt(u, pv).to(dt).view(-1)

    return draw(rows, ("bernoulli", dt), core).reshape(dims)
