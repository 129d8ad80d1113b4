"""Test-id helper: parameter ids that every pytest session can address by name."""

from __future__ import annotations

import re

_UNSAFE_ID = re.compile(r"[^\w.=+-]+")


def safe_id(text: str) -> str:
    """``text`` as a test-id part: runs of anything but word characters and ``.=+-`` become ``_``.

    Example: ``safe_id(r"betas\\[0\\]") == "betas_0"``.
    """
    return _UNSAFE_ID.sub("_", text).strip("_") or "_"
