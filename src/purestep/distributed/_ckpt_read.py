"""The read half of :func:`purestep.distributed.checkpoint.load`: checks, then DCP's read.

:func:`prepare` runs before any of DCP's collectives: ``metadata.json``
(against its own checksum), every data file's size, the key match with
``like`` and ``.metadata``'s checksum; with ``donate`` and ``verify`` it then
reads and checks every record (each rank a share) before anything is written
into the live state. :func:`read` runs DCP's load through the verifying
:class:`RecordReader` and turns every failure into a :class:`CheckpointError`.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from purestep.distributed._ckpt_errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointReadError,
)
from purestep.distributed._ckpt_group import _quiet_no_dist, _raise_agreed, _rank, _world, from_dcp
from purestep.distributed._ckpt_integrity import (
    DCP_METADATA,
    file_problem,
    records,
    verify_metadata_file,
    verify_records,
)
from purestep.distributed._ckpt_paths import METADATA_FILE, read_metadata
from purestep.distributed._ckpt_state import describe, flatten, mismatch
from purestep.distributed._storage import RecordReader

__all__ = ["cross_check", "prepare", "read"]


def _check(path: Path, like: TensorDictBase, expected_of: Any, what: str, verify: bool) -> Any:
    """Metadata, file sizes, the key match and ``.metadata``'s checksum, before any of DCP's
    collectives; returns ``(md, flat_like, .metadata bytes or None)``."""
    md = read_metadata(path)
    found = file_problem(path, md)
    if found is not None:
        raise CheckpointCorruptError(
            f"checkpoint {path} is damaged: {found[1]}", path=path, file=found[0]
        )
    flat_like = flatten(like, "like")
    err = mismatch(path, expected_of(md), describe(flat_like), what)
    if err is not None:
        raise err
    dcp_md = verify_metadata_file(path, md) if verify else None
    return md, flat_like, dcp_md


def prepare(
    path: Path,
    like: TensorDictBase,
    group: Any,
    expected_of: Callable[[Mapping[str, Any]], Any],
    what: str,
    donate: bool,
    verify: bool,
    prefix: str = "",
) -> tuple[dict[str, Any], dict[str, torch.Tensor], bytes | None]:
    """Every check that can fail before DCP reads, agreed by all ranks.

    Returns ``(metadata.json, flat like, .metadata bytes)``. With ``donate`` and
    ``verify``, each rank then reads and checks its share of every record this
    load reads (the keys of ``like``, under ``prefix`` in the checkpoint), so a
    damaged checkpoint fails here, before the live state is touched.
    """
    problem: CheckpointError | None = None
    md: dict[str, Any] = {}
    flat_like: dict[str, torch.Tensor] = {}
    dcp_md: bytes | None = None
    try:
        md, flat_like, dcp_md = _check(path, like, expected_of, what, verify)
    except CheckpointError as e:
        problem = e
    _raise_agreed(group, problem, f"loading checkpoint {path}")
    if donate and verify:  # check every byte before anything is written into the live state
        try:
            only = _only(md, flat_like, prefix)
            verify_records(path, only, rank=_rank(group), world=_world(group))
        except CheckpointError as e:
            problem = e
        _raise_agreed(group, problem, f"loading checkpoint {path}")
    return md, flat_like, dcp_md


def _only(
    md: dict[str, Any], flat_like: Mapping[str, torch.Tensor], prefix: str = ""
) -> dict[str, Any]:
    """``md`` whose integrity records are those of ``flat_like``'s keys under ``prefix``."""
    recs = md["integrity"]["records"]
    names = {prefix + k for k in flat_like}
    kept = [r for r in recs if r.get("key") in names]
    if len(kept) == len(recs):
        return md
    return {**md, "integrity": {**md["integrity"], "records": kept}}


def read(
    group: Any,
    path: Path,
    flat_like: dict[str, torch.Tensor],
    donate: bool,
    md: Mapping[str, Any],
    verify: bool,
    dcp_md: bytes | None,
) -> dict[str, torch.Tensor]:
    """DCP's load of ``path`` into ``flat_like`` (or fresh ``empty_like`` tensors unless
    ``donate``) through the verifying :class:`RecordReader`; failures as :class:`CheckpointError`."""
    dst = flat_like if donate else {k: torch.empty_like(v) for k, v in flat_like.items()}
    if not dst:
        return dst
    _quiet_no_dist()
    try:
        with torch.no_grad():
            dcp_load(
                dst,
                storage_reader=RecordReader(path, integrity=md, verify=verify, dcp_metadata=dcp_md),
                process_group=group,
                no_dist=group is None,
            )
    except CheckpointException as e:
        found = from_dcp(e, path, CheckpointReadError, "loading")
        if isinstance(found, CheckpointError):
            raise found from found.__cause__
        raise found from e  # this rank was interrupted (KeyboardInterrupt, SystemExit)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointReadError(
            f"loading checkpoint {path} failed: {type(e).__name__}: {e}", path=path
        ) from e
    return dst


def cross_check(path: Path, md: Mapping[str, Any]) -> None:
    """DCP's ``.metadata`` (checksum verified first) places every record where metadata.json does."""
    dcp_md = pickle.loads(verify_metadata_file(path, md))
    if not isinstance(dcp_md, Metadata):
        raise CheckpointCorruptError(
            f"checkpoint {path} is damaged: {DCP_METADATA} does not hold DCP metadata",
            path=path,
            file=DCP_METADATA,
        )
    ours = {(r.key, r.chunk): (r.file, r.offset, r.length) for r in records(md)}
    theirs = {
        (idx.fqn, tuple(int(x) for x in (idx.offset or ()))): (
            info.relative_path,
            info.offset,
            info.length,
        )
        for idx, info in (dcp_md.storage_data or {}).items()
    }
    if ours != theirs:
        differ = sorted({k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k)})
        raise CheckpointCorruptError(
            f"checkpoint {path} is damaged: {DCP_METADATA} and {METADATA_FILE} disagree about "
            f"the records of {', '.join(k for k, _ in differ[:5])}",
            path=path,
            file=DCP_METADATA,
            key=differ[0][0],
        )
