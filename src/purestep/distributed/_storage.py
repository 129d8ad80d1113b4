"""A DCP storage writer whose records any stock DCP reader can load, written faster and checksummed.

:class:`torch.distributed.checkpoint.FileSystemWriter` writes every tensor as
its own ``torch.save`` *zip* record. For a training state of hundreds of small
tensors that per-record cost dominates: the stock writer is markedly slower
than one ``torch.save`` of the whole dict (``benchmarks/checkpoint.py``; the
figures are in README.md, "Performance").

:class:`RecordWriter` writes the same DCP layout (one ``__<rank>_0.distcp``
file per rank, a ``.metadata`` file, the same :class:`WriteResult` offsets),
but each tensor record is ``torch.save``'s non-zip ("legacy") format: one
pickle header and the storage's bytes, with no zip directory. Stock
``FileSystemReader`` loads it unchanged, because it reads each record with
``torch.load(..., weights_only=True)``, which accepts both formats; a
checkpoint written here is therefore an ordinary DCP checkpoint. Dtypes whose
non-zip records ``torch.load`` cannot read back (float8, uint16/32/64,
complex32, ...) are written as zip records instead (:func:`record_layout`).

While writing, every record's bytes are hashed (:mod:`._ckpt_integrity`:
``xxh3_64``, in cache-sized chunks right after they are written); the
coordinator's :meth:`RecordWriter.finish` collects every rank's record
checksums, the data file sizes and the checksum of ``.metadata`` into
:attr:`RecordWriter.integrity`, which ``save`` stores in ``metadata.json``.

Everything else follows the stock writer: tensors are moved to CPU (with
copy-ahead overlap when a GPU is present), a view whose storage is larger than
itself (or a non-contiguous tensor) is copied first so only its own bytes are
written, row-major, and the file is fsynced before :meth:`write_data` returns.

:class:`RecordReader` reads any DCP file checkpoint. Given purestep's
``metadata.json`` (``integrity=``) it verifies ``.metadata`` before unpickling
it and every record's checksum as it reads it (``verify=True``), and takes the
data of :data:`RAW_TAIL` records from the record's tail, straight into the
target tensor when the chunk is exactly that tensor, instead of unpickling,
which brings a load close to ``torch.load``'s speed.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import xxhash
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystemReader,
    FileSystemWriter,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import (
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from purestep import _compat
from purestep.distributed._ckpt_errors import CheckpointCorruptError, CheckpointReadError
from purestep.distributed._ckpt_integrity import (
    ALGORITHM,
    DCP_METADATA,
    LAYOUT_RAW,
    LAYOUT_ZIP,
    HashingWriter,
    RecordInfo,
    check_bytes,
    hasher,
    read_exact,
    records,
    verify_metadata_file,
)

__all__ = ["RAW_TAIL", "RecordReader", "RecordWriter", "record_layout", "write_record"]

RAW_TAIL = LAYOUT_RAW
"""The record layout :func:`write_record` guarantees for most dtypes (named per record in
purestep's ``metadata.json``).

Each such tensor record ends with ``int64 numel`` and the tensor's bytes in
row-major order, so a reader that knows the chunk's shape and dtype (from DCP's
metadata) can read the data without unpickling the record."""

_LAYOUT_BYTES = "bytes"


@functools.cache
def record_layout(dtype: torch.dtype) -> str:
    """:data:`RAW_TAIL` if ``torch.load`` reads ``dtype``'s non-zip record back, else zip.

    Decided once per dtype by a one-element round trip (torch's non-zip format
    has no storage class for float8, uint16/32/64, complex32, bits types).

    Example:
        >>> record_layout(torch.float32), record_layout(torch.uint16)
        ('torch-legacy-contiguous', 'torch-zip')
    """
    if not _compat.NON_ZIP_RECORDS:
        return LAYOUT_ZIP
    buf = io.BytesIO()
    try:
        probe = torch.zeros(8, dtype=torch.uint8).view(dtype)
        _compat.save_record(probe, buf, False)
        buf.seek(0)
        back = torch.load(buf, weights_only=True)
    except Exception:
        return LAYOUT_ZIP
    return LAYOUT_RAW if back.dtype == dtype else LAYOUT_ZIP


def write_record(tensor: torch.Tensor, stream: Any) -> int:
    """Append ``tensor`` to ``stream`` as a ``torch.load``-able record; return its length.

    The record is ``torch.save``'s non-zip format, which ``torch.load`` reads
    (with ``weights_only=True`` too), or its zip format for the dtypes
    :func:`record_layout` names. Only the tensor's own bytes are written, in
    row-major order: a view of a larger storage, or a non-contiguous tensor,
    is copied first. A non-zip record therefore ends with the storage's
    element count (int64, little-endian) and then the data itself (:data:`RAW_TAIL`).

    Example:
        >>> import io, torch
        >>> buf = io.BytesIO()
        >>> n = write_record(torch.arange(4.0)[1:3], buf)
        >>> _ = buf.seek(0)
        >>> torch.load(buf, weights_only=True)
        tensor([1., 2.])
    """
    if (
        not tensor.is_contiguous()
        or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()
    ):
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    start = int(stream.tell())
    zip_ = record_layout(tensor.dtype) == LAYOUT_ZIP
    _compat.save_record(tensor, stream, zip_)
    return int(stream.tell()) - start


@dataclass
class _CheckedInfo(_StorageInfo):
    """A record's storage info plus what :meth:`RecordWriter.finish` collects (never in ``.metadata``)."""

    layout: str = LAYOUT_RAW
    checksum: str = ""
    file_size: int = -1


class RecordWriter(FileSystemWriter):
    """``FileSystemWriter`` writing one file per rank of fast, stock-readable, checksummed records.

    Args:
        path: the checkpoint directory.
        sync_files: fsync the data file before returning (default ``True``).

    Attributes:
        integrity: on the coordinator after the save, ``{"algorithm", "files",
            "records"}``: every rank's record checksums and layouts, each data
            file's size, and the size and checksum of ``.metadata``.

    Example:
        >>> import tempfile, warnings, torch
        >>> import torch.distributed.checkpoint as dcp
        >>> d = tempfile.mkdtemp()
        >>> out = {"w": torch.zeros(3)}
        >>> writer = RecordWriter(d)
        >>> with warnings.catch_warnings():  # DCP warns that it runs in one process
        ...     warnings.simplefilter("ignore")
        ...     _ = dcp.save({"w": torch.arange(3.0)}, storage_writer=writer, no_dist=True)
        ...     dcp.load(out, storage_reader=dcp.FileSystemReader(d), no_dist=True)
        >>> out["w"], [r["key"] for r in writer.integrity["records"]]
        (tensor([0., 1., 2.]), ['w'])
    """

    def __init__(self, path: str | os.PathLike[str], *, sync_files: bool = True) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=sync_files, thread_count=1)
        self.integrity: dict[str, Any] = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write every item of ``plan`` to this rank's single data file, hashing each record."""
        prefix = plan.storage_data
        if not isinstance(prefix, _StoragePrefix):  # pragma: no cover - set by DCP's planning
            raise TypeError(f"expected a storage prefix in the save plan, got {prefix!r}")
        name = f"{prefix.prefix}0{DEFAULT_SUFFIX}"
        written: list[tuple[WriteItem, int, int, str, str]] = []
        tensor_items = [wi for wi in plan.items if wi.type != WriteItemType.BYTE_IO]
        loader = _compat.cpu_loader(planner.resolve_data, self.per_thread_copy_ahead)
        for wi in tensor_items:
            loader.add(_nbytes(wi), wi)
        loader.start_loading()
        with open(os.path.join(self.path, name), "wb") as f:
            out = HashingWriter(f)
            for wi in plan.items:
                if wi.type == WriteItemType.BYTE_IO:
                    data = planner.resolve_data(wi)
                    if not isinstance(data, io.BytesIO):  # pragma: no cover - DCP invariant
                        raise TypeError(f"{wi.index.fqn}: byte item resolved to {type(data)}")
                    out.start()
                    offset = f.tell()
                    out.write(data.getbuffer())
                    written.append((wi, offset, f.tell() - offset, _LAYOUT_BYTES, out.hexdigest()))
            for tensor, obj in loader.values():
                item = obj if isinstance(obj, WriteItem) else None
                if item is None:  # pragma: no cover - we only add WriteItems
                    raise TypeError(f"unexpected loader item {obj!r}")
                out.start()
                offset = f.tell()
                try:
                    length = write_record(tensor, out)
                except Exception as e:
                    if out.error is not None and out.error is not e:  # keep the OSError (errno)
                        raise out.error from e
                    raise
                written.append((item, offset, length, record_layout(tensor.dtype), out.hexdigest()))
            size = f.tell()
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())
        results = [
            WriteResult(
                index=wi.index,
                size_in_bytes=length,
                storage_data=_CheckedInfo(
                    name, offset, length, layout=layout, checksum=checksum, file_size=size
                ),
            )
            for wi, offset, length, layout, checksum in written
        ]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write ``.metadata`` (stock storage infos only) and collect :attr:`integrity`."""
        recs: list[dict[str, Any]] = []
        files: dict[str, dict[str, Any]] = {}
        plain: list[list[WriteResult]] = []
        for wr_list in results:
            out = []
            for wr in wr_list:
                sd = wr.storage_data
                if isinstance(sd, _CheckedInfo):
                    chunk = tuple(int(x) for x in (wr.index.offset or ()))
                    info = RecordInfo(
                        wr.index.fqn,
                        chunk,
                        sd.relative_path,
                        sd.offset,
                        sd.length,
                        sd.layout,
                        sd.checksum,
                    )
                    recs.append(info.to_json())
                    files[sd.relative_path] = {"size": sd.file_size}
                    sd = _StorageInfo(sd.relative_path, sd.offset, sd.length)
                out.append(
                    WriteResult(index=wr.index, size_in_bytes=wr.size_in_bytes, storage_data=sd)
                )
            plain.append(out)
        super().finish(metadata, plain)
        data = (Path(self.path) / DCP_METADATA).read_bytes()
        files[DCP_METADATA] = {"size": len(data), "checksum": xxhash.xxh3_64_hexdigest(data)}
        recs.sort(key=lambda r: (r["file"], r["offset"]))
        self.integrity = {"algorithm": ALGORITHM, "files": files, "records": recs}


def _numel(sizes: Sequence[int]) -> int:
    n = 1
    for d in sizes:
        n *= int(d)
    return n


def _nbytes(wi: WriteItem) -> int:
    td = wi.tensor_data
    if td is None:  # pragma: no cover - tensor items carry tensor data
        return 0
    return _numel(td.size) * td.properties.dtype.itemsize


class RecordReader(FileSystemReader):
    """``FileSystemReader`` that reads each record with one ``read`` call, and verifies it.

    The stock reader hands ``torch.load`` a Python file view, so unpickling a
    record costs one Python-level ``read`` and ``tell`` per pickle opcode (about
    600 per small tensor). This reader reads each record's bytes at once and
    unpickles from memory; the result is the same.

    With ``integrity`` (purestep's parsed ``metadata.json``) it knows each
    record's file, offset, length, layout and checksum: ``.metadata`` is
    checked before it is unpickled, each record is hashed as it is read
    (``verify=True``) and a mismatch, a short read or a record that the two
    metadata files place differently raises :class:`CheckpointCorruptError`
    naming the checkpoint, file and key. :data:`RAW_TAIL` records skip
    unpickling: the data is read from the record's tail (its element count
    checked), straight into the target tensor when the chunk is exactly it.
    Records with stream transforms (compression, written by other writers) go
    to the stock path.

    Example:
        >>> import tempfile, warnings, torch
        >>> import torch.distributed.checkpoint as dcp
        >>> d = tempfile.mkdtemp()
        >>> out = {"w": torch.zeros(3)}
        >>> with warnings.catch_warnings():  # DCP warns that it runs in one process
        ...     warnings.simplefilter("ignore")
        ...     _ = dcp.save({"w": torch.arange(3.0)}, checkpoint_id=d, no_dist=True)
        ...     dcp.load(out, storage_reader=RecordReader(d), no_dist=True)
        >>> out["w"]
        tensor([0., 1., 2.])
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        integrity: Mapping[str, Any] | None = None,
        verify: bool = True,
        dcp_metadata: bytes | None = None,
    ) -> None:
        super().__init__(path)
        self.checkpoint = Path(path)
        self._md = integrity
        self.verify = verify
        self._dcp_metadata = dcp_metadata
        self._records: dict[tuple[str, tuple[int, ...]], RecordInfo] | None = None
        if integrity is not None:
            self._records = {(r.key, r.chunk): r for r in records(integrity)}
        self._raw_ok = sys.byteorder == "little"
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.Size, torch.dtype]] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata; with ``integrity`` and ``verify``, checked before it is unpickled.

        (DCP swallows an error raised here into an ``AssertionError``, so
        :func:`purestep.checkpoint.load` verifies ``.metadata`` first and passes
        its bytes as ``dcp_metadata``.)
        """
        if self._dcp_metadata is not None:
            data = self._dcp_metadata
        elif self._md is None or not self.verify:
            return super().read_metadata(*args, **kwargs)
        else:
            data = verify_metadata_file(self.checkpoint, self._md)
        metadata = pickle.loads(data)
        if not isinstance(metadata, Metadata):
            raise CheckpointCorruptError(
                f"checkpoint {self.checkpoint} is damaged: {DCP_METADATA} holds a "
                f"{type(metadata).__name__}, not DCP metadata",
                path=self.checkpoint,
                file=DCP_METADATA,
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Also index every stored chunk's shape and dtype (for :data:`RAW_TAIL` reads)."""
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._chunks = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for chunk in md.chunks:
                    self._chunks[fqn, tuple(chunk.offsets)] = (chunk.sizes, md.properties.dtype)

    # -- helpers ---------------------------------------------------------------------------

    def _corrupt(self, message: str, rec: RecordInfo | None, file: str | None = None) -> Exception:
        return CheckpointCorruptError(
            f"checkpoint {self.checkpoint} is damaged: {message}",
            path=self.checkpoint,
            file=rec.file if rec is not None else file,
            key=None if rec is None else rec.key,
        )

    def _record(self, ri: ReadItem, info: Any) -> RecordInfo:
        assert self._records is not None
        index = ri.storage_index
        chunk = tuple(int(x) for x in (index.offset or ()))
        rec = self._records.get((index.fqn, chunk))
        if rec is None:
            raise self._corrupt(
                f"{DCP_METADATA} lists key {index.fqn} (chunk at {list(chunk)}), "
                "which metadata.json does not",
                None,
                DCP_METADATA,
            )
        if (rec.file, rec.offset, rec.length) != (info.relative_path, info.offset, info.length):
            raise self._corrupt(
                f"{DCP_METADATA} and metadata.json disagree about where key {rec.key} is stored",
                rec,
            )
        return rec

    def _check(self, h: Any, rec: RecordInfo) -> None:
        if h is not None:
            got = str(h.hexdigest())
            check_bytes(self.checkpoint, rec.file, rec.checksum, got, rec, rec.key)

    def _read_exact(self, f: Any, into: memoryview, h: Any, rec: RecordInfo) -> None:
        if read_exact(f, into, h) < into.nbytes:
            raise self._corrupt(
                f"{rec.file} is truncated ({rec.where(self.checkpoint)} runs past its end)", rec
            )

    def _read_whole(self, f: Any, rec: RecordInfo) -> bytearray:
        h = hasher() if self.verify else None
        buf = bytearray(rec.length)
        f.seek(rec.offset)
        self._read_exact(f, memoryview(buf), h, rec)
        self._check(h, rec)
        return buf

    def _read_raw(self, f: Any, ri: ReadItem, rec: RecordInfo, dst: torch.Tensor) -> torch.Tensor:
        """The chunk's data from the end of its record (into ``dst`` when it is exactly the chunk)."""
        found = self._chunks.get((ri.storage_index.fqn, tuple(ri.storage_index.offset or ())))
        if found is None:
            raise self._corrupt(f"{DCP_METADATA} has no chunk for key {rec.key}", rec)
        sizes, dtype = found
        numel = _numel(sizes)
        nbytes = numel * dtype.itemsize
        head = rec.length - nbytes
        if head < 8:
            raise self._corrupt(f"{rec.where(self.checkpoint)} is too short", rec)
        h = hasher() if self.verify else None
        header = bytearray(head)
        f.seek(rec.offset)
        self._read_exact(f, memoryview(header), h, rec)
        if int.from_bytes(header[-8:], "little", signed=True) != numel:
            raise self._corrupt(f"{rec.where(self.checkpoint)} does not hold {numel} elements", rec)
        whole = all(o == 0 for o in ri.storage_offsets) and tuple(ri.lengths) == tuple(sizes)
        if (
            whole
            and type(dst) is torch.Tensor
            and dst.device.type == "cpu"
            and dst.dtype == dtype
            and dst.shape == sizes
            and dst.is_contiguous()
        ):
            out = dst
            raw = dst.reshape(-1).view(torch.uint8)
        else:
            raw = torch.empty(nbytes, dtype=torch.uint8)
            out = raw.view(dtype).reshape(sizes)
        if nbytes:
            self._read_exact(f, memoryview(cast(Any, raw.numpy())), h, rec)
        self._check(h, rec)
        return out

    def _read_item(self, f: Any, ri: ReadItem, planner: LoadPlanner) -> None:
        info = self.storage_data[ri.storage_index]
        rec = self._record(ri, info)
        if ri.type == LoadItemType.BYTE_IO:
            planner.load_bytes(ri, io.BytesIO(self._read_whole(f, rec)))
            return
        dst = planner.resolve_tensor(ri).detach()
        if rec.layout == LAYOUT_RAW and self._raw_ok:
            loaded = self._read_raw(f, ri, rec, dst)
        else:
            data = io.BytesIO(self._read_whole(f, rec))
            try:
                loaded = torch.load(data, map_location="cpu", weights_only=True)
            except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
                raise self._corrupt(
                    f"{rec.where(self.checkpoint)} cannot be read back: {e}", rec
                ) from e
        if loaded is not dst:
            src = _compat.narrow_tensor_by_index(loaded, ri.storage_offsets, ri.lengths)
            if dst.size() != src.size():
                raise self._corrupt(
                    f"{rec.where(self.checkpoint)} holds shape {tuple(src.size())}, "
                    f"{DCP_METADATA} says {tuple(dst.size())}",
                    rec,
                )
            dst.copy_(src)
        planner.commit_tensor(ri, dst)

    def _read_file(self, relative_path: str, items: list[ReadItem], planner: LoadPlanner) -> None:
        path = os.path.join(self.path, relative_path)
        try:
            f = open(path, "rb", buffering=0)  # noqa: SIM115 (closed below)
        except FileNotFoundError as e:
            raise self._corrupt(f"data file {relative_path} is missing", None, relative_path) from e
        except OSError as e:
            raise CheckpointReadError(
                f"checkpoint {self.checkpoint}: cannot read {relative_path}: {e}",
                path=self.checkpoint,
                file=relative_path,
            ) from e
        with f:
            for ri in items:
                try:
                    self._read_item(f, ri, planner)
                except (CheckpointCorruptError, CheckpointReadError):
                    raise
                except OSError as e:
                    raise CheckpointReadError(
                        f"checkpoint {self.checkpoint}: reading {relative_path} failed: {e}",
                        path=self.checkpoint,
                        file=relative_path,
                        key=ri.storage_index.fqn,
                    ) from e

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan``, grouped by file, in file order."""
        if any(self.storage_data[ri.storage_index].transform_descriptors for ri in plan.items):
            return super().read_data(plan, planner)
        per_file: dict[str, list[ReadItem]] = {}
        for ri in plan.items:
            per_file.setdefault(self.storage_data[ri.storage_index].relative_path, []).append(ri)
        for relative_path, items in per_file.items():
            items.sort(key=lambda ri: int(self.storage_data[ri.storage_index].offset))
            if self._records is not None:
                self._read_file(relative_path, items, planner)
                continue
            with open(os.path.join(self.path, relative_path), "rb") as f:
                for ri in items:
                    info = self.storage_data[ri.storage_index]
                    f.seek(info.offset)
                    raw = io.BytesIO(f.read(info.length))
                    if ri.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(ri, raw)
                        continue
                    dst = planner.resolve_tensor(ri).detach()
                    loaded = torch.load(raw, map_location="cpu", weights_only=True)
                    src = _compat.narrow_tensor_by_index(loaded, ri.storage_offsets, ri.lengths)
                    if dst.size() != src.size():
                        raise ValueError(
                            f"{ri.storage_index.fqn}: stored chunk has shape "
                            f"{tuple(src.size())}, the target expects {tuple(dst.size())}"
                        )
                    dst.copy_(src)
                    planner.commit_tensor(ri, dst)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut
