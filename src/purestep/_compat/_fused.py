"""Guarded fused optimizer kernels: ``torch._fused_adam_``, ``_fused_adamw_``, ``_fused_sgd_``.

The fallback is torch's functional optimizer API with ``fused=True``, which runs
the same kernel (bitwise equal results) after its own argument checks and
device/dtype grouping.

Example:
    >>> import torch
    >>> from purestep._compat._fused import fused_sgd_
    >>> p, g, buf = [torch.ones(2)], [torch.ones(2)], [torch.zeros(2)]
    >>> _ = fused_sgd_(p, g, buf, lr=0.5, weight_decay=0.0, momentum=0.9, dampening=0.0,
    ...                nesterov=False, maximize=False, is_first_step=True)
    >>> p[0], buf[0]
    (tensor([0.5000, 0.5000]), tensor([1., 1.]))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from purestep._compat._probe import _choose, _clone, _probe_tensors, _same


def _public_fused_adam(decoupled: bool) -> Callable[..., None]:
    from torch.optim.adam import adam

    def fused(
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        max_exp_avg_sqs: list[torch.Tensor],
        state_steps: list[torch.Tensor],
        **kw: Any,
    ) -> None:
        # The functional API counts the step itself; purestep's steps already count it.
        adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            [s - 1 for s in state_steps],
            fused=True,
            decoupled_weight_decay=decoupled,
            **kw,
        )

    return fused


def _public_fused_sgd(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    momentum_buffer_list: list[torch.Tensor],
    *,
    momentum: float,
    is_first_step: bool,
    **kw: Any,
) -> None:
    from torch.optim.sgd import sgd

    # The functional API starts the buffers itself when given none (its first step).
    bufs: list[torch.Tensor | None] = (
        [None] * len(params) if is_first_step or momentum == 0 else list(momentum_buffer_list)
    )
    sgd(params, grads, bufs, fused=True, momentum=momentum, **kw)
    if is_first_step and momentum != 0:
        for dst, src in zip(momentum_buffer_list, bufs, strict=True):
            assert src is not None
            dst.copy_(src)


def _probe_fused(name: str, public: Callable[..., None], **hp: Any) -> Callable[[], bool]:
    def probe() -> bool:
        p, g = _probe_tensors(), [t * 0.5 - 0.1 for t in _probe_tensors()]
        g0 = _clone(g)
        runs = []
        for fn in (getattr(torch, name), public):
            pp = _clone(p)
            if name == "_fused_sgd_":
                bufs = [torch.zeros_like(t) for t in p]
                for k in range(2):
                    fn(pp, g, bufs, is_first_step=k == 0, momentum=0.9, **hp)
                runs.append(pp + bufs)
            else:
                m = [torch.zeros_like(t) for t in p]
                v = [torch.zeros_like(t) for t in p]
                vmax = [torch.zeros_like(t) for t in p]
                for k in range(2):
                    steps = [torch.tensor(float(k + 1)) for _ in p]
                    fn(pp, g, m, v, vmax, steps, amsgrad=True, maximize=False, **hp)
                runs.append(pp + m + v + vmax)
        return _same(runs[0], runs[1]) and _same(g, g0) and not _same(p, runs[0][: len(p)])

    return probe


_ADAM_HP = {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1, "eps": 1e-8}
_SGD_HP = {"lr": 0.1, "weight_decay": 0.01, "dampening": 0.0, "nesterov": True, "maximize": False}

fused_adam_: Callable[..., None] = _choose(
    "torch._fused_adam_",
    _probe_fused("_fused_adam_", _public_fused_adam(False), **_ADAM_HP),
    lambda: torch._fused_adam_,
    _public_fused_adam(False),
)
"""``torch._fused_adam_`` (same keyword signature), or ``torch.optim.adam.adam(fused=True)``."""

fused_adamw_: Callable[..., None] = _choose(
    "torch._fused_adamw_",
    _probe_fused("_fused_adamw_", _public_fused_adam(True), **_ADAM_HP),
    lambda: torch._fused_adamw_,
    _public_fused_adam(True),
)
"""``torch._fused_adamw_``, or ``torch.optim.adam.adam(fused=True, decoupled_weight_decay=True)``."""

fused_sgd_: Callable[..., None] = _choose(
    "torch._fused_sgd_",
    _probe_fused("_fused_sgd_", _public_fused_sgd, **_SGD_HP),
    lambda: torch._fused_sgd_,
    _public_fused_sgd,
)
"""``torch._fused_sgd_`` (same keyword signature), or ``torch.optim.sgd.sgd(fused=True)``."""
