"""From a state to DCP's flat ``{"a.b.c": tensor}`` dict and back: checks and messages.

Everything here raises before anything is written or loaded: keys that would
not round-trip, leaves that are not plain tensors (never silently dropped),
metadata that is not JSON, and a ``like`` state that does not match a checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase

from purestep._keys import STEP
from purestep.distributed._ckpt_errors import CheckpointMismatchError, CheckpointStateError
from purestep.distributed._ckpt_paths import _RANK_PREFIX

__all__ = ["describe", "dtype_name", "flatten", "json_metadata", "mismatch", "step_of"]


def _unsupported(t: torch.Tensor) -> str | None:
    if t.is_nested:
        return "a nested tensor"
    if t.layout != torch.strided:
        return f"layout {t.layout}"
    if t.is_quantized:
        return "a quantized tensor"
    if t.device.type == "meta":
        return "on the meta device (no data)"
    return None


def flatten(td: TensorDictBase, what: str, prefix: str = "") -> dict[str, torch.Tensor]:
    """``{"a.b.c": tensor}`` in leaf order; one :class:`CheckpointStateError` names every bad key.

    Example:
        >>> from tensordict import TensorDict
        >>> flatten(TensorDict({"a": {"b": torch.ones(1)}}, []), "state")
        {'a.b': tensor([1.])}
    """
    out: dict[str, torch.Tensor] = {}
    dotted: list[str] = []
    reserved: list[str] = []
    not_tensor: list[str] = []
    unsupported: list[str] = []
    for key, value in td.items(include_nested=True, leaves_only=True):
        parts = (key,) if isinstance(key, str) else tuple(key)
        name = ".".join(parts)
        if any("." in part for part in parts):
            dotted.append(repr(parts))
        elif not prefix and parts[0].startswith(_RANK_PREFIX):
            reserved.append(name)
        elif not isinstance(value, torch.Tensor):
            not_tensor.append(f"{name} ({type(value).__name__})")
        elif (why := _unsupported(value)) is not None:
            unsupported.append(f"{name} ({why})")
        else:
            out[prefix + name] = value
    for key, value in td.non_tensor_items(include_nested=True):
        parts = (key,) if isinstance(key, str) else tuple(key)
        data = getattr(value, "data", value)
        not_tensor.append(f"{'.'.join(parts)} (non-tensor data: {type(data).__name__})")
    problems = []
    if dotted:
        problems.append(
            "keys containing '.' (checkpoints join nested keys with '.', so these would not "
            "round-trip; nest them instead): " + ", ".join(dotted)
        )
    if reserved:
        problems.append(
            f"top-level keys starting with {_RANK_PREFIX!r} are reserved for per_rank values: "
            + ", ".join(reserved)
        )
    if not_tensor:
        problems.append(
            "non-tensor leaves (a checkpoint holds tensors only; store numbers as 0-dim "
            "tensors and other values in save(metadata=...)): " + ", ".join(not_tensor)
        )
    if unsupported:
        problems.append("unsupported tensors: " + ", ".join(unsupported))
    if problems:
        raise CheckpointStateError(f"cannot checkpoint {what}: " + "; ".join(problems))
    return out


def json_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``metadata`` as a dict after checking it is JSON-serialisable (else :class:`CheckpointStateError`).

    Example:
        >>> json_metadata({"a": 1})
        {'a': 1}
    """
    if metadata is None:
        return None
    try:
        out = dict(metadata)
        json.dumps(out)
    except (TypeError, ValueError) as e:
        raise CheckpointStateError(f"metadata is not JSON-serialisable: {e}") from e
    return out


def dtype_name(dtype: torch.dtype) -> str:
    """``'float32'`` for ``torch.float32``.

    Example:
        >>> dtype_name(torch.bfloat16)
        'bfloat16'
    """
    return str(dtype).removeprefix("torch.")


def describe(flat: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Every key's global shape and dtype name, as ``metadata.json`` records them.

    Example:
        >>> describe({"w": torch.zeros(2, 3)})
        {'w': {'shape': [2, 3], 'dtype': 'float32'}}
    """
    return {k: {"shape": list(v.shape), "dtype": dtype_name(v.dtype)} for k, v in flat.items()}


def mismatch(
    path: Path, expected: Mapping[str, Any], found: Mapping[str, dict[str, Any]], what: str
) -> CheckpointMismatchError | None:
    """One error listing every missing, unexpected and mis-shaped key, or ``None``.

    Example:
        >>> mismatch(Path("/c"), {"w": {"shape": [2], "dtype": "float32"}}, {}, "state").key
        'w'
    """
    missing = [k for k in found if k not in expected]
    unexpected = [k for k in expected if k not in found]
    wrong = []
    for k, f in found.items():
        e = expected.get(k)
        if e is not None and (list(e["shape"]) != f["shape"] or e["dtype"] != f["dtype"]):
            wrong.append(
                f"{k}: checkpoint has {tuple(e['shape'])} {e['dtype']}, "
                f"like has {tuple(f['shape'])} {f['dtype']}"
            )
    if not (missing or unexpected or wrong):
        return None
    lines = [f"checkpoint {path} does not match `like` ({what}):"]
    if missing:
        lines.append("  missing from the checkpoint (in like only): " + ", ".join(missing))
    if unexpected:
        lines.append("  unexpected in the checkpoint (not in like): " + ", ".join(unexpected))
    if wrong:
        lines.append("  mismatched shape or dtype: " + "; ".join(wrong))
    first = (missing + unexpected + [w.split(":")[0] for w in wrong])[0]
    return CheckpointMismatchError("\n".join(lines), path=path, key=first)


def step_of(state: TensorDictBase) -> int | None:
    """``int(state["step"])`` when it is an integer scalar, else ``None``.

    Example:
        >>> from tensordict import TensorDict
        >>> step_of(TensorDict({"step": torch.tensor(4)}, []))
        4
    """
    s = state.get(STEP, None)
    if isinstance(s, torch.Tensor) and s.numel() == 1 and not s.dtype.is_floating_point:
        return int(s.item())
    return None
