"""Mutation scores of the critical modules, and the gate they must pass (docs/testing.md).

Reads what ``mutmut run`` left in ``mutants/`` (one ``.meta`` file per mutated source
file) and the reviewed lists of equivalent mutants in ``tools/mutation_equivalents/*.toml`` (one
file per area),
and prints, for every critical area and every file in it, how many mutants were killed,
how many survived, which survivors are equivalent, and the score

    score = killed / (mutants - equivalent - unreachable)

where "killed" counts mutmut's "killed" and "timeout" verdicts (a mutant that makes a
test hang was caught; mutmut scores it the same way), except exit status 255, which
mutmut also calls a timeout but which means its test runner failed (shown as "error"),
and every other verdict of a
non-equivalent mutant (survived, no tests, not run yet, suspicious) counts against it.
"Unreachable" mutants are the second kind of entry: code that no single-process CPU test
can run (a CUDA-only branch, a branch taken only with several ranks), each listed with the
GPU or multi-process test that covers it. They are not equivalent, so the table shows them
in their own column and also gives the strict score, which counts them as survivors.

Each equivalence entry names its mutants and the line they put in the source; the report
re-reads each mutant's diff and calls the entry stale when the line is no longer there
(the function changed and mutmut renumbered its mutants), or when the mutant was killed
after all (then it was not equivalent). Stale entries fail the gate, so the list cannot
silently drift away from the code.

Usage (from the repository root, after ``mutmut run``)::

    python tools/mutation_report.py                 # the table, per area and per file
    python tools/mutation_report.py --markdown      # the same, as docs/testing.md's table
    python tools/mutation_report.py --survivors     # every non-equivalent survivor, with its diff
    python tools/mutation_report.py --survivors "purestep.tree.*"   # ... of matching mutants
    python tools/mutation_report.py --check         # exit 1 unless every area meets its target
    mutmut run $(python tools/mutation_report.py --pending "purestep.optim.*")   # re-run those
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
import tomllib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENTS = ROOT / "tools" / "mutation_equivalents"

# The critical areas of issue 18, the source files (relative to src/purestep/) each
# covers, and the share of non-equivalent mutants that must be killed.
AREAS: dict[str, tuple[tuple[str, ...], float]] = {
    "testing/": (
        (
            "testing/_compare.py",
            "testing/_global_rng.py",
            "testing/_steps.py",
            "testing/checks.py",
            "testing/_accumulation.py",
            "testing/imperative.py",
        ),
        1.00,
    ),
    "optim/": (("optim/*",), 0.95),
    "step/": (("step/*",), 0.95),
    "rng.py": (("rng.py",), 0.95),
    "tree.py": (("tree.py",), 0.95),
    "distributed/checkpoint.py": (("distributed/checkpoint.py",), 0.95),
    "loop/": (("loop/*",), 0.95),
}

# mutmut's exit codes (mutmut.stats.status_by_exit_code), folded into what the score needs.
_STATUS = {
    1: "killed",
    3: "killed",
    0: "survived",
    5: "no tests",
    33: "no tests",
    34: "skipped",
    36: "timeout",
    24: "timeout",
    -24: "timeout",
    152: "timeout",
    # mutmut maps 255 to "timeout", but it is its forkserver failing to run the tests at
    # all (e.g. a test id the warm session could not find): no verdict, so not caught.
    255: "error",
    37: "caught by type check",
    None: "not run",
}
_CAUGHT = {"killed", "timeout", "caught by type check"}


def status_of(exit_code: int | None) -> str:
    """mutmut's verdict for an exit code ("suspicious" for any code it does not name).

    Example:
        >>> status_of(1), status_of(0), status_of(None), status_of(-11)
        ('killed', 'survived', 'not run', 'suspicious')
    """
    return _STATUS.get(exit_code, "suspicious")


@dataclass(frozen=True)
class Equivalent:
    """One reviewed mutant: the line it writes, and why no test here can tell it apart.

    ``kind`` is ``"equivalent"`` (no input can tell it from the original) or
    ``"unreachable"`` (it differs only where no single-process CPU test can run).
    """

    mutant: str
    line: str
    reason: str
    kind: str = "equivalent"


@dataclass
class Tally:
    """Verdict counts of one file or area."""

    counts: Counter[str] = field(default_factory=Counter)
    equivalent: int = 0
    unreachable: int = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def caught(self) -> int:
        return sum(self.counts[s] for s in _CAUGHT)

    @property
    def score(self) -> float | None:
        """Killed share of the mutants neither equivalent nor unreachable (None if none).

        Example:
            >>> t = Tally(Counter(killed=19, survived=2), equivalent=1)
            >>> t.score
            0.95
        """
        denominator = self.total - self.equivalent - self.unreachable
        return None if denominator <= 0 else self.caught / denominator

    @property
    def strict_score(self) -> float | None:
        """Killed share of the non-equivalent mutants, unreachable ones counted as survivors."""
        denominator = self.total - self.equivalent
        return None if denominator <= 0 else self.caught / denominator

    def add(self, other: Tally) -> None:
        self.counts.update(other.counts)
        self.equivalent += other.equivalent
        self.unreachable += other.unreachable


def load_equivalents(path: Path = EQUIVALENTS) -> dict[str, Equivalent]:
    """The reviewed equivalent mutants, by name, from a TOML file or a folder of them.

    Each file holds ``[[equivalent]]`` and ``[[unreachable]]`` tables, each with
    ``reason`` and either one ``mutant`` and its ``line`` (the text the mutant's diff
    adds, or a part of it) or a list ``mutants = [[name, line], ...]`` that share the
    reason.

    Example:
        >>> sorted(load_equivalents())[:1]  # doctest: +SKIP
        ['purestep.optim._adam.x_adam__mutmut_12']
    """
    files = sorted(path.glob("*.toml")) if path.is_dir() else [path] if path.exists() else []
    out: dict[str, Equivalent] = {}
    for file in files:
        data = tomllib.loads(file.read_text())
        for kind in ("equivalent", "unreachable"):
            for entry in data.get(kind, []):
                reason = entry["reason"]
                pairs = entry.get("mutants") or [[entry["mutant"], entry["line"]]]
                for name, line in pairs:
                    if name in out:
                        raise ValueError(f"{file}: {name} is listed twice")
                    out[name] = Equivalent(name, line, reason, kind)
    return out


def load_verdicts(mutants: Path) -> dict[str, tuple[str, str]]:
    """``{mutant name: (source file relative to src/purestep/, verdict)}`` from ``mutants/``.

    Example:
        >>> load_verdicts(Path("no-such-dir"))
        {}
    """
    base = mutants / "src" / "purestep"
    out: dict[str, tuple[str, str]] = {}
    for meta in sorted(base.rglob("*.py.meta")):
        rel = meta.relative_to(base).as_posix().removesuffix(".meta")
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        for name, code in codes.items():
            out[name] = (rel, status_of(code))
    return out


def area_of(rel: str) -> str | None:
    """The critical area a source file (relative to src/purestep/) belongs to, if any.

    Example:
        >>> area_of("optim/_adam.py"), area_of("testing/checks.py"), area_of("methods/kd.py")
        ('optim/', 'testing/', None)
    """
    for area, (patterns, _) in AREAS.items():
        if any(fnmatch.fnmatch(rel, p) for p in patterns):
            return area
    return None


def _listed(eq: Equivalent | None, status: str) -> str | None:
    """The column a listed mutant counts in ("equivalent", "unreachable"), or None.

    A listing counts only for the verdict it claims: an equivalent mutant must have
    survived, an unreachable one survived or been reached by no test.
    """
    if eq is not None and eq.kind == "equivalent" and status == "survived":
        return "equivalent"
    if eq is not None and eq.kind == "unreachable" and status in ("survived", "no tests"):
        return "unreachable"
    return None


def tally(
    verdicts: dict[str, tuple[str, str]], equivalents: dict[str, Equivalent]
) -> tuple[dict[str, Tally], dict[str, Tally]]:
    """Per-area and per-file tallies; equivalent survivors counted apart from the rest.

    Example:
        >>> v = {"a.x_f__mutmut_1": ("rng.py", "killed"), "a.x_f__mutmut_2": ("rng.py", "survived")}
        >>> areas, files = tally(v, {})
        >>> areas["rng.py"].score, files["rng.py"].counts["survived"]
        (0.5, 1)
    """
    files: dict[str, Tally] = {}
    for name, (rel, status) in verdicts.items():
        t = files.setdefault(rel, Tally())
        kind = _listed(equivalents.get(name), status)
        if kind == "equivalent":
            t.equivalent += 1
            status = kind
        elif kind == "unreachable":
            t.unreachable += 1
            status = kind
        t.counts[status] += 1
    areas: dict[str, Tally] = {area: Tally() for area in AREAS}
    for rel, t in files.items():
        area = area_of(rel)
        if area is not None:
            areas[area].add(t)
    return areas, files


def stale_equivalents(
    verdicts: dict[str, tuple[str, str]],
    equivalents: dict[str, Equivalent],
    diff_of: DiffFn,
) -> list[str]:
    """Entries of the equivalence list that no longer describe a surviving mutant.

    An entry is stale when its mutant does not exist, was killed (so it was not
    equivalent), or its diff no longer adds the recorded line (mutmut renumbered the
    function's mutants after a change). A recorded line starting with ``-`` is a line
    the mutant deletes (for mutants that add none).

    Example:
        >>> stale_equivalents({}, {"m": Equivalent("m", "x", "r")}, lambda n, p: "")
        ['m: no such mutant in mutants/']
    """
    out: list[str] = []
    for name, eq in sorted(equivalents.items()):
        if name not in verdicts:
            out.append(f"{name}: no such mutant in mutants/")
            continue
        rel, status = verdicts[name]
        if status in _CAUGHT:
            out.append(f"{name}: listed as {eq.kind} but {status}")
            continue
        if status == "no tests" and eq.kind == "equivalent":
            out.append(f"{name}: listed as equivalent but no test reaches it (not a verdict)")
            continue
        # A mutant that only deletes a line is recorded as "-<text of the deleted line>".
        sign, want = ("-", eq.line[1:]) if eq.line.startswith("-") else ("+", eq.line)
        body = [ln for ln in diff_of(name, rel).splitlines() if not ln.startswith(sign * 3)]
        if not any(want.strip() in ln[1:].strip() for ln in body if ln.startswith(sign)):
            verb = "deletes" if sign == "-" else "adds"
            out.append(f"{name}: its diff no longer {verb} {want!r}")
    return out


class DiffFn:
    """Computes a mutant's diff with mutmut's own reader (one parse per file)."""

    def __call__(self, name: str, rel: str) -> str:
        from mutmut.mutation.diff_apply import get_diff_for_mutant

        return str(get_diff_for_mutant(name, path=Path("src") / "purestep" / rel))


def _fmt_score(t: Tally) -> str:
    s = t.score
    n = t.total - t.equivalent - t.unreachable
    return "-" if s is None else f"{t.caught}/{n} = {100 * s:.1f} %"


def _fmt_strict(t: Tally) -> str:
    s = t.strict_score
    return "-" if s is None else f"{100 * s:.1f} %"


_COLUMNS = (
    "killed",
    "timeout",
    "survived",
    "equivalent",
    "unreachable",
    "no tests",
    "not run",
    "suspicious",
    "error",
)


def rows(areas: dict[str, Tally], files: dict[str, Tally]) -> Iterable[tuple[str, Tally, str]]:
    """(label, tally, target) rows: each area, then its files indented."""
    for area, (_, target) in AREAS.items():
        yield area, areas[area], f"{100 * target:.0f} %"
        for rel in sorted(files):
            if area_of(rel) == area and rel != area:
                yield f"  {rel}", files[rel], ""


def render(areas: dict[str, Tally], files: dict[str, Tally], markdown: bool) -> str:
    """The score table, as text or as a markdown table."""
    head = ("module", "mutants", *_COLUMNS, "score", "strict", "target")
    lines = []
    for label, t, target in rows(areas, files):
        counts = (str(t.counts[c]) for c in _COLUMNS)
        cells = (label, str(t.total), *counts, _fmt_score(t), _fmt_strict(t), target)
        lines.append(cells)
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for cells in lines:
            label = cells[0]
            label = f"&nbsp;&nbsp;`{label.strip()}`" if label.startswith(" ") else f"**`{label}`**"
            out.append("| " + " | ".join((label, *cells[1:])) + " |")
        return "\n".join(out)
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*head), *(fmt.format(*c) for c in lines)])


def failures(areas: dict[str, Tally], stale: Sequence[str]) -> list[str]:
    """Why the gate fails: areas under target or not fully run, and stale entries.

    Example:
        >>> failures({"rng.py": Tally(Counter(killed=1, survived=1))}, [])
        ['rng.py: 1/2 = 50.0 % < 95 %']
    """
    out = []
    for area, t in areas.items():
        target = AREAS[area][1]
        if t.counts["not run"]:
            out.append(f"{area}: {t.counts['not run']} mutants not run yet")
        s = t.score
        if s is not None and s < target - 1e-12:
            out.append(f"{area}: {_fmt_score(t)} < {100 * target:.0f} %")
    return out + [f"stale equivalence entry {s}" for s in stale]


def pending(
    verdicts: dict[str, tuple[str, str]],
    equivalents: dict[str, Equivalent],
    globs: Sequence[str],
) -> list[str]:
    """Names of the mutants matching any glob that count against the score, to re-run.

    Those are the ones neither caught nor counted as listed (an equivalent survivor, an
    unreachable survivor or untested mutant): survivors, untested, not run yet (listed or
    not: a listed mutant must run to confirm it survives), suspicious or errored. After new tests land, ``mutmut run``
    with these names re-runs exactly them (a glob would re-run every matching mutant).

    Example:
        >>> v = {"p.x_f__mutmut_1": ("rng.py", "killed"), "p.x_f__mutmut_2": ("rng.py", "not run")}
        >>> pending(v, {}, ["p.*"])
        ['p.x_f__mutmut_2']
    """
    return [
        name
        for name, (rel, status) in sorted(verdicts.items())
        if status not in _CAUGHT
        and not _listed(equivalents.get(name), status)
        and area_of(rel) is not None
        and any(fnmatch.fnmatch(name, g) for g in globs)
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mutants", type=Path, default=Path("mutants"))
    parser.add_argument("--equivalents", type=Path, default=EQUIVALENTS)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--survivors", nargs="?", const="*", metavar="GLOB")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--pending", nargs="+", metavar="GLOB")
    args = parser.parse_args(argv)

    verdicts = load_verdicts(args.mutants)
    if not verdicts:
        print(f"no mutmut results under {args.mutants}/: run `mutmut run` first", file=sys.stderr)
        return 2
    equivalents = load_equivalents(args.equivalents)
    areas, files = tally(verdicts, equivalents)
    if args.pending is not None:
        print("\n".join(pending(verdicts, equivalents, args.pending)))
        return 0
    diff_of = DiffFn()
    if args.survivors is not None:
        for name, (rel, status) in sorted(verdicts.items()):
            if status in _CAUGHT or status == "not run" or name in equivalents:
                continue
            if area_of(rel) is None or not fnmatch.fnmatch(name, args.survivors):
                continue
            print(f"# {name}: {status}")
            print(diff_of(name, rel))
            print()
        return 0
    print(render(areas, files, args.markdown))
    stale = stale_equivalents(verdicts, equivalents, diff_of)
    problems = failures(areas, stale)
    for p in problems:
        print(f"FAIL {p}", file=sys.stderr)
    return 1 if args.check and problems else 0


if __name__ == "__main__":
    sys.exit(main())
