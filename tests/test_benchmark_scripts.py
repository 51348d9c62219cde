"""The scripts under benchmarks/ (behind BENCHMARKS.md's tables) still fit the code: each
compiles, and every name it imports from the project (`dflash_mlx`, `converters`, `app`,
`benchmarks`) exists. They take minutes to run, so they are not run here."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "benchmarks").rglob("*.py"))
PROJECT = {"dflash_mlx", "converters", "app", "benchmarks"}


def project_imports(tree: ast.Module) -> list[tuple[str, str | None]]:
    """(module, name) for each project import of a script; name None for `import module`."""
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] in PROJECT]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in PROJECT:
            out += [(node.module, alias.name) for alias in node.names]
    return out


def test_there_are_scripts():
    assert {p.name for p in SCRIPTS} >= {"render.py", "chains.py", "lookup_replay.py"}


@pytest.mark.parametrize("script", SCRIPTS, ids=[str(p.relative_to(ROOT)) for p in SCRIPTS])
def test_script_compiles_and_its_imports_exist(script):
    source = script.read_text()
    compile(source, str(script), "exec")
    imports = project_imports(ast.parse(source))
    missing = []
    for module, name in imports:
        try:
            found = importlib.import_module(module)
        except ImportError:
            missing.append(module)
            continue
        if name is not None and not hasattr(found, name):
            try:  # `from package import submodule`
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{module}.{name}")
    assert not missing, f"{script.name} imports what does not exist: {missing}"


def test_a_missing_name_is_caught():
    tree = ast.parse("from dflash_mlx.tree import build_tree, no_such_function\nimport app.no_such_module\n")
    assert project_imports(tree) == [
        ("dflash_mlx.tree", "build_tree"),
        ("dflash_mlx.tree", "no_such_function"),
        ("app.no_such_module", None),
    ]
    assert not hasattr(importlib.import_module("dflash_mlx.tree"), "no_such_function")
