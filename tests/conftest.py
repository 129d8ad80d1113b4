"""Test configuration: hypothesis profiles, and the ``cuda`` marker's skip.

``CI=true`` selects the ``ci`` profile (derandomized: the same examples on every
run, so a CI run is reproducible); elsewhere ``dev`` explores new examples each
run. Under mutmut (which sets ``MUTANT_UNDER_TEST`` in every run it starts) the
``mutation`` profile is the default: derandomized, so a mutant's verdict does not
depend on the luck of the draw and reruns agree; no example database, so a
failure found for one mutant is not replayed against the next; no deadline, so a
slow example on the loaded machine never counts as a kill; no shrinking (the
first failing example kills the mutant; shrinking it only burns the CPU-time limit
mutmut reports as a timeout); and at most
``MUTATION_MAX_EXAMPLES`` (default 20) examples for the tests that do not set
their own ``max_examples``; torch then runs one intra-op thread per test process
(see docs/testing.md, "Mutation testing"), and every test runs in a scratch working
directory, so a mutant that deletes its working directory cannot delete mutmut's. Pick one
explicitly with ``HYPOTHESIS_PROFILE=dev|ci|mutation``.

Tests marked ``cuda`` run whenever ``torch.cuda.is_available()`` and are skipped
(with the reason) otherwise, so the default ``pytest`` runs them on a GPU machine.
"""

from __future__ import annotations

import gc
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

from _ids import safe_id

settings.register_profile(
    "ci", derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "mutation",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=int(os.environ.get("MUTATION_MAX_EXAMPLES", "20")),
    # a mutant is killed by the first failing example: no shrinking, no search for more
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow],
)
_DEFAULT_PROFILE = (
    "mutation" if "MUTANT_UNDER_TEST" in os.environ else ("ci" if os.environ.get("CI") else "dev")
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", _DEFAULT_PROFILE))
if "MUTANT_UNDER_TEST" in os.environ:
    # mutmut runs --max-children test processes side by side, one per core: one intra-op
    # thread each by default (several would spin against each other, and count against the
    # CPU-time limit that mutmut reports as a "timeout"); MUTATION_THREADS=n to change it.
    torch.set_num_threads(int(os.environ.get("MUTATION_THREADS", "1")))

    @pytest.fixture(autouse=True)
    def _scratch_working_directory(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Under mutmut each test runs in a fresh scratch working directory.

        mutmut runs the tests in ``mutants/``, beside its mutated sources and verdicts. A
        mutant of code that deletes directories (checkpoint pruning, scratch clean-up) can
        turn a path into the working directory: one did, and deleted every verdict of a
        2.5-hour run. Here such a mutant deletes only its own scratch directory (and fails).
        """
        monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Under mutmut, freeze what collection built out of the cyclic garbage collector.

    mutmut forks each mutant's test process from a server that has imported and collected
    the whole selection (~380 000 objects). pytest's session end calls ``gc.collect()``
    several times, and in a forked child each pass walks (and copies, page by page) that
    whole inherited heap: ~2 s a mutant on this machine, against ~0.2 s frozen, enough to
    push a quick mutant past mutmut's wall-clock limit as a false "timeout". Objects made
    by the tests themselves are still collected.
    """
    if "MUTANT_UNDER_TEST" in os.environ:
        gc.freeze()


def pytest_make_parametrize_id(config: pytest.Config, val: object, argname: str) -> str | None:
    """String parameters get ids made only of safe characters (see ``_check_ids``)."""
    return safe_id(val) if isinstance(val, str) else None


def _check_ids(items: list[pytest.Item]) -> None:
    """Refuse a test whose parameter id holds a bracket, backslash, colon or space.

    mutmut runs each mutant's tests by node id in a second pytest session of a warmed-up
    process; there an id such as ``[adam-betas\\[0\\]-4]`` was "not found", pytest exited
    4, and mutmut reported the mutant as a *timeout*, which counts as caught: 320 false
    kills in ``optim/``. Ids made with ``ids=`` must use ``_ids.safe_id``.
    """
    bad = [
        i.nodeid
        for i in items
        if "[" in i.nodeid and re.search(r"[][\\: ]", i.nodeid.split("[", 1)[1][:-1])
    ]
    if bad:
        raise pytest.UsageError(
            f"test ids must not hold brackets, backslashes, colons or spaces (use tests/_ids.py: safe_id): {bad}"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse unsafe test ids; skip the ``cuda``-marked tests when there is no CUDA device."""
    _check_ids(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marker `cuda`)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
