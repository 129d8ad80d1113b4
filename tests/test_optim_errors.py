"""Bad input fails at the boundary, naming the field, key path and shapes."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from purestep import optim
from purestep.optim import schedules

ALL: dict[str, Callable[[], optim.Transform]] = {
    "adam": lambda: optim.adam(lr=0.1),
    "adamw": lambda: optim.adamw(lr=0.1),
    "sgd": lambda: optim.sgd(lr=0.1, momentum=0.9),
    "lion": lambda: optim.lion(lr=0.1),
    "clip": lambda: optim.clip_by_global_norm(1.0),
    "scale": lambda: optim.scale_by_schedule(-0.1),
    "chain": lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(lr=0.1)),
}


def params() -> TensorDict:
    return TensorDict({"enc": {"fc": {"weight": torch.ones(3, 2)}}, "head": torch.ones(4)}, [])


@pytest.mark.parametrize("name", sorted(ALL))
@pytest.mark.parametrize("method", ["step", "update"])
def test_grads_with_wrong_shape_name_path_and_both_shapes(name: str, method: str) -> None:
    """A grad whose shape differs from its param fails with the key path and both shapes."""
    opt = ALL[name]()
    p = params()
    g = TensorDict({"enc": {"fc": {"weight": torch.ones(2, 3)}}, "head": torch.ones(4)}, [])
    with pytest.raises(ValueError, match=re.escape("enc.fc.weight")) as info:
        getattr(opt, method)(g, opt.init(p), p)
    assert "(2, 3)" in str(info.value) and "(3, 2)" in str(info.value)


@pytest.mark.parametrize("name", sorted(ALL))
@pytest.mark.parametrize("method", ["step", "update"])
def test_grads_with_missing_or_extra_keys_name_them(name: str, method: str) -> None:
    """Missing and unexpected grad keys are named by key path."""
    opt = ALL[name]()
    p = params()
    g = TensorDict({"enc": {"fc": {"bias": torch.ones(3)}}, "head": torch.ones(4)}, [])
    with pytest.raises(ValueError, match=r"missing enc\.fc\.weight.*unexpected enc\.fc\.bias"):
        getattr(opt, method)(g, opt.init(p), p)


def test_update_without_params_checks_grads_against_state() -> None:
    """update(grads, state) with no params still names a mismatching key path."""
    opt = optim.adam(lr=0.1)
    state = opt.init(params())
    g = TensorDict({"enc": {"fc": {"weight": torch.ones(3, 2)}}, "head": torch.ones(5)}, [])
    with pytest.raises(ValueError, match=r"head.*\(5,\).*\(4,\)"):
        opt.update(g, state)


@pytest.mark.parametrize(
    ("make", "kwargs", "field"),
    [
        (optim.adam, {"lr": -1.0}, "lr"),
        (optim.adamw, {"lr": -1e-3}, "lr"),
        (optim.adamw, {"lr": float("nan")}, "lr"),
        (optim.adamw, {"betas": (1.0, 0.999)}, r"betas\[0\]"),
        (optim.adamw, {"betas": (0.9, -0.1)}, r"betas\[1\]"),
        (optim.adam, {"betas": (0.9,)}, "betas"),
        (optim.adamw, {"eps": 0.0}, "eps"),
        (optim.adam, {"eps": -1e-8}, "eps"),
        (optim.adamw, {"weight_decay": -0.1}, "weight_decay"),
        (optim.sgd, {"momentum": -0.5}, "momentum"),
        (optim.sgd, {"dampening": 1.5}, "dampening"),
        (optim.sgd, {"weight_decay": -1.0}, "weight_decay"),
        (optim.sgd, {"nesterov": True}, "nesterov"),
        (optim.sgd, {"nesterov": True, "momentum": 0.9, "dampening": 0.1}, "nesterov"),
        (optim.lion, {"betas": (0.9, 1.0)}, r"betas\[1\]"),
        (optim.lion, {"lr": -1.0}, "lr"),
        (optim.clip_by_global_norm, {"max_norm": 0.0}, "max_norm"),
        (optim.adamw, {"lr": schedules.linear(-1.0, 0.0, 10)}, "lr"),
    ],
)
def test_bad_hyperparameters_fail_at_construction_naming_the_field(
    make: Callable[..., optim.Transform], kwargs: dict[str, Any], field: str
) -> None:
    """Out-of-range hyperparameters raise ValueError whose message starts with the field."""
    with pytest.raises(ValueError, match=rf"^{field}"):
        make(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{"lr": "0.1"}, {"amsgrad": 1}, {"eps": None}],
    ids=["lr-str", "amsgrad-int", "eps-none"],
)
def test_wrong_types_fail_at_construction(kwargs: dict[str, Any]) -> None:
    """Non-numeric or non-bool hyperparameters raise TypeError naming the field."""
    with pytest.raises(TypeError, match=next(iter(kwargs))):
        optim.adam(**kwargs)


def test_schedule_lr_is_accepted_and_zero_lr_allowed() -> None:
    """A schedule (or lr=0) is a valid lr; hparams keep it for inspection."""
    sched = schedules.cosine_decay(1e-3, 100)
    assert optim.adamw(lr=sched).hparams.lr is sched
    assert optim.sgd(lr=0.0).hparams.lr == 0.0


def test_non_floating_params_fail_at_init_naming_the_path() -> None:
    """Integer params cannot be optimized: init names the offending leaf."""
    p = TensorDict({"a": {"steps": torch.zeros(2, dtype=torch.int64)}}, [])
    with pytest.raises(TypeError, match=r"a\.steps.*int64"):
        optim.adamw().init(p)


def test_update_with_weight_decay_needs_params() -> None:
    """Weight decay needs params; update without them says so."""
    opt = optim.adamw(lr=0.1, weight_decay=0.1)
    p = params()
    with pytest.raises(ValueError, match="needs params"):
        opt.update(p, opt.init(p))
