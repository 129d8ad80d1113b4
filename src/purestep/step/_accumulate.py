"""Gradient accumulation over microbatches with a single grads buffer."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from purestep import tree
from purestep.step._batch import batch_size, with_index
from purestep.step._grad import GradFn, Microbatch, is_bound, microbatch_scope
from purestep.step._sink import GradSink, sink_scope

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
        raise ValueError(
            f"accumulate: batch of {b} samples cannot be split into k={k} microbatches"
        )
    q, r = divmod(b, k)
    return [q + 1 if i < r else q for i in range(k)]


def _scale_(tensors: list[torch.Tensor], w: float) -> None:
    if w != 1.0 and tensors:
        torch._foreach_mul_([tree.local(t) for t in tensors], w)


def _add_(acc: list[torch.Tensor], new: list[torch.Tensor], w: float) -> None:
    if acc:
        torch._foreach_add_([tree.local(t) for t in acc], [tree.local(t) for t in new], alpha=w)


def _is_sink(sink: GradSink, role: str, leaves: list[torch.Tensor]) -> bool:
    """Whether ``leaves`` are the sink's accumulators for ``role`` (already weighted and summed)."""
    acc = sink.acc.get(role)
    return (
        acc is not None
        and len(acc) == len(leaves)
        and all(a is b for a, b in zip(acc, leaves, strict=True))
    )


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
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"accumulate: k must be a positive int, got {k!r}")

    def acc_fn(
        params: TensorDictBase,
        batch: TensorDictBase,
        key: torch.Tensor,
        *,
        roles: Sequence[str] | None = None,
    ) -> tuple[TensorDict, TensorDict]:
        batch = with_index(batch)
        b = batch_size(batch)
        sizes = microbatch_sizes(b, k)
        if k == 1:
            return grad_fn(params, batch, key, roles=roles)
        grads: TensorDict | None = None
        metrics: TensorDict | None = None
        g_acc: dict[str, list[torch.Tensor]] = {}
        m_acc: list[torch.Tensor] = []
        sink = GradSink()
        start = 0
        for i, n in enumerate(sizes):
            mb = batch[start : start + n]
            start += n
            w = n / b
            with microbatch_scope(Microbatch(index=i, count=k, weight=w)), sink_scope(sink, w):
                g, m = grad_fn(params, mb, key, roles=roles)
            m_leaves = [
                t.to(torch.float32) if not t.is_floating_point() else t for t in tree.leaves(m)
            ]
            if metrics is None:
                metrics = tree.rebuild(m, [t * w for t in m_leaves])
                m_acc = tree.leaves(metrics)
            else:
                _add_(m_acc, m_leaves, w)
            leaves: list[torch.Tensor] = []
            for role_key in g.keys():
                role = str(role_key)
                leaves = tree.leaves(g.get(role))
                if is_bound(params.get(role)):
                    # already the weighted sum, harvested on the last microbatch
                    g_acc[role] = leaves
                elif _is_sink(sink, role, leaves):
                    g_acc[role] = sink.acc[role]  # accumulated in .grad by backward (_sink.py)
                elif role not in g_acc:
                    _scale_(leaves, w)
                    g_acc[role] = leaves
                    sink.blocked.add(role)
                else:
                    _add_(g_acc[role], leaves, w)
            if grads is None:
                grads = g
            else:
                for new_role in g.keys():
                    if new_role not in grads.keys():
                        grads.set(new_role, g.get(new_role))
            del g, m, m_leaves, leaves  # free this microbatch's grads before the next backward
        assert grads is not None and metrics is not None
        return grads, metrics

    return acc_fn
