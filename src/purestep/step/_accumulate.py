"""Gradient accumulation over microbatches with a single grads buffer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from purestep import _compat, tree
from purestep.errors import BatchError
from purestep.step._batch import batch_size, with_index
from purestep.step._bound import is_bound
from purestep.step._context import Microbatch, microbatch_scope
from purestep.step._grad import GradFn
from purestep.step._sink import MicrobatchGrads, sink_scope

KeyPath = tuple[str, ...]


def _from_paths(like: TensorDictBase, by_path: dict[KeyPath, torch.Tensor]) -> TensorDict:
    """``like``'s structure with the leaves in ``by_path`` (paths not there left out)."""
    return tree.select(like, [by_path.get(p) for p in tree.paths(like)])


__all__ = ["accumulate", "microbatch_sizes"]


def microbatch_sizes(b: int, k: int) -> list[int]:
    """Sizes of ``k`` microbatches of a batch of ``b``: as equal as possible, larger first.

    Example:
        >>> microbatch_sizes(10, 4)
        [3, 3, 2, 2]
    """
    if k < 1:
        raise ValueError(f"accumulate: k must be >= 1, got {k}")
    if b < k:
        raise BatchError(
            f"accumulate: batch of {b} samples cannot be split into k={k} microbatches"
        )
    q, r = divmod(b, k)
    return [q + 1 if i < r else q for i in range(k)]


def _add_into(acc: dict[KeyPath, torch.Tensor], g: TensorDictBase, w: float) -> None:
    """``acc[path] += w * g[path]`` for every leaf of ``g`` (new paths start at ``w * g``)."""
    for path, leaf in zip(tree.paths(g), tree.leaves(g), strict=True):
        have = acc.get(path)
        if have is None:
            acc[path] = leaf * w if w != 1.0 else leaf.clone()
        else:
            tree.local(have).add_(tree.local(leaf), alpha=w)


def _owned(sink: MicrobatchGrads, role: str, g: TensorDictBase) -> bool:
    """Whether ``g`` is exactly the sink's accumulated ``.grad`` tensors for ``role``."""
    if role not in sink.tracked:
        return False
    mine = [t for t in sink.grads(role) if t is not None]
    got = tree.leaves(g)
    return len(mine) == len(got) and all(a is b for a, b in zip(mine, got, strict=True))


def accumulate(grad_fn: GradFn, k: int) -> GradFn:
    """Split the batch into ``k`` microbatches and combine grads and metrics as the full-batch mean.

    ``batch["index"] = arange(B)`` is assigned first when absent, so per-sample
    randomness (drawn with ``rng.*(..., index=batch["index"])``) is the same as in
    one big batch. Microbatch ``i`` of size ``n_i`` is weighted ``n_i / B``, so the
    result equals the full-batch mean of a per-sample-mean loss up to float
    summation order, also when ``B`` is not divisible by ``k``. Metrics are
    combined with the same weights. Peak memory holds one grads buffer.

    With ``grad_fn`` from :func:`purestep.value_and_grad`, each microbatch's
    loss is weighted before its backward and autograd accumulates the grads in
    ``.grad`` of requires-grad leaves shared by the microbatches: exactly the
    imperative loop ``(loss_i * n_i / B).backward()`` (bitwise equal). Grads
    from any other ``grad_fn`` are scaled and added as lists.

    Bound (FSDP) roles accumulate in their ``.grad`` too; gradient sync runs on
    the last microbatch only, and the grads are harvested once.

    Args:
        grad_fn: from :func:`purestep.value_and_grad` (must return fresh grad tensors).
        k: number of microbatches (``1 <= k <= B``).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from purestep import value_and_grad
        >>> gf = value_and_grad(lambda p, b, key: ((p["m", "w"] * b["x"]).mean(), {}))
        >>> p = TensorDict({"m": {"w": torch.ones(1)}}, [])
        >>> b = TensorDict({"x": torch.arange(4.0)}, [4])
        >>> accumulate(gf, 2)(p, b, torch.tensor(0))[0]["m", "w"]
        tensor([1.5000])
    """
    if not callable(grad_fn):
        raise TypeError(
            f"accumulate: grad_fn is a {type(grad_fn).__name__}, not callable; pass "
            "value_and_grad(loss_fn)"
        )
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(
            f"accumulate: k must be an int >= 1 (the number of microbatches), got {k!r}"
        )
    if k < 1:
        raise ValueError(f"accumulate: k must be a positive int, got {k!r}")

    def acc_fn(
        params: TensorDictBase,
        batch: TensorDictBase,
        key: torch.Tensor,
        *,
        roles: Sequence[str] | None = None,
        buffers: TensorDictBase | None = None,
        donate: bool = False,
    ) -> tuple[TensorDict, TensorDict]:
        batch = with_index(batch)
        b = batch_size(batch)
        sizes = microbatch_sizes(b, k)
        extra: dict[str, Any] = {}
        if buffers is not None:
            extra["buffers"] = buffers
        if donate:
            extra["donate"] = True
        if k == 1:
            return grad_fn(params, batch, key, roles=roles, **extra)
        metrics: TensorDict | None = None
        m_acc: list[torch.Tensor] = []
        listed: dict[str, dict[KeyPath, torch.Tensor]] = {}  # roles summed here, by path
        from_sink: list[str] = []  # roles summed in .grad by value_and_grad
        harvested: dict[str, TensorDictBase] = {}  # bound roles: the sum, at the last microbatch
        sink = MicrobatchGrads()
        start = 0
        for i, n in enumerate(sizes):
            mb = batch[start : start + n]
            start += n
            w = n / b
            with microbatch_scope(Microbatch(index=i, count=k, weight=w)), sink_scope(sink, w):
                g, m = grad_fn(params, mb, key, roles=roles, **extra)
            m_leaves = [
                t.to(torch.float32) if not t.is_floating_point() else t for t in tree.leaves(m)
            ]
            if metrics is None:
                metrics = tree.rebuild(m, [t * w for t in m_leaves])
                m_acc = tree.leaves(metrics)
            elif m_acc:
                _compat.foreach_add_(m_acc, m_leaves, alpha=w)
            for role_key in g.keys():
                role = str(role_key)
                role_grads = g.get(role)
                if is_bound(params.get(role)):
                    harvested[role] = role_grads  # the weighted sum, on the last microbatch
                elif role in sink.served:
                    if not _owned(sink, role, role_grads):
                        raise RuntimeError(
                            f"accumulate: the grads of role {role!r} are not the ones "
                            "value_and_grad accumulated (a wrapper between accumulate and "
                            "value_and_grad changed them per microbatch); transform gradients "
                            "after accumulate, e.g. in the optimizer chain"
                        )
                    if role not in from_sink:
                        from_sink.append(role)
                else:
                    _add_into(listed.setdefault(role, {}), role_grads, w)
            del g, m, m_leaves  # free this microbatch's grads before the next backward
        assert metrics is not None
        out: dict[str, TensorDictBase] = {}
        for role in params.keys():
            if role in harvested:
                out[role] = harvested[role]
            elif role in from_sink:
                if role in listed:
                    raise RuntimeError(
                        f"accumulate: role {role!r} got gradients both through "
                        "value_and_grad's accumulation and from another grad_fn"
                    )
                grads = sink.grads(role)
                for t in sink.tracked[role][2]:
                    t.grad = None
                like = params.get(role)
                out[role] = tree.select(like, grads)
            elif role in listed:
                out[role] = _from_paths(params.get(role), listed[role])
        return tree.plain_td(out), metrics

    return acc_fn
