"""Adapting a model to the flow contract ``forward(x_t, t, **cond) -> velocity`` (diffusers models)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["FlowAdapter", "adapt"]


class FlowAdapter(nn.Module):
    """``model`` called as ``model(x_t, t * timestep_scale, **renamed cond)``, output unwrapped.

    Build it with :func:`adapt`. The wrapped model is the child ``model``, so a
    state built from the adapter holds its weights under ``"model"`` (e.g.
    ``state["params", "student", "model"]``); ``export.load_params(adapter,
    tree)`` writes them into the wrapped module, after which
    ``adapter.model.save_pretrained(...)`` saves them.

    Attributes:
        model: the wrapped module.
        timestep_scale: the model receives ``t * timestep_scale``.
        output: attribute (or mapping key) of the model's output that holds the
            velocity (``"sample"`` for diffusers), or ``None`` for a tensor output.
        cond_map: ``{condition key: the model's keyword}``; other keys pass unchanged.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        timestep_scale: float = 1.0,
        output: str | None = None,
        cond_map: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"adapt: model must be an nn.Module, got {type(model).__name__}")
        ts = timestep_scale
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
            raise ValueError(f"adapt: timestep_scale must be a finite number > 0, got {ts!r}")
        if ts <= 0:
            raise ValueError(f"adapt: timestep_scale must be a finite number > 0, got {ts!r}")
        if output is not None and not isinstance(output, str):
            raise TypeError(f"adapt: output must be an attribute name or None, got {output!r}")
        cmap = dict(cond_map or {})
        bad = {k: v for k, v in cmap.items() if not (isinstance(k, str) and isinstance(v, str))}
        if bad:
            raise TypeError(f"adapt: cond_map must map str to str, got {bad!r}")
        self.model = model
        self.timestep_scale = float(ts)
        self.output = output
        self.cond_map = cmap

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, **cond: Any) -> torch.Tensor:
        """The wrapped model's velocity for ``x_t`` at flow times ``t`` (in ``[0, 1]``)."""
        tt = t * self.timestep_scale if self.timestep_scale != 1.0 else t
        out = self.model(x_t, tt, **{self.cond_map.get(k, k): v for k, v in cond.items()})
        if self.output is None:
            return out  # type: ignore[no-any-return]
        if isinstance(out, Mapping):
            if self.output not in out:
                raise KeyError(
                    f"adapt: {type(self.model).__name__}'s output has no {self.output!r} "
                    f"(keys: {sorted(out)})"
                )
            return out[self.output]  # type: ignore[no-any-return]
        if not hasattr(out, self.output):
            raise AttributeError(
                f"adapt: {type(self.model).__name__}'s output ({type(out).__name__}) has no "
                f"attribute {self.output!r}"
            )
        return getattr(out, self.output)  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return (
            f"timestep_scale={self.timestep_scale}, output={self.output!r}, "
            f"cond_map={self.cond_map!r}"
        )


def adapt(
    model: nn.Module,
    *,
    timestep_scale: float = 1.0,
    output: str | None = None,
    cond_map: Mapping[str, str] | None = None,
) -> FlowAdapter:
    """Wrap ``model`` so that it meets the flow contract ``forward(x_t, t, **cond) -> velocity``.

    The methods and samplers call ``adapter(x_t, t, **cond)`` with ``t`` in
    ``[0, 1]``; the adapter passes ``t * timestep_scale`` as the model's second
    positional argument (diffusers' ``timestep``), renames the conditions by
    ``cond_map`` and returns ``output`` of the result (diffusers returns an
    object whose ``.sample`` is the prediction). The scale lives in the model,
    so every sampler and method uses it without a ``t_scale`` argument; a
    ``t_scale != 1`` given as well is refused (it would scale twice).

    A diffusers model with class-label dropout (``class_dropout_prob``) draws
    it from torch's global RNG in train mode: keep such a model in ``eval()``
    and use the methods' own condition dropout (``cond_dropout``), which is
    keyed by ``purestep.rng``.

    Args:
        model: the module, e.g. a diffusers ``DiTTransformer2DModel`` or ``UNet2DModel``.
        timestep_scale: the model's timestep is ``t * timestep_scale`` (1000
            for diffusers models trained on timesteps in ``[0, 1000]``).
        output: attribute or key of the model's output holding the velocity
            (``"sample"`` for diffusers); ``None``: the output is the tensor.
        cond_map: ``{condition key: the model's keyword}``, e.g.
            ``{"label": "class_labels"}``.

    Returns:
        A :class:`FlowAdapter` (an ``nn.Module`` holding ``model`` as ``.model``).

    Raises:
        ValueError: a ``timestep_scale`` that is not a finite number > 0.
        TypeError: ``model`` is not a module, or a bad ``output`` / ``cond_map``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> class Model(nn.Module):  # diffusers-style: timestep in [0, 1000], an output object
        ...     def forward(self, sample, timestep, class_labels=None):
        ...         return {"sample": sample * 0 + timestep[:, None]}
        >>> m = adapt(Model(), timestep_scale=1000.0, output="sample",
        ...           cond_map={"label": "class_labels"})
        >>> m(torch.zeros(2, 3), torch.tensor([0.5, 1.0]), label=torch.tensor([1, 2]))[:, 0]
        tensor([ 500., 1000.])
    """
    return FlowAdapter(model, timestep_scale=timestep_scale, output=output, cond_map=cond_map)
