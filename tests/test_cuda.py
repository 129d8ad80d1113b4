"""The CUDA suite (marker ``cuda``): runs wherever CUDA is available, skipped elsewhere.

``pytest -m cuda`` runs only these. They check what a CPU cannot:

* rng: CUDA draws equal the CPU's (integer, uniform, bernoulli bitwise; normal
  within the documented bound), through the fused Triton kernels and the eager
  path, for CPU and CUDA keys; no host sync; throughput sanity.
* optimizers: parity with ``torch.optim``'s fused CUDA kernels (fp32, bf16).
* ``train_step`` (plain and ``accumulate``) bitwise equal to the imperative loop.
* the README's loss, verbatim, on a CUDA batch.
* checkpoint save and load of a CUDA state (loads back onto the GPU).
* ``fsdp.bind`` on nccl with one GPU under torchrun, save and bitwise resume.
* steps, EMA and the methods' losses without host syncs
  (``torch.cuda.set_sync_debug_mode("error")``).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

import purestep as ps
from purestep import _rng_dispatch, optim, rng, tree
from purestep.distributed import checkpoint as ckpt
from purestep.methods import dmd2, finetune, flow, nft

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parents[1]
DEV = torch.device("cuda")
FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Any host-device synchronisation inside the block raises (sync debug mode ``error``)."""
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


@pytest.fixture
def eager_rng(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA draws through the eager int64 path instead of the fused kernels."""
    monkeypatch.setattr(_rng_dispatch, "kernels", lambda dev: None)


@pytest.fixture
def kernels_must_hold() -> Iterator[None]:
    """Fail if the dispatcher switches the fused kernels off (a kernel disagreed or failed)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="purestep.rng", category=RuntimeWarning)
        yield


def _assert_normal_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """The documented bound ``|a - b| <= 8 eps max(1, |b|)``."""
    assert got.dtype == want.dtype and got.shape == want.shape
    eps = torch.finfo(want.dtype).eps
    err = (got.double().cpu() - want.double().cpu()).abs()
    bound = 8 * eps * want.double().cpu().abs().clamp_min(1)
    assert bool((err <= bound).all()), f"max |diff| {float(err.max()):.3g}"


# --------------------------------------------------------------------------- rng

IDX = torch.tensor([3, -1, 2**40, 7, 0])
SHAPES = [(5, 1), (5, 3001), (5, 2, 33)]


def _draws(k: torch.Tensor, shape: tuple[int, ...], index: torch.Tensor | None, **kw: Any):  # type: ignore[no-untyped-def]
    """Every exact (non-normal) draw of one key, shape and placement: name -> tensor."""
    ix = {} if index is None else {"index": index}
    out = {}
    for dt in FLOATS:
        out[f"uniform {dt}"] = rng.uniform(k, shape, dtype=dt, **ix, **kw)
        out[f"uniform bounds {dt}"] = rng.uniform(k, shape, low=-3, high=0.5, dtype=dt, **ix, **kw)
    for dt in (torch.int64, torch.int8, torch.float32, torch.bfloat16, torch.float16):
        hi = {torch.int8: 100, torch.float16: 60000}.get(dt, 2**40)
        out[f"randint {dt}"] = rng.randint(k, -hi, hi, shape, dtype=dt, **ix, **kw)
    out["bernoulli"] = rng.bernoulli(k, 0.3, shape, **ix, **kw)
    out["bernoulli bool"] = rng.bernoulli(k, 0.7, shape, dtype=torch.bool, **ix, **kw)
    out["bernoulli bf16"] = rng.bernoulli(k, 0.5, shape, dtype=torch.bfloat16, **ix, **kw)
    p = torch.linspace(0, 1, shape[-1], dtype=torch.float64)
    out["bernoulli tensor p"] = rng.bernoulli(
        k, p.to(kw.get("device", "cpu") if index is None else index.device), shape, **ix, **kw
    )
    out["randperm"] = rng.randperm(k, shape[-1], **ix, **kw)
    return out


@pytest.mark.parametrize(
    ("path", "key_on", "shape"),
    [("fused", "cpu", s) for s in SHAPES]
    + [("eager", "cpu", s) for s in SHAPES]
    + [("fused", "cuda", (5, 3001)), ("eager", "cuda", (5, 3001))],
)
@pytest.mark.parametrize("with_index", [True, False])
def test_cuda_draws_equal_cpu_draws(
    request: pytest.FixtureRequest,
    path: str,
    key_on: str,
    shape: tuple[int, ...],
    with_index: bool,
) -> None:
    """Integer, uniform and bernoulli draws are bitwise the CPU's on CUDA (fused kernels and
    eager path, CPU and CUDA keys, with and without index); normal is within the bound."""
    request.getfixturevalue("eager_rng" if path == "eager" else "kernels_must_hold")
    k = rng.fold_in(rng.key(21), 5)
    kd = k if key_on == "cpu" else k.to(DEV)
    if with_index:
        ref = _draws(k, shape, IDX)
        got = _draws(kd, shape, IDX.to(DEV))  # computes on index's device
        z_ref = {dt: rng.normal(k, shape, dtype=dt, index=IDX) for dt in FLOATS}
        z = {dt: rng.normal(kd, shape, dtype=dt, index=IDX.to(DEV)) for dt in FLOATS}
    else:
        ref = _draws(k, shape, None)
        got = _draws(kd, shape, None, device=DEV)
        z_ref = {dt: rng.normal(k, shape, dtype=dt) for dt in FLOATS}
        z = {dt: rng.normal(kd, shape, dtype=dt, device=DEV) for dt in FLOATS}
    for name, want in ref.items():
        assert got[name].device.type == DEV.type, name
        assert got[name].dtype == want.dtype, name
        assert torch.equal(got[name].cpu(), want), name
    for dt in FLOATS:
        assert z[dt].device.type == DEV.type
        _assert_normal_close(z[dt], z_ref[dt])
    affine = rng.normal(kd, shape, mean=1.5, std=0.5, device=DEV)
    _assert_normal_close(affine, rng.normal(k, shape, mean=1.5, std=0.5))


def test_large_cuda_draws_equal_cpu_draws(kernels_must_hold: None) -> None:
    """Draws of 2**22 + 3 values (thousands of programs) match the CPU too."""
    k, n = rng.key(22), 2**22 + 3
    assert torch.equal(rng.uniform(k, n, device=DEV).cpu(), rng.uniform(k, n))
    assert torch.equal(rng.randint(k, 0, 7, n, device=DEV).cpu(), rng.randint(k, 0, 7, n))
    _assert_normal_close(rng.normal(k, n, device=DEV), rng.normal(k, n))
    idx = torch.arange(64)
    _assert_normal_close(
        rng.normal(k, (64, 65537), index=idx.to(DEV)), rng.normal(k, (64, 65537), index=idx)
    )


def test_fused_kernels_serve_cuda_draws(kernels_must_hold: None) -> None:
    """With triton installed, CUDA draws use the fused kernels (and keep using them)."""
    pytest.importorskip("triton")
    assert os.environ.get("PURESTEP_RNG_TRITON", "1") != "0", "PURESTEP_RNG_TRITON=0 is set"
    assert _rng_dispatch.kernels(DEV) is not None
    rng.normal(rng.key(0), (4, 1000), index=torch.arange(4, device=DEV))
    assert _rng_dispatch.kernels(DEV) is not None


def test_cuda_draws_with_a_cpu_key_do_not_sync(kernels_must_hold: None) -> None:
    """Draws from a CPU key with a CUDA index (or device=) never synchronise the host."""
    k = rng.fold_in(rng.key(1), 3)
    idx = torch.arange(64, device=DEV)

    def all_draws() -> None:
        rng.normal(k, (64, 4096), index=idx)
        rng.normal(k, (64, 7), index=idx, dtype=torch.bfloat16)
        rng.normal(k, (64,), index=idx, mean=0.5, std=2.0, dtype=torch.float64)
        rng.uniform(k, (64,), index=idx)
        rng.uniform(k, (64, 3), index=idx, low=0.02, high=0.98)
        rng.randint(k, 0, 4, (64,), index=idx)
        rng.bernoulli(k, 0.1, (64,), index=idx, dtype=torch.bool)
        rng.randperm(k, 64, device=DEV)
        rng.normal(k, (1000,), device=DEV)
        rng.fold_in(k, 7, 9)  # a host key stays on the host

    all_draws()  # first use of each kind: the one-time kernel check (syncs once)
    with no_host_sync():
        all_draws()


def test_rng_throughput_is_within_reach_of_torch(kernels_must_hold: None) -> None:
    """Sanity: a 16M-value fp32 normal draw takes under 3x torch.randn (benchmarks/rng.py
    measures the ratio; the target is 1.5x)."""
    n = 1 << 24
    k, gen = rng.key(3), torch.Generator(device=DEV).manual_seed(0)
    ours = _median_cuda_ms(lambda: rng.normal(k, n, device=DEV))
    theirs = _median_cuda_ms(lambda: torch.randn(n, device=DEV, generator=gen))
    assert ours <= 3.0 * theirs, f"rng.normal {ours:.3f} ms vs torch.randn {theirs:.3f} ms"


def _median_cuda_ms(fn: Callable[[], object], reps: int = 15) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]


def test_cuda_draws_leave_torch_generators_alone() -> None:
    """No draw touches torch's global CUDA (or CPU) generator state."""
    cpu, cuda = torch.random.get_rng_state(), torch.cuda.get_rng_state_all()
    k = rng.key(4)
    rng.normal(k, (4, 3), index=torch.arange(4, device=DEV))
    rng.randperm(k, 7, device=DEV)
    rng.bernoulli(k, 0.5, 9, device=DEV)
    assert torch.equal(torch.random.get_rng_state(), cpu)
    assert all(torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), cuda, strict=True))


# --------------------------------------------------------------------------- optimizers


def _params_and_grads(
    dtype: torch.dtype, steps: int
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 33), (33,), (7, 3, 5), (1,), (1000,)]
    init = [torch.randn(s, generator=g).to(dtype).to(DEV) for s in shapes]
    grads = [[torch.randn(s, generator=g).to(dtype).to(DEV) for s in shapes] for _ in range(steps)]
    return init, grads


OPTIMIZERS: dict[
    str, tuple[Callable[[], optim.Transform], Callable[..., torch.optim.Optimizer]]
] = {
    "adamw": (
        lambda: optim.adamw(lr=1e-2, weight_decay=0.1),
        lambda ps_: torch.optim.AdamW(ps_, lr=1e-2, weight_decay=0.1, fused=True),
    ),
    "adam-amsgrad": (
        lambda: optim.adam(lr=1e-2, amsgrad=True),
        lambda ps_: torch.optim.Adam(ps_, lr=1e-2, amsgrad=True, fused=True),
    ),
    "sgd-momentum": (
        lambda: optim.sgd(lr=1e-2, momentum=0.9, weight_decay=0.01),
        lambda ps_: torch.optim.SGD(ps_, lr=1e-2, momentum=0.9, weight_decay=0.01, fused=True),
    ),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("donate", [True, False])
def test_optimizers_match_torch_fused_on_cuda(name: str, dtype: torch.dtype, donate: bool) -> None:
    """10 steps of purestep's optimizer on CUDA equal torch.optim's fused CUDA kernel: bitwise in
    fp32 (the same kernel), within bf16 tolerance in bf16; params stay on the GPU."""
    make, make_torch = OPTIMIZERS[name]
    init, grads = _params_and_grads(dtype, 10)
    ref = [nn.Parameter(t.clone()) for t in init]
    topt = make_torch(ref)
    for gs in grads:
        for p, g in zip(ref, gs, strict=True):
            p.grad = g.clone()
        topt.step()
    opt = make()
    params = TensorDict({f"p{i}": t.clone() for i, t in enumerate(init)}, [])
    state = opt.init(params)
    for gs in grads:
        g_td = TensorDict({f"p{i}": g for i, g in enumerate(gs)}, [])
        params, state = opt.step(g_td, state, params, donate=donate)
    for i, want in enumerate(ref):
        got = params[f"p{i}"]
        assert got.device.type == DEV.type and got.dtype == dtype
        if dtype == torch.float32:
            assert torch.equal(got, want.detach()), f"{name} p{i}"
        else:
            torch.testing.assert_close(got, want.detach())


def test_muon_keeps_its_step_counts_with_its_cuda_params() -> None:
    """muon's per-parameter step counts live on the params' GPU, as adamw's do (the fused
    AdamW kernel of its fallback params reads them there); a step keeps every leaf there."""
    params = TensorDict({"w": torch.ones(4, 3, device=DEV), "b": torch.ones(3, device=DEV)}, [])
    for opt in (optim.muon(lr=0.02), optim.adamw(lr=0.02)):
        steps = tree.leaves(opt.init(params)["steps"])
        assert [t.device.type for t in steps] == ["cuda", "cuda"], opt.name
    opt = optim.muon(lr=0.02)
    new, state = opt.step(params.apply(torch.ones_like), opt.init(params), params)
    assert all(t.device.type == "cuda" for t in tree.leaves(new) + tree.leaves(state["steps"]))


def test_optimizer_step_does_not_sync() -> None:
    """A donated AdamW step with a schedule (lr from the CPU count) never syncs the host."""
    opt = optim.chain(
        optim.clip_by_global_norm(1.0), optim.adamw(optim.schedules.warmup_cosine(1e-3, 2, 10))
    )
    init, grads = _params_and_grads(torch.float32, 3)
    params = TensorDict({f"p{i}": t for i, t in enumerate(init)}, [])
    state = opt.init(params)
    g_td = TensorDict({f"p{i}": g for i, g in enumerate(grads[0])}, [])
    params, state = opt.step(g_td, state, params, donate=True)
    with no_host_sync():
        opt.step(g_td, state, params, donate=True)


def test_sgd_per_parameter_step_counts_stay_on_the_cpu_for_cuda_params() -> None:
    """SGD with momentum and dampening keeps its per-parameter ``steps`` on the CPU for CUDA
    params (its kernel reads them on the host to find each param's first update; there is no
    fused step counter on the GPU), before and after a step."""
    opt = optim.sgd(lr=1e-2, momentum=0.9, dampening=0.1)
    init, grads = _params_and_grads(torch.float32, 1)
    params = TensorDict({f"p{i}": t for i, t in enumerate(init)}, [])
    state = opt.init(params)
    assert {t.device.type for t in tree.leaves(state["steps"])} == {"cpu"}
    g_td = TensorDict({f"p{i}": g for i, g in enumerate(grads[0])}, [])
    params, state = opt.step(g_td, state, params, donate=True)
    assert {t.device.type for t in tree.leaves(state["steps"])} == {"cpu"}
    assert {t.device.type for t in tree.leaves(params)} == {DEV.type}


# --------------------------------------------------------------------------- train_step


class _MLP(nn.Module):
    def __init__(self, d: int = 48) -> None:
        super().__init__()
        self.inp = nn.Linear(d, 2 * d)
        self.norm = nn.LayerNorm(2 * d)
        self.out = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.inp(x))))  # type: ignore[no-any-return]


def _mse(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((pred - y) ** 2).mean()


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("autocast", [False, True])
def test_train_step_equals_the_imperative_loop_on_cuda(k: int, autocast: bool) -> None:
    """3 donated train_steps (fused AdamW, accumulate(k)) give bitwise the weights of the loop
    zero_grad / forward / (loss_i n_i / B).backward() / AdamW(fused=True).step() on CUDA."""
    torch.manual_seed(0)
    model = _MLP().to(DEV)
    ref_model = _MLP().to(DEV)
    ref_model.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    batches = [
        {
            "x": torch.randn(16, 48, generator=g).to(DEV),
            "y": torch.randn(16, 48, generator=g).to(DEV),
        }
        for _ in range(3)
    ]
    amp = torch.autocast(DEV.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()

    def loss_fn(
        params: TensorDictBase, b: TensorDictBase, key: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with amp:
            return _mse(ps.call(model, params["m"], b["x"]), b["y"]).float(), {}

    opts = {"m": optim.adamw(lr=1e-2, weight_decay=0.1)}
    grad_fn = ps.value_and_grad(loss_fn)
    if k > 1:
        grad_fn = ps.accumulate(grad_fn, k)
    step = ps.train_step(grad_fn, opts, donate=True, grad_norm=False)
    state = step.prepare(ps.init_state({"m": model}, opts, seed=0))
    topt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    sizes = ps.step.microbatch_sizes(16, k)
    for b in batches:
        state, _ = step(state, b)
        topt.zero_grad(set_to_none=True)
        start = 0
        for n in sizes:
            xs, ys = b["x"][start : start + n], b["y"][start : start + n]
            start += n
            with amp:
                loss = _mse(ref_model(xs), ys).float()
            (loss * (n / 16) if k > 1 else loss).backward()
        topt.step()
    for name, p in ref_model.named_parameters():
        got = state["params", "m", *name.split(".")]
        assert got.device.type == DEV.type
        assert torch.equal(got, p.detach()), name
    assert state["rng"].device.type == "cpu" and state["step"].device.type == "cpu"


class _Dropping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x))  # type: ignore[no-any-return]


def _assert_keyed_dropout(net: nn.Module, params: TensorDictBase, x: torch.Tensor) -> None:
    """Same key, same mask; other key, other mask; torch's generators as they were after."""
    gens = [torch.cuda.get_rng_state(d) for d in range(torch.cuda.device_count())]
    cpu = torch.get_rng_state()
    a = ps.call(net, params, x, key=rng.key(1))
    b = ps.call(net, params, x, key=rng.key(1))
    c = ps.call(net, params, x, key=rng.key(2))
    assert bool((a == 0).any()), "dropout dropped nothing"
    assert torch.equal(a, b) and not torch.equal(a, c)
    for d, g in enumerate(gens):
        assert torch.equal(torch.cuda.get_rng_state(d), g), f"cuda:{d}'s generator moved"
    assert torch.equal(torch.get_rng_state(), cpu), "the CPU generator moved"


def test_keyed_call_seeds_and_restores_the_cuda_generator() -> None:
    """call(..., key=) with CUDA in use: dropout is a function of the key and torch's CUDA and
    CPU generators are restored, for CUDA params, the module's own parameters, CPU params and an
    empty params tree."""
    torch.manual_seed(0)
    net = _Dropping().to(DEV)
    x = torch.ones(64, 32, device=DEV)
    _assert_keyed_dropout(net, ps.params_of("m", net), x)  # CUDA params
    _assert_keyed_dropout(net, TensorDict({}, []), x)  # no params given: the module's own
    own = TensorDict(dict(net.named_parameters()), [])  # its own nn.Parameters: run as it is
    _assert_keyed_dropout(net, own, x)
    cpu_net = _Dropping()
    _assert_keyed_dropout(cpu_net, ps.params_of("m", cpu_net), x.cpu())  # CPU params


def test_keyed_call_seeds_the_cuda_generator_in_a_scope_and_on_the_generic_path() -> None:
    """call(..., key=) with CUDA params inside a call_scope (value_and_grad's loss) and on the
    generic path (a TensorDictParams): dropout is a function of the key, torch's generators
    are restored."""
    from tensordict import TensorDictParams

    torch.manual_seed(0)
    net = _Dropping().to(DEV)
    x = torch.ones(64, 32, device=DEV)
    with ps.call_scope():
        _assert_keyed_dropout(net, ps.params_of("m", net), x)
    _assert_keyed_dropout(net, TensorDictParams(ps.params_of("m", net), no_convert=True), x)


def test_keyed_call_of_an_fsdp_module_with_detached_views_seeds_the_cuda_generator() -> None:
    """An FSDP2-managed module on the GPU (one process, nccl, world size 1) called under
    no_grad with detached views of its own params and key=: dropout is a function of the
    key, torch's generators are restored."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available() or dist.is_initialized():
        pytest.skip("needs nccl and no process group in this process")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore())
    try:
        torch.manual_seed(0)
        net = _Dropping().to(DEV)
        fully_shard(net, mesh=init_device_mesh("cuda", (1,)))
        own = TensorDict(dict(net.named_parameters()), []).unflatten_keys(".")
        with torch.no_grad():
            _assert_keyed_dropout(net, own.detach(), torch.ones(64, 32, device=DEV))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_keyed_call_on_the_second_gpu_seeds_and_restores_that_gpus_generator() -> None:
    """Params on cuda:1 while cuda:0 is current: cuda:1's generator is the one keyed (and
    restored), so the dropout masks drawn there are a function of the key."""
    torch.manual_seed(0)
    dev = torch.device("cuda", 1)
    assert torch.cuda.current_device() == 0
    net = _Dropping().to(dev)
    _assert_keyed_dropout(net, ps.params_of("m", net), torch.ones(64, 32, device=dev))


def _readme_block() -> str:
    """The code block of README.md's "The pieces" section, verbatim."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## The pieces") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None
    return match.group(1)


class _Velocity(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 64), nn.SiLU(), nn.Linear(64, 2))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, t[:, None]], dim=-1))  # type: ignore[no-any-return]


def test_readme_loss_runs_unchanged_on_a_cuda_batch(kernels_must_hold: None) -> None:
    """README's "The pieces" code, executed verbatim with a CUDA model and CUDA batches:
    noise lands on the GPU, the weights train there, rng and step stay on the CPU."""
    g = torch.Generator().manual_seed(0)
    data = [{"x0": torch.randn(32, 2, generator=g).to(DEV)} for _ in range(4)]
    scope: dict[str, Any] = {"model": _Velocity().to(DEV), "data": data}
    exec(compile(_readme_block(), "README.md", "exec"), scope)
    state, metrics = scope["state"], scope["metrics"]
    assert int(state["step"]) == 4
    assert state["rng"].device.type == "cpu" and state["step"].device.type == "cpu"
    for leaf in tree.leaves(state["params"]):
        assert leaf.device.type == DEV.type
    for leaf in tree.leaves(state["ema"]):
        assert leaf.device.type == DEV.type
    assert math.isfinite(float(metrics["loss"]))


# --------------------------------------------------------------------------- checkpoint


def test_checkpoint_of_a_cuda_state_loads_back_onto_the_gpu(tmp_path: Path) -> None:
    """save / load of a CUDA state: every leaf comes back bitwise, on the device of `like`."""
    model = _MLP().to(DEV)
    opts = {"m": optim.adamw(1e-3)}

    def loss_fn(
        params: TensorDictBase, b: TensorDictBase, key: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return _mse(ps.call(model, params["m"], b["x"]), b["x"]), {}

    step = ps.with_ema(ps.train_step(ps.value_and_grad(loss_fn), opts, donate=True), 0.9, ["m"])
    state = step.prepare(ps.init_state({"m": model}, opts, seed=0))
    state, _ = step(state, {"x": torch.randn(8, 48, device=DEV)})
    ckpt.save(state, tmp_path / "c")
    like = step.prepare(ps.init_state({"m": _MLP().to(DEV)}, opts, seed=1))
    loaded = ckpt.load(tmp_path / "c", like=like)
    for path, a, b in zip(tree.paths(state), tree.leaves(state), tree.leaves(loaded), strict=True):
        assert b.device == a.device, tree.format_path(path)
        assert b.dtype == a.dtype and torch.equal(a, b), tree.format_path(path)
    assert loaded["params", "m", "inp", "weight"].device.type == DEV.type
    assert loaded["rng"].device.type == "cpu"


# --------------------------------------------------------------------------- fsdp on nccl


def _torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    return subprocess.run(
        [*cmd, str(ROOT / "examples" / "fsdp_train.py"), "--device", DEV.type, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _final_norm(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    match = re.search(r"done: step (\d+), student param norm ([0-9.]+)", proc.stdout)
    assert match is not None, proc.stdout[-2000:]
    return f"{match.group(1)} {match.group(2)}"


def test_fsdp_example_on_nccl_saves_and_resumes_bitwise(tmp_path: Path) -> None:
    """examples/fsdp_train.py under torchrun on one GPU (nccl): train 4 steps with saves, resume
    to 6; the final weights equal an uninterrupted 6-step run's."""
    a, b = tmp_path / "resumed", tmp_path / "straight"
    common = ["--save-every", "2", "--log-every", "1", "--accumulate", "2"]
    _final_norm(
        _torchrun(["--steps", "4", "--ckpt-dir", str(a), "--resume", "none", *common], ROOT)
    )
    resumed = _final_norm(
        _torchrun(["--steps", "6", "--ckpt-dir", str(a), "--resume", "latest", *common], ROOT)
    )
    straight = _final_norm(
        _torchrun(["--steps", "6", "--ckpt-dir", str(b), "--resume", "none", *common], ROOT)
    )
    assert resumed.startswith("6 ")
    assert resumed == straight


# --------------------------------------------------------------------------- host syncs


def _noisy_loss(model: nn.Module) -> Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    def loss_fn(
        params: TensorDictBase, b: TensorDictBase, key: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        eps = rng.normal(rng.fold_in(key, 1), b["x"].shape, index=b["index"])
        return _mse(ps.call(model, params["m"], b["x"] + 0.1 * eps), b["x"]), {}

    return loss_fn


def _synced_step(wrap: Callable[[Any], Any]) -> tuple[Any, TensorDictBase, dict[str, torch.Tensor]]:
    model = _MLP().to(DEV)
    opts = {"m": optim.adamw(optim.schedules.warmup_cosine(1e-3, 2, 20))}
    step = wrap(ps.train_step(ps.value_and_grad(_noisy_loss(model)), opts, donate=True))
    state = step.prepare(ps.init_state({"m": model}, opts, seed=0))
    batch = {"x": torch.randn(16, 48, device=DEV)}
    for _ in range(2):  # warm-up: allocator, kernel checks, lazy inits
        state, _ = step(state, batch)
    return step, state, batch


def test_train_step_with_ema_does_not_sync() -> None:
    """A donated train_step with rng noise, grad-norm metric and EMA never syncs the host."""
    step, state, batch = _synced_step(lambda s: ps.with_ema(s, 0.99, ["m"]))
    with no_host_sync():
        state, metrics = step(state, batch)
    assert metrics["loss"].device.type == DEV.type


@pytest.mark.xfail(
    strict=True,
    reason="skip_nonfinite reads the finiteness check on the host (bool(finite) in "
    "step/_train.py), one sync per step; src/purestep/step is being rewritten",
)
def test_skip_nonfinite_does_not_sync() -> None:
    """skip_nonfinite (with EMA) decides on the device, without a host sync."""
    step, state, batch = _synced_step(lambda s: ps.skip_nonfinite(ps.with_ema(s, 0.99, ["m"])))
    with no_host_sync():
        step(state, batch)


class _Tiny(nn.Module):
    """v(x_t, t[, label]) for the method losses."""

    def __init__(self, classes: int | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(classes + 1, 16) if classes is not None else None
        self.inp = nn.Linear(3, 16)
        self.out = nn.Linear(16, 2)

    def forward(
        self, x: torch.Tensor, t: torch.Tensor, label: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = self.inp(torch.cat([x, t[:, None].to(x.dtype)], 1))
        if self.emb is not None and label is not None:
            h = h + self.emb(label)
        return self.out(torch.tanh(h))  # type: ignore[no-any-return]


def _method_losses() -> dict[str, tuple[Callable[..., Any], TensorDict, TensorDict]]:
    student, teacher, critic = _Tiny(3).to(DEV), _Tiny(3).to(DEV), _Tiny(3).to(DEV)
    p = ps.params_of("student", student)
    x0 = torch.randn(32, 2, device=DEV)
    label = torch.randint(0, 3, (32,), device=DEV)
    ft_cfg = finetune.FinetuneConfig(cond_keys=("label",), cond_dropout=0.2, null_cond={"label": 3})
    d_cfg = dmd2.DMD2Config(
        student_steps=(1.0, 0.6, 0.3),
        cond_keys=("label",),
        null_cond={"label": 3},
        guidance_scale=2.0,
    )
    batch = TensorDict({"x0": x0, "label": label}, [32])
    n_batch = TensorDict(
        {
            "x0": x0,
            "adv": torch.randn(32, device=DEV),
            "index": torch.arange(32, device=DEV),
            "prompt": TensorDict({"label": label}, [32]),
        },
        [32],
    )
    dmd2_params = TensorDict({"student": p, "critic": ps.params_of("critic", critic)}, [])
    return {
        "finetune": (finetune.loss_fn(student, ft_cfg), TensorDict({"student": p}, []), batch),
        "dmd2": (dmd2.loss_fn(student, teacher, critic, d_cfg), dmd2_params, batch),
        "nft": (
            nft.loss_fn(student, None, p, nft.NFTConfig(cond_keys=("label",))),
            TensorDict({"student": p, "old": p.clone()}, []),
            n_batch,
        ),
    }


@pytest.mark.parametrize("name", ["finetune", "dmd2", "nft"])
def test_method_losses_do_not_sync(name: str) -> None:
    """Each method's loss (noise, timesteps, condition dropout, rollouts) on a CUDA batch runs
    without a host sync, from a CPU step key."""
    loss_fn, params, batch = _method_losses()[name]
    key = rng.fold_in(rng.key(0), 3)
    loss_fn(params, batch, key)  # warm-up
    with no_host_sync():
        loss, _ = loss_fn(params, batch, key)
    assert (loss if isinstance(loss, torch.Tensor) else loss["critic"]).device.type == DEV.type


def test_nft_rollouts_and_kd_batches_do_not_sync() -> None:
    """nft.sample with CUDA prompts and kd.batches of CUDA data never sync the host."""
    from purestep.methods import kd

    model = _Tiny().to(DEV)
    params = flow.frozen_params(model)
    prompts = TensorDict({"index": torch.arange(4, device=DEV)}, [4])
    data = TensorDict({"x": torch.randn(20, 2, device=DEV)}, [20], device=DEV)
    nft.sample(model, params, prompts, rng.key(0), group_size=3, steps=2, sample_shape=(2,))
    it = kd.batches(data, 5, key=rng.key(1))
    next(it)
    with no_host_sync():
        out = nft.sample(
            model, params, prompts, rng.key(0), group_size=3, steps=2, sample_shape=(2,)
        )
        batch = next(it)
    assert out["x0"].device.type == DEV.type and out["index"].device.type == DEV.type
    assert batch["index"].device.type == DEV.type
