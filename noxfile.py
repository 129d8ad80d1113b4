"""Version matrix: purestep's tests on the oldest and newest torch/tensordict it supports.

Each stack gets its own virtual environment (under ``.nox/``), installs
``purestep[test]`` editable with its torch and tensordict, checks that it got
those versions, and runs pytest. ``.ci/run`` runs every session after the main
suite (pinned torch 2.13.0); run one locally with

    nox -s "tests(newest)"            # or lowest_torch, lowest_tensordict
    nox -s "tests(newest)" -- tests/test_internals.py -x   # pytest arguments

Stacks (see README, "Supported versions"):

- ``lowest_torch``: torch 2.11.0, the declared floor, with tensordict 0.15.2,
  the oldest tensordict that installs beside it (0.15.0 and 0.15.1 require
  torch >= 2.13).
- ``lowest_tensordict``: tensordict 0.15.0, the declared floor, with torch
  2.13.0, the oldest torch it installs beside (the CPU wheel on local disk).
- ``newest``: whatever the registry serves now, unpinned (a new torch release
  is tested the day it appears); the session fails if that is older than
  :data:`NEWEST_KNOWN`, so a resolver that silently falls back is caught.

The machine's pip configuration may cap torch (a ``constraint`` file in a global
pip.conf). Each session sets ``PIP_CONSTRAINT`` to its own file, which replaces
that setting for the session's pip calls only; nothing global is changed.
"""

from __future__ import annotations

from pathlib import Path

import nox

nox.options.sessions = ["tests"]
nox.options.error_on_missing_interpreters = True

PYTHON = "3.11"

# stack name -> exact pins ("" = unpinned: the newest the registry serves)
STACKS: dict[str, dict[str, str]] = {
    "lowest_torch": {"torch": "2.11.0", "tensordict": "0.15.2"},
    "lowest_tensordict": {"torch": "2.13.0", "tensordict": "0.15.0"},
    "newest": {"torch": "", "tensordict": ""},
}

# The newest releases known when this file was last updated; ``newest`` must get
# at least these.
NEWEST_KNOWN = {"torch": "2.15.0", "tensordict": "0.15.3"}

# Default pytest arguments: README's `pytest` (unit, property, doctest and
# two-process FSDP/DCP tests) less its two slowest groups. Neither touches a
# torch or tensordict surface that the rest leaves out:
# - the examples' end-to-end runs (test_examples, test_quickstart): the same
#   public API at larger sizes;
# - the fault-injection runs that kill training processes (test_loop_faults
#   and the SIGKILL-during-save tests): process and filesystem behaviour. The
#   checkpoint round trips stay in.
# What is left takes about 45 % of the full suite's time; the pinned stack in
# .ci/run still runs all of it. Pass pytest arguments after `--` to change it.
PYTEST_ARGS = [
    "-q",
    "-p",
    "no:cacheprovider",
    "--durations=5",
    "--ignore=tests/test_examples.py",
    "--ignore=tests/test_quickstart.py",
    "--ignore=tests/test_loop_faults.py",
    "-k",
    "not sigkill",
]

_CHECK = """
import sys
from importlib.metadata import version
from packaging.version import Version
want, floor = {want!r}, {floor!r}
for name in ("torch", "tensordict"):
    got = Version(version(name))
    print(f"{{name}} {{got}}")
    if want[name] and got.release != Version(want[name]).release:
        sys.exit(f"{{name}}: wanted {{want[name]}}, got {{got}}")
    if not want[name] and got < Version(floor[name]):
        sys.exit(f"{{name}}: newest stack got {{got}}, older than {{floor[name]}}")
"""


@nox.session(python=PYTHON)
@nox.parametrize("stack", list(STACKS), ids=list(STACKS))
def tests(session: nox.Session, stack: str) -> None:
    """The test suite on one torch/tensordict stack."""
    pins = STACKS[stack]
    constraints = Path(session.create_tmp()) / "constraints.txt"
    constraints.write_text(
        "# written by noxfile.py: replaces any global pip constraint for this session\n"
        + "".join(f"{name}=={v}\n" for name, v in pins.items() if v)
    )
    env = {"PIP_CONSTRAINT": str(constraints), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    # --no-compile: byte-compiling torch's ~4,000 modules at install took 3 of the
    # 4 minutes a CPU torch install took here; Python compiles what it imports.
    session.install("--no-compile", "torch", "tensordict", env=env)
    session.install("--no-compile", "-e", ".[test]", env=env)
    session.run("python", "-c", _CHECK.format(want=pins, floor=NEWEST_KNOWN))
    # Byte-compile what the two-process tests import now, once: otherwise both
    # workers compile it at their first import, which on a loaded machine ran past
    # the workers' 120 s start timeout (19 FSDP tests errored that way).
    session.run(
        "python",
        "-c",
        "import torch.distributed.checkpoint, torch.distributed.fsdp, tensordict, purestep",
    )
    session.run("pytest", *(session.posargs or PYTEST_ARGS))
