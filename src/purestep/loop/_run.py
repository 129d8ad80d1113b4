"""``run``: the reference loop around a step function (see :mod:`purestep.loop`)."""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import signal
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase

from purestep._images import write_png
from purestep._keys import STEP
from purestep.distributed import checkpoint as ckpt
from purestep.loop._checkpointing import (
    LOOP_KEY,
    pending_metrics,
    probe_writable,
    restore_any,
    resume_sources,
    save,
)
from purestep.loop._checkpointing import rank as _rank
from purestep.loop._collectives import CollectiveTimeoutError, guard_collectives
from purestep.loop._data import DataStream
from purestep.loop._metrics import MetricBuffer
from purestep.loop._signals import StopSignal
from purestep.loop._sinks import Image, Sink, check_sinks, make_sinks
from purestep.step import as_batch

__all__ = ["LOOP_KEY", "BatchKeyError", "CollectiveTimeoutError", "Preempted", "run"]

StepLike = Callable[[TensorDictBase, Any], tuple[TensorDictBase, Any]]
EvalFn = Callable[[TensorDictBase], Mapping[str, Any] | TensorDictBase]


class Preempted(SystemExit):
    """Raised by :func:`run` after SIGTERM or SIGINT, once the checkpoint is saved.

    A ``SystemExit`` with code ``128 + signum`` (143 for SIGTERM, 130 for SIGINT):
    left uncaught, the process exits with that status and no traceback; code
    after ``run`` (an export of the unfinished model, say) does not run by
    accident, and ``except Exception`` does not swallow it.

    Attributes:
        state: the training state at the stop (without the loop's keys).
        step: ``int(state["step"])``.
        signum: the signal received.
        checkpoint: the checkpoint written at ``step``, or ``None`` without a
            ``checkpoint_dir``.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> e = Preempted(TensorDict({"step": torch.tensor(7)}, []), 15, None)
        >>> e.code, e.step
        (143, 7)
    """

    def __init__(self, state: TensorDictBase, signum: int, checkpoint: Path | None) -> None:
        super().__init__(128 + signum)
        self.state = state
        self.step = int(state.get(STEP))
        self.signum = signum
        self.checkpoint = checkpoint


def _preempted_message(signum: int, step: int, root: Path | None, path: Path | None) -> str:
    """What a preempted run prints (rank 0, stderr): the step, the checkpoint, how to resume."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    head = f"purestep.loop.run: {name} received; stopped after step {step}"
    if path is None:
        return f"{head}; no checkpoint_dir, so nothing was saved (Preempted.state holds the state)"
    return (
        f"{head}; checkpoint saved to {path}. To continue, run again with "
        f"checkpoint_dir={str(root)!r} and resume='latest'"
    )


class BatchKeyError(KeyError):
    """A step read a key that the batch does not have (the message names it).

    Example:
        >>> str(BatchKeyError("the batch has no key 'y'"))
        "the batch has no key 'y'"
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _check_int(name: str, value: Any, minimum: int, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"run: {name} must be an int >= {minimum}, got {value!r}")


def _check_timeout(value: Any) -> None:
    if value is None:
        return
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"run: collective_timeout must be seconds or a timedelta, got {value!r}")
    if not seconds > 0:
        raise ValueError(f"run: collective_timeout must be positive, got {value!r}")


def _key_sets(td: TensorDictBase) -> list[set[str]]:
    out = [set(td.keys())]
    for k in td.keys():
        v = td.get(k)
        if isinstance(v, TensorDictBase):
            out += _key_sets(v)
    return out


def _missing_batch_key(err: KeyError, batch: TensorDictBase) -> str | tuple[str, ...] | None:
    """The key a failed lookup on ``batch`` (or a node or split of it) asked for, or None.

    Read from the traceback, not from the error's text: the outermost frame of a
    method called on such a TensorDict (``td[key]``, ``td.get(key)``: the key is
    the first argument after ``self``) whose key the TensorDict lacks. A split
    is recognised by its keys (a batch's, perhaps plus the ``"index"`` the step
    adds); a failed lookup on anything else (the state, a dict) is not a batch key.
    """
    nodes = _key_sets(batch)
    tb = err.__traceback__
    while tb is not None:
        frame, tb = tb.tb_frame, tb.tb_next
        code = frame.f_code
        names = code.co_varnames[: code.co_argcount]
        if len(names) < 2 or names[0] != "self":
            continue
        td = frame.f_locals.get("self")
        if not isinstance(td, TensorDictBase):
            continue
        keys = set(td.keys())
        if keys not in nodes and keys - {"index"} not in nodes:
            continue
        key = frame.f_locals.get(names[1])
        if isinstance(key, tuple) and len(key) == 1:
            key = key[0]
        if isinstance(key, tuple) and key and all(isinstance(k, str) for k in key):
            if key not in td.keys(include_nested=True):
                return cast(tuple[str, ...], key)
        elif isinstance(key, str) and key not in keys:
            return key
    return None


def _call(step: StepLike, state: TensorDictBase, batch: TensorDictBase, s: int) -> Any:
    try:
        out = step(state, batch)
    except KeyError as e:
        key = _missing_batch_key(e, batch)
        if key is None:
            raise
        raise BatchKeyError(
            f"run: the batch for step {s} has no key {key!r}, which the step reads "
            f"(batch keys: {sorted(batch.keys())})"
        ) from e
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], TensorDictBase)):
        raise TypeError(
            f"run: the step returned {type(out).__name__}; expected (state, metrics) with "
            "state a TensorDict"
        )
    return out


def _to_batch(raw: Any, s: int) -> TensorDictBase:
    try:
        return as_batch(raw)
    except (TypeError, ValueError) as e:
        raise type(e)(f"run: the batch for step {s}: {e}") from e


def _crossed(prev: int, new: int, every: int) -> bool:
    return new // every > prev // every


def _progress_bar(enabled: bool, start: int, total: int, desc: str) -> Any:
    if not enabled:
        return None
    try:
        tqdm = importlib.import_module("tqdm.auto").tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=start, desc=desc, dynamic_ncols=True, mininterval=0.5)


def _short(record: Mapping[str, float]) -> dict[str, str]:
    return {k: f"{v:.4g}" for k, v in list(record.items())[:6]}


def _evaluate(
    eval_fn: EvalFn, state: TensorDictBase
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """``eval_fn``'s scalars (means, as floats) and images (top-level :class:`Image` values)."""
    out = eval_fn(state)
    if not isinstance(out, (Mapping, TensorDictBase)):
        raise TypeError(f"run: eval_fn returned {type(out).__name__}; expected a dict of metrics")
    images: dict[str, torch.Tensor] = {}
    if isinstance(out, Mapping):
        images = {f"eval/{k}": v.pixels for k, v in out.items() if isinstance(v, Image)}
        out = {k: v for k, v in out.items() if not isinstance(v, Image)}
    buf = MetricBuffer()
    buf.add(out)
    return {f"eval/{k}": v for k, v in buf.pop().items()}, images


def _write_images(
    sinks: Sequence[Any], root: Path | None, step: int, images: Mapping[str, torch.Tensor]
) -> None:
    """Each image to ``root/images/<name>_<step>.png`` and to the sinks with ``image()``."""
    for name, pixels in images.items():
        if root is not None:
            write_png(pixels, root / "images" / f"{name.replace('/', '_')}_{step:08d}.png")
        for sink in sinks:
            if callable(image := getattr(sink, "image", None)):
                image(step, name, pixels)


def run(
    step: StepLike,
    state: TensorDictBase,
    data: Iterable[Any],
    *,
    num_steps: int,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    save_every: int | None = None,
    keep_last: int = 3,
    resume: str | os.PathLike[str] | None = "latest",
    log_every: int = 1,
    sinks: Sequence[str | Sink] | str | Sink = ("jsonl",),
    eval_fn: EvalFn | None = None,
    eval_every: int | None = None,
    progress: bool = True,
    desc: str = "train",
    async_save: bool = False,
    collective_timeout: float | datetime.timedelta | None = None,
) -> TensorDict:
    """Train ``state`` with ``step`` until ``state["step"] == num_steps``; returns the final state.

    Args:
        step: ``step(state, batch) -> (state, metrics)``; its ``prepare(state)``,
            when present, runs first (so the state's structure is fixed before a
            checkpoint is loaded into it).
        state: the initial state (ignored, but for its structure, when resuming).
        data: an iterable of batches (TensorDicts or dicts of tensors, converted
            with :func:`purestep.step.as_batch`); re-iterated when exhausted.
        num_steps: the target value of ``state["step"]`` (a resumed run does only
            the remaining steps).
        checkpoint_dir: where checkpoints (``step_XXXXXXXX/``) and the named
            sinks' files go. ``None``: no checkpoints and no metric files.
        save_every: save every this many steps (and at the last step, and on
            preemption); ``None``: only at the last step and on preemption.
        keep_last: keep this many newest checkpoints (older ones are pruned).
        resume: ``"latest"``: continue from the newest intact checkpoint in
            ``checkpoint_dir`` (from scratch if there is none); damaged or
            incomplete ones are skipped with a warning naming them (a damaged
            one is renamed ``<name>.damaged-<token>`` and kept when its step is
            saved again). A path: from that checkpoint; if ``checkpoint_dir``
            holds later checkpoints this is refused (``ValueError``): resuming
            there would replace them and drop their metric records, so to
            branch from an older checkpoint pass a new ``checkpoint_dir``
            (``resume`` may point into the old one). ``None``: from scratch (an
            error if ``checkpoint_dir`` already holds checkpoints).
        log_every: a log point every this many steps, and also at every
            checkpoint, the last step and a preemption.
        sinks: ``"jsonl"`` (``checkpoint_dir/metrics.jsonl``), ``"csv"``
            (``metrics.csv``), ``"tensorboard"`` (``tensorboard/``), or callables
            ``(step, metrics: dict[str, float]) -> None`` such as
            :class:`JSONLSink` (any path). Only rank 0 calls them.
        eval_fn: ``eval_fn(state) -> dict`` of scalars, logged as ``eval/<name>``,
            and of :class:`Image` values (sample grids), written (rank 0) to
            ``<checkpoint_dir>/images/eval_<name>_<step>.png`` and to sinks
            with an ``image`` method (TensorBoard).
            Runs on every rank (it may use collectives).
        eval_every: run ``eval_fn`` every this many steps (``None``: at the last
            step only).
        progress: show a tqdm progress bar on rank 0 (if tqdm is installed).
        desc: the progress bar's label.
        async_save: write the periodic checkpoints in the background
            (``purestep.checkpoint.save(..., async_=True)``): the loop is blocked
            only while the state is copied to CPU buffers. The last step's and a
            preemption's checkpoints are written synchronously, so every
            checkpoint is complete when ``run`` returns or raises.
        collective_timeout: with a process group, the default group's
            collective timeout during the run (seconds or a ``timedelta``;
            ``None`` keeps the group's own, which torch sets to 30 minutes
            unless ``init_process_group(timeout=...)`` says otherwise). A rank
            that hangs then ends the job: the ranks waiting for it raise
            :class:`CollectiveTimeoutError` after this long (a rank that dies
            ends it at once). Choose it above the slowest legitimate wait
            (the first step's compilation, a long evaluation).

    Metrics: a step's metrics stay on device until a log point; the record then
    holds each metric's mean over the steps since the previous log point that
    reported it (one host read per device), keyed ``"a/b"`` for nested keys, and
    ``eval/...`` for ``eval_fn``'s, under the log point's step. A step has at
    most one record.

    Replayed steps: on start, file sinks drop every record with a step greater
    than the step resumed from (0 for a fresh start). Records are written before
    the checkpoint of their step, so after any crash and a ``resume="latest"``
    restart every step appears in the log once.

    Checkpoints: :func:`purestep.checkpoint.save` of the state plus
    ``loop.batches_consumed``, with per-rank values ``loop.epoch``,
    ``loop.position`` (batches into the current pass) and, when ``data`` has
    ``state_dict()``/``load_state_dict()``, ``loop.data_state`` (its state as
    ``torch.save`` bytes). On resume the data is restored to that position (by
    its ``load_state_dict``, or by skipping batches of a fresh pass), so the run
    sees the batches an uninterrupted run would have seen, provided that
    iterating ``data`` is deterministic given the pass number (``set_epoch(n)``
    is called on ``data`` or ``data.sampler`` before pass ``n``). A checkpoint
    without the loop's keys (saved by hand) resumes with ``state["step"]``
    batches skipped. The returned state has no loop keys.

    Preemption: the first SIGTERM or SIGINT finishes the current step (and
    its log record at a log point), saves a checkpoint at that step (if ``checkpoint_dir``),
    prints (rank 0, stderr) the signal, the step, the checkpoint and how to
    resume, and raises :class:`Preempted` (a ``SystemExit``). A second signal
    acts at once. Metrics of the steps since the last log point are not logged
    then but carried in the checkpoint (``metadata.loop.pending_metrics``) into
    the resumed run's next record, so a preempted and resumed run writes the
    same records as an uninterrupted one (bitwise on CPU; on an accelerator the
    carried values are averaged on the CPU, equal up to rounding). Without a
    ``checkpoint_dir`` they are logged at the stop.

    Raises:
        ValueError: a bad argument, a ``resume`` path older than checkpoints in
            ``checkpoint_dir``, data that yields no batches.
        purestep.checkpoint.CheckpointError: a ``resume`` path that is not a
            checkpoint, a checkpoint whose keys do not match the state (all
            listed; a ``ValueError`` too), a failed save; see ``docs/errors.md``.
        OSError: ``checkpoint_dir`` is not writable.
        CollectiveTimeoutError: a collective waited longer than its timeout
            (see ``collective_timeout``).
        BatchKeyError: the step read a key the batch does not have (named).
        Preempted: on SIGTERM / SIGINT.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import purestep as ps
        >>> from purestep import loop
        >>> net = nn.Linear(2, 1)
        >>> loss = lambda p, b, k: ((ps.call(net, p["m"], b["x"]) - b["y"]) ** 2).mean()
        >>> opt = {"m": ps.optim.sgd(lr=0.1)}
        >>> step = ps.train_step(ps.value_and_grad(lambda p, b, k: (loss(p, b, k), {})), opt)
        >>> data = [{"x": torch.ones(4, 2), "y": torch.zeros(4, 1)}] * 3
        >>> state = loop.run(step, ps.init_state({"m": net}, opt, seed=0), data, num_steps=5,
        ...                  progress=False)
        >>> int(state["step"])
        5
    """
    _check_int("num_steps", num_steps, 1)
    _check_int("save_every", save_every, 1, optional=True)
    _check_int("keep_last", keep_last, 1)
    _check_int("log_every", log_every, 1)
    _check_int("eval_every", eval_every, 1, optional=True)
    if save_every is not None and checkpoint_dir is None:
        raise ValueError("run: save_every needs a checkpoint_dir")
    if eval_every is not None and eval_fn is None:
        raise ValueError("run: eval_every is set but eval_fn is None")
    if not callable(step) or (eval_fn is not None and not callable(eval_fn)):
        raise TypeError("run: step and eval_fn must be callables")
    if not isinstance(state, TensorDictBase):
        raise TypeError(f"run: state is a {type(state).__name__}; expected a TensorDict")
    check_sinks(sinks)
    _check_timeout(collective_timeout)
    rank = _rank()
    prepare = getattr(step, "prepare", None)
    if callable(prepare):
        state = prepare(state)
    if LOOP_KEY in state:
        raise ValueError(f"run: the state has a top-level key {LOOP_KEY!r}, reserved for the loop")
    if STEP not in state:
        raise KeyError("run: the state has no 'step' counter (build it with purestep.init_state)")
    root = None if checkpoint_dir is None else Path(checkpoint_dir)
    if root is not None:
        probe_writable(root, rank)
    phase = ["while resuming"]
    with guard_collectives(collective_timeout, lambda: phase[0]):
        stream = DataStream(data)
        stream.check_state()
        sources = resume_sources(resume, root)
        source = None
        if sources:
            state, source = restore_any(sources, state, stream)
        s = int(state.get(STEP))
        if s > num_steps:
            raise ValueError(f"run: resumed at step {s}, past num_steps={num_steps}")
        buf = MetricBuffer()
        if source is not None and rank == 0:  # a preempted window's metrics, not yet logged
            buf.restore(pending_metrics(source))
        out_sinks = make_sinks(sinks, root) if rank == 0 else []
        bar = None
        try:
            for sink in out_sinks:
                if callable(start := getattr(sink, "start", None)):
                    start(s)
            bar = _progress_bar(progress and rank == 0, s, num_steps, desc)

            def emit(at: int, record: dict[str, float]) -> None:
                for sink in out_sinks:
                    sink(at, record)
                if bar is not None:
                    bar.set_postfix(_short(record), refresh=False)

            def take() -> dict[str, float]:
                if rank == 0:
                    return buf.pop()
                buf.clear()  # only rank 0 logs: no host read elsewhere
                return {}

            saved_at = s if source is not None else -1
            with StopSignal() as stop:
                while s < num_steps:
                    phase[0] = f"in step {s + 1} (state['step'] was {s})"
                    state, metrics = _call(step, state, _to_batch(stream.next(), s), s)
                    new = int(state.get(STEP))
                    if new <= s:
                        raise RuntimeError(
                            f"run: the step did not advance state['step'] (was {s}, now {new})"
                        )
                    buf.add(metrics)
                    prev, s = s, new
                    final = s >= num_steps
                    save_now = root is not None and (
                        final or (save_every is not None and _crossed(prev, s, save_every))
                    )
                    record = take() if (final or save_now or _crossed(prev, s, log_every)) else {}
                    if eval_fn is not None and (
                        _crossed(prev, s, eval_every) if eval_every is not None else final
                    ):
                        phase[0] = f"in eval_fn at step {s}"
                        scalars, images = _evaluate(eval_fn, state)
                        record.update(scalars)
                        if images and rank == 0:
                            _write_images(out_sinks, root, s, images)
                    if record:
                        emit(s, record)
                    if bar is not None:
                        bar.update(s - prev)
                    if save_now:
                        assert root is not None
                        phase[0] = f"while saving the checkpoint of step {s}"
                        save(root, state, stream, s, keep_last, async_=async_save and not final)
                        saved_at = s
                    phase[0] = f"after step {s} (agreeing on stop signals)"
                    signum = stop.poll()
                    if signum and not final:
                        path = None
                        if root is None:
                            if buf and (record := take()):
                                emit(s, record)
                        else:
                            path = ckpt.step_dir(root, s)
                            if saved_at != s:  # not a log point: carry the window's metrics
                                pending = buf.pending() if rank == 0 else None
                                buf.clear()
                                save(root, state, stream, s, keep_last, pending_metrics=pending)
                            ckpt.wait_pending()  # an async save of this very step completes first
                        if rank == 0:
                            print(_preempted_message(signum, s, root, path), file=sys.stderr)
                        raise Preempted(state, signum, path)
        except BaseException:
            if (
                async_save
            ):  # the run failed with a save in flight: let it finish (its error is moot)
                with contextlib.suppress(Exception):
                    ckpt.wait_pending()
            raise
        finally:
            for sink in out_sinks:
                if callable(close := getattr(sink, "close", None)):
                    close()
            if bar is not None:
                bar.close()
        return cast(TensorDict, state)
