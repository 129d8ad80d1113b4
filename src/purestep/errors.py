"""The errors purestep raises when it is used wrongly.

Each class derives from :class:`PurestepError` *and* from the builtin
exception that was raised for the same mistake before it had a type of its
own, so ``except ValueError`` / ``except KeyError`` clauses keep working.
Messages name the user's object at fault (the key path in the state, the
role, the batch key, the count at which a schedule goes bad) and say what to
do. See ``docs/errors.md`` for the full list.

Key paths are written with dots: ``params.student.fc.weight`` is
``state["params", "student", "fc", "weight"]``.

Example:
    >>> from purestep import errors
    >>> e = errors.StateError("state has no 'step'", path=("step",))
    >>> isinstance(e, KeyError), isinstance(e, ValueError), str(e), e.path
    (True, True, "state has no 'step'", ('step',))
"""

from __future__ import annotations

__all__ = [
    "BatchError",
    "DonatedStateError",
    "ModuleInUseError",
    "NonFiniteError",
    "PurestepError",
    "RoleError",
    "ScheduleError",
    "StateError",
]


class PurestepError(Exception):
    """Base class of every error purestep raises for a misuse it detects.

    Example:
        >>> issubclass(StateError, PurestepError)
        True
    """


class _Described(PurestepError):
    """An error whose ``str`` is its message as given (``KeyError`` would quote it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StateError(_Described, KeyError, ValueError):
    """The training state does not fit the step it is given to.

    A key the step needs is missing (``step``, ``rng``, ``params.<role>``,
    ``opt_state.<role>``); ``params`` and ``opt_state`` of a role disagree (a
    leaf dropped, added, renamed, reshaped or re-typed on one side); the
    optimizer state was built for another optimizer (or other
    hyperparameters); or two leaves share memory, so a donated step would
    update it twice. ``path`` is the key path at fault (a tuple), when there
    is one.

    Example:
        >>> e = StateError("params.student.bias: missing", path=("params", "student", "bias"))
        >>> e.path
        ('params', 'student', 'bias')
    """

    def __init__(self, message: str, path: tuple[str, ...] | None = None) -> None:
        super().__init__(message)
        self.path = path


class RoleError(_Described, KeyError, ValueError):
    """A role named in an argument (``optimizers``, ``grads``, ``roles=``, ``every=``) is unknown.

    Example:
        >>> str(RoleError("apply_gradients: no optimizer for role 'critic'", role="critic"))
        "apply_gradients: no optimizer for role 'critic'"
    """

    def __init__(self, message: str, role: str | None = None) -> None:
        super().__init__(message)
        self.role = role


class BatchError(_Described, ValueError):
    """A batch the step cannot use.

    No samples (``B = 0``), entries that disagree on ``B``, or a
    ``batch["index"]`` that is not a 1-D int64 tensor of distinct sample ids
    (per-sample noise is drawn from ``fold_in(key, index[i])``: duplicate ids
    would draw the same noise). ``key`` names the batch entry at fault.

    Example:
        >>> BatchError("batch has no samples (B=0)", key=None).key is None
        True
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class ScheduleError(_Described, ValueError):
    """A learning rate (or schedule) that is negative, not finite, or too large for the params.

    ``count`` is the optimizer count at which the value goes bad, when known.
    purestep's own schedules are checked over their whole domain when an
    optimizer is built with them; a user callable is checked at every update,
    before anything changes.

    Example:
        >>> ScheduleError("lr(6) = -0.02", count=6).count
        6
    """

    def __init__(self, message: str, count: int | None = None) -> None:
        super().__init__(message)
        self.count = count


class DonatedStateError(_Described, RuntimeError):
    """A state was used again after it was donated to a step (``donate=True``).

    A donated step updates params and optimizer state in their own buffers,
    so the input state now shows a half-updated mix and a second step on it
    would apply a second update to the same buffers. Use the state the step
    returned, or build the step with ``donate=False``.

    Example:
        >>> issubclass(DonatedStateError, RuntimeError)
        True
    """


class ModuleInUseError(_Described, RuntimeError):
    """A module's parameters are swapped by a ``call`` in another thread.

    Example:
        >>> issubclass(ModuleInUseError, RuntimeError)
        True
    """


class NonFiniteError(_Described, FloatingPointError):
    """Raised by :func:`purestep.skip_nonfinite` after too many consecutive skipped steps.

    Example:
        >>> issubclass(NonFiniteError, FloatingPointError)
        True
    """


def with_prefix(error: Exception, prefix: str) -> Exception:
    """A copy of ``error`` (same type and attributes) whose message starts with ``prefix``.

    Builtin errors other than purestep's become a ``ValueError``/``KeyError``/
    ``TypeError`` of the same class when it takes one message argument.

    Example:
        >>> str(with_prefix(ScheduleError("lr(3) = -1.0", count=3), "role 'student': "))
        "role 'student': lr(3) = -1.0"
    """
    message = prefix + (str(error.args[0]) if error.args else str(error))
    if isinstance(error, PurestepError):
        new = type(error).__new__(type(error))
        new.__dict__.update(error.__dict__)
        Exception.__init__(new, message)
        return new
    try:
        return type(error)(message)
    except TypeError:
        return error
