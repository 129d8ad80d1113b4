"""``flow.adapt``: a diffusers-style model (timestep in [0, 1000], keyword conditions, an output
object) meets the flow contract, and samplers and methods use its scale without t_scale."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import purestep as ps
from purestep import export, optim, rng, testing
from purestep.methods import finetune, flow


class _Out:
    def __init__(self, sample: torch.Tensor) -> None:
        self.sample = sample


class DiffusersLike(nn.Module):
    """``forward(sample, timestep, class_labels=None) -> _Out(sample=...)``, timestep in [0, 1000]."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.lin = nn.Linear(3, 2)
        self.emb = nn.Embedding(4, 2)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(
        self, sample: torch.Tensor, timestep: torch.Tensor, class_labels: torch.Tensor
    ) -> _Out:
        h = torch.cat([sample, timestep[:, None] / 1000.0], 1)
        return _Out(torch.tanh(self.lin(h)) + self.emb(class_labels))


class FlowNet(nn.Module):
    """The same function, written to the flow contract by hand (the reference)."""

    def __init__(self, inner: DiffusersLike) -> None:
        super().__init__()
        self.model = inner

    def forward(self, x: torch.Tensor, t: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return self.model(x, t * 1000.0, class_labels=label).sample  # type: ignore[no-any-return]


def test_adapted_model_samples_like_the_hand_written_wrapper() -> None:
    """flow.sample on adapt(m, timestep_scale=1000, output="sample", cond_map=...) equals the
    sample of a hand-written wrapper, with no t_scale anywhere; with guidance too."""
    inner = DiffusersLike()
    adapted = flow.adapt(
        inner, timestep_scale=1000.0, output="sample", cond_map={"label": "class_labels"}
    )
    ref = FlowNet(inner)
    noise = rng.normal(rng.key(1), (5, 2))
    label = torch.tensor([0, 1, 2, 0, 1])
    for kw in ({}, {"null_cond": {"label": torch.full((5,), 3)}, "guidance_scale": 2.0}):
        got = flow.sample(
            adapted, None, noise, flow.timestep_schedule(4), cond={"label": label}, **kw
        )
        want = flow.sample(ref, None, noise, flow.timestep_schedule(4), cond={"label": label}, **kw)
        assert torch.equal(got, want)


def test_a_t_scale_on_top_of_the_adapters_scale_is_refused() -> None:
    """Scaling twice would silently give bad samples: predict_velocity refuses it by name."""
    adapted = flow.adapt(
        DiffusersLike(), timestep_scale=1000.0, output="sample", cond_map={"label": "class_labels"}
    )
    with pytest.raises(ValueError, match="scaled twice"):
        flow.sample(
            adapted,
            None,
            torch.zeros(2, 2),
            flow.timestep_schedule(2),
            cond={"label": torch.zeros(2, dtype=torch.long)},
            t_scale=1000.0,
        )


def test_finetune_trains_the_adapted_model_and_exports_into_the_wrapped_one() -> None:
    """finetune on the adapter: the state holds the weights under "model"; load_params writes them
    into the wrapped module (what save_pretrained saves); the property kit passes."""
    inner = DiffusersLike()
    adapted = flow.adapt(
        inner, timestep_scale=1000.0, output="sample", cond_map={"label": "class_labels"}
    )
    opt = optim.adam(1e-2)
    step = finetune.make_step(adapted, opt, finetune.FinetuneConfig(cond_keys=("label",)))
    state = finetune.init_state(adapted, opt, seed=0)
    g = torch.Generator().manual_seed(0)
    batch = TensorDict(
        {"x0": torch.randn(4, 2, generator=g), "label": torch.randint(0, 4, (4,), generator=g)}, [4]
    )
    testing.assert_pure(step, state, batch)
    state, _ = step(state, batch)
    trained = ps.variables(state, "student")
    assert set(trained.keys()) == {"model"}
    export.load_params(adapted, trained)
    testing.assert_trees_equal(export.module_variables(inner), trained["model"])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"timestep_scale": 0.0}, ValueError, "timestep_scale"),
        ({"timestep_scale": float("inf")}, ValueError, "timestep_scale"),
        ({"output": 3}, TypeError, "output"),
        ({"cond_map": {"label": 1}}, TypeError, "cond_map"),
    ],
)
def test_bad_adapter_arguments_are_refused(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        flow.adapt(DiffusersLike(), **kwargs)


def test_a_missing_output_attribute_is_named() -> None:
    adapted = flow.adapt(DiffusersLike(), output="pred", cond_map={"label": "class_labels"})
    with pytest.raises(AttributeError, match="'pred'"):
        adapted(torch.zeros(2, 2), torch.zeros(2), label=torch.zeros(2, dtype=torch.long))
