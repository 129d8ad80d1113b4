"""Checkpoint integrity in one process: the recorded checksums, leaves that cannot be saved,
stock DCP readers, never replacing what save did not check, the verify command, the error
types, and cleanup after any exception."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from _checkpoint_states import DTYPES, _random_tensor, _same, _small, _train_state
from purestep.distributed import checkpoint as ckpt


def test_metadata_names_the_checksum_algorithm_and_every_record(tmp_path: Path) -> None:
    """metadata.json records the algorithm, one checksummed record per key, every file's size,
    and a checksum of its own that read_metadata checks."""
    state = _train_state()
    ckpt.save(state, tmp_path / "c")
    md = ckpt.read_metadata(tmp_path / "c")
    integrity = md["integrity"]
    assert integrity["algorithm"] == "xxh3_64"
    assert sorted(r["key"] for r in integrity["records"]) == sorted(md["keys"])
    for name, info in integrity["files"].items():
        assert (tmp_path / "c" / name).stat().st_size == info["size"]
    assert len(md["checksum"]) == 16
    md["step"] = md["step"] + 1  # a one-digit change that still parses
    (tmp_path / "c" / "metadata.json").write_text(json.dumps(md))
    with pytest.raises(ckpt.CheckpointCorruptError, match="does not match its own checksum"):
        ckpt.read_metadata(tmp_path / "c")


def test_non_tensor_leaves_fail_at_save_naming_them(tmp_path: Path) -> None:
    """A non-tensor leaf (tensordict NonTensorData) would be silently dropped by a tensor-only
    checkpoint: save refuses it by name, before writing anything; so do sparse and meta tensors."""
    state = _small(1)
    state.set_non_tensor(("meta", "name"), "run-a")
    with pytest.raises(ckpt.CheckpointStateError, match=r"non-tensor leaves.*meta\.name \(.*str"):
        ckpt.save(state, tmp_path / "a")
    odd = TensorDict(
        {
            "sparse": torch.eye(2).to_sparse(),
            "meta": torch.empty(2, device="meta"),
            "ok": torch.ones(1),
        },
        [],
    )
    with pytest.raises(
        ckpt.CheckpointStateError, match=r"sparse \(layout.*meta \(on the meta"
    ) as info:
        ckpt.save(odd, tmp_path / "b")
    assert isinstance(info.value, ValueError)
    assert list(tmp_path.iterdir()) == []
    ckpt.save(_small(1), tmp_path / "c")
    with pytest.raises(ckpt.CheckpointStateError, match="non-tensor"):  # and as `like`
        ckpt.load(tmp_path / "c", like=state)


def test_stock_dcp_reader_loads_every_dtype_of_a_purestep_checkpoint(tmp_path: Path) -> None:
    """Stock DCP FileSystemReader loads a purestep checkpoint bitwise, including the dtypes
    written as zip records (float8, uint16/32/64) and int64/bool buffers."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    state = TensorDict({str(d).split(".")[1]: _random_tensor((3, 2), d, g) for d in DTYPES}, [])
    ckpt.save(state, tmp_path / "c")
    flat = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(flat, storage_reader=dcp.FileSystemReader(tmp_path / "c"), no_dist=True)
    assert _same(TensorDict(flat, []), state)
    layouts = {r["layout"] for r in ckpt.read_metadata(tmp_path / "c")["integrity"]["records"]}
    assert layouts == {"torch-legacy-contiguous", "torch-zip"}


def test_overwrite_never_replaces_a_damaged_checkpoint_or_a_user_directory(tmp_path: Path) -> None:
    """overwrite=True replaces only a complete checkpoint; a damaged one and a user's directory
    stay byte for byte as they were."""
    ckpt.save(_small(1), tmp_path / "c")
    os.truncate(tmp_path / "c" / "__0_0.distcp", 3)
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes").write_text("mine")
    for name in ("c", "user"):
        with pytest.raises(ckpt.CheckpointExistsError, match="not a complete purestep checkpoint"):
            ckpt.save(_small(2), tmp_path / name, overwrite=True)
    assert (tmp_path / "c" / "__0_0.distcp").stat().st_size == 3
    assert (tmp_path / "user" / "notes").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "user"]


def test_verify_command_exit_status_and_messages(tmp_path: Path) -> None:
    """`python -m purestep.checkpoint verify` exits 0 with an ok line per intact checkpoint, and
    1 naming the checkpoint, file and key of a damaged one (also when given a run directory)."""
    for s in (1, 2):
        ckpt.save(_small(s), ckpt.step_dir(tmp_path, s))
    cmd = [sys.executable, "-m", "purestep.checkpoint", "verify"]
    ok = subprocess.run([*cmd, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.count("ok ") == 2 and "xxh3_64" in ok.stdout
    assert "RuntimeWarning" not in ok.stderr
    f = ckpt.step_dir(tmp_path, 2) / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[-3] ^= 1  # inside the data of the last record
    f.write_bytes(bytes(data))
    bad = subprocess.run([*cmd, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1
    assert "ok " in bad.stdout and "step_00000001" in bad.stdout
    assert "DAMAGED" in bad.stderr and "step_00000002" in bad.stderr
    assert "__0_0.distcp" in bad.stderr and "fails its xxh3_64 checksum" in bad.stderr
    missing = subprocess.run([*cmd, str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert missing.returncode == 1 and "CheckpointNotFoundError" in missing.stderr


def test_checkpoint_errors_are_exceptions_with_their_builtin_meanings() -> None:
    """Every checkpoint error is an Exception (so `except Exception` sees it), and subclasses are
    also the builtin exception naming the same situation."""
    assert issubclass(ckpt.CheckpointError, Exception)
    assert issubclass(ckpt.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(ckpt.CheckpointExistsError, FileExistsError)
    for cls in (
        ckpt.CheckpointMismatchError,
        ckpt.CheckpointStateError,
        ckpt.CheckpointFormatError,
    ):
        assert issubclass(cls, ValueError)
    for cls in (
        ckpt.CheckpointCorruptError,
        ckpt.CheckpointReadError,
        ckpt.CheckpointWriteError,
        ckpt.CheckpointMismatchError,
    ):
        assert issubclass(cls, ckpt.CheckpointError)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, MemoryError])
@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_any_exception_while_writing_removes_the_scratch_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: type[BaseException], async_: bool
) -> None:
    """A BaseException (Ctrl-C, SystemExit) or MemoryError in the middle of writing propagates
    as itself (DCP wraps it in its CheckpointException; purestep unwraps it), and the scratch
    directory is removed: only the previous checkpoint remains, and it is latest."""
    from purestep.distributed import _storage

    ckpt.save(_small(1), tmp_path / "a")
    real = _storage.write_record
    calls = []

    def interrupted(tensor: torch.Tensor, stream: Any) -> int:
        calls.append(1)
        if len(calls) == 2:
            raise exc()
        return real(tensor, stream)

    monkeypatch.setattr(_storage, "write_record", interrupted)
    expected: tuple[type[BaseException], ...] = (exc,)
    if exc is MemoryError:  # an ordinary Exception: reported as a failed save
        expected = (ckpt.CheckpointWriteError,)
    with pytest.raises(expected) as info:
        _save_and_wait(_small(2), tmp_path / "b", async_)
    if exc is MemoryError:
        assert isinstance(info.value.__cause__, MemoryError)
    with contextlib.suppress(BaseException):
        ckpt.wait_pending()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    assert ckpt.latest(tmp_path) == tmp_path / "a"


def _save_and_wait(state: TensorDict, path: Path, async_: bool) -> None:
    handle = ckpt.save(state, path, async_=async_)
    if handle is not None:
        handle.wait()


def _reseal(path: Path, edit: Any) -> None:
    """Apply ``edit`` to the checkpoint's parsed metadata.json and write it back, sealed anew
    (a well-formed metadata.json saying something else, not a damaged one)."""
    from purestep.distributed import _ckpt_integrity

    md = json.loads((path / ckpt.METADATA_FILE).read_bytes())
    edit(md)
    (path / ckpt.METADATA_FILE).write_bytes(_ckpt_integrity.seal(md))


def test_verify_summarises_what_it_checked(tmp_path: Path) -> None:
    """verify's summary: the path, the step, the algorithm metadata.json records (xxh3_64 when
    it records none), the data files and DCP's .metadata, every record (per-rank ones too), the
    record bytes read, and a duration within the call's own."""
    import time

    p = tmp_path / "c"
    state = TensorDict({"w": torch.arange(6.0), "n": {"b": torch.ones(3)}, "step": torch.tensor(5)})
    ckpt.save(state, p, per_rank=TensorDict({"pos": torch.tensor(3)}, []))
    records = ckpt.read_metadata(p)["integrity"]["records"]
    t0 = time.perf_counter()
    s = ckpt.verify(p)
    elapsed = time.perf_counter() - t0
    assert set(s) == {"path", "step", "algorithm", "files", "records", "bytes", "seconds"}
    assert (s["path"], s["step"], s["algorithm"]) == (str(p), 5, "xxh3_64")
    assert (s["files"], s["records"]) == (2, 4)  # __0_0.distcp and .metadata; 3 + 1 keys
    assert s["bytes"] == sum(r["length"] for r in records) > 0
    assert 0 <= s["seconds"] <= elapsed
    _reseal(p, lambda md: md["integrity"].update(algorithm="xxh3_64 (as recorded)"))
    assert ckpt.verify(p)["algorithm"] == "xxh3_64 (as recorded)"
    _reseal(p, lambda md: md["integrity"].pop("algorithm"))
    assert ckpt.verify(p)["algorithm"] == "xxh3_64"


def test_verify_names_a_data_file_of_the_wrong_size(tmp_path: Path) -> None:
    """verify raises CheckpointCorruptError with the checkpoint, the file and its sizes."""
    p = tmp_path / "c"
    ckpt.save(_small(1), p)
    f = p / "__0_0.distcp"
    size = f.stat().st_size
    f.write_bytes(f.read_bytes()[:-1])
    with pytest.raises(ckpt.CheckpointCorruptError) as e:
        ckpt.verify(p)
    assert str(e.value) == (
        f"checkpoint {p} is damaged: data file __0_0.distcp has {size - 1} bytes, "
        f"{size} were written"
    )
    assert (e.value.path, e.value.file) == (p, "__0_0.distcp")
