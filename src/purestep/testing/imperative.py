"""Prove that a purestep step trains a module exactly as the imperative loop it replaces.

:func:`assert_matches_imperative` runs two trainings of the same module from
the same initial weights over the same batches and compares their parameters
and buffers after every step:

* the imperative loop: ``zero_grad``, forward, ``backward``, ``optimizer.step()``
  with the ``torch.optim`` counterpart of the purestep optimizer
  (:func:`torch_optimizer_for`), on a deep copy of the module;
* the purestep step, built from the same loss (or given), on the module itself
  (a purestep step must leave the module's own tensors unchanged; that is checked too).

One loss function serves both: ``loss(forward, batch) -> scalar``, where
``forward(*args, **kwargs)`` runs the module. On the imperative side
``forward`` is the module; on the purestep side it is
``functools.partial(purestep.call, module, params[role])``.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from purestep import tree
from purestep._keys import BUFFERS, PARAMS
from purestep.optim import AdamHParams, SGDHParams, Transform
from purestep.state import init_state
from purestep.step import (
    Batch,
    as_batch,
    call,
    microbatch_sizes,
    train_step,
    value_and_grad,
    with_index,
)
from purestep.step import accumulate as accumulate_grads
from purestep.testing._compare import assert_trees_close, assert_trees_equal, snapshot

__all__ = ["ImperativeLoss", "assert_matches_imperative", "torch_optimizer_for"]

ImperativeLoss = Callable[[Callable[..., Any], TensorDictBase], torch.Tensor]
"""``loss(forward, batch) -> scalar``: ``forward(*args, **kwargs)`` runs the module."""

TorchOptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
StepFn = Callable[[TensorDictBase, Batch], tuple[TensorDictBase, TensorDictBase]]

_HALF = (torch.float16, torch.bfloat16)


def torch_optimizer_for(optimizer: Transform) -> TorchOptimizerFactory:
    """The ``torch.optim`` counterpart of a purestep optimizer, as a factory ``params -> Optimizer``.

    ``adamw`` becomes ``torch.optim.AdamW(fused=True)``, ``adam``
    ``torch.optim.Adam(fused=True)`` and ``sgd`` ``torch.optim.SGD(fused=True)``
    (``foreach=True`` for CPU fp16/bf16 params, as purestep falls back there),
    with the same hyperparameters. A learning-rate schedule is applied by
    setting each group's ``lr`` to ``schedule(count)`` before every
    ``optimizer.step()`` (the returned optimizer's ``step`` does that itself).

    Raises:
        ValueError: for transforms without a single ``torch.optim`` twin (``lion``,
            ``chain``, ``clip_by_global_norm``; ``muon``, whose twin is
            ``torch.optim.Muon`` plus ``AdamW`` split by ``use_muon(path, param)``,
            which a ``params -> Optimizer`` factory cannot ask): pass a factory of your own.

    Example:
        >>> from purestep import optim
        >>> make = torch_optimizer_for(optim.adamw(1e-3, weight_decay=0.1))
        >>> opt = make([nn.Parameter(torch.ones(2))])
        >>> type(opt).__name__, opt.defaults["weight_decay"], opt.defaults["fused"]
        ('AdamW', 0.1, True)
    """
    hp = optimizer.hparams
    if isinstance(hp, AdamHParams) and optimizer.name in ("adam", "adamw"):
        adam_hp = hp
        cls: type[torch.optim.Adam] | type[torch.optim.AdamW] = (
            torch.optim.AdamW if adam_hp.decoupled_weight_decay else torch.optim.Adam
        )

        def make_adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
            opt = cls(
                params,
                lr=_lr0(adam_hp.lr),
                betas=adam_hp.betas,
                eps=adam_hp.eps,
                weight_decay=adam_hp.weight_decay,
                amsgrad=adam_hp.amsgrad,
                fused=True,
            )
            return _scheduled(opt, adam_hp.lr)

        return make_adam
    if isinstance(hp, SGDHParams) and optimizer.name == "sgd":
        sgd_hp = hp

        def make_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
            half_cpu = any(p.device.type == "cpu" and p.dtype in _HALF for p in params)
            opt = torch.optim.SGD(
                params,
                lr=_lr0(sgd_hp.lr),
                momentum=sgd_hp.momentum,
                dampening=sgd_hp.dampening,
                weight_decay=sgd_hp.weight_decay,
                nesterov=sgd_hp.nesterov,
                fused=not half_cpu,
                foreach=half_cpu or None,
            )
            return _scheduled(opt, sgd_hp.lr)

        return make_sgd
    raise ValueError(
        f"torch_optimizer_for: no torch.optim counterpart is known for {optimizer.name!r}; "
        "pass torch_optimizer=lambda params: torch.optim.YourOptimizer(params, ...)"
    )


def _lr0(lr: Any) -> float:
    return float(lr(0)) if callable(lr) else float(lr)


def _scheduled(opt: torch.optim.Optimizer, lr: Any) -> torch.optim.Optimizer:
    """Make ``opt.step()`` set every group's lr to ``lr(count)`` first (count: steps taken)."""
    if not callable(lr):
        return opt
    plain_step = opt.step
    count = [0]

    def step(closure: Any = None) -> Any:
        for group in opt.param_groups:
            group["lr"] = float(lr(count[0]))
        count[0] += 1
        return plain_step(closure)

    opt.step = step  # type: ignore[method-assign]
    return opt


def _unwrap(module: nn.Module) -> nn.Module:
    """The module under a ``torch.compile`` wrapper (``OptimizedModule._orig_mod``)."""
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else module


def _persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` of the persistent buffers, deduplicated as ``named_buffers`` does."""
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for prefix, mod in module.named_modules():
        skip = mod._non_persistent_buffers_set
        for name, buf in mod._buffers.items():
            if buf is None or name in skip or id(buf) in seen:
                continue
            seen.add(id(buf))
            out.append((f"{prefix}.{name}" if prefix else name, buf))
    return out


def _variables(module: nn.Module) -> TensorDict:
    """The module's trainable params (and persistent buffers) as a state-shaped tree."""
    module = _unwrap(module)
    params = [(tuple(n.split(".")), p) for n, p in module.named_parameters() if p.requires_grad]
    out = TensorDict({PARAMS: tree.unflatten(params)}, batch_size=[])
    buffers = [(tuple(n.split(".")), b) for n, b in _persistent_buffers(module)]
    if buffers:
        out.set(BUFFERS, tree.unflatten(buffers))
    return snapshot(out)


def _state_variables(state: TensorDictBase, role: str, want_buffers: bool) -> TensorDict:
    keys = state.keys(include_nested=True)
    if (PARAMS, role) not in keys:
        raise AssertionError(
            f"assert_matches_imperative: the state has no params for role {role!r} "
            f"(roles: {list(state.get(PARAMS).keys()) if PARAMS in state.keys() else []})"
        )
    out = TensorDict({PARAMS: state.get((PARAMS, role))}, batch_size=[])
    if (BUFFERS, role) in keys:
        out.set(BUFFERS, state.get((BUFFERS, role)))
    elif want_buffers:
        raise AssertionError(
            f"assert_matches_imperative: the module has persistent buffers, but the state has "
            f"no ('buffers', {role!r}): purestep would not update, checkpoint or restore them"
        )
    return out


def _microbatches(batch: TensorDictBase, k: int) -> list[tuple[TensorDictBase, float]]:
    b = int(batch.batch_size[0])
    if k == 1:
        return [(batch, 1.0)]
    out, start = [], 0
    for n in microbatch_sizes(b, k):
        out.append((batch[start : start + n], n / b))
        start += n
    return out


def _scalar(value: Any, side: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise TypeError(
            f"assert_matches_imperative: loss(forward, batch) must return a scalar tensor on "
            f"the {side} side; got {type(value).__name__}"
            + (f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else "")
        )
    return value


def _imperative_run(
    model: nn.Module,
    loss: ImperativeLoss,
    make_opt: TorchOptimizerFactory,
    batches: Sequence[TensorDictBase],
    accumulate: int,
) -> list[TensorDict]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_opt(params)
    out = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        for mb, w in _microbatches(batch, accumulate):
            value = _scalar(loss(model, mb), "imperative")
            torch.autograd.backward(value * w if accumulate > 1 else value)
        opt.step()
        out.append(_variables(model))
    return out


def _build_step(
    model: nn.Module, loss: ImperativeLoss, optimizer: Transform, role: str, donate: bool, k: int
) -> StepFn:
    def loss_fn(
        params: TensorDictBase, batch: TensorDictBase, key: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        forward = functools.partial(call, model, params.get(role))
        return _scalar(loss(forward, batch), "purestep"), {}

    grad_fn = value_and_grad(loss_fn)
    if k > 1:
        grad_fn = accumulate_grads(grad_fn, k)
    return train_step(grad_fn, {role: optimizer}, donate=donate, grad_norm=False)


def assert_matches_imperative(
    model: nn.Module,
    loss: ImperativeLoss,
    optimizer: Transform,
    batches: Sequence[Batch],
    *,
    step: StepFn | None = None,
    state: TensorDictBase | None = None,
    torch_optimizer: TorchOptimizerFactory | None = None,
    donate: bool | Sequence[bool] = (False, True),
    accumulate: int = 1,
    role: str = "model",
    seed: int = 0,
    rtol: float = 0.0,
    atol: float = 0.0,
) -> None:
    """Assert that purestep trains ``model`` exactly as the imperative loop does.

    The imperative loop runs on a deep copy of ``model`` (made before anything
    else, so both sides start from the same weights and buffers)::

        opt = torch_optimizer([p for p in model.parameters() if p.requires_grad])
        for batch in batches:
            opt.zero_grad()
            loss(model, batch).backward()       # (loss(model, mb_i) * n_i / B) per microbatch
            opt.step()

    The purestep side runs ``step`` (default: ``train_step(value_and_grad(...))``
    over ``loss`` with ``forward = partial(purestep.call, model, params[role])``,
    ``accumulate(..., k)`` when ``accumulate > 1``, once per value in ``donate``)
    from ``state`` (default: ``init_state({role: model}, {role: optimizer}, seed=seed)``).
    After every step the role's params (and persistent buffers, e.g. BatchNorm
    statistics) must equal the imperative module's, bitwise unless ``rtol`` or
    ``atol`` is given; the initial state must equal the module. A step that does
    not donate (``step.donate is False``) must leave its input state unchanged,
    and afterwards the module's own tensors must be unchanged by the purestep runs.

    Both sides see the same batches: each is converted with
    :func:`purestep.step.as_batch` and gets ``"index"`` first, and microbatches
    are cut as :func:`purestep.accumulate` cuts them. Modules that draw from
    torch's global RNG (dropout) cannot match: use dropout 0 or ``model.eval()``.

    Args:
        model: the module (its train/eval mode is used as it is).
        loss: ``loss(forward, batch) -> scalar tensor``.
        optimizer: the purestep optimizer; its ``torch.optim`` twin comes from
            :func:`torch_optimizer_for` unless ``torch_optimizer`` is given.
        batches: one batch (dict or TensorDict) per step.
        step: your own purestep step over ``model`` (then ``donate`` does not apply).
        state: the initial state for ``step`` (it must hold ``model``'s weights).
        torch_optimizer: ``params -> torch.optim.Optimizer`` for the imperative side.
        donate: the ``donate`` flag(s) of the built step; each is checked.
        accumulate: microbatches per step (both sides).
        role: the role name of ``model`` in the state.
        seed: root PRNG seed of the default state.
        rtol: relative tolerance (0: bitwise).
        atol: absolute tolerance (0: bitwise).

    Raises:
        AssertionError: naming the step, the first diverging parameter or buffer
            path and the max abs/rel difference (or a missing/extra key).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from purestep import optim
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
        >>> g = torch.Generator().manual_seed(0)
        >>> batches = [{"x": torch.randn(8, 3, generator=g), "y": torch.randn(8, 1, generator=g)}
        ...            for _ in range(3)]
        >>> def loss(forward, batch):
        ...     return ((forward(batch["x"]) - batch["y"]) ** 2).mean()
        >>> assert_matches_imperative(net, loss, optim.adamw(1e-2), batches)
    """
    if not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate must be a positive int, got {accumulate!r}")
    if not batches:
        raise ValueError("assert_matches_imperative: batches is empty")
    donates = [donate] if isinstance(donate, bool) else list(donate)
    if not donates:
        raise ValueError("assert_matches_imperative: donate is empty")
    seq = [with_index(as_batch(b)) for b in batches]
    reference = copy.deepcopy(model)
    before = _variables(model)
    own = _own_tensors(model)
    make_opt = torch_optimizer if torch_optimizer is not None else torch_optimizer_for(optimizer)
    rng_before = torch.get_rng_state()
    expected = _imperative_run(reference, loss, make_opt, [snapshot(b) for b in seq], accumulate)
    hint = (
        ""
        if torch.equal(torch.get_rng_state(), rng_before)
        else " (note: the imperative loop drew from torch's global RNG, e.g. dropout; such "
        "draws differ between the two sides: use dropout 0 or model.eval() for this check)"
    )
    want_buffers = BUFFERS in before.keys()

    compare: Callable[..., None]
    if rtol == 0.0 and atol == 0.0:
        compare = assert_trees_equal
    else:
        compare = functools.partial(assert_trees_close, rtol=rtol, atol=atol)

    runs: list[tuple[str, StepFn]]
    if step is not None:
        runs = [("your step", step)]
    else:
        runs = [
            (f"donate={d}", _build_step(model, loss, optimizer, role, d, accumulate))
            for d in donates
        ]
    if state is None:
        state = init_state({role: model}, {role: optimizer}, seed=seed)
    for label, fn in runs:
        prep = getattr(fn, "prepare", None)
        s = snapshot(prep(state) if prep is not None else state)
        _check(compare, s, role, want_buffers, before, f"{label}, initial state", "")
        pure = getattr(fn, "donate", None) is False  # a step that promises not to donate
        for i, batch in enumerate(seq):
            keep = snapshot(s) if pure else None
            new, _ = fn(s, snapshot(batch))
            if keep is not None:
                assert_trees_equal(
                    s,
                    keep,
                    what=f"assert_matches_imperative ({label}, step {i}): the input state "
                    "of a donate=False step after the step (the step wrote into it)",
                )
            s = new
            _check(compare, s, role, want_buffers, expected[i], f"{label}, after step {i}", hint)
    assert_trees_equal(
        _own_tensors(model),
        own,
        what="assert_matches_imperative: the module's own tensors after the purestep runs "
        "(a purestep step changed them)",
    )


def _check(
    compare: Callable[..., None],
    state: TensorDictBase,
    role: str,
    want_buffers: bool,
    expected: TensorDict,
    where: str,
    hint: str,
) -> None:
    actual = _state_variables(state, role, want_buffers)
    if not want_buffers and BUFFERS in actual.keys():
        del actual[BUFFERS]
    try:
        compare(
            actual,
            expected,
            what=f"assert_matches_imperative ({where}): purestep vs the imperative loop",
        )
    except AssertionError as e:  # the hint goes on the first line, before the list of leaves
        first, nl, rest = str(e).partition("\n")
        raise AssertionError(f"{first}{hint}{nl}{rest}") from None


def _own_tensors(model: nn.Module) -> TensorDict:
    items = [(tuple(k.split(".")), v) for k, v in _unwrap(model).state_dict(keep_vars=True).items()]
    tensors = [(k, v.detach()) for k, v in items if isinstance(v, torch.Tensor)]
    return snapshot(tree.unflatten(tensors))
