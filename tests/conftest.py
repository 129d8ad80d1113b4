"""Test configuration: hypothesis profiles, and the ``cuda`` marker's skip.

``CI=true`` selects the ``ci`` profile (derandomized: the same examples on every
run, so a CI run is reproducible); elsewhere ``dev`` explores new examples each
run. Pick one explicitly with ``HYPOTHESIS_PROFILE=dev|ci``.

Tests marked ``cuda`` run whenever ``torch.cuda.is_available()`` and are skipped
(with the reason) otherwise, so the default ``pytest`` runs them on a GPU machine.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the ``cuda``-marked tests when there is no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marker `cuda`)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
