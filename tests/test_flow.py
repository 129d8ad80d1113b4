"""Properties of the rectified-flow maths in ``purestep.methods.flow``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torch import nn

from purestep import rng
from purestep.methods import flow

FAST = settings(max_examples=25, deadline=None)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny models run fastest on one intra-op thread (and robustly on a busy machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _randn(seed: int, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


shapes = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)


@FAST
@given(seed=st.integers(0, 2**31 - 1), shape=shapes, t_lo=st.floats(0.0, 1.0))
def test_x0_and_eps_recovered_from_interpolation_and_velocity(
    seed: int, shape: tuple[int, ...], t_lo: float
) -> None:
    """x0_from_velocity(interpolate(x0, eps, t), t, eps - x0) == x0, and likewise for eps."""
    b = shape[0]
    x0, eps = _randn(seed, *shape), _randn(seed + 1, *shape)
    t = t_lo + (1 - t_lo) * torch.rand(
        b, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    x_t = flow.interpolate(x0, eps, t)
    v = flow.velocity_target(x0, eps)
    torch.testing.assert_close(flow.x0_from_velocity(x_t, t, v), x0)
    torch.testing.assert_close(flow.eps_from_velocity(x_t, t, v), eps)
    ts = t.clamp_min(0.05)
    x_ts = flow.interpolate(x0, eps, ts)
    torch.testing.assert_close(flow.eps_from_x0(x_ts, x0, ts), eps)
    torch.testing.assert_close(flow.velocity_from_x0(x_ts, x0, ts), v)


def test_interpolation_endpoints_are_data_and_noise() -> None:
    """t = 0 gives x0 and t = 1 gives eps exactly."""
    x0, eps = _randn(0, 3, 2), _randn(1, 3, 2)
    assert torch.equal(flow.interpolate(x0, eps, torch.zeros(3, dtype=torch.float64)), x0)
    assert torch.equal(flow.interpolate(x0, eps, torch.ones(3, dtype=torch.float64)), eps)


def test_eps_from_x0_is_finite_at_t_zero() -> None:
    """The t = 0 guard keeps eps_from_x0 and velocity_from_x0 finite."""
    x0 = _randn(0, 2, 3)
    t = torch.zeros(2, dtype=torch.float64)
    assert torch.isfinite(flow.eps_from_x0(x0, x0, t)).all()
    assert torch.isfinite(flow.velocity_from_x0(x0 + 1, x0, t)).all()


def test_timestep_with_wrong_batch_raises() -> None:
    """A [B'] timestep with B' != B is rejected with both shapes in the message."""
    with pytest.raises(ValueError, match=r"shape \[B\]"):
        flow.interpolate(torch.zeros(3, 2), torch.zeros(3, 2), torch.zeros(2))


@FAST
@given(shift=st.floats(0.05, 20.0), seed=st.integers(0, 1000))
def test_shift_is_monotone_with_fixed_endpoints(shift: float, seed: int) -> None:
    """shift_timesteps is increasing in t, maps [0, 1] into itself and fixes 0 and 1."""
    t = torch.sort(
        torch.rand(64, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ).values
    s = flow.shift_timesteps(t, shift)
    assert bool((s[1:] >= s[:-1]).all())
    assert bool(((s >= 0) & (s <= 1)).all())
    ends = flow.shift_timesteps(torch.tensor([0.0, 1.0], dtype=torch.float64), shift)
    torch.testing.assert_close(ends, torch.tensor([0.0, 1.0], dtype=torch.float64))


def test_shift_above_one_moves_timesteps_towards_noise() -> None:
    """shift > 1 raises every interior timestep; shift = 1 is the identity."""
    t = torch.linspace(0.05, 0.95, 19, dtype=torch.float64)
    assert bool((flow.shift_timesteps(t, 3.0) > t).all())
    assert torch.equal(flow.shift_timesteps(t, 1.0), t)
    with pytest.raises(ValueError, match="shift"):
        flow.shift_timesteps(t, 0.0)


@FAST
@given(
    kind=st.sampled_from(["uniform", "logit_normal"]),
    b=st.integers(2, 16),
    cut=st.integers(1, 15),
    shift=st.floats(0.5, 4.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_sample_timesteps_are_per_sample(
    kind: str, b: int, cut: int, shift: float, seed: int
) -> None:
    """A sample's timestep depends only on (key, index[i]): sub-batches draw the same values."""
    cut = min(cut, b - 1)
    key = rng.key(seed)
    idx = torch.arange(100, 100 + b)
    full = flow.sample_timesteps(key, b, kind=kind, shift=shift, index=idx)
    a = flow.sample_timesteps(key, cut, kind=kind, shift=shift, index=idx[:cut])
    c = flow.sample_timesteps(key, b - cut, kind=kind, shift=shift, index=idx[cut:])
    assert torch.equal(torch.cat([a, c]), full)


@FAST
@given(
    kind=st.sampled_from(["uniform", "logit_normal"]),
    lo=st.floats(0.0, 1.0),
    width=st.floats(0.0, 1.0),
    shift=st.floats(0.2, 5.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_sample_timesteps_stay_in_shifted_range(
    kind: str, lo: float, width: float, shift: float, seed: int
) -> None:
    """Timesteps lie in [shift(low), shift(high)], inside [0, 1]."""
    hi = min(1.0, lo + width)
    t = flow.sample_timesteps(
        rng.key(seed),
        256,
        kind=kind,
        low=lo,
        high=hi,
        shift=shift,
        dtype=torch.float64,
    )
    bounds = flow.shift_timesteps(torch.tensor([lo, hi], dtype=torch.float64), shift)
    assert bool((t >= bounds[0] - 1e-12).all()) and bool((t <= bounds[1] + 1e-12).all())


def test_uniform_timesteps_cover_the_interval() -> None:
    """Uniform draws have mean ~1/2 and logit-normal(0, 1) draws concentrate around 1/2."""
    u = flow.sample_timesteps(rng.key(0), 4096)
    ln = flow.sample_timesteps(rng.key(0), 4096, kind="logit_normal")
    assert abs(float(u.mean()) - 0.5) < 0.03
    assert float(u.min()) < 0.01 and float(u.max()) > 0.99
    assert abs(float(ln.mean()) - 0.5) < 0.03 and float(ln.std()) < float(u.std())


def test_timestep_dist_validators_name_the_field() -> None:
    """Bad TimestepDist fields fail at construction with the field's name."""
    with pytest.raises(ValueError, match="high"):
        flow.TimestepDist(high=1.5)
    with pytest.raises(ValueError, match="shift"):
        flow.TimestepDist(shift=-1.0)
    with pytest.raises(ValueError, match="low"):
        flow.TimestepDist(low=0.9, high=0.1)


@pytest.mark.parametrize(("n", "shift"), [(1, 1.0), (4, 1.0), (7, 3.0), (1, 1 / 3)])
def test_timestep_schedule_runs_from_one_to_zero(n: int, shift: float) -> None:
    """The schedule has n + 1 strictly decreasing values from exactly 1 to exactly 0."""
    s = flow.timestep_schedule(n, shift=shift)
    assert s.shape == (n + 1,)
    assert float(s[0]) == 1.0 and float(s[-1]) == 0.0
    assert bool((s[1:] < s[:-1]).all())


@FAST
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 6))
def test_euler_is_exact_for_constant_velocity(seed: int, n: int) -> None:
    """With v = c, any step list from 1 to 0 gives noise - c (one step is exact)."""
    noise, c = _randn(seed, 3, 2), _randn(seed + 1, 1, 2)
    x = flow.euler_sample(lambda x, t: c.expand_as(x), noise, flow.timestep_schedule(n))
    torch.testing.assert_close(x, noise - c)


@FAST
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 8), shift=st.floats(0.3, 4.0))
def test_euler_is_exact_on_straight_flow_paths(seed: int, n: int, shift: float) -> None:
    """For a point mass at a, v(x, t) = (x - a) / t has straight paths: Euler lands on a."""
    noise, a = _randn(seed, 4, 3), _randn(seed + 1, 1, 3)

    def v(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return (x - a) / t[:, None]

    x = flow.euler_sample(v, noise, flow.timestep_schedule(n, shift=shift))
    torch.testing.assert_close(x, a.expand_as(x))


def test_euler_trajectory_and_grad_mode() -> None:
    """The trajectory stacks every state (first = noise, last = result); no graph by default."""
    w = torch.ones(2, requires_grad=True)
    noise = torch.ones(3, 2)
    x, traj = flow.euler_sample(lambda x, t: x * w, noise, [1.0, 0.5, 0.0], return_trajectory=True)
    assert traj.shape == (3, 3, 2)
    assert torch.equal(traj[0], noise) and torch.equal(traj[-1], x)
    assert not x.requires_grad
    y = flow.euler_sample(lambda x, t: x * w, noise, [1.0, 0.0], enable_grad=True)
    assert isinstance(y, torch.Tensor) and y.requires_grad


def test_euler_rejects_bad_step_lists() -> None:
    """Steps must be strictly decreasing, in [0, 1], at least two."""
    for steps in ([1.0], [0.0, 1.0], [1.0, 1.0, 0.0], [1.5, 0.0]):
        with pytest.raises(ValueError, match="steps"):
            flow.euler_sample(lambda x, t: x, torch.zeros(1, 1), steps)


@FAST
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(-3.0, 8.0))
def test_cfg_interpolates_and_extrapolates(seed: int, scale: float) -> None:
    """cfg is affine in scale: 0 -> uncond, 1 -> cond, and cfg(u, c, s) - u == s (c - u)."""
    u, c = _randn(seed, 5), _randn(seed + 1, 5)
    assert torch.equal(flow.cfg(u, c, 0.0), u)
    torch.testing.assert_close(flow.cfg(u, c, 1.0), c)
    torch.testing.assert_close(flow.cfg(u, c, scale) - u, scale * (c - u))


class _CondNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.lin = nn.Linear(3, 2, dtype=torch.float64)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(2, 3, generator=g, dtype=torch.float64))
        self.emb = nn.Embedding(4, 2, dtype=torch.float64)

    def forward(self, x: torch.Tensor, t: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.cat([x, t[:, None]], 1)) + self.emb(label)  # type: ignore[no-any-return]


def test_guided_velocity_equals_cfg_of_two_calls() -> None:
    """The batched guided velocity equals cfg of separate null and conditional calls."""
    net = _CondNet()
    x, t = (
        _randn(0, 5, 2),
        torch.rand(5, generator=torch.Generator().manual_seed(1), dtype=torch.float64),
    )
    cond = {"label": torch.tensor([0, 1, 2, 1, 0])}
    null = flow.null_condition(cond, {"label": 3})
    assert null["label"].tolist() == [3] * 5
    guided = flow.guided_velocity(net, None, x, t, cond, null, 2.5)
    ref = flow.cfg(net(x, t, **null), net(x, t, **cond), 2.5)
    torch.testing.assert_close(guided, ref)
    plain = flow.guided_velocity(net, None, x, t, cond, null, 1.0)
    torch.testing.assert_close(plain, net(x, t, **cond))


def test_predict_velocity_uses_given_params_and_restores_module() -> None:
    """With params the module runs on them and keeps its own parameters afterwards."""
    net = _CondNet()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    params = flow.frozen_params(net).apply(torch.zeros_like)
    x, t = _randn(0, 2, 2), torch.zeros(2, dtype=torch.float64)
    v = flow.predict_velocity(net, params, x, t, {"label": torch.tensor([1, 2])})
    assert torch.equal(v, torch.zeros_like(v))
    for k, val in net.state_dict().items():
        assert torch.equal(val, before[k])


@FAST
@given(p=st.floats(0.0, 1.0), seed=st.integers(0, 2**31 - 1), cut=st.integers(1, 7))
def test_condition_dropout_is_per_sample(p: float, seed: int, cut: int) -> None:
    """Which samples drop their condition depends only on (key, index[i])."""
    key = rng.key(seed)
    labels = torch.arange(8) % 3
    idx = torch.arange(20, 28)
    full = flow.condition_dropout(key, {"label": labels}, {"label": 9}, p, index=idx)["label"]
    parts = [
        flow.condition_dropout(key, {"label": labels[s]}, {"label": 9}, p, index=idx[s])["label"]
        for s in (slice(0, cut), slice(cut, 8))
    ]
    assert torch.equal(torch.cat(parts), full)
    assert bool(((full == labels) | (full == 9)).all())


def test_condition_dropout_extremes() -> None:
    """p = 0 keeps every condition, p = 1 replaces all by the null value."""
    cond = {"label": torch.tensor([1, 2, 3]), "emb": torch.ones(3, 2)}
    null = {"label": 0, "emb": torch.zeros(2)}
    idx = torch.arange(3)
    kept = flow.condition_dropout(rng.key(0), cond, null, 0.0, index=idx)
    assert torch.equal(kept["label"], cond["label"]) and torch.equal(kept["emb"], cond["emb"])
    dropped = flow.condition_dropout(rng.key(0), cond, null, 1.0, index=idx)
    assert dropped["label"].tolist() == [0, 0, 0] and float(dropped["emb"].abs().sum()) == 0.0


@FAST
@given(seed=st.integers(0, 2**31 - 1))
def test_renoise_one_step_equals_euler(seed: int) -> None:
    """With steps [1, 0] the re-noising sampler is one Euler step: x0 = x_1 - v."""
    net = _CondNet()
    noise = _randn(seed, 4, 2)
    label = {"label": torch.tensor([0, 1, 2, 3])}

    def v(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return net(x, t, **label)  # type: ignore[no-any-return]

    a = flow.renoise_sample(v, noise, [1.0, 0.0], key=rng.key(seed))
    b = flow.euler_sample(v, noise, [1.0, 0.0])
    assert torch.equal(a, b)


@FAST
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 6), cut=st.integers(1, 5))
def test_renoise_sampler_is_exact_and_per_sample(seed: int, n: int, cut: int) -> None:
    """A student that always predicts x0 = a ends at a; its states depend only on (key, index[i])."""
    a = _randn(seed, 1, 3)
    noise = _randn(seed + 1, 6, 3)

    def v(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return (x - a) / t[:, None]

    key, idx = rng.key(seed), torch.arange(10, 16)
    steps = flow.timestep_schedule(n)
    x, traj = flow.renoise_sample(v, noise, steps, key=key, index=idx, return_trajectory=True)
    torch.testing.assert_close(x, a.expand_as(x))
    _, t1 = flow.renoise_sample(
        v, noise[:cut], steps, key=key, index=idx[:cut], return_trajectory=True
    )
    _, t2 = flow.renoise_sample(
        v, noise[cut:], steps, key=key, index=idx[cut:], return_trajectory=True
    )
    torch.testing.assert_close(torch.cat([t1, t2], dim=1), traj, rtol=0, atol=1e-12)


def test_default_sample_ids_and_draws_live_on_the_batch_device() -> None:
    """A batch without ids gets arange(B) on its own device (meta standing in for CUDA), so
    timesteps and noise drawn with those ids land there too, from a CPU key."""
    batch = TensorDict({"x0": torch.zeros(4, 3, device="meta")}, [4])
    idx = flow.batch_index(batch)
    assert idx.device.type == "meta" and idx.shape == (4,)
    assert flow.sample_timesteps(rng.key(0), 4, index=idx).device.type == "meta"
    assert flow.noise_like(rng.key(0), batch["x0"], idx).device.type == "meta"
    x = flow.renoise_sample(
        lambda x, t: x, torch.zeros(4, 3, device="meta"), [1.0, 0.5, 0.0], key=rng.key(0)
    )
    assert x.device.type == "meta"
