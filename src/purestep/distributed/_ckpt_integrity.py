"""Checksums of checkpoint records and files, and the checks made with them.

Algorithm: xxHash's ``xxh3_64`` (the ``xxhash`` package), chosen by measurement
(``python benchmarks/checksum.py``; the figures are in README.md, "Performance"):
on the cache-hot pieces the writer and reader hash, it is several times faster
than ``zlib.crc32``, ``zlib.adler32`` or crc32c, which would add about as much
time as the save itself takes; that is why it is a dependency. It is a 64-bit
non-cryptographic hash: it detects accidental damage (bit flips, torn or stale
writes, truncation, a file from another checkpoint), not deliberate tampering.

What is covered, so that no byte of a checkpoint can change unnoticed:

* every tensor record (the whole record: pickle header and data), its
  checksum stored in ``metadata.json`` under ``integrity.records`` with its
  key, chunk offsets, file, offset, length and layout;
* DCP's ``.metadata`` file (size and checksum), verified before it is unpickled;
* every data file's size (``integrity.files``): checked by :func:`file_problem`
  without reading the data (``is_complete``, ``latest``);
* ``metadata.json`` itself: its last line is ``"checksum"``, the hash of the
  file's bytes with that value zeroed (:func:`seal`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from purestep.distributed._ckpt_errors import CheckpointCorruptError, CheckpointReadError

__all__ = [
    "ALGORITHM",
    "CHUNK",
    "DCP_METADATA",
    "LAYOUT_RAW",
    "LAYOUT_ZIP",
    "HashingWriter",
    "RecordInfo",
    "file_problem",
    "hasher",
    "read_exact",
    "seal",
    "seal_problem",
    "verify_records",
]

ALGORITHM = "xxh3_64"
"""The checksum algorithm, recorded in ``metadata.json`` as ``integrity.algorithm``."""

CHUNK = 1 << 19
"""Bytes hashed at a time (512 KiB: still in cache after the write or read that moved them)."""

DCP_METADATA = ".metadata"
"""DCP's own metadata file in a checkpoint directory."""

LAYOUT_RAW = "torch-legacy-contiguous"
"""Record layout: ``torch.save`` non-zip; ends with int64 numel and the row-major data."""

LAYOUT_ZIP = "torch-zip"
"""Record layout: ``torch.save``'s zip format (dtypes the non-zip format cannot load back)."""


def hasher() -> xxhash.xxh3_64:
    """A fresh incremental hasher of :data:`ALGORITHM`.

    Example:
        >>> h = hasher(); h.update(b"abc"); h.hexdigest()
        '78af5f94892f3950'
    """
    return xxhash.xxh3_64()


class HashingWriter:
    """Write-through wrapper of a binary file that hashes every byte written since :meth:`start`.

    Large buffers are written and hashed in :data:`CHUNK`-sized pieces, so each
    piece is hashed while it is still in cache.

    Example:
        >>> import io
        >>> w = HashingWriter(io.BytesIO()); w.start()
        >>> w.write(b"abc"), w.hexdigest()
        (3, '78af5f94892f3950')
    """

    def __init__(self, f: Any) -> None:
        self._f = f
        self._h = hasher()
        self.error: OSError | None = None
        """The last ``OSError`` a write raised (torch's zip writer replaces it with its own error)."""

    def start(self) -> None:
        """Begin a new record: reset the hash."""
        self._h = hasher()

    def hexdigest(self) -> str:
        """The hash of the bytes written since :meth:`start`."""
        return str(self._h.hexdigest())

    def write(self, data: Any) -> int:
        """Write ``data`` (any C-contiguous buffer) and hash it; returns its length in bytes."""
        if type(data) is bytes:  # pickle's small writes: the common case, kept cheap
            try:
                self._f.write(data)
            except OSError as e:
                self.error = e
                raise
            self._h.update(data)
            return len(data)
        mv = memoryview(data)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        n = mv.nbytes
        try:
            for i in range(0, max(n, 1), CHUNK):
                piece = mv[i : i + CHUNK]
                self._f.write(piece)
                self._h.update(piece)
        except OSError as e:
            self.error = e
            raise
        return n

    def flush(self) -> None:
        """Flush the underlying file."""
        self._f.flush()

    def tell(self) -> int:
        """The underlying file's position."""
        return int(self._f.tell())


def read_exact(f: Any, into: memoryview, h: Any | None) -> int:
    """Fill ``into`` from ``f`` (hashing each chunk into ``h``); returns the bytes read (short at EOF).

    Example:
        >>> import io
        >>> buf = bytearray(4)
        >>> read_exact(io.BytesIO(b"abcdef"), memoryview(buf), None), bytes(buf)
        (4, b'abcd')
    """
    n = into.nbytes
    got = 0
    while got < n:
        piece = into[got : min(n, got + CHUNK)]
        k = f.readinto(piece)
        if not k:
            break
        if h is not None:
            h.update(piece[:k])
        got += k
    return got


@dataclass(frozen=True)
class RecordInfo:
    """Where one stored chunk of one key lives and what its bytes hash to.

    Example:
        >>> r = RecordInfo("w", (0,), "__0_0.distcp", 0, 400, LAYOUT_RAW, "00ff")
        >>> RecordInfo.from_json(r.to_json()) == r
        True
    """

    key: str
    chunk: tuple[int, ...]
    file: str
    offset: int
    length: int
    layout: str
    checksum: str

    def to_json(self) -> dict[str, Any]:
        """The record as stored in ``metadata.json``."""
        return {
            "key": self.key,
            "chunk": list(self.chunk),
            "file": self.file,
            "offset": self.offset,
            "length": self.length,
            "layout": self.layout,
            "checksum": self.checksum,
        }

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> RecordInfo:
        """Parse a record written by :meth:`to_json` (``KeyError``/``TypeError`` if malformed)."""
        return RecordInfo(
            str(d["key"]),
            tuple(int(x) for x in d["chunk"]),
            str(d["file"]),
            int(d["offset"]),
            int(d["length"]),
            str(d["layout"]),
            str(d["checksum"]),
        )

    def where(self, path: Path) -> str:
        """``'the record of key <key> in <path>/<file> (bytes a..b)'``, for error messages."""
        chunk = f" (chunk at {list(self.chunk)})" if any(self.chunk) else ""
        return (
            f"the record of key {self.key}{chunk} in {path / self.file} "
            f"(bytes {self.offset}..{self.offset + self.length})"
        )


_PLACEHOLDER = b"0" * 16
_SEAL = re.compile(rb'"checksum": "([0-9a-f]{16})"\n}\n\Z')


def _line(key: str, value: Any, indent: str) -> str:
    return f"{indent}{json.dumps(key)}: {json.dumps(value)}"


def seal(md: Mapping[str, Any]) -> bytes:
    """``metadata.json``'s bytes: one top-level key per line, one integrity record per line,
    and last ``"checksum"``: the hash of these very bytes with the checksum's value zeroed.

    Hashing the bytes (rather than re-serialising the parsed content) keeps
    writing and checking to one pass of the C JSON codec and a hash.

    Example:
        >>> data = seal({"a": 1})
        >>> data.decode().splitlines()[:2], seal_problem(data)
        (['{', ' "a": 1,'], None)
    """
    lines = []
    for key, value in md.items():
        if key == "checksum":
            continue
        if key == "integrity" and isinstance(value, Mapping):
            inner = []
            for k, v in value.items():
                if k == "records" and isinstance(v, list) and v:
                    rows = ",\n".join("   " + json.dumps(r) for r in v)
                    inner.append(f"  {json.dumps(k)}: [\n{rows}\n  ]")
                else:
                    inner.append(_line(k, v, "  "))
            lines.append(f" {json.dumps(key)}: {{\n" + ",\n".join(inner) + "\n }")
        else:
            lines.append(_line(key, value, " "))
    lines.append(f' "checksum": "{_PLACEHOLDER.decode()}"')
    data = ("{\n" + ",\n".join(lines) + "\n}\n").encode()
    at = data.rindex(_PLACEHOLDER)
    digest = xxhash.xxh3_64_hexdigest(data).encode()
    return data[:at] + digest + data[at + len(_PLACEHOLDER) :]


def seal_problem(data: bytes) -> str | None:
    """Why ``data`` (a ``metadata.json``'s bytes) does not match its own checksum; ``None`` if it does.

    ``"it has no checksum"`` when the last line is not a checksum.

    Example:
        >>> data = bytearray(seal({"a": 1})); data[8] ^= 1  # "a": 1 -> "a": 0
        >>> seal_problem(bytes(data))
        'its content does not match its own checksum'
    """
    m = _SEAL.search(data)
    if m is None:
        return "it has no checksum"
    zeroed = data[: m.start(1)] + _PLACEHOLDER + data[m.end(1) :]
    if xxhash.xxh3_64_hexdigest(zeroed) != m.group(1).decode():
        return "its content does not match its own checksum"
    return None


def _files(md: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    files = md["integrity"]["files"]
    if not isinstance(files, dict):
        raise TypeError("integrity.files is not an object")
    return files


def records(md: Mapping[str, Any]) -> list[RecordInfo]:
    """The records listed in a (sealed, hence trusted) ``metadata.json``.

    Example:
        >>> records({"integrity": {"records": []}})
        []
    """
    return [RecordInfo.from_json(r) for r in md["integrity"]["records"]]


def file_problem(path: Path, md: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first file listed in ``md`` that is missing or not of its recorded size, and why.

    Cheap: one ``stat`` per file, no data read.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> file_problem(d, {"integrity": {"files": {"f": {"size": 3}}}})
        ('f', 'data file f is missing')
    """
    for name, info in _files(md).items():
        try:
            size = os.stat(path / name).st_size
        except FileNotFoundError:
            return name, f"data file {name} is missing"
        except OSError as e:
            return name, f"data file {name} cannot be read ({e})"
        if size != int(info["size"]):
            return name, f"data file {name} has {size} bytes, {int(info['size'])} were written"
    return None


def _by_file(recs: Sequence[RecordInfo]) -> Iterator[tuple[str, list[RecordInfo]]]:
    groups: dict[str, list[RecordInfo]] = {}
    for r in recs:
        groups.setdefault(r.file, []).append(r)
    for name, items in groups.items():
        yield name, sorted(items, key=lambda r: r.offset)


def check_bytes(
    path: Path, name: str, expected: str, got: str, what: str | RecordInfo, key: str | None
) -> None:
    """Raise :class:`CheckpointCorruptError` if the ``got`` checksum differs from ``expected``.

    ``what`` names the bytes (a record's description is built only on a mismatch).

    Example:
        >>> check_bytes(Path("/c"), "f", "00", "00", "record", None)
    """
    if got != expected:
        where = what.where(path) if isinstance(what, RecordInfo) else what
        raise CheckpointCorruptError(
            f"checkpoint {path} is damaged: {where} fails its {ALGORITHM} checksum "
            f"(stored {expected}, computed {got})",
            path=path,
            file=name,
            key=key,
        )


def verify_metadata_file(path: Path, md: Mapping[str, Any]) -> bytes:
    """DCP's ``.metadata`` bytes, after checking their size and checksum.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp()); _ = (d / ".metadata").write_bytes(b"x")
        >>> md = {"integrity": {"files": {".metadata": {"size": 1, "checksum": "eaf06c6480b2cd11"}}}}
        >>> verify_metadata_file(d, md)
        b'x'
    """
    info = _files(md).get(DCP_METADATA)
    if info is None:
        raise CheckpointCorruptError(
            f"checkpoint {path} is damaged: metadata.json does not list {DCP_METADATA}",
            path=path,
            file="metadata.json",
        )
    try:
        data = (path / DCP_METADATA).read_bytes()
    except FileNotFoundError as e:
        raise CheckpointCorruptError(
            f"checkpoint {path} is damaged: {DCP_METADATA} is missing",
            path=path,
            file=DCP_METADATA,
        ) from e
    except OSError as e:
        raise CheckpointReadError(
            f"checkpoint {path}: cannot read {DCP_METADATA}: {e}", path=path, file=DCP_METADATA
        ) from e
    if len(data) != int(info["size"]):
        raise CheckpointCorruptError(
            f"checkpoint {path} is damaged: {DCP_METADATA} has {len(data)} bytes, "
            f"{int(info['size'])} were written",
            path=path,
            file=DCP_METADATA,
        )
    got = xxhash.xxh3_64_hexdigest(data)
    check_bytes(path, DCP_METADATA, str(info["checksum"]), got, DCP_METADATA, None)
    return data


def verify_records(path: Path, md: Mapping[str, Any], *, rank: int = 0, world: int = 1) -> int:
    """Read and check this rank's share of the records (every ``world``-th); returns bytes read.

    Rank 0 also checks ``.metadata``. Files are read in offset order, each
    record hashed chunk by chunk; the first mismatch, missing file or short
    read raises :class:`CheckpointCorruptError` naming the file and key.

    Example:
        >>> import tempfile
        >>> verify_records(Path(tempfile.mkdtemp()), {"integrity": {"records": [], "files": {}}},
        ...                rank=1, world=2)
        0
    """
    if rank == 0:
        verify_metadata_file(path, md)
    mine = [r for i, r in enumerate(records(md)) if i % world == rank]
    total = 0
    buf = bytearray(CHUNK)
    for name, recs in _by_file(mine):
        try:
            f = open(path / name, "rb", buffering=0)  # noqa: SIM115 (closed below)
        except FileNotFoundError as e:
            raise CheckpointCorruptError(
                f"checkpoint {path} is damaged: data file {name} is missing",
                path=path,
                file=name,
                key=recs[0].key,
            ) from e
        except OSError as e:
            raise CheckpointReadError(
                f"checkpoint {path}: cannot read {name}: {e}", path=path, file=name
            ) from e
        with f:
            for r in recs:
                try:
                    digest = _hash_range(f, r, buf)
                except OSError as e:
                    raise CheckpointReadError(
                        f"checkpoint {path}: reading {name} failed: {e}",
                        path=path,
                        file=name,
                        key=r.key,
                    ) from e
                if digest is None:
                    raise CheckpointCorruptError(
                        f"checkpoint {path} is damaged: {name} is truncated "
                        f"({r.where(path)} runs past its end)",
                        path=path,
                        file=name,
                        key=r.key,
                    )
                check_bytes(path, name, r.checksum, digest, r, r.key)
                total += r.length
    return total


def _hash_range(f: Any, r: RecordInfo, buf: bytearray) -> str | None:
    """The checksum of ``r``'s bytes in ``f``, or ``None`` if the file ends first."""
    h = hasher()
    f.seek(r.offset)
    left = r.length
    while left:
        view = memoryview(buf)[: min(left, CHUNK)]
        got = read_exact(f, view, h)
        if got < view.nbytes:
            return None
        left -= got
    return str(h.hexdigest())
