"""init_state: layout, detachment, and clear errors at the boundary."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from tensordict import TensorDict
from torch import nn

import purestep as ps
from purestep import optim, rng, testing, tree


def test_state_has_documented_keys_and_cpu_counters() -> None:
    """The state holds params, opt_state, rng and step; rng and step are int64 CPU scalars."""
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    state = ps.init_state({"student": net}, {"student": optim.adamw(1e-3)}, seed=7)
    assert set(state.keys()) == {"params", "opt_state", "rng", "step"}
    assert state["step"].dtype == torch.int64 and state["step"].device.type == "cpu"
    assert state["rng"].dtype == torch.int64 and state["rng"].device.type == "cpu"
    assert torch.equal(state["rng"], rng.key(7))
    assert int(state["step"]) == 0
    assert tree.paths(state["params", "student"]) == [
        ("0", "weight"),
        ("0", "bias"),
        ("2", "weight"),
        ("2", "bias"),
    ]


def test_params_are_detached_copies_of_module_weights() -> None:
    """Module params are copied: equal values, no autograd, no shared storage."""
    net = nn.Linear(2, 2)
    state = ps.init_state({"student": net}, {}, seed=0)
    w = state["params", "student", "weight"]
    assert torch.equal(w, net.weight)
    assert not w.requires_grad
    assert w.data_ptr() != net.weight.data_ptr()


def test_frozen_params_and_buffers_are_not_state() -> None:
    """Only requires_grad params become state; buffers and frozen params stay with the module."""
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    net[0].bias.requires_grad_(False)
    state = ps.init_state({"student": net}, {}, seed=0)
    assert ("0", "bias") not in tree.paths(state["params", "student"])
    assert ("1", "running_mean") not in tree.paths(state["params", "student"])
    assert ("0", "weight") in tree.paths(state["params", "student"])


@settings(max_examples=20, deadline=None)
@given(testing.param_trees(dtypes=(torch.float32, torch.bfloat16, torch.float64)))
def test_tensordict_params_round_trip_with_optimizer_state_shaped_like_params(
    params: TensorDict,
) -> None:
    """TensorDict params keep their structure; the optimizer's moments mirror it."""
    state = ps.init_state({"student": params}, {"student": optim.adam(1e-3)}, seed=0)
    testing.assert_trees_equal(state["params", "student"], params)
    assert tree.paths(state["opt_state", "student", "mu"]) == tree.paths(params)


def test_optimizer_for_unknown_role_is_an_error_naming_it() -> None:
    """An optimizer for a role without params names the role."""
    with pytest.raises(ValueError, match="critic"):
        ps.init_state({"student": nn.Linear(1, 1)}, {"critic": optim.sgd(0.1)}, seed=0)


def test_role_without_trainable_params_is_an_error() -> None:
    """A module whose params are all frozen cannot be a trainable role."""
    net = nn.Linear(1, 1).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        ps.init_state({"teacher": net}, {}, seed=0)


def test_non_floating_param_is_an_error_naming_the_key() -> None:
    """Integer leaves cannot be trained; the error names the key path."""
    params = TensorDict({"layer": {"w": torch.ones(2, dtype=torch.int64)}}, [])
    with pytest.raises(TypeError, match=r"layer\.w"):
        ps.init_state({"student": params}, {}, seed=0)


def test_dotted_leaf_key_is_an_error() -> None:
    """Dotted leaf keys would not round-trip through checkpoint flattening."""
    params = TensorDict({"fc.weight": torch.ones(2)}, [])
    with pytest.raises(ValueError, match=r"fc\.weight"):
        ps.init_state({"student": params}, {}, seed=0)


def test_non_transform_optimizer_is_a_type_error() -> None:
    """torch.optim objects are rejected with a pointer to purestep.optim."""
    net = nn.Linear(1, 1)
    with pytest.raises(TypeError, match="Transform"):
        ps.init_state({"student": net}, {"student": torch.optim.SGD(net.parameters(), 0.1)}, seed=0)  # type: ignore[dict-item]


def test_extra_is_stored_under_extra() -> None:
    """Method-owned tensors go under state['extra']."""
    state = ps.init_state({"s": nn.Linear(1, 1)}, {}, seed=0, extra={"n": torch.zeros(())})
    assert "n" in state["extra"].keys()
