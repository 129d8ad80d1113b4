"""The fused Triton kernels of purestep.rng against its eager path.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, on
CPU tensors, numpy maths): the rng dispatcher is pointed at an interpreted copy of
``purestep._rng_triton`` for CPU draws, so every draw below goes through the
kernel path and is compared with the eager path of the same call. Needs the
``triton`` package (CUDA builds of torch ship it); skipped without it. On a CUDA
machine ``tests/test_cuda.py`` checks the compiled kernels the same way.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from purestep import _rng_dispatch, rng

pytest.importorskip("triton")

FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def _load_interpreted() -> ModuleType:
    """A fresh copy of purestep._rng_triton whose kernels run in Triton's interpreter."""
    path = os.path.join(os.path.dirname(rng.__file__), "_rng_triton.py")
    name = "purestep._rng_triton_interpreted"
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    assert module.INTERPRETED
    return module


KERNELS = _load_interpreted()


@pytest.fixture
def fused(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """Route CPU draws through the interpreted kernels (verification state reset).

    A kernel switched off by the dispatcher's check (its RuntimeWarning) fails the
    test: otherwise the eager fallback would hide the kernel's error.
    """
    monkeypatch.setattr(_rng_dispatch, "_VERIFIED", set())
    monkeypatch.setattr(_rng_dispatch, "_FUSED", {"module": KERNELS, "tried": True})
    monkeypatch.setattr(
        _rng_dispatch,
        "kernels",
        lambda dev: _rng_dispatch._FUSED["module"] if dev.type == "cpu" else None,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="purestep.rng", category=RuntimeWarning)
        yield KERNELS


def _eager(fn: Callable[[], torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(_rng_dispatch, "kernels", lambda dev: None)
        return fn()


def _assert_normal_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """The documented bound: |a - b| <= 8 eps max(1, |b|)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    eps = torch.finfo(want.dtype).eps
    err = (got.double() - want.double()).abs()
    assert bool((err <= 8 * eps * want.double().abs().clamp_min(1)).all()), float(err.max())


DRAWS: dict[str, Callable[..., torch.Tensor]] = {
    "uniform": lambda k, s, dt, **kw: rng.uniform(k, s, dtype=dt, **kw),
    "uniform_bounds": lambda k, s, dt, **kw: rng.uniform(k, s, low=-2.0, high=3.0, dtype=dt, **kw),
    "randint": lambda k, s, dt, **kw: rng.randint(k, -3, 17, s, **kw),
    "randint_wide": lambda k, s, dt, **kw: rng.randint(k, -(2**62), 2**62 - 1, s, **kw),
    "randint_int8": lambda k, s, dt, **kw: rng.randint(k, -100, 100, s, dtype=torch.int8, **kw),
    # float16 and float64 only: Triton's interpreter truncates float32 -> bfloat16 where the
    # GPU rounds to nearest even (test_cuda.py checks bfloat16 on the device)
    "randint_float": lambda k, s, dt, **kw: rng.randint(
        k, -(2**40), 2**40, s, dtype=torch.float64 if dt == torch.bfloat16 else dt, **kw
    ),
    "bernoulli": lambda k, s, dt, **kw: rng.bernoulli(k, 0.3, s, dtype=dt, **kw),
    "bernoulli_mask": lambda k, s, dt, **kw: rng.bernoulli(k, 0.7, s, dtype=torch.bool, **kw),
    "bernoulli_tensor_p": lambda k, s, dt, **kw: rng.bernoulli(
        k, torch.full(s[-1:], 0.25, dtype=torch.float64), s, **kw
    ),
    "randperm": lambda k, s, dt, **kw: rng.randperm(k, s[-1], **kw),
}
shapes = st.lists(st.integers(1, 12), min_size=1, max_size=3).map(tuple)
seeds = st.integers(-(2**63), 2**64 - 1)
# the `fused` fixture routes draws to the kernels; sharing it across examples is intended
SHARED_FIXTURE = [HealthCheck.function_scoped_fixture]


@pytest.mark.parametrize("name", list(DRAWS))
@settings(max_examples=8, deadline=None, suppress_health_check=SHARED_FIXTURE)
@given(seed=seeds, shape=shapes, dt=st.sampled_from(FLOATS), with_index=st.booleans())
def test_integer_and_uniform_kernels_equal_the_eager_path_bitwise(
    fused: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    seed: int,
    shape: tuple[int, ...],
    dt: torch.dtype,
    with_index: bool,
) -> None:
    """uniform, randint, bernoulli and randperm from the kernels are bitwise the eager draws."""
    k = rng.key(seed)
    kw: dict[str, Any] = {}
    if with_index:
        kw["index"] = torch.arange(shape[0], dtype=torch.int64) * (2**40 + 3) - 7
    got = DRAWS[name](k, shape, dt, **kw)
    want = _eager(lambda: DRAWS[name](k, shape, dt, **kw), monkeypatch)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want), name


@settings(max_examples=12, deadline=None, suppress_health_check=SHARED_FIXTURE)
@given(
    seed=seeds,
    shape=shapes,
    dt=st.sampled_from(FLOATS),
    with_index=st.booleans(),
    affine=st.booleans(),
)
def test_normal_kernel_is_within_the_documented_bound_of_the_eager_path(
    fused: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    seed: int,
    shape: tuple[int, ...],
    dt: torch.dtype,
    with_index: bool,
    affine: bool,
) -> None:
    """normal from the kernel is within 8 eps max(1, |z|) of the eager draw (odd rows too)."""
    k = rng.key(seed)
    kw: dict[str, Any] = {"dtype": dt}
    if affine:
        kw.update(mean=0.5, std=2.0)
    if with_index:
        kw["index"] = torch.arange(shape[0], dtype=torch.int64) * 5 + 2
    got = rng.normal(k, shape, **kw)
    want = _eager(lambda: rng.normal(k, shape, **kw), monkeypatch)
    _assert_normal_close(got, want)


def test_long_rows_span_several_programs(
    fused: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows longer than one block (1024 lanes) and odd lengths: every element is written once."""
    k = rng.key(3)
    idx = torch.tensor([4, -9, 2**50])
    for n in (1023, 1024, 1025, 2049, 4097):
        got = rng.uniform(k, (3, n), index=idx, dtype=torch.float64)
        want = _eager(
            lambda n=n: rng.uniform(k, (3, n), index=idx, dtype=torch.float64), monkeypatch
        )
        assert torch.equal(got, want), n
        _assert_normal_close(
            rng.normal(k, (3, n), index=idx),
            _eager(lambda n=n: rng.normal(k, (3, n), index=idx), monkeypatch),
        )


def test_int64_offsets_give_the_same_draws(
    fused: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The int64-offset variant (used past 2**31 elements) equals the int32 one."""
    k = rng.key(4)
    idx = torch.arange(5)
    small = rng.uniform(k, (5, 300), index=idx, dtype=torch.float64)
    z_small = rng.normal(k, (5, 301), index=idx)
    monkeypatch.setattr(KERNELS, "WIDE_AT", 16)
    assert torch.equal(rng.uniform(k, (5, 300), index=idx, dtype=torch.float64), small)
    assert torch.equal(rng.normal(k, (5, 301), index=idx), z_small)


def test_a_key_by_pointer_equals_a_key_by_value(
    fused: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key already on the draw's device (read by the kernel) gives the draws of a host key."""
    k, idx = rng.key(-5), torch.tensor([0, 7, -1])
    by_value = (rng.randint(k, 0, 1000, (3, 40), index=idx), rng.normal(k, (3, 41), index=idx))
    monkeypatch.setattr(KERNELS, "CPU_KEY_BY_POINTER", True)
    monkeypatch.setattr(_rng_dispatch, "_VERIFIED", set())
    assert torch.equal(rng.randint(k, 0, 1000, (3, 40), index=idx), by_value[0])
    assert torch.equal(rng.normal(k, (3, 41), index=idx), by_value[1])


def test_a_wrong_kernel_is_caught_and_replaced_by_the_eager_path(
    fused: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel that disagrees with the eager path on its probe draw is never used: the draw
    is the eager one, a RuntimeWarning says so, and later draws stay eager."""
    k = rng.key(6)
    want = _eager(lambda: rng.uniform(k, 100), monkeypatch)

    def off_by_one_bit(out: torch.Tensor, *args: Any) -> torch.Tensor:
        KERNELS.uniform(out, *args)
        return out.view(torch.int32).add_(1).view(out.dtype)

    monkeypatch.setitem(_rng_dispatch._FUSED, "module", _Patched(uniform=off_by_one_bit))
    with pytest.warns(RuntimeWarning, match="uniform kernel disagrees"):
        got = rng.uniform(k, 100)
    assert torch.equal(got, want)
    assert _rng_dispatch._FUSED["module"] is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(rng.uniform(k, 100), want)


def test_a_kernel_that_fails_falls_back_to_the_eager_path(
    fused: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel that raises (no compiler, launch failure) gives the eager draw and a warning."""
    k = rng.key(7)
    want = _eager(lambda: rng.normal(k, (2, 9), index=torch.arange(2)), monkeypatch)

    def broken(*args: Any) -> torch.Tensor:
        raise RuntimeError("no ptxas")

    monkeypatch.setitem(_rng_dispatch._FUSED, "module", _Patched(normal=broken))
    with pytest.warns(RuntimeWarning, match="no ptxas"):
        got = rng.normal(k, (2, 9), index=torch.arange(2))
    assert torch.equal(got, want)


class _Patched(ModuleType):
    """The interpreted kernels with some functions replaced."""

    def __init__(self, **overrides: Callable[..., torch.Tensor]) -> None:
        super().__init__("patched_kernels")
        self.__dict__.update({k: getattr(KERNELS, k) for k in KERNELS.__all__})
        self.__dict__.update(overrides)
