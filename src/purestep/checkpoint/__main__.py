"""``python -m purestep.checkpoint verify PATH [PATH ...]``: check checkpoints without a model.

Each PATH is a checkpoint directory, or a run directory whose checkpoints
(complete and damaged ones) are all checked. Every byte is read and checked
against the checksums in ``metadata.json`` (:func:`purestep.checkpoint.verify`).
Prints one line per checkpoint (``ok``, or ``DAMAGED`` / ``FAILED`` with the error) and exits
with status 0 if all are intact, 1 if any is not, 2 on bad usage.

Example:
    >>> main(["verify", "/nonexistent/ckpt"])
    1
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from purestep.distributed import checkpoint as ckpt

__all__ = ["main"]


def _targets(path: Path) -> list[Path]:
    """``path`` itself, or, for a run directory, every checkpoint in it (intact and damaged)."""
    if (path / ckpt.METADATA_FILE).exists():
        return [path]
    found = ckpt.checkpoints(path) + [p for p, _ in ckpt.damaged(path)]
    return sorted(set(found)) or [path]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    Example:
        >>> main(["verify", "/nonexistent/ckpt"])
        1
    """
    ap = argparse.ArgumentParser(prog="python -m purestep.checkpoint", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="check every byte of checkpoints against their checksums")
    v.add_argument("paths", nargs="+", type=Path, help="checkpoint or run directories")
    args = ap.parse_args(argv)
    bad = 0
    for target in [t for p in args.paths for t in _targets(p)]:
        try:
            s = ckpt.verify(target)
        except ckpt.CheckpointError as e:
            bad += 1
            label = "DAMAGED" if isinstance(e, ckpt.CheckpointCorruptError) else "FAILED"
            print(f"{label} {target}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        print(
            f"ok {target}: step {s['step']}, {s['records']} records in {s['files']} files, "
            f"{s['bytes'] / 1e6:.1f} MB checked ({s['algorithm']}) in {s['seconds']:.2f} s"
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
