"""Flat leaf lists: order, round trips, structure errors and the global norm."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

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


# -- trees the fast walk cannot read, the fast walk itself, and the small helpers ---------


class _SubTD(TensorDict):
    """A TensorDict subclass: not a plain node, so tree's walkers take the generic API."""


def _generic_variants(td: TensorDict) -> dict[str, TensorDictBase]:
    """``td``'s leaves in trees that need the generic API, at the top and below a plain node."""
    top = _SubTD({}, [])
    for p, v in zip(tree.paths(td), tree.leaves(td), strict=True):
        top.set(p, v)
    lazy = LazyStackedTensorDict(td, td.clone(), stack_dim=0)
    return {
        "subclass": top,
        # plain leaves first, then a node the fast walk must give up on
        "subclass_below_plain": TensorDict({"head": torch.ones(2), "mid": td, "sub": top}, []),
        "subclass_first": TensorDict({"sub": top, "tail": torch.ones(2)}, []),
        "lazy_stack": lazy,
        "lazy_below_plain": TensorDict({"head": torch.ones(2), "mid": td, "lazy": lazy}, []),
    }


def _api_paths(td: TensorDictBase) -> list[tuple[str, ...]]:
    return [k if isinstance(k, tuple) else (k,) for k in td.keys(True, True)]


@settings(max_examples=15, deadline=None)
@given(testing.param_trees(dtypes=(torch.float32, torch.float64)))
def test_trees_the_fast_walk_cannot_read_give_the_tensordict_api_paths_and_leaves(
    td: TensorDict,
) -> None:
    """Subclass and lazy-stack nodes: paths, leaves, first_leaf, keyed_leaves, rebuild and
    map_with_leaves agree with TensorDict's own keys/values (multi-character keys as 1-tuples)."""
    for name, g in _generic_variants(td).items():
        want_paths = _api_paths(g)
        want = list(g.values(True, True))
        assert tree.paths(g) == want_paths, name
        got = tree.leaves(g)
        assert len(got) == len(want), name
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), name
        first = tree.first_leaf(g)
        assert first is not None and torch.equal(first, want[0]), name
        key, ls = tree.keyed_leaves(g)
        assert key == keyed_key_of(want_paths), name
        assert all(torch.equal(a, b) for a, b in zip(ls, want, strict=True)), name
        if "lazy" in name:
            continue  # apply() walks a lazy stack's parts: not rebuildable from its leaves
        new = [t + 1 for t in want]
        out = tree.rebuild(g, iter(new))  # any iterable, also where the fast walk gives up
        assert type(out) is type(g), name
        assert _api_paths(out) == want_paths, name
        assert all(torch.equal(a, b) for a, b in zip(out.values(True, True), new, strict=True))
        mapped, mls = tree.map_with_leaves(g, lambda t: t * 2)
        assert type(mapped) is type(g), name
        assert _api_paths(mapped) == want_paths, name
        assert all(torch.equal(a, b * 2) for a, b in zip(mls, want, strict=True)), name
        assert all(a is b for a, b in zip(mapped.values(True, True), mls, strict=True)), name


def keyed_key_of(paths: list[tuple[str, ...]]) -> object:
    """The structure key keyed_leaves documents for a tree it cannot walk itself."""
    return (tree._GENERIC_KEY, tuple(paths))


@settings(max_examples=15, deadline=None)
@given(testing.param_trees(dtypes=(torch.float32,), max_leaves=5))
def test_structure_keys_are_equal_exactly_when_the_key_paths_are(td: TensorDict) -> None:
    """keyed_leaves: the same key for a tree with the same paths (other values), a
    different key when any one key name on any path changes; leaves are leaves(td)."""
    key, ls = tree.keyed_leaves(td)
    assert all(a is b for a, b in zip(ls, tree.leaves(td), strict=True))
    assert len(ls) == len(tree.leaves(td))
    assert tree.keyed_leaves(tree.rebuild(td, [t * 0 for t in ls]))[0] == key
    hash(key)
    ps = tree.paths(td)
    for i, p in enumerate(ps):
        for depth in range(len(p)):
            renamed = [
                (*q[:depth], "zz", *q[depth + 1 :]) if q[: depth + 1] == p[: depth + 1] else q
                for q in ps
            ]
            other = tree.unflatten(list(zip(renamed, ls, strict=True)))
            assert tree.keyed_leaves(other)[0] != key, (i, depth)


@settings(max_examples=10, deadline=None)
@given(testing.param_trees(dtypes=(torch.float32,), max_leaves=5))
def test_plain_trees_are_walked_without_the_tensordict_api_and_in_one_walk(
    td: TensorDict,
) -> None:
    """The fast walkers never call TensorDict's keys/values/items/apply on plain trees, and
    keyed_leaves / assert_same_structure / rebuild / map_with_leaves / merge / select build
    no path or leaf list of their own (one walk), with the same results."""
    td = TensorDict({"e": {}, "t": td, "z": {"k": torch.zeros(1)}}, [])
    want_paths = tree.paths(td)
    want_leaves = tree.leaves(td)
    want_key = tree.keyed_leaves(td)[0]
    twin = tree.rebuild(td, [t.clone() for t in want_leaves])
    other = TensorDict({"o": {"p": torch.ones(3)}}, [])

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("the generic walk ran on a plain tree")

    with pytest.MonkeyPatch.context() as mp:
        for name in ("keys", "values", "items", "apply"):
            mp.setattr(TensorDict, name, boom)
        assert tree.paths(td) == want_paths
        assert all(a is b for a, b in zip(tree.leaves(td), want_leaves, strict=True))
        assert tree.first_leaf(td) is want_leaves[0]
        mp.setattr(tree, "paths", boom)
        mp.setattr(tree, "leaves", boom)
        key, ls = tree.keyed_leaves(td)
        assert key == want_key
        assert all(a is b for a, b in zip(ls, want_leaves, strict=True))
        tree.assert_same_structure(td, twin)
        tree.assert_same_structure(td, twin, check_shapes=False)
        new = [t + 1 for t in want_leaves]
        out = tree.rebuild(td, new)
        mapped, mls = tree.map_with_leaves(td, lambda t: t + 1)
        sel = tree.select(td, new)
        merged = tree.merge(td, other)
    assert all(a is b for a, b in zip(tree.leaves(out), new, strict=True))
    assert all(a is b for a, b in zip(tree.leaves(mapped), mls, strict=True))
    assert all(a is b for a, b in zip(tree.leaves(sel), new, strict=True))
    assert tree.paths(out) == tree.paths(mapped) == tree.paths(sel) == want_paths
    assert "e" in out.keys() and "e" in mapped.keys()  # the empty subtree is kept
    assert tree.paths(merged) == [*want_paths, ("o", "p")]


def _full(message: str) -> str:
    """A pattern matching exactly ``message``."""
    return f"^{re.escape(message)}$"


def _td(d: dict[str, object], batch: list[int] | None = None) -> TensorDict:
    return TensorDict(d, batch or [])


@pytest.mark.parametrize("generic", [False, True], ids=["plain", "subclass"])
def test_structure_errors_name_every_missing_and_unexpected_path_sorted(generic: bool) -> None:
    """assert_same_structure's messages, whole: sorted missing/unexpected dotted paths, a
    reordering, a leaf where the other has a subtree, a shape, with the what/like names."""
    mk = _SubTD if generic else TensorDict
    w, b = torch.ones(2, 3), torch.ones(3)
    params = mk({"m": {"w": w, "b": b}, "z": torch.ones(1), "a": torch.ones(1)}, [])
    grads = mk({"m": {"w": w}, "y": {"q": torch.ones(1)}, "x": torch.ones(1)}, [])
    with pytest.raises(
        ValueError,
        match=_full("grads keys differ from params: missing a, m.b, z; unexpected x, y.q"),
    ):
        tree.assert_same_structure(params, grads)
    with pytest.raises(ValueError, match=_full("u keys differ from v: missing a, z")):
        tree.assert_same_structure(params, mk({"m": {"w": w, "b": b}}, []), what="u", like="v")
    with pytest.raises(ValueError, match=_full("grads keys differ from params: unexpected k")):
        tree.assert_same_structure(mk({"m": {"w": w}}, []), mk({"m": {"w": w}, "k": b}, []))
    with pytest.raises(
        ValueError, match=_full("grads keys differ from params: same keys in a different order")
    ):
        tree.assert_same_structure(mk({"a": b, "c": b}, []), mk({"c": b, "a": b}, []))
    # a 0-d leaf where the other tree has a subtree with batch size [] (the same "shape")
    with pytest.raises(
        ValueError, match=_full("grads keys differ from params: missing s; unexpected s.t")
    ):
        tree.assert_same_structure(mk({"s": torch.ones(())}, []), mk({"s": {"t": b}}, []))
    with pytest.raises(
        ValueError, match=_full("grads keys differ from params: missing s.t; unexpected s")
    ):
        tree.assert_same_structure(mk({"s": {"t": b}}, []), mk({"s": torch.ones(())}, []))
    bad = mk({"m": {"w": torch.ones(3, 2), "b": b}, "z": torch.ones(1), "a": torch.ones(1)}, [])
    with pytest.raises(
        ValueError, match=_full("updates at m.w has shape (3, 2), but state has shape (2, 3)")
    ):
        tree.assert_same_structure(params, bad, what="updates", like="state")
    tree.assert_same_structure(params, bad, check_shapes=False)
    tree.assert_same_structure(params, params.clone())


def test_structure_check_mixes_plain_and_generic_trees() -> None:
    """A plain tree against a subclass tree (either side) is compared by paths and shapes."""
    plain = _td({"m": {"w": torch.ones(2)}})
    sub = _SubTD({"m": {"w": torch.ones(2)}}, [])
    tree.assert_same_structure(plain, sub)
    tree.assert_same_structure(sub, plain)
    with pytest.raises(
        ValueError, match=_full("grads at m.w has shape (3,), but params has shape (2,)")
    ):
        tree.assert_same_structure(sub, _td({"m": {"w": torch.ones(3)}}))


def test_merge_is_the_union_in_order_and_names_the_path_both_trees_have() -> None:
    """merge: a's keys first then b's new ones, recursively, leaves not copied; an overlap
    (two leaves, or a leaf and a subtree, either way) raises naming its dotted path, except
    that keep_a keeps a's leaf (and still refuses a leaf against a subtree)."""
    t = [torch.full((1,), float(i)) for i in range(6)]
    a = _td({"bn": {"weight": t[0]}, "fc": t[1]})
    b = _td({"bn": {"running_mean": t[2], "n": {"c": t[3]}}, "head": t[4]})
    m = tree.merge(a, b)
    assert tree.paths(m) == [
        ("bn", "weight"),
        ("bn", "running_mean"),
        ("bn", "n", "c"),
        ("fc",),
        ("head",),
    ]
    assert all(x is y for x, y in zip(tree.leaves(m), [t[0], t[2], t[3], t[1], t[4]], strict=True))
    assert tree.paths(tree.merge(_SubTD({"s": {"x": t[0]}}, []), b)) == [
        ("s", "x"),
        ("bn", "running_mean"),
        ("bn", "n", "c"),
        ("head",),
    ]
    assert tree.paths(tree.merge(a, _SubTD({"bn": {"y": t[5]}}, []))) == [
        ("bn", "weight"),
        ("bn", "y"),
        ("fc",),
    ]
    lazy = LazyStackedTensorDict(_td({"q": t[5]}), _td({"q": t[4]}), stack_dim=0)
    lm = tree.merge(a, _td({"lz": lazy}))
    assert tree.paths(lm) == [("bn", "weight"), ("fc",), ("lz", "q")]
    assert tree.paths(tree.merge(lazy, _td({"r": t[0]}))) == [("q",), ("r",)]
    overlap = _td({"bn": {"weight": t[5]}, "z": t[5]})
    with pytest.raises(ValueError, match=_full("trees: both trees have 'bn.weight'")):
        tree.merge(a, overlap)
    with pytest.raises(ValueError, match=_full("role 'student': both trees have 'fc'")):
        tree.merge(a, _td({"fc": {"w": t[5]}}), what="role 'student'")
    with pytest.raises(ValueError, match=_full("trees: both trees have 'fc'")):
        tree.merge(_td({"fc": {"w": t[5]}}), a)
    kept = tree.merge(a, overlap, keep_a=True)
    assert tree.paths(kept) == [("bn", "weight"), ("fc",), ("z",)]
    assert tree.leaves(kept)[0] is t[0] and tree.leaves(kept)[2] is t[5]
    with pytest.raises(ValueError, match=_full("trees: both trees have 'bn'")):
        tree.merge(a, _td({"bn": t[5]}), keep_a=True)


def test_select_keeps_the_paths_with_values_and_drops_emptied_subtrees() -> None:
    """select: all values given is rebuild (batch size kept); None drops that leaf and any
    subtree left empty; all None is the empty tree; a count mismatch names both counts."""
    like = _td({"a": torch.ones(2), "b": {"c": torch.ones(2), "d": torch.ones(2)}}, [2])
    v = [torch.zeros(2), torch.full((2,), 2.0), torch.full((2,), 3.0)]
    full = tree.select(like, v)
    assert full.batch_size == torch.Size([2])
    assert all(x is y for x, y in zip(tree.leaves(full), v, strict=True))
    part = tree.select(like, [None, v[1], None])
    assert tree.paths(part) == [("b", "c")] and part["b", "c"] is v[1]
    assert tree.paths(tree.select(like, [v[0], None, None])) == [("a",)]
    assert list(tree.select(like, [v[0], None, None]).keys()) == ["a"]
    assert tree.paths(tree.select(like, [None, None, None])) == []
    with pytest.raises(ValueError, match=_full("select: 2 values for a tree of 3 leaves")):
        tree.select(like, [v[0], None])


def test_unflatten_nests_dotted_paths_in_order() -> None:
    """unflatten: 1-, 2- and 3-element paths become nested keys, in the given order."""
    t = [torch.full((1,), float(i)) for i in range(4)]
    out = tree.unflatten(
        [(("ab",), t[0]), (("m", "w"), t[1]), (("m", "n", "x"), t[2]), (("cd",), t[3])]
    )
    assert out.batch_size == torch.Size([])
    assert tree.paths(out) == [("ab",), ("m", "w"), ("m", "n", "x"), ("cd",)]
    assert all(x is y for x, y in zip(tree.leaves(out), t, strict=True))
    assert tree.paths(tree.unflatten([])) == []


def test_rebuild_keeps_the_templates_batch_size_and_device_and_pins_its_messages() -> None:
    """rebuild of a template with batch dims or a device keeps them; the wrong number of
    leaves raises with both counts, also for a generator of leaves."""
    for like in (
        _td({"a": torch.ones(2), "n": {"b": torch.ones(2)}}, [2]),
        TensorDict({"a": torch.ones(2), "n": {"b": torch.ones(2)}}, [], device="cpu"),
    ):
        new = [torch.zeros(2), torch.full((2,), 5.0)]
        out = tree.rebuild(like, new)
        assert out.batch_size == like.batch_size and out.device == like.device
        assert out["n"].batch_size == like.batch_size and out["n"].device == like.device
        assert all(x is y for x, y in zip(tree.leaves(out), new, strict=True))
        mapped, _ = tree.map_with_leaves(like, torch.zeros_like)
        assert mapped.batch_size == like.batch_size and mapped.device == like.device
    like = _td({"a": torch.ones(2), "n": {"b": torch.ones(2)}})
    with pytest.raises(
        ValueError, match=_full("rebuild: fewer leaves (1) than the template tree has")
    ):
        tree.rebuild(like, (t for t in [torch.ones(2)]))
    with pytest.raises(
        ValueError, match=_full("rebuild: more leaves than the template tree has (3 given, 2 used)")
    ):
        tree.rebuild(like, [torch.ones(2)] * 3)


def test_plain_td_stores_its_items_as_given_with_the_batch_size() -> None:
    """plain_td keeps the very tensors and nodes (no checks, no copies, nested dicts left as
    they are) and the batch size it is given."""
    t, node, raw = torch.ones(2, 3), _td({"x": torch.ones(2)}, [2]), {"y": torch.ones(1)}
    td = tree.plain_td({"t": t, "n": node}, torch.Size([2]))
    assert type(td) is TensorDict and td.batch_size == torch.Size([2])
    assert td._tensordict["t"] is t and td._tensordict["n"] is node
    assert tree.plain_td({"r": raw})._tensordict["r"] is raw
    assert tree.plain_td({"t": t}).batch_size == torch.Size([])


def test_format_path_joins_tuples_and_keeps_strings() -> None:
    """format_path: a tuple is dotted, a string (even one with several letters) is itself."""
    assert tree.format_path(("student", "fc", "weight")) == "student.fc.weight"
    assert tree.format_path(("w",)) == "w"
    assert tree.format_path("student") == "student"


def test_group_by_device_dtype_lists_indices_per_device_and_dtype_in_first_seen_order() -> None:
    """group_by_device_dtype: one group of all indices when uniform, else one per
    (device, dtype) in first-seen order with ascending indices; {} for no tensors."""
    cpu, meta = torch.device("cpu"), torch.device("meta")
    f32, f64, bf16 = torch.float32, torch.float64, torch.bfloat16
    assert tree.group_by_device_dtype([]) == {}
    assert tree.group_by_device_dtype([torch.ones(1)]) == {(cpu, f32): [0]}
    assert tree.group_by_device_dtype([torch.ones(1)] * 3) == {(cpu, f32): [0, 1, 2]}
    mixed = [torch.ones(1), torch.ones(1, dtype=f64), torch.ones(1), torch.ones(1, dtype=bf16)]
    got = tree.group_by_device_dtype(mixed)
    assert list(got.items()) == [((cpu, f32), [0, 2]), ((cpu, f64), [1]), ((cpu, bf16), [3])]
    devs = [torch.ones(1), torch.empty(1, device="meta"), torch.ones(1)]
    assert list(tree.group_by_device_dtype(devs).items()) == [
        ((cpu, f32), [0, 2]),
        ((meta, f32), [1]),
    ]
    tail = [torch.ones(1, dtype=f64), torch.ones(1, dtype=f64), torch.ones(1)]
    assert list(tree.group_by_device_dtype(tail).items()) == [
        ((cpu, f64), [0, 1]),
        ((cpu, f32), [2]),
    ]


class _Shard:
    """Duck-typed stand-in for a DTensor: local() and copy_ reach it through to_local()."""

    def __init__(self, t: torch.Tensor) -> None:
        self._local = t

    def to_local(self) -> torch.Tensor:
        return self._local


def test_local_and_copy_go_through_to_local_and_copy_every_leaf() -> None:
    """local(): to_local() where there is one, else the tensor itself; copy_ copies each
    src into its dst (through local shards) and is a no-op for empty lists."""
    t = torch.ones(2)
    assert tree.local(t) is t
    s = _Shard(torch.zeros(2))
    assert tree.local(s) is s._local  # type: ignore[arg-type]
    dst = [torch.zeros(2), _Shard(torch.zeros(3))]
    src = [_Shard(torch.full((2,), 4.0)), torch.arange(3.0)]
    tree.copy_(dst, src)  # type: ignore[arg-type]
    assert torch.equal(dst[0], torch.full((2,), 4.0))
    assert torch.equal(dst[1]._local, torch.arange(3.0))  # type: ignore[union-attr]
    tree.copy_([], [])


def test_clone_and_zeros_like_give_fresh_buffers_of_the_same_structure() -> None:
    """clone: equal values in new buffers; zeros_like: zeros of each leaf's shape and dtype."""
    td = _td({"a": torch.arange(3.0), "n": {"b": torch.ones(2, dtype=torch.float64)}})
    c = tree.clone(td)
    testing.assert_trees_equal(c, td)
    assert all(
        x.data_ptr() != y.data_ptr() for x, y in zip(tree.leaves(c), tree.leaves(td), strict=True)
    )
    z = tree.zeros_like(td)
    assert tree.paths(z) == tree.paths(td)
    for x, y in zip(tree.leaves(z), tree.leaves(td), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and not x.any()


def test_trees_without_leaves_have_no_paths_leaves_or_first_leaf() -> None:
    """Empty trees, plain or not (also with empty subtrees): [] paths and leaves, first_leaf None."""
    for td in (_td({}), _td({"e": {}}), _SubTD({}, []), _SubTD({"e": {}}, [])):
        assert tree.paths(td) == [] and tree.leaves(td) == []
        assert tree.first_leaf(td) is None
