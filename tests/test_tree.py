"""Flat leaf lists: order, round trips, structure errors and the global norm."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from tensordict import TensorDict

from purestep import testing, tree


@settings(max_examples=25, deadline=None)
@given(testing.param_trees(dtypes=(torch.float32, torch.bfloat16, torch.float64)))
def test_leaves_and_paths_follow_tensordict_order(td: TensorDict) -> None:
    """leaves/paths list leaves in TensorDict's own depth-first order."""
    assert tree.paths(td) == [
        k if isinstance(k, tuple) else (k,) for k in td.keys(include_nested=True, leaves_only=True)
    ]
    assert all(a is b for a, b in zip(tree.leaves(td), td.values(True, True), strict=True))


@settings(max_examples=25, deadline=None)
@given(testing.param_trees(dtypes=(torch.float32, torch.float64)))
def test_rebuild_of_leaves_is_the_identity_and_does_not_touch_the_template(td: TensorDict) -> None:
    """rebuild(td, leaves(td)) == td; rebuilding with new leaves leaves td unchanged."""
    testing.assert_trees_equal(tree.rebuild(td, tree.leaves(td)), td)
    before = testing.snapshot(td)
    out = tree.rebuild(td, [t + 1 for t in tree.leaves(td)])
    testing.assert_trees_equal(td, before)
    assert tree.paths(out) == tree.paths(td)


@settings(max_examples=25, deadline=None)
@given(testing.param_trees(dtypes=(torch.float32, torch.bfloat16, torch.float64), max_leaves=8))
def test_global_norm_equals_the_norm_of_all_leaves_concatenated(td: TensorDict) -> None:
    """global_norm over mixed dtypes is the L2 norm of the concatenation (float32 result)."""
    leaves = tree.leaves(td)
    expected = torch.cat([t.reshape(-1).to(torch.float64) for t in leaves]).norm()
    got = tree.global_norm(leaves)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


def test_structure_mismatch_names_key_paths_and_shapes() -> None:
    """Missing/unexpected keys and shape mismatches are named."""
    a = TensorDict({"m": {"w": torch.ones(2, 3), "b": torch.ones(3)}}, [])
    with pytest.raises(ValueError, match=r"missing m\.b"):
        tree.assert_same_structure(a, TensorDict({"m": {"w": torch.ones(2, 3)}}, []))
    with pytest.raises(ValueError, match=r"m\.w has shape \(3, 2\).*\(2, 3\)"):
        tree.assert_same_structure(
            a, TensorDict({"m": {"w": torch.ones(3, 2), "b": torch.ones(3)}}, [])
        )


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("delta", [-1, 1])
def test_rebuild_with_the_wrong_number_of_leaves_names_both_counts(
    batched: bool, delta: int
) -> None:
    """Too few or too many leaves: ValueError with the counts, for plain and batched trees."""
    td = TensorDict({"a": torch.ones(2), "b": {"c": torch.zeros(2)}}, [2] if batched else [])
    new = [torch.ones(2)] * (2 + delta)
    word = "fewer" if delta < 0 else "more"
    with pytest.raises(
        ValueError, match=rf"rebuild: {word} leaves.*\b{2 + delta} given|{word}.*\({2 + delta}\)"
    ):
        tree.rebuild(td, new)


@given(td=testing.param_trees())
@settings(max_examples=40, deadline=None)
def test_first_leaf_is_the_first_of_leaves(td: TensorDict) -> None:
    """first_leaf(td) is leaves(td)[0] (the same object), or None for a tree without leaves."""
    ls = tree.leaves(td)
    first = tree.first_leaf(td)
    assert (first is None and not ls) or first is ls[0]
    empty_first = TensorDict({"e": {}, "t": td}, [])
    assert tree.first_leaf(empty_first) is (ls[0] if ls else None)
