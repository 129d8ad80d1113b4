"""Collection rules for the whole repository (``pytest`` collects doctests from ``src/``).

``purestep._rng_triton`` holds Triton kernels and imports ``triton``, which CUDA
builds of torch ship and CPU builds do not: without it the module's doctests are
not collected (its kernels are tested by ``tests/test_rng_triton.py``).
"""

from __future__ import annotations

import importlib.util

collect_ignore: list[str] = []
if importlib.util.find_spec("triton") is None:
    collect_ignore.append("src/purestep/_rng_triton.py")
