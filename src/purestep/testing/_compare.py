"""Tree comparison that names the first diverging key path and the size of the difference."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from purestep import tree

__all__ = ["assert_trees_close", "assert_trees_equal", "snapshot"]

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_td(x: TensorDictBase | Mapping[str, Any]) -> TensorDictBase:
    return x if isinstance(x, TensorDictBase) else TensorDict(dict(x), batch_size=[])


def snapshot(x: TensorDictBase | Mapping[str, Any]) -> TensorDict:
    """A deep copy (fresh buffers) to compare against later.

    Example:
        >>> import torch
        >>> s = snapshot({"w": torch.ones(1)})
        >>> s["w"]
        tensor([1.])
    """
    out = _as_td(x).apply(lambda t: tree.local(t).detach().clone())
    assert isinstance(out, TensorDict)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = tree.local(t).detach()
    if t.is_floating_point() or t.is_complex():
        return t.contiguous().view(_INT_VIEW[t.element_size()])
    return t


def _diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    a64 = tree.local(a).detach().to(torch.float64).cpu()
    b64 = tree.local(b).detach().to(torch.float64).cpu()
    d = (a64 - b64).abs()
    finite = torch.isfinite(d)
    max_abs = float(d[finite].max()) if finite.any() else float("nan")
    denom = b64.abs().clamp_min(1e-30)
    rel = (d / denom)[finite]
    max_rel = float(rel.max()) if rel.numel() else float("nan")
    return max_abs, max_rel


def _structure(a: TensorDictBase, b: TensorDictBase, what: str) -> None:
    pa, pb = tree.paths(a), tree.paths(b)
    if pa != pb:
        missing = [tree.format_path(p) for p in pa if p not in set(pb)]
        extra = [tree.format_path(p) for p in pb if p not in set(pa)]
        raise AssertionError(
            f"{what}: key structure differs; only in expected: {missing or '-'}; "
            f"only in actual: {extra or '-'}"
        )


def assert_trees_equal(
    actual: TensorDictBase | Mapping[str, Any],
    expected: TensorDictBase | Mapping[str, Any],
    *,
    what: str = "trees",
) -> None:
    """Assert bitwise equality (NaN payloads included) of two trees.

    Raises:
        AssertionError: naming the first diverging key path (leaf order), shapes or
            dtypes at fault, and the max abs/rel difference there.

    Example:
        >>> import torch
        >>> assert_trees_equal({"w": torch.ones(2)}, {"w": torch.ones(2)})
    """
    a, b = _as_td(actual), _as_td(expected)
    _structure(b, a, what)
    for path, x, y in zip(tree.paths(a), tree.leaves(a), tree.leaves(b), strict=True):
        name = tree.format_path(path)
        if x.shape != y.shape or x.dtype != y.dtype:
            raise AssertionError(
                f"{what}: first difference at {name}: actual {x.dtype}{tuple(x.shape)} vs "
                f"expected {y.dtype}{tuple(y.shape)}"
            )
        if not torch.equal(_bits(x).cpu(), _bits(y).cpu()):
            max_abs, max_rel = _diff(x, y)
            raise AssertionError(
                f"{what}: first difference at {name} (not bitwise equal): "
                f"max abs diff {max_abs:.3g}, max rel diff {max_rel:.3g}"
            )


def assert_trees_close(
    actual: TensorDictBase | Mapping[str, Any],
    expected: TensorDictBase | Mapping[str, Any],
    *,
    rtol: float | None = None,
    atol: float | None = None,
    what: str = "trees",
) -> None:
    """Assert leafwise ``torch.testing.assert_close`` (dtype-default tolerances when None).

    Raises:
        AssertionError: naming the first diverging key path and the max abs/rel difference.

    Example:
        >>> import torch
        >>> assert_trees_close({"w": torch.ones(2)}, {"w": torch.ones(2) + 1e-9})
    """
    a, b = _as_td(actual), _as_td(expected)
    _structure(b, a, what)
    for path, x, y in zip(tree.paths(a), tree.leaves(a), tree.leaves(b), strict=True):
        name = tree.format_path(path)
        try:
            torch.testing.assert_close(
                tree.local(x).detach().cpu(),
                tree.local(y).detach().cpu(),
                rtol=rtol,
                atol=atol,
                equal_nan=True,
            )
        except AssertionError:
            if x.shape != y.shape or x.dtype != y.dtype:
                raise AssertionError(
                    f"{what}: first difference at {name}: actual {x.dtype}{tuple(x.shape)} vs "
                    f"expected {y.dtype}{tuple(y.shape)}"
                ) from None
            max_abs, max_rel = _diff(x, y)
            raise AssertionError(
                f"{what}: first difference at {name}: max abs diff {max_abs:.3g}, "
                f"max rel diff {max_rel:.3g} (rtol={rtol}, atol={atol})"
            ) from None
