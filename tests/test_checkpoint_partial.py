"""Partial loads: ``checkpoint.load(path, keys=..., strict=False)`` read a subtree, verified."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from purestep import checkpoint as ckpt
from purestep import testing


def _state(seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return TensorDict(
        {
            "params": {"student": {"w": r(3, 2), "b": r(2)}, "critic": {"w": r(4)}},
            "ema": {"student": {"w": r(3, 2), "b": r(2)}},
            "buffers": {"student": {"n": torch.tensor(5)}},
            "opt_state": {"student": {"mu": {"w": r(3, 2), "b": r(2)}}},
            "step": torch.tensor(7),
            "rng": torch.tensor(11),
        },
        [],
    )


def _flip_byte(path: Path, key: str) -> None:
    """Damage one byte of ``key``'s record (its last data byte)."""
    md = json.loads((path / ckpt.METADATA_FILE).read_text())
    (rec,) = [r for r in md["integrity"]["records"] if r["key"] == key]
    f = path / rec["file"]
    data = bytearray(f.read_bytes())
    data[rec["offset"] + rec["length"] - 1] ^= 0xFF
    f.write_bytes(bytes(data))


@settings(max_examples=10, deadline=None)
@given(
    prefixes=st.lists(
        st.sampled_from(["ema.student", "params", "params.critic", "buffers", "step"]),
        min_size=1,
        max_size=3,
        unique=True,
    ),
    seed=st.integers(0, 100),
)
def test_partial_load_returns_exactly_the_selected_subtrees(
    tmp_path_factory: pytest.TempPathFactory, prefixes: list[str], seed: int
) -> None:
    """load(keys=P) without like == the saved state restricted to the keys under P (bitwise)."""
    state = _state(seed)
    path = tmp_path_factory.mktemp("c") / "ckpt"
    ckpt.save(state, path)
    out = ckpt.load(path, keys=prefixes)
    want = {
        k: v
        for k, v in state.flatten_keys(".").items()
        if any(k == p or k.startswith(p + ".") for p in prefixes)
    }
    assert sorted(out.flatten_keys(".").keys()) == sorted(want)
    for k, v in want.items():
        assert (
            torch.equal(out.flatten_keys(".")[k], v) and out.flatten_keys(".")[k].dtype == v.dtype
        )


def test_partial_load_into_a_like_and_strict_false(tmp_path: Path) -> None:
    """keys= with a like of just that subtree; strict=False loads like's keys and ignores the rest."""
    state = _state()
    ckpt.save(state, tmp_path / "c")
    like = TensorDict({"ema": {"student": state["ema", "student"].apply(torch.zeros_like)}}, [])
    out = ckpt.load(tmp_path / "c", like=like, keys=[("ema", "student")])
    testing.assert_trees_equal(out["ema"], state["ema"])
    out = ckpt.load(tmp_path / "c", like=like, strict=False)
    testing.assert_trees_equal(out["ema"], state["ema"])
    assert torch.equal(like["ema", "student", "w"], torch.zeros(3, 2))  # like untouched
    with pytest.raises(ckpt.CheckpointMismatchError, match="unexpected in the checkpoint"):
        ckpt.load(tmp_path / "c", like=like)  # strict by default: every other key is named
    bad = TensorDict({"ema": {"student": {"w": torch.zeros(3, 3)}}}, [])
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"ema.student.w"):
        ckpt.load(tmp_path / "c", like=bad, strict=False)
    missing = TensorDict({"ema": {"critic": {"w": torch.zeros(4)}}}, [])
    with pytest.raises(ckpt.CheckpointMismatchError, match="missing from the checkpoint"):
        ckpt.load(tmp_path / "c", like=missing, strict=False)
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"'ema\.teacher'"):
        ckpt.load(tmp_path / "c", keys=["ema.teacher"])
    with pytest.raises(TypeError, match="like="):
        ckpt.load(tmp_path / "c")


def test_partial_load_verifies_what_it_reads(tmp_path: Path) -> None:
    """A damaged record under the selected keys fails the load (naming it; a donated load leaves
    like untouched); damage elsewhere is not read, so that subtree still loads."""
    state = _state()
    ckpt.save(state, tmp_path / "c")
    _flip_byte(tmp_path / "c", "ema.student.w")
    with pytest.raises(ckpt.CheckpointCorruptError, match=r"ema\.student\.w"):
        ckpt.load(tmp_path / "c", keys=["ema.student"])
    like = TensorDict({"ema": {"student": state["ema", "student"].apply(torch.zeros_like)}}, [])
    with pytest.raises(ckpt.CheckpointCorruptError):
        ckpt.load(tmp_path / "c", like=like, keys=["ema"], donate=True)
    assert torch.equal(like["ema", "student", "w"], torch.zeros(3, 2))
    out = ckpt.load(tmp_path / "c", keys=["params.student"])
    testing.assert_trees_equal(out["params", "student"], state["params", "student"])
    donated = TensorDict({"params": {"critic": {"w": torch.zeros(4)}}}, [])
    ckpt.load(tmp_path / "c", like=donated, keys=["params.critic"], donate=True)
    assert torch.equal(donated["params", "critic", "w"], state["params", "critic", "w"])


@pytest.mark.parametrize("bad", [(), ("params", 1), 3, []], ids=["empty", "non_str", "int", "list"])
def test_a_keys_entry_that_is_no_prefix_is_refused_by_name(tmp_path: Path, bad: object) -> None:
    """keys entries must be dotted strings or non-empty sequences of strings; anything else
    (an empty tuple too, which would select everything) is a TypeError that shows it."""
    ckpt.save(_state(), tmp_path / "c")
    with pytest.raises(TypeError) as e:
        ckpt.load(tmp_path / "c", keys=["step", bad])  # type: ignore[list-item]
    assert str(e.value) == f"load: keys entries must be dotted str or tuples of str, got {bad!r}"


def test_a_partial_load_without_like_refuses_an_unknown_dtype_by_key(tmp_path: Path) -> None:
    """A metadata.json naming a dtype this torch lacks fails the template with its key."""
    from purestep.distributed import _ckpt_integrity

    p = tmp_path / "c"
    ckpt.save(_state(), p)
    md = json.loads((p / ckpt.METADATA_FILE).read_bytes())
    md["keys"]["ema.student.w"]["dtype"] = "float99"
    (p / ckpt.METADATA_FILE).write_bytes(_ckpt_integrity.seal(md))
    with pytest.raises(ckpt.CheckpointFormatError) as e:
        ckpt.load(p, keys=["ema"])
    assert str(e.value) == "load: unknown dtype 'float99' of key 'ema.student.w'"
    testing.assert_trees_equal(ckpt.load(p, keys=["step"]), TensorDict({"step": torch.tensor(7)}))


def test_a_prefix_that_selects_nothing_is_named_with_the_top_level_keys(tmp_path: Path) -> None:
    """Prefixes select whole key-path components ('ema.stud' is not 'ema.student'); every
    prefix that selects nothing is named in one CheckpointMismatchError (key: the first), with
    the checkpoint's top-level keys, with or without ``like``."""
    state = _state()
    path = tmp_path / "c"
    ckpt.save(state, path)
    keys = ["params.student.w", "ema.stud", ("opt_state", "student", "mu"), "optim"]
    like = TensorDict({"params": {"student": {"w": torch.zeros(3, 2)}}}, [])
    for template in (None, like):
        with pytest.raises(ckpt.CheckpointMismatchError) as info:
            ckpt.load(path, like=template, keys=keys)
        assert str(info.value) == (
            f"checkpoint {path} has no key 'ema.stud', 'optim' (nor any under it); its "
            "top-level keys are ['buffers', 'ema', 'opt_state', 'params', 'rng', 'step']"
        )
        assert info.value.details() == {"path": path, "file": None, "key": "ema.stud"}


def test_load_needs_like_or_keys_and_a_donated_load_needs_like(tmp_path: Path) -> None:
    """Without like= and keys= there is nothing to load into (TypeError); donate=True without
    like= has no tensors to fill (ValueError); each message says what to pass."""
    ckpt.save(_state(), tmp_path / "c")
    with pytest.raises(TypeError) as info:
        ckpt.load(tmp_path / "c")
    assert str(info.value) == (
        "load: pass like= (a template state), keys= (prefixes to load), or both"
    )
    msg = "load: donate=True needs like= (the tensors to load into)"
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        ckpt.load(tmp_path / "c", keys=["ema"], donate=True)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not_strict"])
def test_a_like_with_non_tensor_leaves_is_refused_by_name(tmp_path: Path, strict: bool) -> None:
    """A non-tensor leaf in like (strict or not) fails the load with a CheckpointStateError that
    calls it part of `like` and names the leaf."""
    ckpt.save(_state(), tmp_path / "c")
    like = TensorDict({"step": torch.tensor(0)}, [])
    like.set_non_tensor(("meta", "name"), "run-a")
    with pytest.raises(ckpt.CheckpointStateError) as info:
        ckpt.load(tmp_path / "c", like=like, strict=strict)
    assert str(info.value) == (
        "cannot checkpoint like: non-tensor leaves (a checkpoint holds tensors only; store "
        "numbers as 0-dim tensors and other values in save(metadata=...)): meta.name "
        "(non-tensor data: str)"
    )


def test_a_strict_false_mismatch_names_the_state_and_only_like_keys(tmp_path: Path) -> None:
    """With strict=False the mismatch error lists like's missing and mis-shaped keys, says it is
    about the state (not per-rank values), and never the checkpoint keys like lacks."""
    path = tmp_path / "c"
    ckpt.save(_state(), path)
    like = TensorDict(
        {"ema": {"critic": {"w": torch.zeros(4)}, "student": {"b": torch.zeros(3)}}}, []
    )
    with pytest.raises(ckpt.CheckpointMismatchError) as info:
        ckpt.load(path, like=like, strict=False)
    assert str(info.value) == (
        f"checkpoint {path} does not match `like` (state):\n"
        "  missing from the checkpoint (in like only): ema.critic.w\n"
        "  mismatched shape or dtype: ema.student.b: checkpoint has (2,) float32, "
        "like has (3,) float32"
    )
    assert info.value.details() == {"path": path, "file": None, "key": "ema.critic.w"}
