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


def test_only_the_compat_package_imports_its_modules() -> None:
    """``purestep._compat``'s modules (``_probe``, ``_foreach``, ...) are reached through the
    package's re-exports (``_compat.foreach_add_``) from everywhere else in ``src``, so the
    concept split inside it can change without touching a call site, and a test's
    monkeypatch of ``_compat.X`` is the binding the call sites read."""
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        if _module_name(path).startswith("purestep._compat"):
            continue
        for line, target in _private_imports(path):
            if target.startswith("purestep._compat."):
                bad.append(f"{path.relative_to(SRC)}:{line} imports {target}")
    assert not bad, "imports of _compat's modules (use the package's names):\n" + "\n".join(bad)


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


# -- the state's well-known keys have one home: purestep._keys ---------------------------------

# Literals equal to a state key that do not mean the state's key: (module, literal) -> count.
# Anything else that spells a state key in src/ must use the constant (purestep._keys, public
# as purestep.state.PARAMS etc.).
_NOT_STATE_KEYS: dict[tuple[str, str], int] = {
    ("purestep/__init__.py", "rng"): 1,  # the module purestep.rng in __all__
    ("purestep/_layout.py", "params"): 1,  # a Layout attribute (__slots__)
    ("purestep/_layout.py", "buffers"): 1,  # a Layout attribute (__slots__)
    ("purestep/state.py", "buffers"): 1,  # the ParamSource method getattr(source, "buffers")
    ("purestep/state.py", "params"): 1,  # the argument's name in init_state's error message
    ("purestep/tree.py", "params"): 1,  # assert_same_structure(like="params"): a message word
    ("purestep/step/_accumulate.py", "buffers"): 1,  # grad_fn's buffers= keyword
    ("purestep/step/_train.py", "buffers"): 3,  # grad_fn's buffers= keyword
    ("purestep/compile/_core.py", "buffers"): 3,  # grad_fn's buffers= keyword; EMA layer attribute
    ("purestep/compile/_plan.py", "buffers"): 1,  # the EMA layer's attribute
    ("purestep/compile/_core.py", "skip"): 1,  # an EMA mode (skip / copy / avg)
    ("purestep/compile/_step.py", "skip"): 1,  # an EMA mode (skip / copy / avg)
    ("purestep/step/_validate.py", "extra"): 2,  # a problem kind (missing / extra leaves)
    ("purestep/checkpoint/__main__.py", "step"): 1,  # the verify summary's field
    ("purestep/distributed/_ckpt_paths.py", "step"): 1,  # metadata.json's field
    ("purestep/distributed/_ckpt_write.py", "step"): 1,  # metadata.json's field
    ("purestep/distributed/checkpoint.py", "step"): 2,  # metadata.json's / the summary's field
    ("purestep/loop/_checkpointing.py", "step"): 1,  # metadata.json's field
    ("purestep/loop/_sinks.py", "step"): 9,  # the metrics record's step column
    ("purestep/plot.py", "step"): 3,  # the metrics record's step column, the axis label
}


def _state_key_literals(path: Path, keys: set[str]) -> list[tuple[int, str]]:
    """``(line, literal)`` for every string constant in ``path`` equal to one of ``keys``,
    docstrings excepted (their examples show users the literals)."""
    module = ast.parse(path.read_text(), str(path))
    docstrings = set()
    for node in ast.walk(module):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return sorted(
        (node.lineno, node.value)
        for node in ast.walk(module)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value in keys
        and id(node) not in docstrings
    )


def test_state_keys_are_named_by_their_constants() -> None:
    """No module of ``src/`` spells a state key (``"params"``, ``"step"``, ...) as a string
    literal: they use ``purestep._keys``' constants, so a key has one home. The few literals
    that only look like one (a metrics column, a keyword argument, a metadata field) are
    listed, with their count, in ``_NOT_STATE_KEYS``."""
    from purestep import _keys

    keys = set(_keys.STATE_KEYS)
    seen: dict[tuple[str, str], list[int]] = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == "purestep/_keys.py":
            continue
        for line, lit in _state_key_literals(path, keys):
            seen.setdefault((rel, lit), []).append(line)
    bad = [
        f"{rel}:{','.join(map(str, lines))} spells {lit!r} ({len(lines)} times, "
        f"{_NOT_STATE_KEYS.get((rel, lit), 0)} allowed)"
        for (rel, lit), lines in sorted(seen.items())
        if len(lines) > _NOT_STATE_KEYS.get((rel, lit), 0)
    ]
    assert not bad, (
        "state keys written as literals: use the constants of purestep._keys (or, for a "
        "literal that is not the state's key, add it to _NOT_STATE_KEYS with the reason):\n"
        + "\n".join(bad)
    )
    stale = sorted(k for k, n in _NOT_STATE_KEYS.items() if len(seen.get(k, [])) < n)
    assert not stale, f"_NOT_STATE_KEYS allows more than the source has (lower it): {stale}"


def test_the_state_key_scan_finds_a_planted_literal(tmp_path: Path) -> None:
    """The scan is not vacuous: it reports ``state.get("params")`` and ``("ema", role)`` but not
    a docstring that shows ``state["params"]``."""
    f = tmp_path / "m.py"
    f.write_text(
        'def f(state, role):\n    """state["params"] in a docstring."""\n'
        '    return state.get("params"), ("ema", role), "step" + "s"\n'
    )
    assert _state_key_literals(f, {"params", "ema", "step"}) == [
        (3, "ema"),
        (3, "params"),
        (3, "step"),
    ]


def test_every_state_key_is_documented() -> None:
    """Each constant of ``purestep._keys`` names a key the state layout in
    docs/ARCHITECTURE.md shows, and ``purestep.state`` exports it."""
    from purestep import _keys, state

    doc = (SRC.parent / "docs" / "ARCHITECTURE.md").read_text()
    layout = doc[doc.index("## The state") : doc.index("## Layers")]
    assert [k for k in _keys.STATE_KEYS if f'"{k}"' not in layout] == []
    for name in _keys.__all__:
        assert getattr(state, name) == getattr(_keys, name) and name in state.__all__


def _attrs_classes() -> list[type]:
    import importlib

    import attrs

    found: list[type] = []
    for path in sorted((SRC / "purestep").rglob("*.py")):
        name = _module_name(path)
        try:
            module = importlib.import_module(name)
        except ImportError:  # an optional extra (triton) that is not installed
            continue
        found.extend(
            obj
            for obj in vars(module).values()
            if isinstance(obj, type) and attrs.has(obj) and obj.__module__ == name
        )
    return found


def test_every_attrs_class_has_a_working_repr() -> None:
    """repr() works for every attrs class in purestep with an attrs-generated __repr__ (on an
    instance with its fields set to None): attrs >= 26.1 runs the generated __repr__ with the defining module's globals, so a
    module-level name ``_compat`` (purestep's) shadowed attrs' own and repr raised
    AttributeError for Transform, SkipNonFinite, EMAStep and NFTStep."""
    import attrs

    classes = _attrs_classes()
    generated = [
        c
        for c in classes
        if "attrs generated" in getattr(getattr(c.__repr__, "__code__", None), "co_filename", "")
    ]
    assert {c.__name__ for c in generated} >= {"Transform", "SkipNonFinite", "EMAStep", "NFTStep"}
    for cls in generated:
        obj = object.__new__(cls)
        for field in attrs.fields(cls):
            object.__setattr__(obj, field.name, None)
        text = repr(obj)  # AttributeError before the fix
        assert isinstance(text, str) and text, cls
