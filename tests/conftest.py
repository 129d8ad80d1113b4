"""Test configuration: hypothesis profiles.

``CI=true`` selects the ``ci`` profile (derandomized: the same examples on every
run, so a CI run is reproducible); elsewhere ``dev`` explores new examples each
run. Pick one explicitly with ``HYPOTHESIS_PROFILE=dev|ci``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
