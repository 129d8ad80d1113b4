"""Canaries for the private torch/tensordict internals purestep relies on (docs/internals.md).

Each test checks the *behaviour* purestep relies on, not just that a name
exists, and fails with an ``AssertionError`` that names the internal, so a
torch or tensordict release that changes one shows up as "[torch._fused_sgd_]
changed: ..." in the version matrix (``nox``, see README) instead of as a
silently wrong optimizer step or checkpoint. The last test keeps the register
complete: every private name the source uses must have an entry in
docs/internals.md.

All of this runs in a few seconds; none of it spawns a process.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import io
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from tensordict import TensorDict
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
REGISTER = ROOT / "docs" / "internals.md"


@contextlib.contextmanager
def internal(name: str) -> Iterator[None]:
    """Turn any failure inside the block into an AssertionError that names ``name``."""
    try:
        yield
    except AssertionError as e:
        raise AssertionError(
            f"[{name}] changed behaviour: {e} -- purestep relies on it; see "
            f"docs/internals.md ({name}) for where and for the fallback"
        ) from e
    except Exception as e:  # gone, renamed or a new signature
        raise AssertionError(
            f"[{name}] is gone or its signature changed ({type(e).__name__}: {e}) -- "
            f"purestep relies on it; see docs/internals.md ({name}) for where and for the fallback"
        ) from e


def _rand(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _bits_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# --- tensordict ------------------------------------------------------------------------------


def _nested() -> tuple[TensorDict, torch.Tensor, torch.Tensor]:
    w, b = _rand(2, 3), _rand(3, seed=1)
    return TensorDict({"fc": {"w": w}, "b": b}, []), w, b


def test_tensordict_storage_dict_is_the_nodes_live_entries() -> None:
    """``TensorDict._tensordict`` is the node's own dict: direct entries, insertion order, no copies."""
    with internal("TensorDict._tensordict"):
        td, w, b = _nested()
        d = td._tensordict
        assert isinstance(d, dict), f"expected a dict, got {type(d).__name__}"
        assert list(d) == ["fc", "b"], f"keys {list(d)} are not the direct keys in insertion order"
        assert d["b"] is b, "a leaf is not stored as the very tensor that was set"
        assert type(d["fc"]) is TensorDict, "a nested node is not stored as a TensorDict"
        assert d["fc"]._tensordict["w"] is w, "a nested leaf is not the tensor that was set"
        new = torch.zeros(3)
        td.set("b", new)
        assert td._tensordict["b"] is new, "td.set() is not reflected in _tensordict (a copy?)"
        walked = list(td.values(include_nested=True, leaves_only=True))
        assert [t is x for t, x in zip(walked, [w, new], strict=True)] == [True, True], (
            "the public depth-first leaf order differs from the _tensordict walk's"
        )


def test_tensordict_private_device_and_batch_size_mirror_the_public_ones() -> None:
    """``TensorDict._device`` / ``_batch_size`` are ``device`` / ``batch_size`` (read unchecked)."""
    with internal("TensorDict._device / TensorDict._batch_size"):
        td, _, _ = _nested()
        assert td._device is None and td.device is None
        assert td._batch_size == td.batch_size == torch.Size([])
        on_cpu = TensorDict({"x": torch.zeros(4, 2)}, [4], device="cpu")
        assert on_cpu._device == torch.device("cpu")
        assert on_cpu._batch_size == torch.Size([4])


def test_new_unsafe_builds_the_checked_constructors_tensordict_without_copying() -> None:
    """``TensorDict._new_unsafe(items, batch_size=, nested=False)`` == ``TensorDict(items, ...)``."""
    with internal("TensorDict._new_unsafe"):
        inner = TensorDict({"w": _rand(2)}, [])
        x = _rand(3)
        fast = TensorDict._new_unsafe(
            {"x": x, "sub": inner}, batch_size=torch.Size([]), nested=False
        )
        assert type(fast) is TensorDict, f"got {type(fast).__name__}"
        assert fast._tensordict["x"] is x and fast._tensordict["sub"] is inner, "entries copied"
        assert fast.batch_size == torch.Size([]) and fast.device is None and not fast.is_locked
        slow = TensorDict({"x": x, "sub": inner}, [])
        assert (fast == slow).all(), "differs from the checked constructor's result"
        assert list(fast.keys(include_nested=True)) == list(slow.keys(include_nested=True))


# --- torch: version counters, nn.Module slots, torch.compile wrappers ----------------------------------------


def test_version_counter_moves_on_in_place_ops_only() -> None:
    """``Tensor._version`` grows on every in-place write and not on reads (norm memo keys)."""
    with internal("torch.Tensor._version"):
        t = _rand(3)
        v0 = t._version
        _ = t * 2
        _ = torch.linalg.vector_norm(t)
        assert t._version == v0, "a read moved the version counter"
        t.mul_(2)
        assert t._version > v0, "an in-place op did not move the version counter"
        v1 = t._version
        torch._foreach_mul_([t], 2.0)
        assert t._version > v1, "an in-place foreach op did not move the version counter"


def test_module_slot_dicts_are_what_attribute_access_and_forward_read() -> None:
    """``module.__dict__["_parameters" | "_buffers" | "_modules" | "_non_persistent_buffers_set"]``.

    They hold what ``module.x`` returns and what ``forward`` computes with, and
    the set names exactly the buffers ``state_dict`` leaves out.
    """
    with internal(
        'nn.Module.__dict__["_parameters" | "_buffers" | "_modules" | "_non_persistent_buffers_set"]'
    ):
        net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        net[1].register_buffer("scratch", torch.zeros(2), persistent=False)
        d = net.__dict__
        assert d["_modules"]["0"] is net[0], "_modules does not hold the children"
        slots = net[0].__dict__["_parameters"]
        assert slots["weight"] is net[0].weight, "_parameters does not hold the parameters"
        bufs = net[1].__dict__["_buffers"]
        assert bufs["running_mean"] is net[1].running_mean, "_buffers does not hold the buffers"
        hidden = net[1].__dict__["_non_persistent_buffers_set"]
        assert hidden == {"scratch"}, f"non-persistent set is {hidden}"
        assert "1.scratch" not in net.state_dict() and "1.running_mean" in net.state_dict()
        plain, mean = torch.zeros(2, 2), torch.full((2,), 5.0)
        old_w, old_mean = slots["weight"], bufs["running_mean"]
        slots["weight"], bufs["running_mean"] = plain, mean
        try:
            assert net[0].weight is plain, "attribute access does not read _parameters"
            assert net[1].running_mean is mean, "attribute access does not read _buffers"
            net.eval()
            out = net(torch.ones(1, 2))
            want = (net[0].bias.detach() - 5.0) / torch.sqrt(net[1].running_var + net[1].eps)
            torch.testing.assert_close(out, want[None] * net[1].weight + net[1].bias)
        finally:
            slots["weight"], bufs["running_mean"] = old_w, old_mean


def test_compile_wrapper_keeps_the_module_under_orig_mod() -> None:
    """``torch._dynamo.eval_frame.OptimizedModule`` wraps the module as ``_modules["_orig_mod"]``."""
    with internal("torch._dynamo.eval_frame.OptimizedModule._orig_mod"):
        lin = nn.Linear(2, 2)
        compiled = torch.compile(lin)  # builds the wrapper; nothing is compiled until called
        import sys

        eval_frame = sys.modules["torch._dynamo.eval_frame"]
        assert isinstance(compiled, eval_frame.OptimizedModule), type(compiled).__name__
        assert compiled.__dict__["_modules"]["_orig_mod"] is lin, "not under _orig_mod"
        names = [n for n, _ in compiled.named_parameters()]
        assert names == ["_orig_mod.weight", "_orig_mod.bias"], names


def test_inductor_standalone_compile_and_mode_options_keep_their_shape() -> None:
    """``standalone_compile`` takes purestep's keywords (``donate_graph_module`` only from torch
    2.12, passed where it exists); ``reduce-overhead`` asks for CUDA graphs."""
    from purestep.compile._backend import _takes_donate_graph_module

    with internal("torch._inductor.standalone_compile"):
        params = inspect.signature(torch._inductor.standalone_compile).parameters
        for kw in ("dynamic_shapes", "options"):
            assert kw in params, f"no {kw}= keyword: {list(params)}"
        assert _takes_donate_graph_module() == ("donate_graph_module" in params)
    with internal("torch._inductor.list_mode_options"):
        opts = torch._inductor.list_mode_options("reduce-overhead")
        assert opts.get("triton.cudagraphs") is True, opts


def test_fake_tensor_mode_makes_fake_tensors_of_the_inputs_metadata() -> None:
    """``FakeTensorMode.from_tensor`` gives a ``torch._subclasses.FakeTensor`` with the same metadata."""
    with internal("torch._subclasses.fake_tensor.FakeTensorMode"):
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=None)
        real = torch.ones(3, 2, dtype=torch.float64)
        fake = mode.from_tensor(real)
        assert isinstance(fake, torch._subclasses.FakeTensor), type(fake).__name__
        assert (fake.shape, fake.dtype, fake.device) == (real.shape, real.dtype, real.device)
        with mode:
            out = fake * 2
        assert isinstance(out, torch._subclasses.FakeTensor), type(out).__name__


def test_global_parameter_registration_hooks_dict_sees_public_registrations() -> None:
    """``nn.modules.module._global_parameter_registration_hooks`` holds the public hooks."""
    from torch.nn.modules import module as torch_module

    with internal("torch.nn.modules.module._global_parameter_registration_hooks"):
        hooks = torch_module._global_parameter_registration_hooks
        before = len(hooks)
        handle = nn.modules.module.register_module_parameter_registration_hook(
            lambda m, name, p: None
        )
        try:
            assert len(hooks) == before + 1, "a public registration is not in the dict"
        finally:
            handle.remove()
        assert len(hooks) == before, "removing the handle did not empty the dict"


# --- torch: optimizer kernels ------------------------------------------------------------------

_SHAPES = [(3, 5), (7,), (17,), (2, 2, 2)]  # one >= 16 elements: the vectorized CPU path


def _tensors(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [_rand(*s, seed=seed + i, dtype=dtype) for i, s in enumerate(_SHAPES)]


@pytest.mark.parametrize(
    ("kernel", "amsgrad", "weight_decay"),
    [
        ("_fused_adam_", False, 0.0),
        ("_fused_adam_", True, 0.1),
        ("_fused_adamw_", False, 0.01),
        ("_fused_adamw_", True, 0.0),
    ],
)
def test_fused_adam_kernels_equal_torch_optim_fused_and_the_foreach_reference(
    kernel: str, amsgrad: bool, weight_decay: float
) -> None:
    """The direct kernel call (as purestep makes it) == ``Adam(W)(fused=True)`` bitwise, 3 steps.

    And within fp32 rounding of the ``foreach=True`` reference, with grads never written.
    """
    name = f"torch.{kernel}"
    with internal(name):
        fn = getattr(torch, kernel)
        cls = torch.optim.AdamW if kernel == "_fused_adamw_" else torch.optim.Adam
        kw = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": weight_decay}
        p = _tensors(0)
        mu = [torch.zeros_like(t) for t in p]
        nu = [torch.zeros_like(t) for t in p]
        nu_max = [torch.zeros_like(t) for t in p] if amsgrad else []
        refs = {mode: [nn.Parameter(t.clone()) for t in p] for mode in ("fused", "foreach")}
        opts = {
            mode: cls(ps, amsgrad=amsgrad, **kw, **{mode: True})  # type: ignore[arg-type]
            for mode, ps in refs.items()
        }
        for step in (1, 2, 3):
            g = _tensors(10 * step)
            g_before = [t.clone() for t in g]
            steps = torch.full((), float(step), dtype=torch.float32)
            fn(
                p, g, mu, nu, nu_max, [steps] * len(p),
                lr=kw["lr"], beta1=0.9, beta2=0.99, weight_decay=weight_decay, eps=1e-8,
                amsgrad=amsgrad, maximize=False,
            )  # fmt: skip
            assert _bits_equal(g, g_before), "the kernel wrote the gradients"
            for mode, ps in refs.items():
                for param, grad in zip(ps, g_before, strict=True):
                    param.grad = grad.clone()
                opts[mode].step()
        assert _bits_equal(p, [t.detach() for t in refs["fused"]]), (
            f"not bitwise equal to {cls.__name__}(fused=True) after 3 steps"
        )
        for got, want in zip(p, refs["foreach"], strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("momentum", "dampening", "nesterov", "weight_decay"),
    [
        (0.0, 0.0, False, 0.0),
        (0.9, 0.0, False, 0.01),
        (0.9, 0.0, True, 0.0),
        (0.5, 0.3, False, 0.0),
    ],
)
def test_fused_sgd_kernel_equals_torch_optim_fused_and_the_foreach_reference(
    momentum: float, dampening: float, nesterov: bool, weight_decay: float
) -> None:
    """The direct ``torch._fused_sgd_`` call == ``SGD(fused=True)`` bitwise over 3 steps (fp32).

    Including ``is_first_step`` (momentum buffer initialised to the direction),
    and within fp32 rounding of ``foreach=True``; grads are never written.
    """
    with internal("torch._fused_sgd_"):
        kw = {
            "lr": 0.1,
            "momentum": momentum,
            "dampening": dampening,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
        }
        p = _tensors(0)
        buf = [torch.zeros_like(t) for t in p] if momentum else []
        refs = {mode: [nn.Parameter(t.clone()) for t in p] for mode in ("fused", "foreach")}
        opts = {
            mode: torch.optim.SGD(ps, **kw, **{mode: True})  # type: ignore[arg-type]
            for mode, ps in refs.items()
        }
        for step in (1, 2, 3):
            g = _tensors(10 * step)
            g_before = [t.clone() for t in g]
            torch._fused_sgd_(
                p, g, buf, maximize=False, is_first_step=step == 1 and bool(momentum), **kw
            )
            assert _bits_equal(g, g_before), "the kernel wrote the gradients"
            for mode, ps in refs.items():
                for param, grad in zip(ps, g_before, strict=True):
                    param.grad = grad.clone()
                opts[mode].step()
        assert _bits_equal(p, [t.detach() for t in refs["fused"]]), (
            "not bitwise equal to SGD(fused=True) after 3 steps"
        )
        for got, want in zip(p, refs["foreach"], strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-7)


def _cpu_fused_sgd_half_is_wrong(dtype: torch.dtype) -> bool:
    """pytorch/pytorch#191763: CPU ``_fused_sgd_`` skips or corrupts fp16/bf16 tensors >= 16."""
    p, g = _rand(64, dtype=dtype), _rand(64, seed=1, dtype=dtype)
    want = (p.float() - 0.1 * g.float()).to(dtype)  # the fp32 math of the fused kernels
    got = p.clone()
    torch._fused_sgd_(
        [got], [g], [], weight_decay=0.0, momentum=0.0, lr=0.1, dampening=0.0,
        nesterov=False, maximize=False, is_first_step=False,
    )  # fmt: skip
    return not torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_fused_sgd_half_precision_bug_is_worked_around_where_present(
    dtype: torch.dtype,
) -> None:
    """Where the CPU fp16/bf16 ``_fused_sgd_`` bug is present, purestep does not call it.

    Skips, saying so, on a torch that has fixed it (the workaround in
    ``optim._kernels.fused_supported`` could then be narrowed to older torch).
    """
    from purestep.optim._kernels import fused_supported

    with internal("torch._fused_sgd_ (CPU fp16/bf16 workaround)"):
        broken = _cpu_fused_sgd_half_is_wrong(dtype)
        uses_it = fused_supported(torch.device("cpu"), dtype, kernel="sgd")
        assert not (broken and uses_it), (
            f"the CPU {dtype} kernel is wrong on torch {torch.__version__} but "
            "fused_supported() selects it"
        )
    if not broken:
        pytest.skip(
            f"torch {torch.__version__}: the CPU {dtype} _fused_sgd_ bug (pytorch#191763) is "
            "fixed; fused_supported's workaround could be limited to older torch"
        )


_FOREACH_CASES = {
    # op: (foreach call, per-tensor reference)
    "_foreach_add": (
        lambda a, b: torch._foreach_add(a, b, alpha=0.3),
        lambda a, b: [x.add(y, alpha=0.3) for x, y in zip(a, b, strict=True)],
    ),
    "_foreach_add_": (
        lambda a, b: torch._foreach_add_(a, b, alpha=-0.7) or a,
        lambda a, b: [x.add_(y, alpha=-0.7) for x, y in zip(a, b, strict=True)],
    ),
    "_foreach_add_ (scalar)": (
        lambda a, b: torch._foreach_add_(a, 1e-8) or a,
        lambda a, b: [x.add_(1e-8) for x in a],
    ),
    "_foreach_sub_": (
        lambda a, b: torch._foreach_sub_(a, b) or a,
        lambda a, b: [x.sub_(y) for x, y in zip(a, b, strict=True)],
    ),
    "_foreach_copy_": (
        lambda a, b: torch._foreach_copy_(a, b) or a,
        lambda a, b: [x.copy_(y) for x, y in zip(a, b, strict=True)],
    ),
    "_foreach_lerp": (
        lambda a, b: torch._foreach_lerp(a, b, 0.1),
        lambda a, b: [torch.lerp(x, y, 0.1) for x, y in zip(a, b, strict=True)],
    ),
    "_foreach_lerp_": (
        lambda a, b: torch._foreach_lerp_(a, b, 0.1) or a,
        lambda a, b: [x.lerp_(y, 0.1) for x, y in zip(a, b, strict=True)],
    ),
    "_foreach_mul_": (
        lambda a, b: torch._foreach_mul_(a, 0.9) or a,
        lambda a, b: [x.mul_(0.9) for x in a],
    ),
    "_foreach_div_": (
        lambda a, b: torch._foreach_div_(a, 1.7) or a,
        lambda a, b: [x.div_(1.7) for x in a],
    ),
    "_foreach_sqrt": (
        lambda a, b: torch._foreach_sqrt([x.abs() for x in a]),
        lambda a, b: [x.abs().sqrt() for x in a],
    ),
    "_foreach_sign_": (
        lambda a, b: torch._foreach_sign_(a) or a,
        lambda a, b: [x.sign_() for x in a],
    ),
    "_foreach_maximum_": (
        lambda a, b: torch._foreach_maximum_(a, b) or a,
        lambda a, b: [torch.maximum(x, y, out=x) for x, y in zip(a, b, strict=True)],
    ),
    "_foreach_addcmul_": (
        lambda a, b: torch._foreach_addcmul_(a, b, b, 0.01) or a,
        lambda a, b: [x.addcmul_(y, y, value=0.01) for x, y in zip(a, b, strict=True)],
    ),
    "_foreach_addcdiv_": (
        lambda a, b: torch._foreach_addcdiv_(a, b, [y.abs() + 1 for y in b], -0.5) or a,
        lambda a, b: [x.addcdiv_(y, y.abs() + 1, value=-0.5) for x, y in zip(a, b, strict=True)],
    ),
}


@pytest.mark.parametrize("op", list(_FOREACH_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_foreach_op_equals_the_per_tensor_op(op: str, dtype: torch.dtype) -> None:
    """Each ``torch._foreach_*`` op purestep calls == the per-tensor public op (allclose).

    Bitwise where the per-tensor op is the same arithmetic (fp32); bf16 within
    one bf16 rounding, since the CPU kernels may round in a different order.
    """
    name = f"torch.{op.split(' ')[0]}"
    with internal(name):
        call, ref = _FOREACH_CASES[op]
        got = call(_tensors(0, dtype), _tensors(50, dtype))
        want = ref(_tensors(0, dtype), _tensors(50, dtype))
        assert len(got) == len(want), f"{len(got)} results for {len(want)} inputs"
        if dtype == torch.float32:
            torch.testing.assert_close(list(got), want, rtol=1e-6, atol=1e-7)
        else:
            torch.testing.assert_close(list(got), want, rtol=1.6e-2, atol=1e-5)


def test_foreach_mul_applies_a_tensor_scalar_at_the_ops_math_precision() -> None:
    """``_foreach_mul_(bf16 list, float64 0-dim tensor)`` does not round the factor to bf16.

    ``optim._kernels.foreach_mul_`` passes CPU factors as such tensors because a
    Python float *is* rounded to bf16 first (``1 - 1e-4`` becomes 1.0).
    """
    with internal("torch._foreach_mul_ (tensor scalar)"):
        ts = [torch.ones(20, dtype=torch.bfloat16) * 3]
        factor = 1 - 2e-3
        torch._foreach_mul_(ts, torch.tensor(factor, dtype=torch.float64))
        want = (torch.ones(20) * 3 * factor).to(torch.bfloat16)
        assert torch.equal(ts[0], want), f"got {ts[0][0].item()}, want {want[0].item()}"


def test_foreach_norm_with_dtype_equals_vector_norm() -> None:
    """``torch._foreach_norm(ts, 2, dtype=float32)`` == ``vector_norm(t, dtype=float32)`` each."""
    with internal("torch._foreach_norm"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            ts = _tensors(3, dtype)
            got = torch._foreach_norm(ts, 2, dtype=torch.float32)  # type: ignore[arg-type]
            for g, t in zip(got, ts, strict=True):
                assert g.dtype == torch.float32, f"{dtype}: norm dtype {g.dtype}"
                want = torch.linalg.vector_norm(t, dtype=torch.float32)
                torch.testing.assert_close(g, want, rtol=1e-6, atol=0)
        f64 = _tensors(3, torch.float64)
        got64 = torch._foreach_norm(f64, 2)
        assert all(n.dtype == torch.float64 for n in got64), "float64 norms are not float64"


# --- torch.distributed: FSDP2 and DCP -------------------------------------------------------


def test_fsdp_marks_every_managed_module() -> None:
    """``fully_shard`` sets ``_is_fsdp_managed_module = True`` on every module it manages.

    One process (gloo, world size 1, an in-memory store), destroyed at the end.
    """
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group in this process")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with internal("FSDP2 module._is_fsdp_managed_module"):
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        try:
            mesh = init_device_mesh("cpu", (1,))
            net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 1)))
            plain = nn.Linear(1, 1)
            fully_shard(net[0], mesh=mesh)
            fully_shard(net, mesh=mesh)
            unmarked = [
                n or "<root>"
                for n, m in net.named_modules()
                if getattr(m, "_is_fsdp_managed_module", False) is not True
            ]
            assert not unmarked, f"modules managed by fully_shard but not marked: {unmarked}"
            assert not getattr(plain, "_is_fsdp_managed_module", False), "a plain module is marked"
            assert hasattr(net[1][0].weight, "to_local"), "managed params are not DTensors"
        finally:
            dist.destroy_process_group()


def test_process_group_timeout_is_readable_and_settable() -> None:
    """``_get_backend(device).options._timeout`` reads a group's timeout; ``_set_pg_timeout``
    changes it (what ``loop.run(collective_timeout=)`` relies on)."""
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group in this process")
    import datetime

    from purestep.distributed import timeouts

    name = (
        "Process-group timeouts: ProcessGroup._get_backend(device).options._timeout, "
        "distributed_c10d._set_pg_timeout"
    )
    with internal(name):
        dist.init_process_group(
            "gloo",
            rank=0,
            world_size=1,
            store=dist.HashStore(),
            timeout=datetime.timedelta(seconds=77),
        )
        try:
            assert timeouts.get_timeout() == datetime.timedelta(seconds=77), "read back"
            timeouts.set_timeout(12.0)
            assert timeouts.get_timeout() == datetime.timedelta(seconds=12), "set, then read"
        finally:
            dist.destroy_process_group()


def test_non_zip_torch_save_record_is_torch_loadable_and_ends_with_the_raw_data() -> None:
    """``torch.save(t, f, _use_new_zipfile_serialization=False)``: the layout RAW_TAIL names.

    Not a zip; ``torch.load(weights_only=True)`` reads it; it ends with the
    element count (int64 little-endian) and the tensor's bytes, row-major.
    """
    with internal("torch.save(_use_new_zipfile_serialization=False)"):
        for t in (_rand(3, 5), torch.arange(7, dtype=torch.int64), _rand(4, dtype=torch.bfloat16)):
            buf = io.BytesIO()
            torch.save(t, buf, _use_new_zipfile_serialization=False)
            raw = buf.getvalue()
            assert not raw.startswith(b"PK"), "the record is a zip archive"
            nbytes = t.numel() * t.element_size()
            tail = raw[-nbytes:]
            count = int.from_bytes(raw[-nbytes - 8 : -nbytes], "little", signed=True)
            assert count == t.numel(), f"{count} before the data, want numel {t.numel()}"
            assert tail == t.contiguous().view(torch.uint8).numpy().tobytes(), "tail != data"
            back = torch.load(io.BytesIO(raw), weights_only=True)
            assert torch.equal(back, t) and back.dtype == t.dtype, "torch.load round trip"


def test_narrow_tensor_by_index_is_a_chain_of_narrows() -> None:
    """``torch.distributed._shard._utils.narrow_tensor_by_index(t, offsets, sizes)``."""
    with internal("torch.distributed._shard._utils.narrow_tensor_by_index"):
        from torch.distributed._shard._utils import narrow_tensor_by_index

        t = _rand(6, 5)
        got = narrow_tensor_by_index(t, [2, 1], [3, 4])
        assert torch.equal(got, t[2:5, 1:5]), "not t[2:5, 1:5]"
        assert got.untyped_storage().data_ptr() == t.untyped_storage().data_ptr(), "not a view"
        assert torch.equal(narrow_tensor_by_index(t, [0, 0], [6, 5]), t)


def test_dcp_filesystem_private_types_keep_their_shape() -> None:
    """DCP's ``_StorageInfo``, ``_StoragePrefix`` and ``_SerialCpuLoader`` as RecordWriter uses them."""
    from torch.distributed.checkpoint import filesystem as fs

    with internal("torch.distributed.checkpoint.filesystem._StorageInfo"):
        info = fs._StorageInfo("__0_0.distcp", 10, 20)
        assert (info.relative_path, info.offset, info.length) == ("__0_0.distcp", 10, 20)
        assert not info.transform_descriptors, "a plain record now has stream transforms"
    with internal("torch.distributed.checkpoint.filesystem._StoragePrefix"):
        assert fs._StoragePrefix("__0_").prefix == "__0_"
    with internal("torch.distributed.checkpoint.filesystem._SerialCpuLoader"):
        view = torch.arange(10.0)[2:5]
        loader = fs._SerialCpuLoader(lambda obj: {"a": view, "b": torch.ones(2)}[obj])
        assert isinstance(loader, fs._TensorLoader)
        loader.add(12, "a")
        loader.add(8, "b")
        loader.start_loading()
        got = list(loader.values())
        assert [o for _, o in got] == ["a", "b"], "items not returned in the order added"
        assert torch.equal(got[0][0], view), "wrong tensor"
        assert got[0][0].device.type == "cpu"
    with internal("torch.distributed.checkpoint.filesystem._OverlappingCpuLoader"):
        params = inspect.signature(fs._OverlappingCpuLoader).parameters
        assert "inflight_threshhold" in params, f"parameters are now {list(params)}"
    with internal("FileSystemWriter.per_thread_copy_ahead"):
        assert isinstance(dcp.FileSystemWriter("unused").per_thread_copy_ahead, int)


def _one_process_dcp(fn: object) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*process group.*")
        fn()  # type: ignore[operator]


def test_dcp_reads_purestep_records_and_purestep_reads_dcp_records(tmp_path: Path) -> None:
    """Stock ``FileSystemReader`` loads a RecordWriter checkpoint, and RecordReader a stock one.

    The first holds while the non-zip record and DCP's ``_StorageInfo``
    (relative path, offset, length) mean what RecordWriter writes; the second
    while ``FileSystemReader.storage_data`` maps each chunk to its record.
    """
    from purestep.distributed._storage import RecordReader, RecordWriter

    state = {"w": _rand(4, 3), "b": torch.arange(5), "h": _rand(17, dtype=torch.bfloat16)}
    with internal("DCP: stock FileSystemReader reading purestep's non-zip records"):
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        _one_process_dcp(
            lambda: dcp.save(state, storage_writer=RecordWriter(tmp_path / "ours"), no_dist=True)
        )
        _one_process_dcp(
            lambda: dcp.load(
                out, storage_reader=dcp.FileSystemReader(tmp_path / "ours"), no_dist=True
            )
        )
        for k, v in state.items():
            assert torch.equal(out[k], v), f"{k} differs after a stock load"
    with internal("DCP: FileSystemReader.storage_data (RecordReader on a stock checkpoint)"):
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        _one_process_dcp(lambda: dcp.save(state, checkpoint_id=tmp_path / "stock", no_dist=True))
        _one_process_dcp(
            lambda: dcp.load(out, storage_reader=RecordReader(tmp_path / "stock"), no_dist=True)
        )
        for k, v in state.items():
            assert torch.equal(out[k], v), f"{k} differs after RecordReader on a stock checkpoint"


# --- the canaries themselves ------------------------------------------------------------------


def _eval_frame() -> object:
    import torch._dynamo.eval_frame

    return torch._dynamo.eval_frame


class _IgnoresWrites(dict):  # type: ignore[type-arg]
    def __setitem__(self, key: object, value: object) -> None:
        pass


_BROKEN = {
    "a no-op fused kernel": (
        (torch, "_fused_sgd_", lambda *a, **k: None),
        lambda: test_fused_sgd_kernel_equals_torch_optim_fused_and_the_foreach_reference(
            0.9, 0.0, False, 0.01
        ),
        "[torch._fused_sgd_] changed behaviour",
    ),
    "a renamed compile wrapper": (
        (_eval_frame(), "OptimizedModule", None),
        test_compile_wrapper_keeps_the_module_under_orig_mod,
        "[torch._dynamo.eval_frame.OptimizedModule._orig_mod] is gone",
    ),
    "a hooks dict that no longer sees registrations": (
        (nn.modules.module, "_global_parameter_registration_hooks", _IgnoresWrites()),
        test_global_parameter_registration_hooks_dict_sees_public_registrations,
        "[torch.nn.modules.module._global_parameter_registration_hooks] changed behaviour",
    ),
    "a removed foreach op": (
        (torch, "_foreach_lerp_", None),
        lambda: test_foreach_op_equals_the_per_tensor_op("_foreach_lerp_", torch.float32),
        "[torch._foreach_lerp_] is gone",
    ),
}


@pytest.mark.parametrize("change", list(_BROKEN))
def test_a_canary_fails_naming_its_internal_when_that_internal_changes(
    change: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Simulated torch changes (patched for this test only) make the canary fail with the name."""
    (owner, attr, replacement), canary, expected = _BROKEN[change]
    if replacement is None:
        monkeypatch.delattr(owner, attr)
    else:
        monkeypatch.setattr(owner, attr, replacement)
    with pytest.raises(AssertionError) as failure:
        canary()
    assert str(failure.value).startswith(expected), str(failure.value)


# --- the register itself -----------------------------------------------------------------------

# Private names the source may use, found in its syntax tree: attributes read on
# objects other than self/cls (``td._tensordict``, ``torch._fused_sgd_``), private
# string keys (``d["_parameters"]``, ``getattr(m, "_is_fsdp_managed_module")``),
# private segments of dotted torch paths (imports, ``"torch._dynamo.eval_frame"``),
# private names imported from torch, and private keyword arguments
# (``_use_new_zipfile_serialization=``). Names purestep defines itself (functions,
# classes, modules, its own attributes and module constants) are not internals.
_TORCH_PATH = re.compile(r"\btorch(?:\.\w+)+")
_STDLIB_BASES = {"os", "sys"}  # os._exit and the like are not torch's


def _own_names(files: list[Path]) -> tuple[set[str], set[str]]:
    """(names purestep defines, attribute names it sets or keeps on its own objects)."""
    defined: set[str] = set()
    attrs: set[str] = set()
    for path in files:
        defined.add(path.stem)
        module = ast.parse(path.read_text())
        for node in ast.walk(module):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Attribute) and (
                isinstance(node.ctx, ast.Store)
                or (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                attrs.add(node.attr)
            elif isinstance(node, ast.ImportFrom) and (
                node.level > 0 or (node.module or "").startswith("purestep")
            ):
                defined.update((a.asname or a.name) for a in node.names)
        for stmt in module.body:  # module-level constants
            targets = (
                stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
            )
            defined.update(t.id for t in targets if isinstance(t, ast.Name))
    return defined, attrs


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and len(name) > 1


def _private_names_in_src() -> dict[str, set[str]]:
    files = sorted((ROOT / "src" / "purestep").rglob("*.py"))
    defined, attrs = _own_names(files)
    stems = {p.stem for p in files}
    found: dict[str, set[str]] = {}
    for path in files:
        text = path.read_text()
        names: list[str] = []
        for chain in _TORCH_PATH.findall(text):
            names += [seg for seg in chain.split(".") if _is_private(seg)]
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                base = node.value.id if isinstance(node.value, ast.Name) else None
                if base in {"self", "cls", *_STDLIB_BASES} or node.attr in attrs:
                    continue
                if base in stems and node.attr in defined:  # one purestep module's private name
                    continue
                names.append(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.fullmatch(r"_[A-Za-z]\w*", node.value) and node.value not in attrs:
                    names.append(node.value)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                names += [a.name for a in node.names if _is_private(a.name)]
            elif isinstance(node, ast.keyword) and node.arg and _is_private(node.arg):
                names.append(node.arg)
        for name in names:
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_register_lists_every_private_name_the_source_uses() -> None:
    """Every private torch/tensordict name found in ``src/purestep`` appears in docs/internals.md."""
    register = REGISTER.read_text()
    found = _private_names_in_src()
    for expected in ("_fused_adamw_", "_tensordict", "_parameters", "_StorageInfo", "_shard"):
        assert expected in found, f"the scanner missed {expected}: {sorted(found)}"
    missing = {n: sorted(files) for n, files in found.items() if n not in register}
    assert not missing, (
        "private internals used in src/ but not in docs/internals.md (add an entry and a "
        f"canary in tests/test_internals.py): {missing}"
    )
