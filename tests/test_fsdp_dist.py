"""FSDP2-bound training steps on gloo, world size 2 (one WorkerPool for the module).

Hypothesis draws examples in this (parent) process; each example runs tasks on
both ranks through the pool, and the single-process reference is computed here
(no process group) from the same initial weights and the same global batches.
Task functions are module-level so they pickle by reference.
"""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, TensorDictBase
from torch import nn

import purestep as ps
from purestep import optim, rng, tree
from purestep.distributed import checkpoint as ckpt
from purestep.distributed import fsdp
from purestep.testing import assert_trees_close, assert_trees_equal
from purestep.testing.workers import WorkerPool

pytestmark = pytest.mark.distributed

WORLD = 2
# fp32 tolerance for world size 2 vs 1 (different reduction order), after a few Adam steps
TOL = {"rtol": 2e-4, "atol": 2e-5}


# -- model, loss and runs, shared by the parent and the workers ----------------------------


class Block(nn.Module):
    """A pre-norm residual MLP block (what ``bind(shard=[Block])`` shards individually)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d, device="meta")
        self.fc1 = nn.Linear(d, 2 * d, device="meta")
        self.fc2 = nn.Linear(2 * d, d, device="meta")

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.tanh(self.fc1(self.norm(h))))


class Net(nn.Module):
    """A tiny denoiser ``(x_t, t) -> velocity``."""

    def __init__(self, d: int, depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(d + 1, d, device="meta")
        self.blocks = nn.ModuleList([Block(d) for _ in range(depth)])
        self.out = nn.Linear(d, d, device="meta")

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.inp(torch.cat([x, t[:, None]], dim=1))
        for b in self.blocks:
            h = b(h)
        return self.out(h)  # type: ignore[no-any-return]


@attrs.frozen
class Cfg:
    """One example: model size, data, optimizer, accumulation."""

    d: int = 4
    depth: int = 2
    model_seed: int = 0
    data_seed: int = 0
    global_batch: int = 8
    k: int = 1
    lr: float = 1e-2
    max_norm: float = 0.5
    mesh: tuple[int, ...] = (WORLD,)
    sync_every: bool = False


def make_net(cfg: Cfg) -> Net:
    """The model with weights from ``cfg.model_seed`` (built on meta, filled explicitly)."""
    net = Net(cfg.d, cfg.depth).to_empty(device="cpu")
    g = torch.Generator().manual_seed(cfg.model_seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return net


def optimizers(cfg: Cfg) -> dict[str, optim.Transform]:
    return {"student": optim.chain(optim.clip_by_global_norm(cfg.max_norm), optim.adamw(cfg.lr))}


def global_batch(cfg: Cfg, step: int) -> TensorDict:
    g = torch.Generator().manual_seed(cfg.data_seed * 1000 + step)
    return TensorDict({"x": torch.randn(cfg.global_batch, cfg.d, generator=g)}, [cfg.global_batch])


def loss_fn_for(net: nn.Module) -> ps.step.LossFn:
    """Flow matching with per-sample noise and timesteps (keys folded with ``batch["index"]``)."""

    def loss_fn(
        params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        k_t, k_e = rng.split(key, 2)
        x0 = batch["x"]
        t = rng.uniform(k_t, (x0.shape[0],), index=batch["index"])
        eps = rng.normal(k_e, x0.shape, index=batch["index"])
        x_t = (1 - t[:, None]) * x0 + t[:, None] * eps
        pred = ps.call(net, params["student"], x_t, t)
        err = (pred - (eps - x0)) ** 2
        return err.mean(), {"x_sq": x0.pow(2).mean()}

    return loss_fn


def make_step(net: nn.Module, cfg: Cfg, *, donate: bool) -> ps.TrainStep:
    grad_fn = ps.accumulate(ps.value_and_grad(loss_fn_for(net)), cfg.k)
    return ps.train_step(grad_fn, optimizers(cfg), donate=donate)


def full(td: TensorDictBase) -> TensorDict:
    """Plain full tensors (gathers DTensors on every rank: a collective)."""
    return fsdp.gather(td)


def _mesh(cfg: Cfg) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    names = ("replicate", "shard") if len(cfg.mesh) == 2 else ("shard",)
    return init_device_mesh("cpu", cfg.mesh, mesh_dim_names=names)


def bound_state(cfg: Cfg) -> tuple[Net, fsdp.FSDPBinding, TensorDict]:
    net = make_net(cfg)
    binding = fsdp.bind(net, mesh=_mesh(cfg), shard=[Block], sync_every_microbatch=cfg.sync_every)
    state = ps.init_state({"student": binding}, optimizers(cfg), seed=cfg.model_seed)
    return net, binding, state


def run_single(cfg: Cfg, steps: int, state: TensorDict | None = None) -> tuple[TensorDict, list]:
    """The single-process reference (functional role): ``steps`` steps from ``state``."""
    net = make_net(cfg)
    if state is None:
        state = ps.init_state({"student": net}, optimizers(cfg), seed=cfg.model_seed)
    step = make_step(net, cfg, donate=False)
    metrics = []
    while int(state["step"]) < steps:
        state, m = step(state, global_batch(cfg, int(state["step"])))
        metrics.append(m)
    return state, metrics


def _metrics_row(m: TensorDictBase) -> dict[str, float]:
    return {
        "loss": float(m["loss"]),
        "x_sq": float(m["x_sq"]),
        "grad_norm": float(m["student", "grad_norm"]),
    }


# -- worker tasks -------------------------------------------------------------------------


def task_train(
    cfg: Cfg,
    steps: int,
    *,
    save_at: Sequence[int] = (),
    root: str | None = None,
    async_: bool = False,
    resume: str | None = None,
    kill_rank_during_save_at: int | None = None,
) -> dict[str, Any]:
    """Train ``steps`` steps with a bound state; save after the steps in ``save_at``.

    Returns the full state (gathered) and per-step metrics.
    """
    net, binding, state = bound_state(cfg)
    if resume is not None:
        ckpt.load(resume, like=state, donate=True)
        assert all(
            a is b for a, b in zip(tree.leaves(state["params"]), net.parameters(), strict=True)
        )
    step = make_step(net, cfg, donate=True)
    rows = []
    while int(state["step"]) < steps:
        s = int(state["step"])
        state, m = step(state, fsdp.shard_batch(global_batch(cfg, s), binding.mesh))
        rows.append(_metrics_row(m))
        if s + 1 in save_at:
            assert root is not None
            if kill_rank_during_save_at == s + 1:
                _kill_during_write(rank=1)
            ckpt.save(state, ckpt.step_dir(root, s + 1), async_=async_)
    ckpt.wait_pending()
    return {"state": full(state), "metrics": rows}


def _kill_during_write(rank: int) -> None:
    """SIGKILL this process (if it is ``rank``) after DCP wrote its data files, before publish."""
    if dist.get_rank() != rank:
        return
    from purestep.distributed._storage import RecordWriter

    original = RecordWriter.write_data

    def write_then_die(self: Any, *args: Any, **kwargs: Any) -> Any:
        fut = original(self, *args, **kwargs)
        fut.wait()
        os.kill(os.getpid(), signal.SIGKILL)
        return fut

    RecordWriter.write_data = write_then_die  # type: ignore[method-assign]


def task_grad_none_during_accumulation(cfg: Cfg) -> list[list[bool]]:
    """For each microbatch: were the sharded params' ``.grad`` all None when its loss ran?"""
    net, binding, state = bound_state(cfg)
    inner = loss_fn_for(net)
    seen: list[list[bool]] = []

    def loss_fn(params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor) -> Any:
        seen.append([p.grad is None for p in tree.leaves(params["student"])])
        return inner(params, batch, key)

    grad_fn = ps.accumulate(ps.value_and_grad(loss_fn), cfg.k)
    step = ps.train_step(grad_fn, optimizers(cfg), donate=True)
    state, _ = step(state, fsdp.shard_batch(global_batch(cfg, 0), binding.mesh))
    after = all(p.grad is None for p in net.parameters())
    return [*seen, [after]]


def task_params_alias(cfg: Cfg) -> dict[str, Any]:
    net, binding, state = bound_state(cfg)
    leaves = tree.leaves(state["params", "student"])
    return {
        "same_objects": all(a is b for a, b in zip(leaves, net.parameters(), strict=True)),
        "dtensor": all(type(t).__name__ == "DTensor" for t in leaves),
        "placements": sorted({str(t.placements) for t in leaves}),
        "fsdp_modules": len(binding.fsdp_modules),
        "paths": tree.paths(state["params", "student"]),
    }


def task_donate_false_raises(cfg: Cfg) -> str:
    net, binding, state = bound_state(cfg)
    step = make_step(net, cfg, donate=False)
    try:
        step(state, fsdp.shard_batch(global_batch(cfg, 0), binding.mesh))
    except ValueError as e:
        return str(e)
    return ""


def task_shard_batch_indivisible(n: int) -> str:
    try:
        fsdp.shard_batch({"x": torch.zeros(n, 2)})
    except ValueError as e:
        return str(e)
    return ""


def task_reduce_metrics() -> dict[str, Any]:
    r = dist.get_rank()
    m = TensorDict(
        {"a": torch.tensor(float(r)), "b": {"v": torch.full((2,), 2.0 * r)}, "n": torch.tensor(r)},
        [],
    )
    out = fsdp.reduce_metrics(m)
    return {"a": float(out["a"]), "v": out["b", "v"].tolist(), "n": int(out["n"])}


def _two_role_loss(student: nn.Module, critic: nn.Module) -> ps.step.LossFn:
    """One scalar loss through both nets: the critic reads the student's output."""

    def loss_fn(
        params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x0 = batch["x"]
        t = rng.uniform(key, (x0.shape[0],), index=batch["index"])
        pred = ps.call(student, params["student"], x0, t)
        score = ps.call(critic, params["critic"], pred, t)
        return (pred - x0).pow(2).mean() + 0.5 * score.pow(2).mean(), {}

    return loss_fn


def _two_role_step(cfg: Cfg, student: nn.Module, critic: nn.Module, donate: bool) -> ps.TrainStep:
    opt = {"student": optim.adamw(cfg.lr), "critic": optim.adamw(cfg.lr)}
    grad_fn = ps.accumulate(ps.value_and_grad(_two_role_loss(student, critic)), cfg.k)
    return ps.train_step(grad_fn, opt, every={"critic": 2}, donate=donate)


def run_two_roles(cfg: Cfg, steps: int) -> TensorDict:
    """Single-process reference: student every step, critic every 2nd step."""
    student, critic = make_net(cfg), make_net(attrs.evolve(cfg, model_seed=cfg.model_seed + 1))
    opt = {"student": optim.adamw(cfg.lr), "critic": optim.adamw(cfg.lr)}
    state = ps.init_state({"student": student, "critic": critic}, opt, seed=0)
    step = _two_role_step(cfg, student, critic, donate=False)
    for s in range(steps):
        state, _ = step(state, global_batch(cfg, s))
    return state


def task_two_roles(cfg: Cfg, steps: int) -> TensorDict:
    student, critic = make_net(cfg), make_net(attrs.evolve(cfg, model_seed=cfg.model_seed + 1))
    mesh = _mesh(cfg)
    bs, bc = fsdp.bind(student, mesh=mesh), fsdp.bind(critic, mesh=mesh, shard=[Block])
    opt = {"student": optim.adamw(cfg.lr), "critic": optim.adamw(cfg.lr)}
    state = ps.init_state({"student": bs, "critic": bc}, opt, seed=0)
    step = _two_role_step(cfg, student, critic, donate=True)
    for s in range(steps):
        state, _ = step(state, fsdp.shard_batch(global_batch(cfg, s), mesh))
    return full(state)


def task_detached_call(cfg: Cfg) -> dict[str, Any]:
    """Call a bound module with its params, with detached views (no_grad), and with bad inputs
    (grad enabled, a copy that shares no memory, a misspelt key)."""
    net, _, state = bound_state(cfg)
    params = state["params", "student"]
    x, t = torch.ones(4, cfg.d), torch.full((4,), 0.5)
    with torch.no_grad():
        own = ps.call(net, params, x, t)
        detached = ps.call(net, params.detach(), x, t)
    errors = []
    renamed = TensorDict({"inp": {"wieght": params["inp", "weight"].detach()}}, [])
    for grad, p in [(True, params.detach()), (False, params.clone()), (False, renamed)]:
        try:
            with torch.set_grad_enabled(grad):
                ps.call(net, p, x, t)
        except ValueError as e:
            errors.append(str(e))
    return {
        "equal": torch.equal(own, detached),
        "still_aliased": all(
            a is b for a, b in zip(tree.leaves(params), net.parameters(), strict=True)
        ),
        "errors": errors,
    }


def _dmd2_parts(cfg: Cfg) -> tuple[nn.Module, nn.Module, nn.Module, dict[str, Any], Any]:
    from purestep.methods import dmd2

    student = make_net(cfg)
    teacher = make_net(attrs.evolve(cfg, model_seed=cfg.model_seed + 1)).requires_grad_(False)
    critic = make_net(attrs.evolve(cfg, model_seed=cfg.model_seed + 2))
    opts = {"student": optim.adamw(cfg.lr), "critic": optim.adamw(cfg.lr, betas=(0.0, 0.999))}
    config = dmd2.DMD2Config(generator_update_interval=2, rollout="data", x0_key="x")
    return student, teacher, critic, opts, config


def run_dmd2_single(cfg: Cfg, steps: int) -> TensorDict:
    from purestep import export
    from purestep.methods import dmd2

    student, teacher, critic, opts, config = _dmd2_parts(cfg)
    state = dmd2.init_state(student=student, critic=critic, optimizers=opts, seed=0)
    step = dmd2.make_step(
        student=student,
        teacher=teacher,
        teacher_params=export.module_variables(teacher),
        critic=critic,
        optimizers=opts,
        config=config,
        accumulate=cfg.k,
    )
    for s in range(steps):
        state, _ = step(state, global_batch(cfg, s))
    return state


def task_dmd2(cfg: Cfg, steps: int) -> TensorDict:
    from purestep import export
    from purestep.methods import dmd2

    student, teacher, critic, opts, config = _dmd2_parts(cfg)
    mesh = _mesh(cfg)
    bs, bc = fsdp.bind(student, mesh=mesh, shard=[Block]), fsdp.bind(critic, mesh=mesh)
    state = ps.init_state({"student": bs, "critic": bc}, opts, seed=0)
    step = dmd2.make_step(
        student=student,
        teacher=teacher,
        teacher_params=export.module_variables(teacher),
        critic=critic,
        optimizers=opts,
        config=config,
        accumulate=cfg.k,
        donate=True,
    )
    for s in range(steps):
        state, _ = step(state, fsdp.shard_batch(global_batch(cfg, s), mesh))
    return full(state)


# -- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with WorkerPool(WORLD, task_timeout_s=120, pg_timeout_s=60) as p:
        yield p


def _same_on_all_ranks(results: list[dict[str, Any]]) -> dict[str, Any]:
    first = results[0]
    for other in results[1:]:
        assert_trees_equal(other["state"], first["state"], what="state on rank 1 vs rank 0")
        assert other["metrics"] == first["metrics"]
    return first


# -- properties ---------------------------------------------------------------------------


def test_bound_params_are_the_modules_sharded_parameters(pool: WorkerPool) -> None:
    """bind: the state's params are the very sharded DTensor parameters, one FSDP group per block."""
    cfg = Cfg(depth=3)
    for res in pool.run(task_params_alias, cfg):
        assert res["same_objects"]
        assert res["dtensor"]
        assert res["placements"] == ["(Shard(dim=0),)"]
        assert res["fsdp_modules"] == cfg.depth + 1
        assert ("blocks", "0", "fc1", "weight") in res["paths"]


@settings(max_examples=6, deadline=None)
@given(
    k=st.sampled_from([1, 2, 4]),
    mesh=st.sampled_from([(WORLD,), (1, WORLD), (WORLD, 1)]),
    d=st.sampled_from([4, 5]),
    seed=st.integers(0, 2**16),
    per_rank=st.sampled_from([4, 6]),
)
def test_sharded_step_equals_single_process_step(
    pool: WorkerPool, k: int, mesh: tuple[int, ...], d: int, seed: int, per_rank: int
) -> None:
    """Sharding invariance: accumulate(k) on 2 ranks (FSDP or HSDP) == one process, same global batch.

    Params, optimizer state and logged metrics (loss averaged over ranks, global
    grad norm) agree within fp32 tolerance after 3 steps, with clipping active.
    """
    cfg = Cfg(
        d=d, model_seed=seed, data_seed=seed + 1, global_batch=WORLD * per_rank, k=k, mesh=mesh
    )
    steps = 3
    res = _same_on_all_ranks(pool.run(task_train, cfg, steps))
    ref_state, ref_metrics = run_single(cfg, steps)
    assert_trees_close(res["state"], ref_state, **TOL, what="state (2 ranks vs 1)")
    for got, want in zip(res["metrics"], ref_metrics, strict=True):
        for name, value in _metrics_row(want).items():
            assert got[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name


@settings(max_examples=3, deadline=None)
@given(k=st.sampled_from([2, 4]), seed=st.integers(0, 2**16))
def test_sync_off_accumulation_equals_sync_every_microbatch(
    pool: WorkerPool, k: int, seed: int
) -> None:
    """Gradient sync only on the last microbatch gives the same step as syncing every microbatch."""
    cfg = Cfg(model_seed=seed, data_seed=seed, global_batch=16, k=k)
    off = _same_on_all_ranks(pool.run(task_train, cfg, 2))
    every = _same_on_all_ranks(pool.run(task_train, attrs.evolve(cfg, sync_every=True), 2))
    assert_trees_close(off["state"], every["state"], **TOL, what="sync-off vs sync-every")


def test_no_gradient_is_reduced_before_the_last_microbatch(pool: WorkerPool) -> None:
    """With sync off, sharded ``.grad`` stays None until the last microbatch, and is cleared after.

    With sync on every microbatch, the reduced grads appear after the first one
    (so the check can fail).
    """
    k = 3
    cfg = Cfg(global_batch=12, k=k)
    for seen in pool.run(task_grad_none_during_accumulation, cfg):
        assert all(all(mb) for mb in seen[:k]), seen
        assert seen[k] == [True]
    for seen in pool.run(task_grad_none_during_accumulation, attrs.evolve(cfg, sync_every=True)):
        assert all(seen[0])
        assert not any(any(mb) for mb in seen[1:k]), seen


def test_a_bound_role_that_is_not_due_gets_no_stale_gradient(pool: WorkerPool) -> None:
    """Grads that reach a bound role on steps it is not due (every=2) are dropped, not carried
    into its next update: two bound roles with a cadence == the single-process run."""
    cfg = Cfg(model_seed=5, data_seed=6, k=2)
    ref = run_two_roles(cfg, 4)
    for res in pool.run(task_two_roles, cfg, 4):
        assert_trees_close(res, ref, **TOL, what="two bound roles vs one process")


def test_detached_bound_params_run_the_module_itself_under_no_grad(pool: WorkerPool) -> None:
    """call() with detached views of bound params (no_grad) runs the module with its own
    sharded params and leaves the binding intact; with grad, with other weights, or with a
    key that names no parameter, it raises, saying which."""
    for res in pool.run(task_detached_call, Cfg()):
        assert res["equal"]
        assert res["still_aliased"]
        assert res["errors"] == [
            "call: FSDPNet got DTensor params that are not its bound parameters; an "
            "FSDP-sharded module always runs with its own parameters. To stop gradients into "
            "them, call it under torch.no_grad() (detached views are fine there)",
            "call: param 'inp.weight' is a DTensor that does not share memory with FSDPNet's "
            "own (FSDP-sharded) parameter; an FSDP module always runs with its own parameters: "
            "copy other weights (e.g. an EMA) into them first",
            "call: FSDPNet has no parameter 'inp.wieght'",
        ]


def test_dmd2_with_bound_student_and_critic_equals_single_process(pool: WorkerPool) -> None:
    """DMD2 (per-role losses, student every 2nd step, critic called with detached params)
    with both roles bound on 2 ranks == the single-process run."""
    cfg = Cfg(model_seed=7, data_seed=8, k=2, lr=3e-3)
    ref = run_dmd2_single(cfg, 4)
    for res in pool.run(task_dmd2, cfg, 4):
        assert_trees_close(res, ref, **TOL, what="dmd2: 2 ranks vs 1 process")
        start = make_net(cfg).inp.weight.detach()
        moved = float((res["params", "student", "inp", "weight"] - start).abs().max())
        assert moved > 1e-4  # the student did update


def test_bound_step_requires_donation(pool: WorkerPool) -> None:
    """A bound role with donate=False fails with a message that says to donate."""
    for msg in pool.run(task_donate_false_raises, Cfg()):
        assert "donate=True" in msg
        assert "'student'" in msg


def test_shard_batch_rejects_indivisible_global_batch(pool: WorkerPool) -> None:
    for msg in pool.run(task_shard_batch_indivisible, 5):
        assert "5 samples" in msg
        assert "2 data-parallel ranks" in msg


def test_reduce_metrics_averages_floats_over_ranks(pool: WorkerPool) -> None:
    """reduce_metrics: float leaves (any shape) become the mean over ranks; ints are kept."""
    res = pool.run(task_reduce_metrics)
    assert [r["a"] for r in res] == [0.5, 0.5]
    assert [r["v"] for r in res] == [[1.0, 1.0], [1.0, 1.0]]
    assert [r["n"] for r in res] == [0, 1]


@settings(max_examples=4, deadline=None)
@given(
    j=st.integers(1, 3),
    async_=st.booleans(),
    k=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_resume_is_bitwise_exact_on_the_same_world_size(
    pool: WorkerPool, j: int, async_: bool, k: int, seed: int
) -> None:
    """Save at step j (sync or async), load in a fresh bound state, continue == uninterrupted, bitwise."""
    cfg = Cfg(model_seed=seed, data_seed=seed, k=k)
    n = 4
    with tempfile.TemporaryDirectory() as root:
        whole = _same_on_all_ranks(
            pool.run(task_train, cfg, n, save_at=(j,), root=root, async_=async_)
        )
        path = ckpt.latest(root)
        assert path == ckpt.step_dir(root, j)
        resumed = _same_on_all_ranks(pool.run(task_train, cfg, n, resume=str(path)))
    assert_trees_equal(resumed["state"], whole["state"], what="resumed vs uninterrupted")
    assert resumed["metrics"] == whole["metrics"][j:]


@settings(max_examples=2, deadline=None)
@given(j=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_resume_on_a_different_world_size(pool: WorkerPool, j: int, seed: int) -> None:
    """2 ranks -> 1 process and 1 process -> 2 ranks: resume == uninterrupted (fp32 tolerance)."""
    cfg = Cfg(model_seed=seed, data_seed=seed, k=2)
    n = 3
    ref, _ = run_single(cfg, n)
    with tempfile.TemporaryDirectory() as root:
        # saved by 2 ranks, continued in this process (plain tensors, no process group)
        pool.run(task_train, cfg, j, save_at=(j,), root=root)
        like = ps.init_state({"student": make_net(cfg)}, optimizers(cfg), seed=0)
        loaded = ckpt.load(ckpt.step_dir(root, j), like=like)
        assert int(loaded["step"]) == j
        cont, _ = run_single(cfg, n, state=loaded)
        assert_trees_close(cont, ref, **TOL, what="2 ranks -> 1 process")
    with tempfile.TemporaryDirectory() as root:
        # saved by this process, continued by 2 ranks
        mid, _ = run_single(cfg, j)
        ckpt.save(mid, ckpt.step_dir(root, j))
        res = _same_on_all_ranks(pool.run(task_train, cfg, n, resume=str(ckpt.step_dir(root, j))))
        assert_trees_close(res["state"], ref, **TOL, what="1 process -> 2 ranks")


def test_sigkill_during_save_keeps_latest_and_restart_matches(pool: WorkerPool) -> None:
    """A rank SIGKILLed inside save leaves latest() at the previous checkpoint; restarting
    from it reaches the uninterrupted run's final state bitwise."""
    cfg = Cfg(model_seed=3, data_seed=4, k=2)
    n = 4
    whole = _same_on_all_ranks(pool.run(task_train, cfg, n))
    with tempfile.TemporaryDirectory() as root:
        with pytest.raises(Exception, match="died"):
            pool.run(task_train, cfg, n, save_at=(1, 2), root=root, kill_rank_during_save_at=2)
        assert ckpt.latest(root) == ckpt.step_dir(root, 1)
        assert not ckpt.is_complete(ckpt.step_dir(root, 2))
        latest = ckpt.latest(root)
        assert latest is not None
        resumed = _same_on_all_ranks(pool.run(task_train, cfg, n, resume=str(latest)))
    assert_trees_equal(resumed["state"], whole["state"], what="restart after SIGKILL")


def _parent_has_no_process_group() -> None:
    assert not dist.is_initialized()


def test_single_process_helpers_need_no_process_group() -> None:
    """shard_batch / reduce_metrics / gather are identities in one process (no group)."""
    _parent_has_no_process_group()
    b = fsdp.shard_batch({"x": torch.arange(6.0).reshape(3, 2)})
    assert b["index"].tolist() == [0, 1, 2]
    m = TensorDict({"loss": torch.tensor(1.5)}, [])
    assert fsdp.reduce_metrics(m) is m
    g = fsdp.gather(TensorDict({"w": torch.ones(2)}, []))
    assert g["w"].tolist() == [1.0, 1.0]
    with pytest.raises(RuntimeError, match="init_process_group"):
        fsdp.bind(nn.Linear(2, 2))
