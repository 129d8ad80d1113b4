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
    if t.is_complex():  # complex128 has no 16-byte integer: compare its two float64 halves
        t = torch.view_as_real(t.contiguous())
    if t.is_floating_point():
        return t.contiguous().view(_INT_VIEW[t.element_size()])
    return t


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    """``"max abs diff X, max rel diff Y"`` over the entries whose difference is finite, plus
    how many entries differ by a non-finite amount (NaN or inf on one side only, or
    infinities of opposite sign), so a NaN among equal entries is not reported as a
    difference of 0."""
    # Complex leaves are compared as complex: a cast to float64 would drop the imaginary part.
    wide = torch.complex128 if a.is_complex() or b.is_complex() else torch.float64
    a64 = tree.local(a).detach().to(wide).cpu()
    b64 = tree.local(b).detach().to(wide).cpu()
    d = (a64 - b64).abs()
    finite = torch.isfinite(d)
    max_abs = float(d[finite].max()) if finite.any() else float("nan")
    denom = b64.abs().clamp_min(1e-30)
    rel = (d / denom)[finite]
    max_rel = float(rel.max()) if rel.numel() else float("nan")
    out = f"max abs diff {max_abs:.3g}, max rel diff {max_rel:.3g}"
    same = (a64 == b64) | (torch.isnan(a64) & torch.isnan(b64))
    odd = int((~finite & ~same).sum())
    if odd:
        out += f"; {odd} of {d.numel()} entries differ by a non-finite amount (NaN or inf)"
    return out


def _structure(a: TensorDictBase, b: TensorDictBase, what: str) -> None:
    pa, pb = tree.paths(a), tree.paths(b)
    if pa != pb:
        missing = [tree.format_path(p) for p in pa if p not in set(pb)]
        extra = [tree.format_path(p) for p in pb if p not in set(pa)]
        raise AssertionError(
            f"{what}: key structure differs; only in expected: {missing or '-'}; "
            f"only in actual: {extra or '-'}"
        )


def _mismatch(x: torch.Tensor, y: torch.Tensor) -> str | None:
    """``"actual <dtype><shape> vs expected <dtype><shape>"`` when those differ, else None."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return f"actual {x.dtype}{tuple(x.shape)} vs expected {y.dtype}{tuple(y.shape)}"
    return None


def report(what: str, failures: list[tuple[str, str]], suffix: str = "") -> str:
    """The message for ``failures`` (``(path, detail)``, leaf order).

    The first line names the first difference; when more leaves differ, one
    line per leaf follows.
    """
    name, detail = failures[0]
    msg = f"{what}: first difference at {name}{detail}{suffix}"
    if len(failures) > 1:
        listed = "".join(f"\n  {n}{d}" for n, d in failures)
        msg += f"\n{len(failures)} leaves differ:{listed}"
    return msg


def equal_failures(
    actual: TensorDictBase | Mapping[str, Any],
    expected: TensorDictBase | Mapping[str, Any],
    *,
    what: str = "trees",
) -> list[tuple[str, str]]:
    """``(path, detail)`` for every leaf of ``actual`` that is not bitwise equal to ``expected``'s.

    The key structures must match (else ``AssertionError``). Internal to the checks.
    """
    a, b = _as_td(actual), _as_td(expected)
    _structure(b, a, what)
    out: list[tuple[str, str]] = []
    for path, x, y in zip(tree.paths(a), tree.leaves(a), tree.leaves(b), strict=True):
        name = tree.format_path(path)
        bad = _mismatch(x, y)
        if bad is not None:
            out.append((name, f": {bad}"))
        elif not torch.equal(_bits(x).cpu(), _bits(y).cpu()):
            out.append((name, f" (not bitwise equal): {_diff(x, y)}"))
    return out


def close_failures(
    actual: TensorDictBase | Mapping[str, Any],
    expected: TensorDictBase | Mapping[str, Any],
    *,
    rtol: float | None,
    atol: float | None,
    what: str = "trees",
) -> list[tuple[str, str]]:
    """``(path, detail)`` for every leaf where ``torch.testing.assert_close`` fails (NaN == NaN).

    The key structures must match (else ``AssertionError``). Internal to the checks.
    """
    a, b = _as_td(actual), _as_td(expected)
    _structure(b, a, what)
    out: list[tuple[str, str]] = []
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
            bad = _mismatch(x, y)
            if bad is not None:
                out.append((name, f": {bad}"))
                continue
            out.append((name, f": {_diff(x, y)}"))
    return out


def assert_trees_equal(
    actual: TensorDictBase | Mapping[str, Any],
    expected: TensorDictBase | Mapping[str, Any],
    *,
    what: str = "trees",
) -> None:
    """Assert bitwise equality (NaN payloads included) of two trees.

    Raises:
        AssertionError: naming the first diverging key path (leaf order), shapes or
            dtypes at fault, and the max abs/rel difference there, then every
            diverging leaf with its differences.

    Example:
        >>> import torch
        >>> assert_trees_equal({"w": torch.ones(2)}, {"w": torch.ones(2)})
    """
    a, b = _as_td(actual), _as_td(expected)
    _structure(b, a, what)
    failures = equal_failures(a, b)
    if failures:
        raise AssertionError(report(what, failures))


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
        AssertionError: naming the first diverging key path and the max abs/rel
            difference, then every diverging leaf with its differences.

    Example:
        >>> import torch
        >>> assert_trees_close({"w": torch.ones(2)}, {"w": torch.ones(2) + 1e-9})
    """
    a, b = _as_td(actual), _as_td(expected)
    _structure(b, a, what)
    failures = close_failures(a, b, rtol=rtol, atol=atol)
    if failures:
        raise AssertionError(report(what, failures, f" (rtol={rtol}, atol={atol})"))
