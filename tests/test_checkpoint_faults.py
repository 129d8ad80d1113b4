"""Fault injection: a damaged, truncated or half-written checkpoint is never silently wrong.

Every fault below is injected into a real checkpoint and the outcome checked:

* single-bit flips, byte-range overwrites and truncations at offsets hypothesis
  picks, in *every* file of a checkpoint (``__0_0.distcp``, ``.metadata``,
  ``metadata.json``, ``.purestep``): each either fails ``verify`` with a
  :class:`CheckpointCorruptError` naming that file, and then every load fails
  the same way and a donated load leaves the live state bitwise unchanged, or
  the bytes carried no data and every load is bitwise equal to what was saved;
* a missing file, and a data file copied from another checkpoint;
* ``ENOSPC`` and ``EIO`` raised at each write and at each fsync of a save
  (sync and async), by monkeypatching ``open`` and ``os.fsync``, and a real
  full disk (a 1 MiB tmpfs, where the machine lets the test mount one): each
  raises :class:`CheckpointWriteError` with the ``OSError`` as ``__cause__``,
  leaves no scratch directory, and the previous checkpoint stays intact and latest;
* ``EIO`` while reading;
* two processes racing to save the same path with ``overwrite=False``;
* ``prune`` beside user directories whose names look like scratch names.

The number of faults injected of each kind is printed at the end of the module
(``fault injection: ...``, about 700 in the default run) and appears in the
test names. ``pytest -m slow tests/test_checkpoint_faults.py`` runs the long
variants: 1000 bit flips per file and 200 writer races.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import errno
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from _checkpoint_states import _same
from purestep import checkpoint as ckpt

FLIPS_PER_FILE = 60
SLOW_FLIPS_PER_FILE = 1000
RANGES_PER_FILE = 30
TRUNCATIONS_PER_FILE = 15
FILES = ["__0_0.distcp", ".metadata", "metadata.json", ".purestep"]
RACES = 24

COUNTS: collections.Counter[str] = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def _report(request: pytest.FixtureRequest) -> Iterator[None]:
    """Print how many faults of each kind this module injected (visible in a plain ``pytest``)."""
    yield
    if not COUNTS:
        return
    parts = ", ".join(f"{n} {kind}" for kind, n in sorted(COUNTS.items()))
    plugins = request.config.pluginmanager
    reporter = plugins.get_plugin("terminalreporter")
    capture = plugins.get_plugin("capturemanager")
    if reporter is None:
        return
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        reporter.write_line(f"\nfault injection: {sum(COUNTS.values())} faults: {parts}")


# -- the checkpoint under attack ---------------------------------------------------------------


def _state() -> TensorDict:
    """Every kind of leaf a training state holds: float params of several dtypes (raw records),
    a uint16 and a float8 leaf (zip records), int64 and bool buffers, an empty tensor, rng, step."""
    g = torch.Generator().manual_seed(0)
    return TensorDict(
        {
            "params": {
                "student": {
                    "fc": {
                        "weight": torch.randn(16, 8, generator=g),
                        "bias": torch.randn(16, generator=g),
                    },
                    "emb": torch.randn(10, 4, generator=g).bfloat16(),
                    "q": torch.randint(0, 60000, (6,), generator=g).to(torch.uint16),
                    "f8": torch.randn(5, generator=g).to(torch.float8_e4m3fn),
                }
            },
            "buffers": {
                "student": {
                    "bn": {
                        "num_batches_tracked": torch.tensor(7),
                        "mask": torch.tensor([True, False, True]),
                    }
                }
            },
            "opt_state": {"student": {"count": torch.tensor(7), "none": torch.zeros(0)}},
            "rng": torch.tensor(-(2**61) + 5),
            "step": torch.tensor(7),
        },
        [],
    )


def _per_rank() -> TensorDict:
    return TensorDict({"loader": {"pos": torch.tensor(123), "epoch": torch.tensor(2)}}, [])


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "step_00000007"
    ckpt.save(_state(), path, per_rank=_per_rank(), metadata={"note": "template"})
    assert sorted(p.name for p in path.iterdir()) == sorted(FILES)
    return path


def _copy(template: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("fault") / template.name
    shutil.copytree(template, dst)
    return dst


def _outcome(path: Path, damaged_file: str) -> str:
    """Check the property for one damaged checkpoint; returns "detected" or "no data".

    verify fails with CheckpointCorruptError naming ``damaged_file``, and so do load,
    load_per_rank (or they load bitwise equal: per-rank records are not read by load) and
    a donated load, which leaves the live state unchanged; or nothing fails and every
    load is bitwise equal to what was saved.
    """
    try:
        ckpt.verify(path)
        verified = None
    except ckpt.CheckpointError as e:
        verified = e
    live = _state().apply(torch.zeros_like)
    live_before = live.clone()
    outs: list[Any] = []
    for fn in (
        lambda: ckpt.load(path, like=_state().apply(torch.zeros_like)),
        lambda: ckpt.load(path, like=live, donate=True),
        lambda: ckpt.load_per_rank(path, like=_per_rank().apply(torch.zeros_like)),
    ):
        try:
            outs.append(fn())
        except ckpt.CheckpointError as e:
            outs.append(e)
    if verified is None:
        assert _same(outs[0], _state()) and _same(outs[1], _state())
        assert _same(outs[2], _per_rank())
        return "no data"
    assert isinstance(verified, ckpt.CheckpointCorruptError), repr(verified)
    assert verified.file == damaged_file, (verified.file, str(verified))
    assert str(path) in str(verified)
    for out in outs:
        if isinstance(out, ckpt.CheckpointError):
            assert isinstance(out, ckpt.CheckpointCorruptError), repr(out)
            assert out.file == damaged_file, (out.file, str(out))
    assert isinstance(outs[0], ckpt.CheckpointError) or _same(outs[0], _state())
    if isinstance(outs[1], ckpt.CheckpointError):
        assert _same(live, live_before), "a failed donated load tore the live state"
    else:
        assert _same(outs[1], _state())
    assert isinstance(outs[2], ckpt.CheckpointError) or _same(outs[2], _per_rank())
    assert any(isinstance(o, ckpt.CheckpointError) for o in outs) or damaged_file == FILES[0]
    return "detected"


def _examples(n: int) -> Any:
    return settings(
        max_examples=n,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


@pytest.mark.parametrize("name", FILES)
@_examples(FLIPS_PER_FILE)
@given(where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_60_single_bit_flips_per_file_fail_verification_or_load_bitwise_equal(
    template: Path, tmp_path_factory: pytest.TempPathFactory, name: str, where: float, bit: int
) -> None:
    """Flip one bit anywhere in any file: detected (clear error naming the file, live state
    untouched) or, for bytes carrying no data, every load is bitwise equal."""
    path = _copy(template, tmp_path_factory)
    f = path / name
    data = bytearray(f.read_bytes())
    data[int(where * len(data))] ^= 1 << bit
    f.write_bytes(bytes(data))
    COUNTS[f"bit flips ({_outcome(path, name)})"] += 1


@pytest.mark.slow
@pytest.mark.parametrize("name", FILES)
@_examples(SLOW_FLIPS_PER_FILE)
@given(where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_1000_single_bit_flips_per_file_fail_verification_or_load_bitwise_equal(
    template: Path, tmp_path_factory: pytest.TempPathFactory, name: str, where: float, bit: int
) -> None:
    """The same property as the default run's, over 1000 flips per file (``pytest -m slow``)."""
    path = _copy(template, tmp_path_factory)
    f = path / name
    data = bytearray(f.read_bytes())
    data[int(where * len(data))] ^= 1 << bit
    f.write_bytes(bytes(data))
    COUNTS[f"bit flips ({_outcome(path, name)})"] += 1


@pytest.mark.parametrize("name", FILES)
@_examples(RANGES_PER_FILE)
@given(where=st.floats(0, 1, exclude_max=True), junk=st.binary(min_size=1, max_size=64))
def test_30_byte_range_overwrites_per_file_fail_verification_or_load_bitwise_equal(
    template: Path, tmp_path_factory: pytest.TempPathFactory, name: str, where: float, junk: bytes
) -> None:
    """Overwrite up to 64 bytes anywhere with arbitrary bytes (a torn or misdirected write)."""
    path = _copy(template, tmp_path_factory)
    f = path / name
    data = bytearray(f.read_bytes())
    start = int(where * len(data))
    piece = junk[: len(data) - start]
    data[start : start + len(piece)] = piece
    f.write_bytes(bytes(data))
    COUNTS[f"byte-range overwrites ({_outcome(path, name)})"] += 1


@pytest.mark.parametrize("name", FILES)
@_examples(TRUNCATIONS_PER_FILE)
@given(where=st.floats(0, 1, exclude_max=True))
def test_15_truncations_per_file_fail_the_cheap_check_and_verification(
    template: Path, tmp_path_factory: pytest.TempPathFactory, name: str, where: float
) -> None:
    """Truncate a file to a random shorter length: is_complete() and latest() reject the
    checkpoint without reading data (except the marker, which carries no data)."""
    path = _copy(template, tmp_path_factory)
    f = path / name
    os.truncate(f, int(where * f.stat().st_size))
    outcome = _outcome(path, name)
    assert (outcome == "no data") == (name == ".purestep")
    assert ckpt.is_complete(path) == (name == ".purestep")
    assert (ckpt.latest(path.parent) is None) == (name != ".purestep")
    COUNTS[f"truncations ({outcome})"] += 1


@pytest.mark.parametrize("name", FILES)
def test_a_missing_file_is_detected_without_reading_data(
    template: Path, tmp_path_factory: pytest.TempPathFactory, name: str
) -> None:
    """Deleting any file but the marker makes the checkpoint incomplete, and loads fail clearly."""
    path = _copy(template, tmp_path_factory)
    (path / name).unlink()
    if name == "metadata.json":  # no longer a checkpoint at all
        assert not ckpt.is_complete(path)
        with pytest.raises(ckpt.CheckpointNotFoundError):
            ckpt.verify(path)
        with pytest.raises(ckpt.CheckpointNotFoundError):
            ckpt.load(path, like=_state())
    else:
        assert ckpt.is_complete(path) == (name == ".purestep")
        assert _outcome(path, name) == ("no data" if name == ".purestep" else "detected")
    COUNTS["missing files"] += 1


def test_a_data_file_from_another_checkpoint_is_detected(
    template: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A data file of the same size from another checkpoint (a stale copy) fails its checksums."""
    other = tmp_path_factory.mktemp("other") / "c"
    state = _state()
    state["params", "student", "fc", "weight"] += 1
    ckpt.save(state, other, per_rank=_per_rank(), metadata={"note": "template"})
    path = _copy(template, tmp_path_factory)
    assert (other / FILES[0]).stat().st_size == (path / FILES[0]).stat().st_size
    shutil.copy(other / FILES[0], path / FILES[0])
    assert ckpt.is_complete(path)  # same sizes: only reading finds it
    assert _outcome(path, FILES[0]) == "detected"
    COUNTS["swapped data files"] += 1


# -- write faults: ENOSPC / EIO at each write and fsync ---------------------------------------


class _Injector:
    """Counts writes and fsyncs; raises ``OSError(err)`` at the ``at``-th one of ``kind``."""

    def __init__(self, kind: str | None = None, at: int = 0, err: int = errno.ENOSPC) -> None:
        self.kind, self.at, self.err = kind, at, err
        self.counts = {"write": 0, "fsync": 0}

    def hit(self, kind: str) -> None:
        self.counts[kind] += 1
        if kind == self.kind and self.counts[kind] == self.at:
            raise OSError(self.err, f"{os.strerror(self.err)} (injected at {kind} {self.at})")


class _FaultyFile:
    def __init__(self, f: Any, inj: _Injector) -> None:
        self._f, self._inj = f, inj

    def write(self, data: Any) -> int:
        self._inj.hit("write")
        return int(self._f.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _FaultyFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.__exit__(*exc)


@contextlib.contextmanager
def _inject(monkeypatch: pytest.MonkeyPatch, inj: _Injector) -> Iterator[None]:
    real_open, real_fsync = builtins.open, os.fsync

    def fake_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real_open(file, mode, *args, **kwargs)
        return _FaultyFile(f, inj) if any(c in mode for c in "wax+") else f

    def fake_fsync(fd: Any) -> None:
        inj.hit("fsync")
        real_fsync(fd)

    with monkeypatch.context() as m:
        m.setattr(builtins, "open", fake_open)
        m.setattr(io, "open", fake_open)
        m.setattr(os, "fsync", fake_fsync)
        yield


def _small(step: int) -> TensorDict:
    g = torch.Generator().manual_seed(step)
    return TensorDict(
        {
            "w": torch.randn(300, generator=g),
            "q": torch.arange(3).to(torch.uint16),  # a zip record: many small writes
            "step": torch.tensor(step),
        },
        [],
    )


def _save(path: Path, async_: bool) -> None:
    handle = ckpt.save(_small(2), path, async_=async_)
    if handle is not None:
        handle.wait()


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_enospc_and_eio_at_every_write_and_fsync_leave_the_previous_checkpoint_latest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_: bool
) -> None:
    """Fail the k-th write (then the k-th fsync) of a save, for every k and for ENOSPC and EIO:
    CheckpointWriteError with the OSError (and its errno) as __cause__, no scratch directory
    left, the previous checkpoint intact and latest."""
    root = tmp_path / "run"
    ckpt.save(_small(1), root / "a")
    counter = _Injector()
    with _inject(monkeypatch, counter):
        _save(root / "probe", async_)
    shutil.rmtree(root / "probe")
    assert counter.counts["write"] >= 10 and counter.counts["fsync"] >= 4, counter.counts
    for kind, n in counter.counts.items():
        for at in range(1, n + 1):
            for err in (errno.ENOSPC, errno.EIO):
                inj = _Injector(kind, at, err)
                with (
                    _inject(monkeypatch, inj),
                    pytest.raises(ckpt.CheckpointWriteError) as info,
                ):
                    _save(root / "b", async_)
                cause = info.value.__cause__
                assert isinstance(cause, OSError) and cause.errno == err, (kind, at, repr(cause))
                assert os.strerror(err) in str(info.value)
                assert sorted(p.name for p in root.iterdir()) == ["a"], (kind, at)
                assert ckpt.latest(root) == root / "a"
                COUNTS[f"injected {errno.errorcode[err]} ({'async' if async_ else 'sync'})"] += 1
    ckpt.verify(root / "a")
    assert _same(ckpt.load(root / "a", like=_small(0)), _small(1))
    _save(root / "b", async_)  # and the disk "recovered": the same save now succeeds
    assert ckpt.latest(root) == root / "b"


def test_a_full_tmpfs_fails_the_save_cleanly_and_frees_its_space(tmp_path: Path) -> None:
    """A real ENOSPC: on a 1 MiB tmpfs a 2 MB save fails with CheckpointWriteError (ENOSPC in
    __cause__), its scratch directory is removed (space freed: a small save then works), and
    the earlier checkpoint stays intact and latest. Skipped where mounting is not permitted."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        ckpt.save(_small(1), mnt / "a")
        big = TensorDict({"w": torch.zeros(500_000), "step": torch.tensor(2)}, [])
        with pytest.raises(ckpt.CheckpointWriteError) as info:
            ckpt.save(big, mnt / "b")
        assert isinstance(info.value.__cause__, OSError)
        assert info.value.__cause__.errno == errno.ENOSPC
        assert sorted(p.name for p in mnt.iterdir()) == ["a"]
        assert ckpt.latest(mnt) == mnt / "a"
        ckpt.verify(mnt / "a")
        ckpt.save(_small(3), mnt / "c")  # the failed save's space was freed
        assert ckpt.latest(mnt) == mnt / "c"
        COUNTS["real ENOSPC (tmpfs)"] += 1
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_eio_while_reading_raises_a_read_error_and_leaves_the_live_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OSError while reading a data file: CheckpointReadError (EIO as __cause__) naming the
    file; a donated load leaves the live state unchanged."""
    ckpt.save(_state(), tmp_path / "c")
    real_open = builtins.open

    def failing_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if str(file).endswith(".distcp"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(file))
        return real_open(file, mode, *args, **kwargs)

    live = _state().apply(torch.zeros_like)
    before = live.clone()
    monkeypatch.setattr(builtins, "open", failing_open)
    for donate in (False, True):
        with pytest.raises(ckpt.CheckpointReadError, match=r"__0_0\.distcp") as info:
            ckpt.load(tmp_path / "c", like=live, donate=donate)
        assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.EIO
        assert _same(live, before)
        COUNTS["injected EIO on read"] += 1


# -- two writers racing ----------------------------------------------------------------------

_RACE = textwrap.dedent(
    """
    import multiprocessing as mp, os, sys
    import torch
    from tensordict import TensorDict
    from purestep import checkpoint as ckpt
    from purestep.distributed import _ckpt_fs

    torch.set_num_threads(1)
    root, trials = sys.argv[1], int(sys.argv[2])
    real_rename = _ckpt_fs.rename_noreplace

    def writer(i, w, barrier, at_publish):
        if at_publish:  # both have written everything; both rename at the same moment
            def rename(src, dst):
                if ".tmp-" in os.path.basename(str(src)):
                    barrier.wait(60)
                return real_rename(src, dst)
            _ckpt_fs.rename_noreplace = rename
        else:  # both start together
            barrier.wait(60)
        state = TensorDict({"w": torch.full((20_000,), float(w)), "step": torch.tensor(i)}, [])
        try:
            ckpt.save(state, os.path.join(root, f"race_{i:03d}"))
            out = "won"
        except ckpt.CheckpointExistsError as e:
            out = "lost " + " ".join(str(e).split())
        except BaseException as e:
            out = "error " + type(e).__name__ + " " + " ".join(str(e).split())
        os.write(1, f"{i} {w} {out}\\n".encode())
        os._exit(0)

    ctx = mp.get_context("fork")
    for i in range(trials):
        barrier = ctx.Barrier(2)
        procs = [ctx.Process(target=writer, args=(i, w, barrier, i % 2 == 0)) for w in (1, 2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
    """
)


@pytest.mark.slow
def test_200_races_of_two_writers_have_exactly_one_winner_and_replace_nothing(
    tmp_path: Path,
) -> None:
    """The race below, 200 times (``pytest -m slow``)."""
    _race(tmp_path, 200)


def test_24_races_of_two_writers_have_exactly_one_winner_and_replace_nothing(
    tmp_path: Path,
) -> None:
    """Two processes save to the same path with overwrite=False, 24 times (half of them held at
    a barrier just before publishing, so both pass the existence check): each time exactly one
    wins, the other gets CheckpointExistsError, the checkpoint holds the winner's values, and
    no scratch directory is left."""
    _race(tmp_path, RACES)


def _race(tmp_path: Path, races: int) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _RACE, str(tmp_path), str(races)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    outcomes: dict[int, dict[int, str]] = collections.defaultdict(dict)
    for line in proc.stdout.splitlines():
        i, w, out = line.split(" ", 2)
        outcomes[int(i)][int(w)] = out
    assert sorted(outcomes) == list(range(races)), proc.stdout
    at_publish = 0
    for i, result in outcomes.items():
        assert sorted(result) == [1, 2], (i, result)
        winners = [w for w, out in result.items() if out == "won"]
        losers = [out for out in result.values() if out.startswith("lost")]
        assert len(winners) == 1 and len(losers) == 1, (i, result)
        at_publish += "published by another writer" in losers[0]
        like = TensorDict({"w": torch.zeros(20_000), "step": torch.tensor(0)}, [])
        got = ckpt.load(tmp_path / f"race_{i:03d}", like=like)
        assert torch.equal(got["w"], torch.full((20_000,), float(winners[0]))), (i, result)
        COUNTS["writer races"] += 1
    assert at_publish >= races // 2, "the forced races did not reach the publish step"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"race_{i:03d}" for i in range(races)]


# -- prune beside user directories ------------------------------------------------------------


def test_prune_removes_only_what_purestep_made(tmp_path: Path) -> None:
    """prune deletes old checkpoints and purestep's stale scratch, never a user's directory whose
    name merely looks like a checkpoint's or a scratch directory's, nor a damaged checkpoint."""
    for s in (1, 2, 3):
        ckpt.save(_small(s), ckpt.step_dir(tmp_path, s))
    user = {
        "notes.tmp-mine": "x",
        "step_00000002.old-backup": "y",
        "data.del-2024": "z",
        "step_00000009": "not a checkpoint",
    }
    for name, text in user.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "file.txt").write_text(text)
    # a user's copy of a checkpoint under a scratch-like name (its marker names another token)
    shutil.copytree(ckpt.step_dir(tmp_path, 1), tmp_path / "step_00000001.tmp-usercopy")
    # purestep's own stale scratch: an interrupted save, a half-deleted checkpoint, an empty dir
    ckpt.save(_small(5), tmp_path / "x")
    token = json.loads((tmp_path / "x" / ".purestep").read_text())["token"]
    os.rename(tmp_path / "x", tmp_path / f"step_00000005.tmp-{token}")
    ckpt.save(_small(6), tmp_path / "y")
    os.rename(tmp_path / "y", tmp_path / "step_00000006.del-abc")
    (tmp_path / "step_00000006.del-abc" / "__0_0.distcp").unlink()
    (tmp_path / "step_00000007.tmp-0123").mkdir()
    # a save killed between creating its marker and writing it: an empty or torn marker alone
    for name, text in (("step_00000008.tmp-4567", ""), ("step_00000010.tmp-89ab", '{"form')):
        (tmp_path / name).mkdir()
        (tmp_path / name / ".purestep").write_text(text)
    # ... but beside a user's file, or naming another token, the directory is not purestep's
    (tmp_path / "step_00000011.tmp-cdef").mkdir()
    (tmp_path / "step_00000011.tmp-cdef" / ".purestep").write_text("")
    (tmp_path / "step_00000011.tmp-cdef" / "file.txt").write_text("w")
    (tmp_path / "step_00000012.tmp-0000").mkdir()
    shutil.copy(
        tmp_path / "step_00000001.tmp-usercopy" / ".purestep", tmp_path / "step_00000012.tmp-0000"
    )
    # a damaged checkpoint
    ckpt.save(_small(0), ckpt.step_dir(tmp_path, 0))
    os.truncate(ckpt.step_dir(tmp_path, 0) / "__0_0.distcp", 5)

    removed = ckpt.prune(tmp_path, keep_last=1)
    assert sorted(p.name for p in removed) == [
        "step_00000001",
        "step_00000002",
        f"step_00000005.tmp-{token}",
        "step_00000006.del-abc",
        "step_00000007.tmp-0123",
        "step_00000008.tmp-4567",
        "step_00000010.tmp-89ab",
    ]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(
        [
            *user,
            "step_00000001.tmp-usercopy",
            "step_00000011.tmp-cdef",
            "step_00000012.tmp-0000",
            "step_00000000",
            "step_00000003",
        ]
    )
    for name, text in user.items():
        assert (tmp_path / name / "file.txt").read_text() == text
    ckpt.verify(tmp_path / "step_00000001.tmp-usercopy")
    COUNTS["prune beside user dirs"] += 1


@pytest.mark.parametrize("directory", [None, 3])
def test_remove_tree_refuses_a_non_path_instead_of_emptying_the_working_directory(
    directory: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``os.scandir(None)`` lists the working directory: given anything but a path, the
    checkpoint directory remover raises and deletes nothing."""
    from purestep.distributed._ckpt_fs import remove_tree

    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(TypeError, match="remove_tree: directory must be a path"):
        remove_tree(directory, last=())  # type: ignore[arg-type]
    assert (tmp_path / "keep.txt").read_text() == "x"


# -- failures before the first byte is written ----------------------------------------------


def _only_previous_left(root: Path) -> None:
    ckpt.wait_pending()  # nothing left pending either
    assert sorted(p.name for p in root.iterdir()) == ["a"]
    assert ckpt.latest(root) == root / "a"


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_a_scratch_directory_that_cannot_be_created_fails_the_save_and_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_: bool
) -> None:
    """ENOSPC while creating the scratch directory (writing its marker): save raises
    CheckpointWriteError naming the checkpoint and the scratch directory, with the OSError
    chained, and removes the half-made scratch directory."""
    from purestep.distributed import _ckpt_fs

    ckpt.save(_small(1), tmp_path / "a")
    full = OSError(errno.ENOSPC, "No space left on device (simulated)")
    made: list[tuple[Path, str]] = []

    def write_marker(directory: Path, token: str) -> None:
        made.append((directory, token))
        assert directory.is_dir()  # created, then the marker write fails
        raise full

    monkeypatch.setattr(_ckpt_fs, "write_marker", write_marker)
    with pytest.raises(ckpt.CheckpointWriteError) as info:
        _save(tmp_path / "b", async_)
    ((scratch, token),) = made
    assert scratch == tmp_path / f"b.tmp-{token}"
    assert str(info.value) == (
        f"saving checkpoint {tmp_path / 'b'}: cannot create its scratch directory {scratch}: {full}"
    )
    assert info.value.details() == {"path": tmp_path / "b", "file": None, "key": None}
    assert info.value.__cause__ is full
    _only_previous_left(tmp_path)
    COUNTS["failed scratch directory"] += 1


def test_a_failed_copy_to_cpu_buffers_fails_an_async_save_and_removes_its_scratch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An async save whose staging copy fails (out of host memory) raises CheckpointWriteError
    from save itself, naming the checkpoint with the failure chained; its scratch directory is
    removed and nothing is left pending."""
    from purestep.distributed import checkpoint as module

    ckpt.save(_small(1), tmp_path / "a")
    oom = RuntimeError("cannot allocate memory (simulated)")

    def stage(flat: Any) -> Any:
        names = sorted(p.name.split(".tmp-")[0] for p in tmp_path.iterdir())
        assert names == ["a", "b"]  # the scratch directory exists while staging
        raise oom

    monkeypatch.setattr(module, "_stage", stage)
    with pytest.raises(ckpt.CheckpointWriteError) as info:
        ckpt.save(_small(2), tmp_path / "b", async_=True)
    assert str(info.value) == (
        f"saving checkpoint {tmp_path / 'b'}: copying the state to CPU buffers failed: {oom}"
    )
    assert info.value.details() == {"path": tmp_path / "b", "file": None, "key": None}
    assert info.value.__cause__ is oom
    _only_previous_left(tmp_path)
    COUNTS["failed staging copy"] += 1


# -- failed collectives (a stand-in process group whose k-th collective fails) ---------------


class _FailingPeers:
    """A stand-in for the checkpoint process group whose ``fail_at``-th collective fails (a
    peer died); the ones before it succeed as on one rank. Counts the collectives."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at = fail_at
        self.calls = 0
        self.died = RuntimeError(f"peer 1 died in collective {fail_at} (simulated)")

    def gather(self, group: Any, value: Any) -> list[Any]:
        if group is None:  # no process group: the real helper's answer
            return [value]
        assert group is self
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.died
        return [value]


def _with_peers(monkeypatch: pytest.MonkeyPatch, fail_at: int) -> _FailingPeers:
    from purestep.distributed import _ckpt_group
    from purestep.distributed import checkpoint as module

    peers = _FailingPeers(fail_at)
    monkeypatch.setattr(module, "_group", lambda: peers)
    for m in (module, _ckpt_group):
        monkeypatch.setattr(m, "_rank", lambda group: 0)
        monkeypatch.setattr(m, "_gather", peers.gather)
    monkeypatch.setattr(module, "_world", lambda group: 1)
    return peers


@pytest.mark.parametrize(
    ("async_", "fail_at"),
    [(False, 1), (False, 2), (False, 3), (True, 4)],
    ids=["target_check", "token", "scratch_dir", "async_staging"],
)
def test_a_failed_collective_fails_the_save_at_each_agreement_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_: bool, fail_at: int
) -> None:
    """With a process group a save agrees with the other ranks on the target check, the scratch
    token, the scratch directory and (async) the staging copy, in that order, before writing:
    whichever collective fails (a peer died), save raises naming the checkpoint with the
    failure chained (a CheckpointWriteError for the token), and leaves no scratch directory."""
    ckpt.save(_small(1), tmp_path / "a")
    peers = _with_peers(monkeypatch, fail_at)
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.save(_small(2), tmp_path / "b", async_=async_)
    assert peers.calls == fail_at
    want = ckpt.CheckpointWriteError if fail_at == 2 else ckpt.CheckpointError
    assert type(info.value) is want
    assert str(info.value) == (
        f"saving checkpoint {tmp_path / 'b'}: a collective with the other ranks failed: "
        f"{peers.died}"
    )
    assert info.value.__cause__ is peers.died
    _only_previous_left(tmp_path)
    COUNTS["failed collective (save)"] += 1


@pytest.mark.parametrize("case", ["load", "load_bad_like", "load_per_rank", "save_existing"])
def test_a_problem_this_rank_found_is_shared_through_the_collective_before_raising(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """load, load_per_rank and save raise a problem found on this rank (a bad like, an existing
    target) only through the collective that shares it with the other ranks, so no rank raises
    alone; when that first collective fails, the error names the operation, the checkpoint, this
    rank's own problem (if any) and the failure (chained)."""
    ckpt.save(_small(1), tmp_path / "a", per_rank=_per_rank())
    like = _small(0)
    if case == "load_bad_like":
        like.set_non_tensor(("meta", "name"), "run-a")
    run = {
        "load_per_rank": lambda: ckpt.load_per_rank(tmp_path / "a", like=_per_rank()),
        "save_existing": lambda: ckpt.save(_small(2), tmp_path / "a"),
    }.get(case, lambda: ckpt.load(tmp_path / "a", like=like))
    peers = _with_peers(monkeypatch, 1)
    with pytest.raises(ckpt.CheckpointError) as info:
        run()
    doing = "saving" if case == "save_existing" else "loading"
    own = {
        "load_bad_like": " (this rank had failed: cannot checkpoint like: non-tensor leaves (a "
        "checkpoint holds tensors only; store numbers as 0-dim tensors and other values in "
        "save(metadata=...)): meta.name (non-tensor data: str))",
        "save_existing": f" (this rank had failed: checkpoint already exists at "
        f"{tmp_path / 'a'}; pass overwrite=True to replace it)",
    }.get(case, "")
    assert type(info.value) is ckpt.CheckpointError
    assert str(info.value) == (
        f"{doing} checkpoint {tmp_path / 'a'}: a collective with the other ranks failed{own}: "
        f"{peers.died}"
    )
    assert info.value.__cause__ is peers.died
    assert peers.calls == 1
    COUNTS["failed collective (agreement)"] += 1
