"""The package structure docs/ARCHITECTURE.md promises, checked on the source.

The layers themselves are an import-linter contract in ``pyproject.toml`` (``lint-imports``,
run by ``.ci/run``); these checks cover what that contract cannot say.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _private_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, imported module)`` for every ``purestep.X._y`` import in ``path``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [
                f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")
            ]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "purestep" and any(p.startswith("_") for p in parts[2:]):
                found.append((node.lineno, name))
    return found


def _owner(module: str) -> str:
    """The package a private module belongs to: everything before its first private part."""
    parts = module.split(".")
    for i, p in enumerate(parts):
        if p.startswith("_") and i > 0:
            return ".".join(parts[:i])
    return module


def test_no_module_imports_another_packages_private_modules() -> None:
    """A module imports ``purestep.X._y`` only from inside package ``purestep.X``: packages meet
    at their public names (``__all__``), so a private module can change without breaking
    another package."""
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        here = _module_name(path)
        for line, target in _private_imports(path):
            owner = _owner(target)
            if not (here == owner or here.startswith(owner + ".")):
                bad.append(f"{path.relative_to(SRC)}:{line} imports {target}")
    assert not bad, "cross-package private imports:\n" + "\n".join(bad)


def test_the_private_import_check_finds_a_planted_violation(tmp_path: Path) -> None:
    """The scan above is not vacuous: it reports a ``from purestep.step._grad import`` written
    outside ``purestep.step``."""
    f = tmp_path / "m.py"
    f.write_text(
        "from purestep.step._grad import value_and_grad\n"
        "import purestep.tree\n"
        "from purestep.optim import _kernels\n"
    )
    assert _private_imports(f) == [(1, "purestep.step._grad"), (3, "purestep.optim._kernels")]
    assert _owner("purestep.step._grad") == "purestep.step"


def test_importing_purestep_does_not_import_the_loop_or_checkpoints() -> None:
    """``import purestep`` loads the step layers only; ``purestep.loop`` and
    ``purestep.checkpoint`` (and with them ``torch.distributed.checkpoint``) load on first
    use, so importing the package never runs an import back up the layers."""
    code = (
        "import sys, purestep\n"
        "late = [m for m in ('purestep.loop', 'purestep.checkpoint', 'purestep.distributed.checkpoint',"
        " 'purestep.methods', 'purestep.testing') if m in sys.modules]\n"
        "assert not late, late\n"
        "assert purestep.loop.run and purestep.checkpoint.save\n"
        "assert 'purestep.loop' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_layers_contract_is_kept() -> None:
    """``lint-imports`` (import-linter, the ``dev`` extra) passes on the source tree."""
    pytest.importorskip("importlinter")
    root = SRC.parent
    r = subprocess.run(
        [sys.executable, "-m", "importlinter.cli", "--config", str(root / "pyproject.toml")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
