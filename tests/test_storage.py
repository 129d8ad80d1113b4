"""The DCP record writer and reader: stock DCP compatibility both ways, and compact records."""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from _checkpoint_states import _bits
from purestep.distributed import checkpoint as ckpt
from purestep.distributed._storage import RAW_TAIL, RecordReader, RecordWriter, write_record
from test_checkpoint import _build, tree_st


def _flat(spec: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    return _flat_td(TensorDict(_build(spec, torch.Generator().manual_seed(seed)), []))


def _equal_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(_bits(a[k]), _bits(b[k])), f"{k} differs"


def _one_process(fn: Any) -> Any:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn()


PAIRS = {
    "RecordWriter -> stock FileSystemReader": (RecordWriter, dcp.FileSystemReader),
    "stock FileSystemWriter -> RecordReader": (dcp.FileSystemWriter, RecordReader),
    "RecordWriter -> RecordReader": (RecordWriter, RecordReader),
}


@pytest.mark.parametrize("pair", list(PAIRS))
@settings(max_examples=15, deadline=None)
@given(spec=tree_st, seed=st.integers(0, 2**31))
def test_checkpoints_round_trip_bitwise_between_ours_and_stock_dcp(
    tmp_path_factory: pytest.TempPathFactory, pair: str, spec: dict[str, Any], seed: int
) -> None:
    """Our records load with stock DCP's reader and stock records with ours, bit for bit."""
    writer, reader = PAIRS[pair]
    sd = _flat(spec, seed)
    path = tmp_path_factory.mktemp("w")
    _one_process(lambda: dcp.save(sd, storage_writer=writer(path), no_dist=True))
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    _one_process(lambda: dcp.load(out, storage_reader=reader(path), no_dist=True))
    _equal_bits(out, sd)


def test_a_view_is_saved_without_the_rest_of_its_storage(tmp_path: Path) -> None:
    """A 4-element view of a 1M-element tensor costs a record of about 4 elements, not 4 MB."""
    big = torch.arange(1_000_000, dtype=torch.float32)
    state = TensorDict({"w": big[10:14]}, [])
    ckpt.save(state, tmp_path / "c")
    data = sum(f.stat().st_size for f in (tmp_path / "c").glob("*.distcp"))
    assert data < 10_000, f"data files hold {data} bytes for a 16-byte tensor"
    out = ckpt.load(tmp_path / "c", like=state.apply(torch.zeros_like))
    assert torch.equal(out["w"], big[10:14])


@settings(max_examples=30, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), max_size=3).map(tuple),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool]),
    prefix=st.binary(max_size=20),
)
def test_write_record_appends_one_loadable_record_of_the_returned_length(
    shape: tuple[int, ...], dtype: torch.dtype, prefix: bytes
) -> None:
    """write_record at any offset returns the record's length; torch.load of that slice is the tensor."""
    t = torch.ones(shape).to(dtype)
    buf = io.BytesIO(prefix)
    buf.seek(0, io.SEEK_END)
    n = write_record(t, buf)
    assert len(buf.getvalue()) == len(prefix) + n
    rec = io.BytesIO(buf.getvalue()[len(prefix) :])
    back = torch.load(rec, weights_only=True)
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


@settings(max_examples=15, deadline=None)
@given(spec=tree_st, seed=st.integers(0, 2**31))
def test_purestep_load_reads_its_own_raw_records_without_unpickling(
    tmp_path_factory: pytest.TempPathFactory, spec: dict[str, Any], seed: int
) -> None:
    """ckpt.load of a purestep checkpoint calls torch.load only for the zip records (dtypes the
    non-zip format cannot read back), never for raw-tail ones, and is bitwise (any dtype/shape)."""
    g = torch.Generator().manual_seed(seed)
    state = TensorDict(_build(spec, g), [])
    path = tmp_path_factory.mktemp("c") / "ckpt"
    ckpt.save(state, path)
    records = ckpt.read_metadata(path)["integrity"]["records"]
    assert {r["layout"] for r in records} <= {RAW_TAIL, "torch-zip"}
    numel = {
        k if isinstance(k, str) else ".".join(k): v.numel() for k, v in state.items(True, True)
    }
    zipped = [r for r in records if r["layout"] == "torch-zip" and numel[r["key"]] > 0]
    calls = []
    real = torch.load

    def counting(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return real(*a, **k)

    torch.load = counting  # type: ignore[assignment]
    try:
        out = ckpt.load(path, like=state.apply(torch.zeros_like))
    finally:
        torch.load = real
    assert len(calls) == len(zipped)  # DCP reads no record of an empty tensor
    _equal_bits(_flat_td(out), _flat_td(state))


def _flat_td(td: TensorDict) -> dict[str, torch.Tensor]:
    return {".".join(k): v for k, v in td.items(True, True)}  # type: ignore[misc]


def test_a_stock_checkpoint_without_purestep_metadata_is_read_by_unpickling(
    tmp_path: Path,
) -> None:
    """RecordReader without purestep's metadata.json (a stock DCP checkpoint of zip records)
    reads each record by unpickling it, bitwise."""
    sd = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor(7), "c": torch.ones(0)}
    _one_process(lambda: dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True))
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    _one_process(lambda: dcp.load(out, storage_reader=RecordReader(tmp_path), no_dist=True))
    _equal_bits(out, sd)


def test_non_contiguous_tensors_are_written_in_row_major_order(tmp_path: Path) -> None:
    """A transposed tensor (its own whole storage, not contiguous) round-trips by the raw-tail path."""
    t = torch.arange(12.0).reshape(3, 4).t()
    assert not t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * 4
    state = TensorDict({"t": t}, [])
    ckpt.save(state, tmp_path / "c")
    out = ckpt.load(tmp_path / "c", like=state.apply(torch.zeros_like))
    assert torch.equal(out["t"], t)
