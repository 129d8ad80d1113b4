"""The mutation gate's arithmetic (tools/mutation_report.py): scores, targets, stale entries.

The report decides whether the mutation run passes (docs/testing.md, "Mutation testing"),
so its counting is tested on hand-made ``mutants/`` folders: a wrong denominator or a
stale equivalence entry taken at its word would let a real survivor through the gate.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "mutation_report", ROOT / "tools" / "mutation_report.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutation_report"] = module
    spec.loader.exec_module(module)
    return module


report = _load()


def _mutants(tmp_path: Path, files: dict[str, dict[str, int | None]]) -> Path:
    base = tmp_path / "mutants" / "src" / "purestep"
    for rel, codes in files.items():
        meta = base / f"{rel}.meta"
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps({"exit_code_by_key": codes}))
    return tmp_path / "mutants"


def _equivalents(tmp_path: Path, text: str) -> Path:
    folder = tmp_path / "eq"
    folder.mkdir()
    (folder / "a.toml").write_text(text)
    return folder


EQ = """
[[equivalent]]
mutant = "purestep.rng.x_f__mutmut_2"
line = "strict=False"
reason = "both lists come from the same batches"

[[equivalent]]
reason = "the default is the same value"
mutants = [["purestep.rng.x_f__mutmut_3", "batch_size=None"]]
"""


def test_score_is_killed_over_mutants_minus_equivalents_and_every_other_verdict_counts_against(
    tmp_path: Path,
) -> None:
    """Killed and timed-out mutants count for the score; survivors, untested and unrun
    mutants against it, and so does mutmut's 255 (its runner failed: no verdict); only
    listed equivalent *survivors* leave the denominator."""
    codes = {
        f"purestep.rng.x_f__mutmut_{i}": c
        for i, c in enumerate([1, 0, 0, 0, 36, 33, None, -11, 255])
    }
    verdicts = report.load_verdicts(_mutants(tmp_path, {"rng.py": codes}))
    equivalents = report.load_equivalents(_equivalents(tmp_path, EQ))
    areas, files = report.tally(verdicts, equivalents)
    t = areas["rng.py"]
    assert (t.total, t.caught, t.equivalent) == (9, 2, 2)
    assert t.score == pytest.approx(2 / 7)
    assert dict(t.counts) == {
        "killed": 1,
        "survived": 1,
        "equivalent": 2,
        "timeout": 1,
        "no tests": 1,
        "not run": 1,
        "suspicious": 1,
        "error": 1,
    }
    assert files["rng.py"].score == t.score


def test_files_are_grouped_into_their_areas_and_others_are_left_out(tmp_path: Path) -> None:
    """A file counts in the area whose pattern it matches; a file outside every area
    (a method) is tallied per file but in no area."""
    verdicts = report.load_verdicts(
        _mutants(
            tmp_path,
            {
                "optim/_adam.py": {"purestep.optim._adam.x_a__mutmut_1": 1},
                "optim/_sgd.py": {"purestep.optim._sgd.x_s__mutmut_1": 0},
                "methods/kd.py": {"purestep.methods.kd.x_k__mutmut_1": 0},
            },
        )
    )
    areas, files = report.tally(verdicts, {})
    assert areas["optim/"].total == 2 and areas["optim/"].score == 0.5
    assert sum(a.total for a in areas.values()) == 2
    assert files["methods/kd.py"].total == 1


def test_the_gate_fails_below_target_with_unrun_mutants_or_stale_entries(tmp_path: Path) -> None:
    """95 % passes the 95 % target, 18/19 does not; the testing kit needs 100 %; any
    mutant not run yet, and any stale entry, fails the gate."""
    ok = report.Tally(report.Counter(killed=19, survived=1))
    low = report.Tally(report.Counter(killed=18, survived=1))
    assert report.failures({"rng.py": ok}, []) == []
    assert report.failures({"rng.py": low}, []) == ["rng.py: 18/19 = 94.7 % < 95 %"]
    assert report.failures({"testing/": ok}, []) == ["testing/: 19/20 = 95.0 % < 100 %"]
    unrun = report.Tally(report.Counter(killed=1, **{"not run": 1}))
    assert report.failures({"tree.py": unrun}, [])[0] == "tree.py: 1 mutants not run yet"
    assert report.failures({}, ["m: gone"]) == ["stale equivalence entry m: gone"]


def test_an_entry_is_stale_when_its_mutant_is_gone_killed_or_writes_another_line(
    tmp_path: Path,
) -> None:
    """The equivalence list is checked against the run: a renumbered mutant (its diff no
    longer adds the recorded line), a killed one, or a missing one is reported."""
    verdicts = {
        "purestep.rng.x_f__mutmut_2": ("rng.py", "survived"),
        "purestep.rng.x_f__mutmut_3": ("rng.py", "killed"),
    }
    equivalents = report.load_equivalents(_equivalents(tmp_path, EQ))
    equivalents["purestep.rng.x_gone__mutmut_1"] = report.Equivalent(
        "purestep.rng.x_gone__mutmut_1", "x", "r"
    )
    diffs = {
        "purestep.rng.x_f__mutmut_2": "--- a\n+++ b\n-    zip(a, b, strict=True)\n+    zip(a, b, strict=False)"
    }
    stale = report.stale_equivalents(verdicts, equivalents, lambda n, rel: diffs.get(n, ""))
    assert stale == [
        "purestep.rng.x_f__mutmut_3: listed as equivalent but killed",
        "purestep.rng.x_gone__mutmut_1: no such mutant in mutants/",
    ]
    diffs["purestep.rng.x_f__mutmut_2"] = "+++ b\n+    zip(a, b)"
    stale = report.stale_equivalents(
        {k: v for k, v in verdicts.items() if k.endswith("2")},
        {k: v for k, v in equivalents.items() if k.endswith("2")},
        lambda n, rel: diffs[n],
    )
    assert stale == ["purestep.rng.x_f__mutmut_2: its diff no longer adds 'strict=False'"]


def test_a_mutant_listed_twice_is_refused(tmp_path: Path) -> None:
    """Two entries for one mutant (two reasons) are a review error, not a merge."""
    folder = _equivalents(tmp_path, EQ)
    (folder / "b.toml").write_text("[[equivalent]]" + EQ.split("[[equivalent]]")[1])
    with pytest.raises(ValueError, match=r"x_f__mutmut_2 is listed twice"):
        report.load_equivalents(folder)


def test_the_committed_equivalence_lists_parse_and_give_every_entry_a_reason() -> None:
    """Every committed entry names a mutant of a critical area, the line it adds and a reason."""
    equivalents = report.load_equivalents()
    for name, eq in equivalents.items():
        assert name.startswith("purestep.") and "__mutmut_" in name, name
        assert eq.line.strip() and len(eq.reason) > 20, name


def test_the_report_says_how_to_get_results_when_there_are_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a ``mutants/`` folder the report exits 2 and says to run mutmut first."""
    assert report.main(["--mutants", str(tmp_path / "none")]) == 2
    assert "run `mutmut run` first" in capsys.readouterr().err


def test_unreachable_mutants_leave_the_score_but_not_the_strict_score(tmp_path: Path) -> None:
    """An ``[[unreachable]]`` entry (CUDA-only, multi-rank-only) is excluded from the score,
    counted as a survivor by the strict score, and stale once it is killed or when an
    ``[[equivalent]]`` entry names a mutant no test reaches."""
    folder = _equivalents(
        tmp_path,
        '[[unreachable]]\nmutant = "purestep.rng.x_f__mutmut_1"\nline = "cuda"\n'
        'reason = "CUDA generators only: tests/test_cuda.py covers it on a GPU"\n'
        '[[equivalent]]\nmutant = "purestep.rng.x_f__mutmut_2"\nline = "x"\n'
        'reason = "the same value under every input the caller can give"\n',
    )
    equivalents = report.load_equivalents(folder)
    assert equivalents["purestep.rng.x_f__mutmut_1"].kind == "unreachable"
    verdicts = {
        "purestep.rng.x_f__mutmut_0": ("rng.py", "killed"),
        "purestep.rng.x_f__mutmut_1": ("rng.py", "no tests"),
        "purestep.rng.x_f__mutmut_2": ("rng.py", "no tests"),
    }
    areas, _ = report.tally(verdicts, equivalents)
    t = areas["rng.py"]
    assert (t.unreachable, t.equivalent, t.score, t.strict_score) == (1, 0, 0.5, 1 / 3)
    stale = report.stale_equivalents(verdicts, equivalents, lambda n, rel: "+ cuda x")
    assert stale == [
        "purestep.rng.x_f__mutmut_2: listed as equivalent but no test reaches it (not a verdict)"
    ]
    verdicts["purestep.rng.x_f__mutmut_1"] = ("rng.py", "killed")
    stale = report.stale_equivalents(verdicts, equivalents, lambda n, rel: "+ cuda x")
    assert stale[0] == "purestep.rng.x_f__mutmut_1: listed as unreachable but killed"


def test_a_deletion_only_mutant_is_recorded_by_the_line_it_deletes(tmp_path: Path) -> None:
    """An entry whose line starts with ``-`` matches a line the mutant deletes (a mutant
    that removes a statement adds none); the ``---`` header never matches."""
    name = "purestep.rng.x_f__mutmut_4"
    eq = {name: report.Equivalent(name, "-state.pop('x')", "r")}
    verdicts = {name: ("rng.py", "survived")}
    diff = "--- src/purestep/rng.py\n+++ src/purestep/rng.py\n     a = 1\n-    state.pop('x')\n"
    assert report.stale_equivalents(verdicts, eq, lambda n, rel: diff) == []
    moved = "--- state.pop('x')\n+++ b\n+    state.pop('x')\n"
    assert report.stale_equivalents(verdicts, eq, lambda n, rel: moved) == [
        f"{name}: its diff no longer deletes \"state.pop('x')\""
    ]


def test_pending_lists_exactly_the_matching_mutants_that_count_against_the_score(
    tmp_path: Path,
) -> None:
    """``--pending`` names every mutant that is neither caught nor listed, and only those
    matching a glob: the set ``mutmut run NAME...`` must re-run after tests land."""
    codes = {f"purestep.rng.x_f__mutmut_{i}": c for i, c in enumerate([1, 0, 0, None, 36, 255])}
    other = {"purestep.tree.x_g__mutmut_1": 0}
    verdicts = report.load_verdicts(_mutants(tmp_path, {"rng.py": codes, "tree.py": other}))
    equivalents = report.load_equivalents(_equivalents(tmp_path, EQ))
    got = report.pending(verdicts, equivalents, ["purestep.rng.*"])
    assert got == [f"purestep.rng.x_f__mutmut_{i}" for i in (1, 3, 5)]
    both = report.pending(verdicts, equivalents, ["purestep.rng.*", "*.x_g__*"])
    assert both == [
        *got[:0],
        "purestep.rng.x_f__mutmut_1",
        "purestep.rng.x_f__mutmut_3",
        "purestep.rng.x_f__mutmut_5",
        "purestep.tree.x_g__mutmut_1",
    ]
