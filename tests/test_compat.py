"""``purestep._compat``: each private internal's public fallback, and the suite run through them.

The canaries in ``test_internals.py`` check that the internals behave as
purestep relies on. These tests check the other half of the guard: that
every public fallback ``_compat`` would switch to computes the same thing as
the internal (bitwise, on inputs large enough for the vectorised CPU paths),
that a failing probe switches with one warning naming the internal, and that
with ``PURESTEP_COMPAT=public`` (every fallback forced) the optimizer parity
tests against ``torch.optim`` and the checkpoint round-trip tests pass.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from purestep import _compat

ROOT = Path(__file__).resolve().parent.parent

# Every internal _compat guards, by the name its warning and FALLBACKS use.
GUARDED = [
    "TensorDict._tensordict/_device/_batch_size",
    "TensorDict._new_unsafe",
    'nn.Module.__dict__["_parameters" | "_buffers" | "_modules" | "_non_persistent_buffers_set"]',
    "torch.nn.modules.module._global_parameter_registration_hooks",
    *(
        f"torch._foreach_{op}"
        for op in [
            "add_",
            "add",
            "sub_",
            "mul_",
            "div_",
            "lerp_",
            "lerp",
            "addcmul_",
            "addcdiv_",
            "maximum_",
            "sqrt",
            "sign_",
            "copy_",
            "norm",
        ]
    ),
    "torch._fused_adam_",
    "torch._fused_adamw_",
    "torch._fused_sgd_",
    "torch.distributed._shard._utils.narrow_tensor_by_index",
    "torch.save(_use_new_zipfile_serialization=False)",
    "torch.distributed.checkpoint.filesystem._SerialCpuLoader/_OverlappingCpuLoader",
]


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


_SHAPES = [(3, 5), (7,), (33,), (2, 2, 2)]  # 33 elements: the vectorised CPU loops and a tail


def _tensors(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [_rand(*s, seed=seed + i, dtype=dtype) for i, s in enumerate(_SHAPES)]


def _bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return _compat._same(a, b)


@pytest.mark.skipif(_compat.FORCE_PUBLIC, reason="PURESTEP_COMPAT=public forces the fallbacks")
def test_every_probe_passes_and_binds_the_internal_on_this_torch() -> None:
    """On a torch/tensordict where every internal behaves, no fallback is taken.

    A failure names the internal whose probe failed (also a ``CompatWarning`` at
    import): the version matrix shows which internal a new release changed.
    """
    assert _compat.FALLBACKS == {}, f"internals on their public fallback: {_compat.FALLBACKS}"
    assert _compat.PLAIN_TD is TensorDict
    assert _compat.new_td == TensorDict._new_unsafe
    assert _compat.foreach_add_ is torch._foreach_add_
    assert _compat.foreach_norm is torch._foreach_norm
    assert _compat.fused_adamw_ is torch._fused_adamw_
    assert _compat.fused_sgd_ is torch._fused_sgd_
    assert _compat.NON_ZIP_RECORDS


def test_forced_mode_binds_every_public_path() -> None:
    """With ``PURESTEP_COMPAT=public``, every guarded internal is on its fallback.

    Runs in the forced subprocess of the test below (skips in a normal run), so
    that run is known to have exercised the public paths.
    """
    if not _compat.FORCE_PUBLIC:
        pytest.skip("only meaningful with PURESTEP_COMPAT=public")
    assert sorted(_compat.FALLBACKS) == sorted(GUARDED)
    assert _compat.PLAIN_TD is not TensorDict
    assert _compat.new_td is _compat._new_td_public
    assert _compat.foreach_add_ is _compat._loop_add_
    assert _compat.foreach_norm is _compat._loop_norm
    assert _compat.fused_sgd_ is _compat._public_fused_sgd
    assert not _compat.NON_ZIP_RECORDS and _compat.save_record is _compat._save_public
    assert _compat.registration_hooks() is _compat._ALWAYS_TO_MODULE


def test_a_failing_probe_falls_back_with_one_warning_naming_the_internal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A probe that returns False or raises selects the public path and warns once, by name."""
    # _choose records into the one FALLBACKS dict that _compat re-exports (rebinding the
    # package attribute would not reach it): seed this test's names under monkeypatch, so
    # the entries are removed afterwards, and check that _choose overwrote them.
    for name in ("torch._foreach_gone_", "torch._ok_"):
        monkeypatch.setitem(_compat.FALLBACKS, name, "")

    def boom() -> bool:
        raise AttributeError("module 'torch' has no attribute '_foreach_gone_'")

    for probe, why in ((lambda: False, "unexpected result"), (boom, "AttributeError")):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = _compat._choose("torch._foreach_gone_", probe, lambda: "fast", "public")
        assert got == "public"
        assert len(seen) == 1 and issubclass(seen[0].category, _compat.CompatWarning)
        msg = str(seen[0].message)
        assert "torch._foreach_gone_" in msg and "speed, not correctness" in msg, msg
        assert why in _compat.FALLBACKS["torch._foreach_gone_"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        passing = _compat._choose("torch._ok_", lambda: True, lambda: "fast", "public")
    assert passing == ("public" if _compat.FORCE_PUBLIC else "fast")
    forced = "forced by PURESTEP_COMPAT=public" if _compat.FORCE_PUBLIC else ""
    assert _compat.FALLBACKS["torch._ok_"] == forced


# op: (internal, public fallback, extra args builder)
_FOREACH: dict[str, tuple[str, Callable[..., Any], Callable[[torch.dtype], tuple[Any, ...]]]] = {
    "add_": ("_foreach_add_", _compat._loop_add_, lambda d: (_tensors(10, d),)),
    "add_scalar": ("_foreach_add_", _compat._loop_add_, lambda d: (0.3,)),
    "add": ("_foreach_add", _compat._loop_add, lambda d: (_tensors(10, d),)),
    "sub_": ("_foreach_sub_", _compat._loop_sub_, lambda d: (_tensors(10, d),)),
    "mul_tensor_scalar": (
        "_foreach_mul_",
        _compat._loop_mul_,
        lambda d: (torch.tensor(1 - 1e-4, dtype=torch.float64),),
    ),
    "mul_": ("_foreach_mul_", _compat._loop_mul_, lambda d: (0.75,)),
    "div_": ("_foreach_div_", _compat._loop_div_, lambda d: (1.7,)),
    "lerp_": ("_foreach_lerp_", _compat._loop_lerp_, lambda d: (_tensors(10, d), 0.1)),
    "lerp": ("_foreach_lerp", _compat._loop_lerp, lambda d: (_tensors(10, d), 0.1)),
    "addcmul_": (
        "_foreach_addcmul_",
        _compat._loop_addcmul_,
        lambda d: (_tensors(10, d), _tensors(20, d), 0.01),
    ),
    "addcdiv_": (
        "_foreach_addcdiv_",
        _compat._loop_addcdiv_,
        lambda d: (_tensors(10, d), [t.abs() + 0.5 for t in _tensors(20, d)], -0.01),
    ),
    "maximum_": ("_foreach_maximum_", _compat._loop_maximum_, lambda d: (_tensors(10, d),)),
    "sqrt": ("_foreach_sqrt", _compat._loop_sqrt, lambda d: ()),
    "sign_": ("_foreach_sign_", _compat._loop_sign_, lambda d: ()),
    "copy_": ("_foreach_copy_", _compat._loop_copy_, lambda d: (_tensors(10, d),)),
    "norm": ("_foreach_norm", _compat._loop_norm, lambda d: (2,)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", sorted(_FOREACH))
def test_foreach_fallback_equals_the_foreach_op_bitwise(case: str, dtype: torch.dtype) -> None:
    """Each per-tensor fallback gives the ``torch._foreach_*`` op's result bit for bit."""
    name, loop, extra = _FOREACH[case]
    args = extra(dtype)
    a, b = _tensors(0, dtype), _tensors(0, dtype)
    if case == "sqrt":
        a, b = [t.abs() for t in a], [t.abs() for t in b]
    out_a = getattr(torch, name)(a, *args)
    out_b = loop(b, *args)
    if name.endswith("_"):
        assert out_b is None
        assert _bits(a, b), f"{loop.__name__} differs from torch.{name} ({dtype})"
    else:
        assert _bits(list(out_a), out_b), f"{loop.__name__} differs from torch.{name} ({dtype})"
        assert _bits(a, b), f"{loop.__name__} wrote its input"


def test_foreach_norm_fallback_accepts_an_accumulation_dtype() -> None:
    """``norm(tensors, 2, dtype=float32)`` of bf16 tensors, as ``tree.global_norm`` calls it."""
    ts = _tensors(3, torch.bfloat16)
    want = torch._foreach_norm(ts, 2, dtype=torch.float32)
    assert _bits(list(want), _compat._loop_norm(ts, 2, dtype=torch.float32))


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("kernel", ["_fused_adam_", "_fused_adamw_"])
def test_fused_adam_fallback_equals_the_kernel_bitwise(kernel: str, amsgrad: bool) -> None:
    """``torch.optim.adam.adam(fused=True)`` with purestep's 1-based steps == the kernel, 3 steps."""
    public = _compat._public_fused_adam(kernel == "_fused_adamw_")
    hp = {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1, "eps": 1e-8}
    runs = []
    for fn in (getattr(torch, kernel), public):
        p = _tensors(0)
        m, v, vmax = ([torch.zeros_like(t) for t in p] for _ in range(3))
        for k in range(3):
            g = _tensors(100 + k)
            g0 = [t.clone() for t in g]
            steps = [torch.tensor(float(k + 1)) for _ in p]
            fn(p, g, m, v, vmax if amsgrad else [], steps, amsgrad=amsgrad, maximize=False, **hp)
            assert _bits(g, g0), "grads were written"
            assert all(int(s) == k + 1 for s in steps), "the caller's step tensors were changed"
        runs.append(p + m + v + vmax)
    assert _bits(runs[0], runs[1])


@pytest.mark.parametrize(
    "hp",
    [
        {"momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0},
        {"momentum": 0.9, "dampening": 0.0, "nesterov": True, "weight_decay": 0.01},
        {"momentum": 0.9, "dampening": 0.3, "nesterov": False, "weight_decay": 0.0},
    ],
)
def test_fused_sgd_fallback_equals_the_kernel_bitwise(hp: dict[str, Any]) -> None:
    """``torch.optim.sgd.sgd(fused=True)`` == ``torch._fused_sgd_``, first step included."""
    runs = []
    for fn in (torch._fused_sgd_, _compat._public_fused_sgd):
        p = _tensors(0)
        bufs = [torch.zeros_like(t) for t in p] if hp["momentum"] else []
        for k in range(3):
            g = _tensors(100 + k)
            fn(p, g, bufs, lr=0.1, maximize=False, is_first_step=k == 0 and bool(bufs), **hp)
        runs.append(p + bufs)
    assert _bits(runs[0], runs[1])


def test_new_td_fallback_builds_the_same_node_without_copies() -> None:
    """The checked constructor gives what ``_new_unsafe`` gives for plain_td's inputs."""
    a, sub = torch.ones(2), TensorDict({"b": torch.zeros(1)}, [])
    for make in (TensorDict._new_unsafe, _compat._new_td_public):
        td = make({"a": a, "n": sub}, batch_size=torch.Size([]), nested=False)
        assert type(td) is TensorDict and td.batch_size == torch.Size([]) and td.device is None
        assert td.get("a") is a and list(td.keys()) == ["a", "n"]
        assert td.get(("n", "b")) is sub.get("b")


def test_narrow_fallback_is_the_same_view() -> None:
    """The ``Tensor.narrow`` chain gives the private helper's view of the same memory."""
    from torch.distributed._shard._utils import narrow_tensor_by_index

    t = torch.arange(60.0).reshape(3, 4, 5)
    for offsets, sizes in (((1, 0, 2), (2, 4, 3)), ((0, 0, 0), (3, 4, 5)), ((2, 3, 4), (1, 1, 1))):
        want = narrow_tensor_by_index(t, offsets, sizes)
        got = _compat._narrow_public(t, offsets, sizes)
        assert torch.equal(got, want) and got.data_ptr() == want.data_ptr()
        assert got.stride() == want.stride()


def test_record_fallback_writes_loadable_zip_records() -> None:
    """Without the non-zip format, records are zip and ``torch.load`` reads them back."""
    for t in (torch.arange(5.0), torch.ones(3, dtype=torch.bfloat16), torch.arange(4)):
        buf = io.BytesIO()
        _compat._save_public(t, buf, False)
        assert zipfile.is_zipfile(io.BytesIO(buf.getvalue()))
        buf.seek(0)
        assert torch.equal(torch.load(buf, weights_only=True), t)


def test_cpu_loader_fallback_yields_what_dcps_serial_loader_yields() -> None:
    """Same CPU tensors (views compacted), same items, same order as ``_SerialCpuLoader``."""
    items = [torch.arange(12.0).reshape(3, 4)[1:], torch.ones(2, dtype=torch.bfloat16)]
    runs = []
    for loader in (
        _compat._private_cpu_loader(items.__getitem__, 0),
        _compat._PublicCpuLoader(items.__getitem__),
    ):
        for i, t in enumerate(items):
            loader.add(t.nbytes, i)
        loader.start_loading()
        runs.append(list(loader.values()))
    assert [o for _, o in runs[0]] == [o for _, o in runs[1]] == [0, 1]
    for (a, _), (b, _) in zip(*runs, strict=True):
        assert torch.equal(a, b) and a.stride() == b.stride()
        assert b.untyped_storage().nbytes() == b.nbytes


def test_module_slot_fallback_makes_call_take_to_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the slot swap disabled, ``call`` runs through ``to_module`` with the same output."""
    import purestep as ps
    from purestep.step import _call

    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    params = ps.params_of("net", net).apply(lambda t: t * 2)
    x = _rand(5, 3, seed=1)
    fast = ps.call(net, params, x)
    monkeypatch.setattr(_compat, "registration_hooks", lambda: _compat._ALWAYS_TO_MODULE)
    assert _call._registration_hooks() is _compat._ALWAYS_TO_MODULE
    assert torch.equal(ps.call(net, params, x), fast)


# The optimizer parity tests against torch.optim and the checkpoint round trips. The
# optimizer files are matched by glob so a reorganised suite is still picked up.
FORCED_FILES = [
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_optim*.py")),
    "tests/test_checkpoint.py",
    "tests/test_storage.py",
]
FORCED_SELECTION = "matches or match_torch or equals_the_imperative or round_trip or forced_mode"


@pytest.mark.skipif(_compat.FORCE_PUBLIC, reason="already running with the fallbacks forced")
def test_optimizer_parity_and_checkpoint_round_trips_pass_on_the_forced_fallbacks() -> None:
    """``PURESTEP_COMPAT=public pytest <optim parity + checkpoint round-trip tests>`` passes.

    A subprocess, because the fallbacks are bound at import. It also runs
    ``test_forced_mode_binds_every_public_path``, so the run is known to have
    used every public path.
    """
    env = {**os.environ, "PURESTEP_COMPAT": "public", "PYTHONPATH": str(ROOT / "src")}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-W",
        "ignore::DeprecationWarning",
        "-rA",
        *FORCED_FILES,
        "tests/test_compat.py",
        "-k",
        FORCED_SELECTION,
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, f"forced-fallback run failed:\n{tail}"
    assert "PASSED tests/test_compat.py::test_forced_mode_binds_every_public_path" in tail, tail
