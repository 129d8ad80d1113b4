"""Integration tests on real model libraries (the ``integration`` extra).

Every model is built from a tiny config with random weights: nothing is
downloaded (the Hugging Face hubs are switched offline before any of their
libraries is imported). A test module skips when its library is absent.

PyPI's torchvision wheels are CUDA builds. Next to a CPU build of torch their
compiled ops (``torchvision/_C.so``) do not load, and torchvision 0.28's
import then fails on ``register_fake("torchvision::nms")`` with "operator
torchvision::nms does not exist"; timm (and transformers, which imports
torchvision when it is installed) fail with it. :func:`_import_torchvision`
declares the two op schemas that import needs, only in that case, so the
pure-Python part of torchvision (all that timm uses to build models) imports;
calling those ops still raises.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator

import pytest
import torch

for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ[_var] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

_TORCHVISION_SCHEMAS: torch.library.Library | None = None


def _import_torchvision() -> None:
    global _TORCHVISION_SCHEMAS
    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision
    except RuntimeError as e:
        if "torchvision::nms does not exist" not in str(e):
            raise
    else:
        return
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    lib = torch.library.Library("torchvision", "FRAGMENT")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TORCHVISION_SCHEMAS = lib  # keep the definitions alive
    import torchvision  # noqa: F401


_import_torchvision()


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one intra-op thread (and robustly on a busy machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
