"""The code's shape, as CONTRIBUTING.md states it: every source file at most 400 lines,
every function at most 80 (its signature included), dependencies that point one way
(`dflash_mlx` <- `converters` <- `app`, then `benchmarks`), and no import cycle among the
project's modules, imports inside functions included (a cycle hidden behind a
function-level import is still a cycle a reader has to untangle); and no test module
importing another (what tests share lives in helper modules and conftest.py)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dflash_mlx", "converters", "app", "benchmarks")  # benchmarks/: where present; in layer order
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80


def source_files() -> list[Path]:
    """Every Python source file of the packages (tests are not source)."""
    return sorted(p for package in PACKAGES if (ROOT / package).is_dir() for p in (ROOT / package).rglob("*.py"))


def module_name(path: Path, root: Path = ROOT) -> str:
    """`dflash_mlx/train/data.py` -> `dflash_mlx.train.data`; a package's `__init__.py` is the package."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_source_files_are_at_most_400_lines():
    long = [f"{relative(p)} ({n})" for p in source_files() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, f"files over {MAX_FILE_LINES} lines: {', '.join(long)}"


def test_functions_are_at_most_80_lines():
    long = []
    for path in source_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # from `def` (decorators aside) to the last line
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{relative(path)}:{node.lineno} {node.name} ({lines})")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (signature included): {', '.join(long)}"


def imported_modules(path: Path, modules: set[str], root: Path = ROOT) -> set[str]:
    """The project modules `path` imports anywhere in it (top level, functions, branches):
    `from package import name` is the submodule `package.name` where that is a module,
    else the package itself."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up level - 1 packages from this module's package
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` where only a.b is ours
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a
    path that returns to its start along import edges, then the component's modules
    that path does not pass through."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                loop = _loop(graph, set(component))
                found.append(loop + sorted(set(component) - set(loop)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _loop(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest import path from the component's first module back to itself (breadth first)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no loop in the component {sorted(component)}")


def import_graph() -> dict[str, set[str]]:
    files = source_files()
    modules = {module_name(p) for p in files}
    return {module_name(p): imported_modules(p, modules) for p in files}


def test_no_import_cycles():
    found = []
    for circle in cycles(import_graph()):
        loop = circle[: circle.index(circle[0], 1) + 1]
        rest = circle[len(loop) :]
        found.append(" -> ".join(loop) + (f" (in the same circle: {', '.join(rest)})" if rest else ""))
    assert not found, "import cycles (function-level imports included): " + "; ".join(found)


def test_the_cycle_finder_sees_a_function_level_cycle(tmp_path):
    """The checker itself: a cycle made of one top-level and one function-level import."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import g\n")
    (package / "b.py").write_text("def g():\n    from . import a\n")
    (package / "c.py").write_text("import pkg.a\n")
    modules = {"pkg", "pkg.a", "pkg.b", "pkg.c"}
    graph = {module_name(p, tmp_path): imported_modules(p, modules, tmp_path) for p in package.glob("*.py")}
    assert graph["pkg.c"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """The edges `a -> b` of `graph` whose `b` is in a later package of PACKAGES than `a`."""
    layer = {package: i for i, package in enumerate(PACKAGES)}

    def of(module: str) -> int:
        return layer[module.split(".")[0]]

    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if of(b) > of(a))


def test_dependencies_point_one_way():
    up = upward_imports(import_graph())
    assert not up, "imports against dflash_mlx <- converters <- app <- benchmarks: " + "; ".join(up)


def named_imports(path: Path) -> set[str]:
    """The modules `path` imports by name at run time: string constants of the module
    that name a project package's module, and literal `importlib.import_module` arguments."""
    tree = ast.parse(path.read_text())
    names = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return {n for n in names if n.split(".")[0] in PACKAGES and n.replace(".", "").replace("_", "").isalnum()}


def test_the_engine_names_one_module_above_it_the_default_models_provider():
    """docs/architecture.md: `dflash_mlx` reaches up once, at run time, by name: `defaults.py`
    imports `converters.default_model` through `importlib` when no provider is registered."""
    up = {}
    for path in source_files():
        if module_name(path).startswith("dflash_mlx"):
            named = {n for n in named_imports(path) if not n.startswith("dflash_mlx")}
            if named:
                up[module_name(path)] = named
    assert up == {"dflash_mlx.defaults": {"converters.default_model"}}, up


#: The engine modules `app` may import besides `dflash_mlx`'s public names (app/__init__.py).
APP_REACHES = {
    "cache",
    "distributed",
    "batch",
    "batch_spec",
    "batch_width",
    "acceptance",
    "text",
    "topk",
    "train",
    "draft_vocab",
    "drafters",
    "atomic",
    "loading",
    "targets",
    "tree",
    "rollback",
    "kernels",
    "host",
}


def test_app_reaches_the_engine_through_its_public_names_and_the_modules_it_lists():
    reached = set()
    for path in source_files():
        if module_name(path).startswith("app"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dflash_mlx."):
                    reached.add(node.module.split(".")[1])
                elif isinstance(node, ast.ImportFrom) and node.module == "dflash_mlx":
                    import dflash_mlx

                    reached |= {a.name for a in node.names if a.name not in dflash_mlx.__all__}
    assert reached <= APP_REACHES, reached - APP_REACHES


def test_the_layer_check_sees_an_upward_import():
    graph = {"dflash_mlx.a": {"converters.b"}, "converters.b": {"dflash_mlx.a"}, "app.c": {"converters.b"}}
    assert upward_imports(graph) == ["dflash_mlx.a -> converters.b"]


def test_no_test_module_imports_another():
    found = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            found += [f"{path.name} imports {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert not found, "; ".join(found)
