"""Does the state fit the step? Checked at the step boundary, before anything changes.

:func:`check_state` runs at the entry of every step and of
:func:`~purestep.apply_gradients`. It raises :class:`~purestep.errors.StateError`
naming the key path at fault when

* a key the step needs is missing or of the wrong kind (``step``, ``rng``,
  ``params.<role>``, ``opt_state.<role>``, a ``buffers`` role without params);
* a role's ``opt_state`` does not fit its ``params`` for the role's optimizer:
  it is compared with what the optimizer's ``init`` makes for those params
  (run on ``meta`` tensors: no memory, no arithmetic), so a leaf dropped,
  added, renamed, reshaped, re-typed or reordered on either side, and a state
  built for another optimizer (or other hyperparameters), are found;
* two leaves share memory (``purestep._sharing.shared_memory``), one of them
  a leaf the step writes, and the step donates: one buffer would be updated
  twice, or a leaf the step only reads (``rng``, user keys) would change.

Cost: the checks that walk every leaf run once per *structure*. A role's
(params, opt_state) pair that passed is remembered by the identity of its two
TensorDict nodes, and the nodes a purestep step returns are registered as
they are built (the optimizer made them from checked nodes), so a training
loop pays a few dictionary lookups per role and step, donated or not.
Replacing a role's subtree (``state["params", role] = ...``), loading or
building a state gives new nodes, checked in full. A leaf replaced *in place*
inside a node that was already checked is not re-checked up front; when the
forward or the optimizer then fails, the step calls :func:`diagnose` (the
check without the cache) and raises the ``StateError`` naming the key instead
of the kernel's message.

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from purestep import optim
    >>> opt = {"m": optim.adamw(1e-3)}
    >>> p = TensorDict({"w": torch.ones(2)}, [])
    >>> state = TensorDict({"params": {"m": p}, "opt_state": {"m": opt["m"].init(p)},
    ...                     "rng": torch.zeros((), dtype=torch.int64),
    ...                     "step": torch.zeros((), dtype=torch.int64)}, [])
    >>> check_state(state, opt, who="train_step")
    >>> state["params", "m"] = TensorDict({"v": torch.ones(2)}, [])  # a new subtree: checked
    >>> check_state(state, opt, who="train_step")
    Traceback (most recent call last):
    ...
    purestep.errors.StateError: train_step: opt_state.m does not fit params.m (optimizer adamw): ...
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from purestep import tree
from purestep._keys import BUFFERS, EMA, EMA_BUFFERS, OPT_STATE, PARAMS, RNG, SKIP, STEP
from purestep._sharing import shared_memory, sharing_message
from purestep.errors import StateError
from purestep.optim import Transform
from purestep.step._donation import check_live

__all__ = [
    "check_pair",
    "check_state",
    "diagnose",
    "remember",
    "remember_pair",
]

KeyPath = tuple[str, ...]
_MAX_LISTED = 6
_CACHE_SIZE = 512

# (id(a), id(b), id(tag)) -> (weakref(a), weakref(b), tag): pairs of nodes that fit.
_CHECKED: dict[tuple[int, int, int], tuple[weakref.ref[Any], weakref.ref[Any], object]] = {}


def _fmt(path: Sequence[str]) -> str:
    return tree.format_path(tuple(path))


def _child(td: TensorDictBase, key: str) -> Any:
    """``td[key]`` or None, without TensorDict's per-call key handling for plain nodes."""
    if type(td) is TensorDict:
        return td._tensordict.get(key)
    return td.get(key) if key in td.keys() else None


def _keys(td: TensorDictBase) -> list[str]:
    return list(td._tensordict) if type(td) is TensorDict else [str(k) for k in td.keys()]


def _drop_oldest(cache: dict[Any, Any]) -> None:
    """Remove the first-inserted entry (another thread may be changing the dict too)."""
    with contextlib.suppress(RuntimeError, StopIteration, KeyError):
        del cache[next(iter(cache))]


def _known(a: object, b: object, tag: object) -> bool:
    entry = _CHECKED.get((id(a), id(b), id(tag)))
    return entry is not None and entry[0]() is a and entry[1]() is b and entry[2] is tag


def _remember(a: object, b: object, tag: object) -> None:
    key = (id(a), id(b), id(tag))
    if key in _CHECKED:
        entry = _CHECKED[key]
        if entry[0]() is a and entry[1]() is b and entry[2] is tag:
            return
    if len(_CHECKED) >= _CACHE_SIZE:
        _drop_oldest(_CHECKED)
    with contextlib.suppress(TypeError):  # a node type without weak references: not kept
        _CHECKED[key] = (weakref.ref(a), weakref.ref(b), tag)


def remember(
    state: TensorDictBase, optimizers: Mapping[str, Transform], *, donated: bool = False
) -> None:
    """Register ``state``'s (params, opt_state) nodes of ``optimizers``' roles as fitting.

    For states a purestep step has just built from checked ones. ``donated``:
    the state came out of a donated step, whose input passed the donated
    check (no shared memory); the next donated check of these nodes skips it.

    Example:
        >>> from tensordict import TensorDict
        >>> remember(TensorDict({"params": {}, "opt_state": {}}, []), {})
    """
    params, opt = _child(state, PARAMS), _child(state, OPT_STATE)
    if params is None or opt is None:
        return
    for role, transform in optimizers.items():
        p, o = _child(params, role), _child(opt, role)
        if p is not None and o is not None:
            _remember(p, o, transform)
            if donated:
                _remember(p, o, _DONATED)


def remember_pair(a: TensorDictBase, b: TensorDictBase, tag: object) -> None:
    """Register two trees as matching (see :func:`check_pair`).

    Example:
        >>> from tensordict import TensorDict
        >>> remember_pair(TensorDict({}, []), TensorDict({}, []), "ema")
    """
    _remember(a, b, tag)


def _is_counter(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.ndim == 0


def check_state(
    state: Any,
    optimizers: Mapping[str, Transform],
    *,
    who: str,
    counters: bool = True,
    donate: bool = False,
    cached: bool = True,
) -> None:
    """Raise a clear error when ``state`` does not fit a step with ``optimizers``.

    Args:
        state: the training state.
        optimizers: ``{role: Transform}`` of the roles the step may update.
        who: the caller, for messages (``"train_step"``).
        counters: also require ``step`` and ``rng`` (a train step needs them,
            ``apply_gradients`` does not).
        donate: the step donates: leaves that share memory are refused.
        cached: skip the per-leaf checks of (params, opt_state) pairs that
            passed before (by node identity); ``False`` checks everything.

    Raises:
        TypeError: ``state`` is not a TensorDict.
        DonatedStateError: ``state`` was donated to a step before.
        StateError: see the module docstring.

    Example:
        >>> from tensordict import TensorDict
        >>> check_state(TensorDict({}, []), {}, who="train_step")
        Traceback (most recent call last):
        ...
        purestep.errors.StateError: train_step: the state has no 'params' ...
    """
    if not isinstance(state, TensorDictBase):
        raise TypeError(
            f"{who}: state is a {type(state).__name__}, expected the TensorDict built by "
            "purestep.init_state (steps are called as step(state, batch))"
        )
    check_live(state, who)
    params = _child(state, PARAMS)
    if not isinstance(params, TensorDictBase):
        _missing(state, (PARAMS,), who, "{role: tree of params}")
    if counters:
        for key, what in ((STEP, "the steps taken"), (RNG, "the root PRNG key")):
            value = _child(state, key)
            if not _is_counter(value):
                if value is None:
                    _missing(state, (key,), who, f"an int64 0-dim tensor: {what}")
                raise StateError(
                    f"{who}: state[{key!r}] is {_describe(value)}; it must be an int64 0-dim "
                    f"tensor ({what}). Build states with purestep.init_state",
                    path=(key,),
                )
    buffers = _child(state, BUFFERS)
    if isinstance(buffers, TensorDictBase):
        for role in _keys(buffers):
            if _child(params, role) is None:
                raise StateError(
                    f"{who}: the state has buffers for role {role!r} but no params for it "
                    f"(roles with params: {_keys(params)})",
                    path=(BUFFERS, role),
                )
    if not optimizers:
        return
    opt = _child(state, OPT_STATE)
    if not isinstance(opt, TensorDictBase):
        _missing(state, (OPT_STATE,), who, "{role: optimizer state}")
    checked = False
    for role, transform in optimizers.items():
        p, o = _child(params, role), _child(opt, role)
        if cached and _known(p, o, transform):
            continue
        _check_role(who, role, p, o, transform, params, opt)
        checked = True
    if donate:
        nodes = [(_child(params, role), _child(opt, role)) for role in optimizers]
        if checked or not all(_known(p, o, _DONATED) for p, o in nodes):
            _check_sharing(state, who)
            for p, o in nodes:
                _remember(p, o, _DONATED)
        else:  # the subtrees passed before; the top-level leaves (step, rng) are re-read
            _check_sharing(state, who, top_only=True)
    if checked:
        for role, transform in optimizers.items():
            _remember(_child(params, role), _child(opt, role), transform)


def diagnose(
    state: Any, optimizers: Mapping[str, Transform], *, who: str, donate: bool = False
) -> StateError | None:
    """The error :func:`check_state` finds without its cache, or None (for failures deep inside).

    A step whose forward or optimizer fails on a state that was edited in place
    after it was checked (a leaf replaced inside a checked subtree) re-checks
    it, so the user sees which key path is wrong instead of a kernel's message.

    Example:
        >>> from tensordict import TensorDict
        >>> diagnose(TensorDict({}, []), {}, who="train_step").path
        ('params',)
    """
    try:
        check_state(state, optimizers, who=who, counters=False, donate=donate, cached=False)
    except StateError as e:
        return e
    except Exception:
        return None
    return None


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return "missing" if x is None else f"a {type(x).__name__}"


def _missing(state: TensorDictBase, path: KeyPath, who: str, what: str) -> None:
    raise StateError(
        f"{who}: the state has no {_fmt(path)!r} ({what}); it has {_keys(state)}. Build states "
        "with purestep.init_state (and step.prepare for the keys wrappers add)",
        path=path,
    )


def _check_role(
    who: str,
    role: str,
    p: Any,
    o: Any,
    transform: Transform,
    params: TensorDictBase,
    opt: TensorDictBase,
) -> None:
    if not isinstance(p, TensorDictBase):
        raise StateError(
            f"{who}: the state has no params.{role} (role {role!r} has an optimizer; roles "
            f"with params: {_keys(params)}); build the state with init_state for every role "
            "the step updates",
            path=(PARAMS, role),
        )
    if not isinstance(o, TensorDictBase):
        raise StateError(
            f"{who}: the state has no opt_state.{role} (roles with an optimizer state: "
            f"{_keys(opt)}); build it with init_state(..., optimizers) using the optimizers "
            "of this step",
            path=(OPT_STATE, role),
        )
    ppaths, pleaves = tree.paths(p), tree.leaves(p)
    for path, leaf in zip(ppaths, pleaves, strict=True):
        if not leaf.is_floating_point():
            raise StateError(
                f"{who}: params.{_fmt((role, *path))} has dtype {leaf.dtype}; trainable params "
                "must be floating point (integer tensors belong in state['buffers'])",
                path=(PARAMS, role, *path),
            )
    expected = _expected_state(p, ppaths, pleaves, transform)
    if expected is None:
        return
    problems = _Problems(role)
    other: list[str] = []
    _compare(ppaths, expected, o, (OPT_STATE, role), problems, other)
    if other:
        raise StateError(
            f"{who}: opt_state.{role} was not built by this step's optimizer for role "
            f"{role!r} ({transform.name}): {'; '.join(other)}. A state built for one "
            "optimizer (or other hyperparameters) cannot be stepped with another: build it "
            "with init_state(..., optimizers) using the optimizers of this step",
            path=(OPT_STATE, role),
        )
    if problems.items:
        listed, path = problems.render()
        raise StateError(
            f"{who}: opt_state.{role} does not fit params.{role} (optimizer "
            f"{transform.name}): {listed}. params and opt_state must describe the same "
            "parameters: change them together, or rebuild the state with init_state",
            path=path,
        )


# (id(transform), params signature) -> (transform, its init on meta params): a few entries
_EXPECTED: dict[tuple[int, tuple[Any, ...]], tuple[Transform, TensorDict | None]] = {}


def _expected_state(
    p: TensorDictBase, ppaths: list[KeyPath], pleaves: list[torch.Tensor], transform: Transform
) -> TensorDict | None:
    """``transform.init`` of params like ``p`` (on ``meta``: no memory), per params signature.

    None when the transform cannot init on meta tensors (nothing to compare).
    """
    sig = tuple((path, t.shape, t.dtype) for path, t in zip(ppaths, pleaves, strict=True))
    key = (id(transform), sig)
    hit = _EXPECTED.get(key)
    if hit is not None and hit[0] is transform:
        return hit[1]
    meta = tree.rebuild(p, [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in pleaves])
    try:
        expected: TensorDict | None = transform.init(meta)
    except Exception:  # a transform whose init cannot run on meta tensors
        expected = None
    if len(_EXPECTED) >= 32:
        _drop_oldest(_EXPECTED)
    _EXPECTED[key] = (transform, expected)
    return expected


class _Problems:
    """Mismatches between a role's params and its optimizer state, grouped by param."""

    def __init__(self, role: str) -> None:
        self.role = role
        # (kind, param path or None, detail) -> state paths
        self.items: dict[tuple[str, KeyPath | None, str], list[KeyPath]] = {}

    def add(self, kind: str, param: KeyPath | None, state_path: KeyPath, detail: str = "") -> None:
        self.items.setdefault((kind, param, detail), []).append(state_path)

    def render(self) -> tuple[str, KeyPath]:
        role = self.role
        parts: list[str] = []
        first: KeyPath | None = None
        for (kind, param, detail), paths in self.items.items():
            names = ", ".join(_fmt(p) for p in paths)
            verb = "is" if len(paths) == 1 else "are"
            pname = f"params.{_fmt((role, *param))}" if param is not None else ""
            if kind == "missing":
                assert param is not None
                parts.append(f"{pname} has no optimizer state ({names} {verb} missing)")
                first = first or (PARAMS, role, *param)
            elif kind == "extra":
                assert param is not None
                parts.append(
                    f"{names} {verb} the state of no param ({pname} is missing: dropped or "
                    "renamed?)"
                )
                first = first or paths[0]
            elif kind == "mismatch":
                parts.append(f"{names} {verb} {detail}" + (f" for {pname}" if pname else ""))
                first = first or paths[0]
            else:  # order
                parts.append(f"{names} {detail}")
                first = first or paths[0]
        listed = "; ".join(parts[:_MAX_LISTED])
        if len(parts) > _MAX_LISTED:
            listed += f" (and {len(parts) - _MAX_LISTED} more)"
        assert first is not None
        return listed, first


def _per_param(e: TensorDictBase, ppaths: list[KeyPath]) -> bool:
    return tree.paths(e) == ppaths


def _compare(
    ppaths: list[KeyPath],
    e: TensorDictBase,
    a: Any,
    at: KeyPath,
    problems: _Problems,
    other: list[str],
) -> None:
    """Compare the actual optimizer state ``a`` with the expected ``e``, node by node."""
    if not isinstance(a, TensorDictBase):
        other.append(f"{_fmt(at)} is {_describe(a)}, expected a tree with keys {_keys(e)}")
        return
    if _per_param(e, ppaths):
        _compare_per_param(ppaths, e, a, at, problems)
        return
    ek, ak = _keys(e), _keys(a)
    if set(ek) != set(ak):
        gone = [_fmt((*at, k)) for k in ek if k not in ak]
        extra = [_fmt((*at, k)) for k in ak if k not in ek]
        detail = "; ".join(
            part
            for part in (
                f"missing {', '.join(gone)}" if gone else "",
                f"unexpected {', '.join(extra)}" if extra else "",
            )
            if part
        )
        other.append(f"{_fmt(at)} has keys {ak}, its optimizer keeps {ek} ({detail})")
        return
    for k in ek:
        ev, av = _child(e, k), _child(a, k)
        if isinstance(ev, TensorDictBase):
            _compare(ppaths, ev, av, (*at, k), problems, other)
        elif not isinstance(av, torch.Tensor):
            other.append(f"{_fmt((*at, k))} is {_describe(av)}, expected {_describe(ev)}")
        elif av.shape != ev.shape or av.dtype != ev.dtype:
            problems.add("mismatch", None, (*at, k), f"{_describe(av)}, expected {_describe(ev)}")


def _compare_per_param(
    ppaths: list[KeyPath],
    e: TensorDictBase,
    a: TensorDictBase,
    at: KeyPath,
    problems: _Problems,
) -> None:
    """A tree with one leaf per param (a moment, step counts) against the params."""
    apaths = tree.paths(a)
    actual = dict(zip(apaths, tree.leaves(a), strict=True))
    pset = set(ppaths)
    bad = False
    for path in ppaths:
        if path not in actual:
            problems.add("missing", path, (*at, *path))
            bad = True
    for path in apaths:
        if path not in pset:
            problems.add("extra", path, (*at, *path))
            bad = True
    for path, want in zip(ppaths, tree.leaves(e), strict=True):
        got = actual.get(path)
        if got is not None and (got.shape != want.shape or got.dtype != want.dtype):
            problems.add(
                "mismatch", path, (*at, *path), f"{_describe(got)}, expected {_describe(want)}"
            )
            bad = True
    if not bad and apaths != ppaths:
        i = next(i for i, (x, y) in enumerate(zip(apaths, ppaths, strict=True)) if x != y)
        problems.add(
            "order",
            None,
            at,
            f"lists its leaves in another order than params.{problems.role} (position "
            f"{i}: {_fmt(apaths[i])!r} vs {_fmt(ppaths[i])!r}); the optimizer pairs them "
            "by position",
        )


def check_pair(
    a: TensorDictBase, b: TensorDictBase, a_at: KeyPath, b_at: KeyPath, *, who: str, tag: str
) -> None:
    """Raise ``StateError`` unless trees ``a`` and ``b`` have the same paths, shapes and dtypes.

    Remembered by identity like :func:`check_state` (``tag`` names the kind of pair).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> p = TensorDict({"w": torch.ones(2)}, [])
        >>> check_pair(p, p.clone(), ("params", "m"), ("ema", "m"), who="with_ema", tag="ema")
        >>> check_pair(p, TensorDict({"w": torch.ones(3)}, []), ("params", "m"), ("ema", "m"),
        ...            who="with_ema", tag="ema")
        Traceback (most recent call last):
        ...
        purestep.errors.StateError: with_ema: ema.m does not match params.m: ema.m.w is a torch.float32 tensor of shape (3,), but params.m.w is a torch.float32 tensor of shape (2,)...
    """
    if _known(a, b, tag):
        return
    ap, bp = tree.paths(a), tree.paths(b)
    problems: list[tuple[KeyPath, str]] = []
    if ap != bp:
        for path in ap:
            if path not in set(bp):
                problems.append(((*b_at, *path), f"{_fmt((*b_at, *path))} is missing"))
        for path in bp:
            if path not in set(ap):
                problems.append(
                    ((*b_at, *path), f"{_fmt((*b_at, *path))} has no {_fmt(a_at)} counterpart")
                )
        if not problems:
            problems.append((b_at, f"{_fmt(b_at)} lists its leaves in another order"))
    else:
        for path, x, y in zip(ap, tree.leaves(a), tree.leaves(b), strict=True):
            if x.shape != y.shape or x.dtype != y.dtype:
                problems.append(
                    (
                        (*b_at, *path),
                        f"{_fmt((*b_at, *path))} is {_describe(y)}, but "
                        f"{_fmt((*a_at, *path))} is {_describe(x)}",
                    )
                )
    if problems:
        listed = "; ".join(m for _, m in problems[:_MAX_LISTED])
        raise StateError(
            f"{who}: {_fmt(b_at)} does not match {_fmt(a_at)}: {listed}. Change them together "
            "(or drop the key and let step.prepare rebuild it)",
            path=problems[0][0],
        )
    _remember(a, b, tag)


_WRITTEN = (PARAMS, OPT_STATE, BUFFERS, EMA, EMA_BUFFERS, SKIP, STEP)
_DONATED = object()  # the cache tag of (params, opt_state) nodes that passed the donated check


def _check_sharing(state: TensorDictBase, who: str, *, top_only: bool = False) -> None:
    """Refuse leaves that share memory where a donated step writes one of them.

    Two written leaves that share memory would be updated twice; a written
    leaf that shares memory with one the step only reads or passes through
    (``rng``, user keys) would silently change it (``state["rng"]`` a view of
    ``state["step"]`` would advance with every ``step.add_(1)``), so donation
    would change the result. Leaves that are never written may share freely. ``top_only``: only the
    leaves directly under the state (``step``, ``rng``, user tensors), for a
    state whose subtrees passed before.
    """
    items: list[tuple[KeyPath, torch.Tensor]] = []
    for key in _keys(state):
        node = _child(state, key)
        if isinstance(node, torch.Tensor):
            items.append(((key,), node))
        elif isinstance(node, TensorDictBase) and not top_only:
            items.extend(
                ((key, *p), t) for p, t in zip(tree.paths(node), tree.leaves(node), strict=True)
            )
    shared = [(a, b) for a, b in shared_memory(items) if a[0] in _WRITTEN or b[0] in _WRITTEN]
    if shared:
        message = sharing_message(who, shared)
        kept = [p for pair in shared for p in pair if p[0] not in _WRITTEN]
        if kept:
            message += (
                f". {_fmt(kept[0])} is not written by the step, so a donated update of the "
                "leaf it shares would change it too"
            )
        raise StateError(message, path=shared[0][0])
