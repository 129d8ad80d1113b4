"""After the graph: the new state and metrics, built on the host as the eager step builds them.

The graph hands back flat tensors (or updated its donated inputs in place);
this module puts them back into TensorDicts and does the eager step's
bookkeeping: ``step + 1``, the optimizers' new ``count``/``lr`` leaves, the
forward's buffers, skip counters and the ``lr``/``grad_norm`` metrics, in the
eager step's key order (the tests compare key structures too).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import attrs
import torch
from tensordict import TensorDict, TensorDictBase

from purestep import tree
from purestep._keys import BUFFERS, EMA, EMA_BUFFERS, OPT_STATE, PARAMS
from purestep.compile._core import OutSpec
from purestep.compile._kernels import HostScalars
from purestep.compile._plan import Layout, Parts
from purestep.optim import current_lr
from purestep.step import next_step, set_skip, skip_update

__all__ = ["Results", "finish", "skipped", "write_params"]


@attrs.frozen
class Results:
    """One graph call: its input layout, what its trace recorded, and its outputs.

    Attributes:
        lay: the flat inputs.
        spec: where each result went (a graph output or an input updated in place).
        outs: the graph's outputs.
        small: applied to metrics and norms (a clone out of a CUDA graph's memory).
    """

    lay: Layout
    spec: OutSpec
    outs: Sequence[torch.Tensor]
    small: Callable[[list[torch.Tensor]], list[torch.Tensor]]

    def take(self, name: Hashable) -> list[torch.Tensor]:
        """The tensors of result group ``name``."""
        lay, outs = self.lay, self.outs
        return [lay.leaves[i] if kind == "in" else outs[i] for kind, i in self.spec.sources[name]]

    def leaf(self, name: Hashable, i: int, host: HostScalars) -> torch.Tensor:
        """Leaf ``i`` of result group ``name``: the host's replacement, else the graph's."""
        for j, t in host.replace:
            if j == i:
                return t
        kind, k = self.spec.sources[name][i]
        return self.lay.leaves[k] if kind == "in" else self.outs[k]

    def metrics(self) -> TensorDict:
        """The loss function's metrics (and the loss)."""
        assert self.spec.metrics is not None
        return self.spec.metrics.build(self.small(self.take("metrics")))

    def norms(self) -> dict[str, torch.Tensor]:
        """``{role: grad norm}`` of the roles whose norm the step took."""
        return {r: self.small(self.take(("norm", r)))[0] for r in self.spec.normed}

    def buffers(self) -> dict[str, TensorDict]:
        """``{role: buffers after the forward}``."""
        return {r: sk.build(self.take((BUFFERS, r))) for r, sk in self.spec.buffers.items()}


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def finish(
    parts: Parts,
    state: TensorDictBase,
    res: Results,
    host: dict[str, HostScalars],
    metrics: TensorDict,
    norms: dict[str, torch.Tensor],
    buffers: dict[str, TensorDict],
) -> tuple[TensorDict, TensorDict]:
    """The new state and the metrics of a step whose updates ran (``res``: the graph that ran them)."""
    train, spec = parts.train, res.spec
    donate = train.donate
    if donate:
        # params, moments and EMAs were updated in their buffers; the 0-dim leaves
        # (count, lr, ...) are new tensors, set into the state as the eager step does
        out = state
        for r in spec.updated:
            for i, path in spec.replaced[r]:
                out.set((OPT_STATE, r, *path), res.leaf(("opt", r), i, host[r]))
    else:
        out = tree.map_with_leaves(state, _same)[0]  # new nodes, as state.copy()
        for r in dict.fromkeys([*spec.updated, *spec.written]):
            out.set((PARAMS, r), tree.rebuild(state.get((PARAMS, r)), res.take((PARAMS, r))))
        for r in spec.updated:
            new_o = res.take(("opt", r))
            for i, t in host[r].replace:
                new_o[i] = t
            out.set((OPT_STATE, r), tree.rebuild(state.get((OPT_STATE, r)), new_o))
        for group, roles in ((EMA, parts.ema_roles), (EMA_BUFFERS, parts.ema_buffer_roles)):
            for r in roles:
                out.set((group, r), tree.rebuild(state.get((group, r)), res.take((group, r))))
    if BUFFERS in state.keys():  # as eager: the forward's working copy is the new buffers
        out.set(BUFFERS, tree.plain_td(dict(buffers)))
    next_step(state, out, donate)
    if train.skip_nonfinite:
        set_skip(out, state, consecutive=0, total_inc=0, donate=donate)
        metrics.set("skipped", torch.zeros((), dtype=torch.bool))
    for r in spec.updated:
        lr = current_lr(out.get((OPT_STATE, r)))
        if lr is not None:
            metrics.set((r, "lr"), lr)
        if r in norms:  # as eager: also without grad_norm when skipping (the norm was taken)
            metrics.set((r, "grad_norm"), norms[r])
    return out, metrics


def skipped(
    parts: Parts, state: TensorDictBase, metrics: TensorDict, step: int
) -> tuple[TensorDict, TensorDict]:
    """A step whose loss or grads were not finite: only ``step`` and the skip counters move."""
    train = parts.train
    return skip_update(state, metrics, donate=train.donate, max_consecutive=train.max_consecutive)


def write_params(state: TensorDictBase, res: Results, donate: bool) -> TensorDictBase:
    """``state`` whose params hold the values the forward wrote in place (as the eager step)."""
    if not donate:
        state = tree.map_with_leaves(state, _same)[0]
    for r, idx in res.spec.written.items():
        values = res.take(("written", r))
        params = state.get((PARAMS, r))
        leaves = tree.leaves(params)
        if donate:
            for i, v in zip(idx, values, strict=True):
                leaves[i].copy_(v)
        else:
            for i, v in zip(idx, values, strict=True):
                leaves[i] = v
            state.set((PARAMS, r), tree.rebuild(params, leaves))
    return state
