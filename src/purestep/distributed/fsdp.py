"""Bind FSDP2-sharded modules to a purestep state: ``bind``, ``shard_batch``, ``reduce_metrics``.

FSDP2 (``fully_shard``) breaks functional calls: after the first forward a
module ignores parameters swapped in by ``functional_call``/``to_module``, and
``autograd.grad`` cannot reach the sharded parameters. So a *bound* role's
params are the module's own sharded ``DTensor`` parameters (the state aliases
them), grads come from ``backward()`` and ``.grad`` (FSDP reduce-scatters them
there), and the optimizer updates them in place (the step must donate).

What the step layer does for bound roles (see :mod:`purestep.step`), and what
this module hooks into it:

* before each ``backward()``, gradient sync is off on every FSDP module of the
  binding except on the last microbatch of :func:`purestep.accumulate`
  (``set_requires_gradient_sync`` and ``set_is_last_backward``, set on each FSDP
  module, since FSDP state is per module);
* on the last microbatch ``.grad`` (the data-parallel mean of the weighted sum)
  is moved into the grads TensorDict and cleared;
* ``train_step`` averages the loss function's metrics (per-rank means) over the
  data-parallel ranks in one collective, so metrics equal one process's.

Data parallelism: each rank computes the mean loss of its slice of the global
batch and FSDP averages grads over ranks, which gives the global-batch mean when
every rank has the same number of samples. :func:`shard_batch` assigns the
global sample ids (``batch["index"]``) before slicing, so per-sample noise is
the same as in one process and results do not depend on the world size (up to
float summation order).

Example:
    >>> import torch.distributed as dist  # doctest: +SKIP
    >>> from purestep import accumulate, init_state, optim, train_step, value_and_grad  # doctest: +SKIP
    >>> from purestep.distributed import fsdp  # doctest: +SKIP
    >>> dist.init_process_group("gloo")  # doctest: +SKIP
    >>> binding = fsdp.bind(model, shard=[Block])  # doctest: +SKIP
    >>> opt = {"student": optim.adamw(1e-3)}  # doctest: +SKIP
    >>> state = init_state({"student": binding}, opt, seed=0)  # doctest: +SKIP
    >>> step = train_step(accumulate(value_and_grad(loss_fn), 4), opt, donate=True)  # doctest: +SKIP
    >>> state, metrics = step(state, fsdp.shard_batch(global_batch, binding.mesh))  # doctest: +SKIP
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import attrs
import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from purestep import tree
from purestep.distributed._data_parallel import Group as Group  # the helpers' group type
from purestep.distributed._data_parallel import (
    dp_rank,
    dp_size,
    gather,
    reduce_metrics,
    shard_batch,
)
from purestep.distributed._owners import Owner, owners_of, register
from purestep.state import buffers_of
from purestep.step import (
    Microbatch,
    register_bound_backward_hook,
    register_bound_graph_hook,
    register_bound_metrics_hook,
)

__all__ = [
    "FSDPBinding",
    "bind",
    "dp_rank",
    "dp_size",
    "gather",
    "reduce_metrics",
    "shard_batch",
]

ShardSpec = Callable[[nn.Module], bool] | Sequence[type[nn.Module]] | Sequence[str]


# -- the binding ----------------------------------------------------------------------------


# Frozen at runtime (on_setattr); not ``attrs.frozen``, whose read-only attributes mypy
# rejects for ParamSource's plain ``aliases_module: bool`` member.
@attrs.define(eq=False, on_setattr=attrs.setters.frozen)
class FSDPBinding:
    """An FSDP2-sharded module whose sharded parameters a purestep state aliases.

    Built by :func:`bind`; pass it as a role's params to
    :func:`purestep.init_state`. Implements :class:`purestep.state.ParamSource`.

    Invariant: :meth:`params` returns the module's own sharded ``nn.Parameter``
    DTensors (the very objects, not copies), so in-place updates of the state's
    params are the module's weights. Keep the state's params and the module
    together: replacing a bound param tensor in the state detaches it.

    Attributes:
        module: the root module (an ``FSDPModule`` after :func:`bind`).
        fsdp_modules: every FSDP-wrapped module, blocks first, the root last.
        mesh: the data-parallel device mesh (1-D: FSDP; 2-D: HSDP, replicate x shard).
        sync_every_microbatch: reduce grads on every microbatch instead of the last only.
        aliases_module: always True (the params are the module's own).

    Example:
        >>> b = bind(nn.Linear(4, 4))  # doctest: +SKIP
        >>> all(p is q for p, q in zip(tree.leaves(b.params()), b.module.parameters()))  # doctest: +SKIP
        True
    """

    module: nn.Module
    fsdp_modules: tuple[nn.Module, ...]
    mesh: DeviceMesh
    sync_every_microbatch: bool = False
    aliases_module: bool = attrs.field(default=True, init=False)

    def params(self) -> TensorDict:
        """The trainable sharded params, nested by module path; the module's own objects.

        Raises:
            RuntimeError: a param is not a sharded DTensor (called between a
                forward and its backward, or the module was not sharded).

        Example:
            >>> sorted(bind(nn.Linear(2, 2)).params().keys())  # doctest: +SKIP
            ['bias', 'weight']
        """
        items: list[tuple[tuple[str, ...], torch.Tensor]] = []
        for name, param in self.module.named_parameters():
            p: torch.Tensor = param
            if not p.requires_grad:
                continue
            if not hasattr(p, "to_local"):
                raise RuntimeError(
                    f"FSDPBinding.params: parameter {name!r} is a {type(p).__name__}, not a "
                    "sharded DTensor; call params() outside forward/backward (after "
                    "backward FSDP registers the sharded parameters again)"
                )
            items.append((tuple(name.split(".")), p))
        if not items:
            raise ValueError(
                f"FSDPBinding.params: module {type(self.module).__name__} has no trainable "
                "parameters (requires_grad=True)"
            )
        out = TensorDict({}, batch_size=[])
        for path, t in items:
            out.set(path, t)  # TensorDict keeps the object: checked below
        for (path, t), leaf in zip(items, tree.leaves(out), strict=True):
            if leaf is not t:  # pragma: no cover - a tensordict behaviour change
                raise RuntimeError(
                    f"FSDPBinding.params: TensorDict replaced parameter {tree.format_path(path)} "
                    "by another object; bound params must alias the module's parameters"
                )
        return out

    def buffers(self) -> TensorDict | None:
        """The module's persistent buffers (its own tensors, not copies), or None.

        Buffers are not sharded: every rank keeps its own (BatchNorm statistics
        of its local batches, unless synchronised); a checkpoint saves rank 0's.

        Example:
            >>> bind(nn.BatchNorm1d(2)).buffers() is not None  # doctest: +SKIP
            True
        """
        return buffers_of("bound", self.module, copy=False)

    def reshard(self) -> None:
        """Reshard every FSDP module (``FSDPModule.reshard`` does not recurse).

        Frees unsharded parameters kept by ``reshard_after_forward=False`` (e.g.
        after an evaluation forward), so the module's registered params are the
        sharded ones again.

        Example:
            >>> bind(nn.Linear(2, 2), reshard_after_forward=False).reshard()  # doctest: +SKIP
        """
        for m in self.fsdp_modules:
            cast(FSDPModule, m).reshard()


def _default_mesh() -> DeviceMesh:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "fsdp.bind: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group(...) first (torchrun sets the environment)"
        )
    backend = str(dist.get_backend()).lower()
    device_type = "cpu" if backend == "gloo" or not torch.cuda.is_available() else "cuda"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _selector(shard: ShardSpec | None, root: nn.Module) -> Callable[[str, nn.Module], bool]:
    if shard is None:
        return lambda name, m: False
    if isinstance(shard, (str, type)):
        items: list[object] = [shard]
    elif callable(shard):
        fn = shard
        return lambda name, m: bool(fn(m))
    else:
        items = list(shard)
    if all(isinstance(s, type) and issubclass(s, nn.Module) for s in items):
        types = tuple(cast(list[type[nn.Module]], items))
        return lambda name, m: isinstance(m, types)
    if all(isinstance(s, str) for s in items):
        names = set(cast(list[str], items))
        known = {n for n, _ in root.named_modules() if n}
        missing = sorted(names - known)
        if missing:
            sample = ", ".join(sorted(known)[:12]) + (", ..." if len(known) > 12 else "")
            raise KeyError(
                f"fsdp.bind: shard names {missing} are not submodules of "
                f"{type(root).__name__} (submodules: {sample})"
            )
        return lambda name, m: name in names
    raise TypeError(
        "fsdp.bind: shard must be a callable module -> bool, a list of module types or "
        f"a list of submodule names; got {shard!r}"
    )


def bind(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    shard: ShardSpec | None = None,
    reshard_after_forward: bool = True,
    mixed_precision: MixedPrecisionPolicy | None = None,
    sync_every_microbatch: bool = False,
) -> FSDPBinding:
    """Shard ``module`` with FSDP2 and bind it for use as a role's params.

    Applies ``fully_shard`` to every submodule selected by ``shard`` (bottom-up,
    so nested selections work), then to the root. Each call makes one
    communication group; shard per block (transformer layer) for overlap and
    peak-memory savings. A module that is already an ``FSDPModule`` is bound as
    it is (``shard`` must then be None).

    Use the result as ``init_state({"student": binding}, ...)`` and build the
    step with ``donate=True``.

    Args:
        module: the model; its parameters are replaced by sharded DTensors
            (``module`` itself is modified, as with ``fully_shard``).
        mesh: 1-D mesh (FSDP) or 2-D ``(replicate, shard)`` mesh (HSDP). Default:
            a 1-D mesh over the default process group, on ``cuda`` unless the
            backend is gloo.
        shard: submodules to shard individually: a callable ``module -> bool``,
            a list of module types, or a list of submodule names
            (``named_modules``). Default: only the root.
        reshard_after_forward: free unsharded params after forward (re-gathered
            in backward); ``False`` trades memory for communication.
        mixed_precision: an FSDP ``MixedPrecisionPolicy`` (e.g.
            ``param_dtype=torch.bfloat16, reduce_dtype=torch.float32``); the
            sharded params (the state) stay in their original dtype.
        sync_every_microbatch: reduce grads after every microbatch of
            :func:`purestep.accumulate` rather than the last only (more
            communication; the same result up to float summation order).

    Returns:
        An :class:`FSDPBinding`.

    Raises:
        RuntimeError: no process group is initialized and no ``mesh`` given.
        KeyError: a name in ``shard`` is not a submodule.
        TypeError: ``shard`` has an unsupported type.

    Example:
        >>> binding = bind(model, shard=[Block])  # doctest: +SKIP
        >>> state = init_state({"student": binding}, {"student": optim.adamw(1e-3)}, seed=0)  # doctest: +SKIP
    """
    mesh = _default_mesh() if mesh is None else mesh
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fsdp.bind: mesh must be 1-D (FSDP) or 2-D (HSDP); got {mesh.ndim}-D")
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise ValueError(
            "fsdp.bind: a 2-D (HSDP) mesh needs dim names, e.g. init_device_mesh(device, "
            "(replicas, shards), mesh_dim_names=('replicate', 'shard'))"
        )
    if isinstance(module, FSDPModule):
        if shard is not None:
            raise ValueError(
                "fsdp.bind: module is already sharded (an FSDPModule); pass shard=None to bind it"
            )
    else:
        select = _selector(shard, module)
        chosen = [m for name, m in module.named_modules() if name and select(name, m)]
        kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
        if mixed_precision is not None:
            kwargs["mp_policy"] = mixed_precision
        # named_modules is pre-order, so its reverse shards children before their parents
        for m in reversed(chosen):
            if not isinstance(m, FSDPModule):
                fully_shard(m, **kwargs)
        fully_shard(module, **kwargs)
    # blocks first (bottom-up, the order fully_shard was applied), root last
    inner = [m for m in module.modules() if isinstance(m, FSDPModule) and m is not module]
    fsdp_modules: tuple[nn.Module, ...] = (*reversed(inner), module)
    owner = Owner(
        modules=tuple(weakref.ref(m) for m in fsdp_modules),
        mesh=mesh,
        sync_every_microbatch=sync_every_microbatch,
    )
    binding = FSDPBinding(
        module=module,
        fsdp_modules=fsdp_modules,
        mesh=mesh,
        sync_every_microbatch=sync_every_microbatch,
    )
    register(tree.leaves(binding.params()), owner)
    for i, m in enumerate(fsdp_modules):
        # after FSDP's own pre-forward hook (prepended): the module holds unsharded params
        m.register_forward_pre_hook(_ForwardParams(owner, i))
    # The step layer learns about bound roles only once something is bound.
    register_bound_backward_hook(_before_backward)
    register_bound_metrics_hook(_reduce_bound_metrics)
    register_bound_graph_hook(_graph_params)
    return binding


# -- hooks into the step layer --------------------------------------------------------------


def _before_backward(leaves: Sequence[torch.Tensor], mb: Microbatch) -> None:
    """Gradient sync on the last microbatch only, on every FSDP module of the owning bindings."""
    for owner in owners_of(leaves):
        sync = mb.is_last or owner.sync_every_microbatch
        for m in owner.fsdp_modules():
            m.set_requires_gradient_sync(sync, recurse=False)
            m.set_is_last_backward(sync)


@attrs.frozen
class _ForwardParams:
    """Forward pre-hook: record the params module ``index`` of ``owner`` runs forward with."""

    owner: Owner
    index: int

    def __call__(self, module: nn.Module, args: Any) -> None:
        self.owner.forward_params[self.index] = tuple(weakref.ref(p) for p in module.parameters())


def _graph_params(leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t for owner in owners_of(leaves) for t in owner.graph_params()]


def _reduce_bound_metrics(leaves: Sequence[torch.Tensor], metrics: TensorDict) -> TensorDict:
    owners = owners_of(leaves)
    if not owners:
        return metrics
    return reduce_metrics(metrics, owners[0].mesh)
