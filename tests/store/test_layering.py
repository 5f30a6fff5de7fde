"""The store sits at the bottom of the package (issue 18): no module under ``tiermem/store``
imports a layer built on it, whether at the top or inside a function, and its modules import
each other without a circle. For the whole package (issue 28): no import circle anywhere (an
import inside a function counts as much as one at the top), no module over 800 lines but
the named ones being split, none of which may grow, and the applications (``tiermem/apps``:
plan, tune, bench, demo, the command) import the library but no library module imports them."""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

import tiermem

PACKAGE = pathlib.Path(tiermem.__file__).resolve().parent
STORE = PACKAGE / "store"
ABOVE = ("tiermem.schedule", "tiermem.optim", "tiermem.offload", "tiermem.apps")


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


STORE_MODULES = {module_name(p): p for p in sorted(STORE.rglob("*.py"))}
ALL_MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every module an ``import``/``from ... import`` anywhere in ``path`` names (relative ones
    resolved; ``from P import M`` counts as ``P.M`` when that is a module of the store)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            found.add(source)
            found.update(f"{source}.{a.name}" for a in node.names
                         if f"{source}.{a.name}" in STORE_MODULES)
    return found


def test_the_scan_sees_the_store_and_its_imports():
    """Guards the scan itself: it finds the modules and the imports they are known to make."""
    assert {"tiermem.store.store", "tiermem.store.trace", "tiermem.store.prefetch",
            "tiermem.store.policy", "tiermem.store.io.posix"} <= set(STORE_MODULES)
    assert "tiermem.store.trace" in imported_modules(STORE / "prefetch.py")
    assert "tiermem._leftovers" in imported_modules(STORE / "nvme.py")  # relative: ``..``
    assert "tiermem.store.io.base" in imported_modules(STORE / "io" / "posix.py")


@pytest.mark.parametrize("name", sorted(STORE_MODULES))
def test_store_module_imports_nothing_above_the_store(name):
    importlib.import_module(name)  # every module of the store imports on its own
    upward = sorted(m for m in imported_modules(STORE_MODULES[name])
                    if any(m == a or m.startswith(a + ".") for a in ABOVE))
    assert not upward, f"{name} imports {upward}: the store must not depend on layers above it"


def test_store_modules_import_each_other_without_a_circle():
    graph = {name: {m for m in imported_modules(path) if m in STORE_MODULES and m != name}
             for name, path in STORE_MODULES.items()}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = path[path.index(name):] + [name]
            pytest.fail("import circle in the store: " + " -> ".join(cycle))
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, path + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_importing_the_store_loads_no_layer_above_it():
    """In a fresh interpreter, importing every store module leaves the layers above unloaded
    (this also catches an import made through ``importlib``, which the scan cannot see)."""
    code = ("import sys\n"
            f"for name in {sorted(STORE_MODULES)!r}:\n"
            "    __import__(name)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[:2] in\n"
            f"             {[a.split('.') for a in ABOVE]!r}))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout


# ------------------------------------------------------------------- the whole package


def package_imports(path: pathlib.Path) -> set[str]:
    """The modules of tiermem that ``path`` imports, anywhere in it (top level, functions,
    ``if`` branches). ``from P import M`` with ``M`` a module counts as ``P.M`` only: ``P`` is
    its parent package, whose ``__init__`` runs first whatever imports it, so it is no edge of
    its own; ``from P import name`` of anything else counts as ``P``."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            modules = [f"{source}.{a.name}" for a in node.names
                       if f"{source}.{a.name}" in ALL_MODULES]
            found.update(modules)
            if len(modules) < len(node.names):
                found.add(source)
    return {m for m in found if m in ALL_MODULES and m != name}


def import_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (module -> modules it imports) as ``[a, b, ..., a]``, or
    None when there is none (depth-first search, modules and edges in sorted order)."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(name: str) -> list[str] | None:
        if name in on_path:
            return path[path.index(name):] + [name]
        if name in done:
            return None
        path.append(name)
        on_path.add(name)
        for dep in sorted(graph.get(name, ())):
            found = visit(dep)
            if found:
                return found
        path.pop()
        on_path.discard(name)
        done.add(name)
        return None

    for name in sorted(graph):
        found = visit(name)
        if found:
            return found
    return None


def test_the_circle_search_finds_a_circle_and_passes_a_tree():
    """Guards the search: a made-up circle is named, in order; a diamond is not a circle."""
    assert import_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert import_circle({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) is None


def test_the_package_scan_sees_function_level_and_submodule_imports():
    assert len(ALL_MODULES) > 50 and "tiermem.rates" in ALL_MODULES
    # a function-level import (inside MachineRates.measure)
    assert "tiermem.optim.cpu_adam" in package_imports(PACKAGE / "rates.py")
    # ``from tiermem import _native`` is the module, not the package's __init__
    cpu_adam = package_imports(PACKAGE / "optim" / "cpu_adam.py")
    assert "tiermem._native" in cpu_adam and "tiermem" not in cpu_adam


def test_no_import_circle_in_the_package():
    graph = {name: package_imports(path) for name, path in ALL_MODULES.items()}
    circle = import_circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle or [])


MAX_LINES = 800
"""No module of tiermem is longer than this (issue 28)."""
BEING_SPLIT = {  # module -> its length when the limit came (issue 28); lower as they shrink
}
"""The modules still over :data:`MAX_LINES`, each with a ceiling it may not exceed."""


def test_no_module_is_over_800_lines_and_none_being_split_grows():
    lines = {p.relative_to(PACKAGE.parent).as_posix(): len(p.read_text().splitlines())
             for p in ALL_MODULES.values()}
    over = {m: n for m, n in lines.items()
            if n > BEING_SPLIT.get(m, MAX_LINES)}
    assert not over, (f"modules over {MAX_LINES} lines (or over their ceiling in "
                      f"BEING_SPLIT): {over}; split them")
    done = sorted(m for m in BEING_SPLIT if lines.get(m, 0) <= MAX_LINES)
    assert not done, f"{done} are {MAX_LINES} lines or fewer now: take them off BEING_SPLIT"


# ------------------------------------------------------------------- library and applications

APPS = "tiermem.apps"
"""The applications' package: plan, tune, bench, demo, run_cost and the ``tiermem`` command."""


def is_app(name: str) -> bool:
    return name == APPS or name.startswith(APPS + ".")


def app_imports_of_the_library(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Library module -> the application modules it imports (only those that do any)."""
    found = {name: sorted(m for m in deps if is_app(m))
             for name, deps in graph.items() if not is_app(name)}
    return {name: deps for name, deps in found.items() if deps}


def test_the_apps_are_a_package_that_imports_the_library():
    """Guards the scan: the applications are where this test looks for them, they import the
    library (the planner its machine model), and a library module importing one is named."""
    apps = {name for name in ALL_MODULES if is_app(name)}
    assert {"tiermem.apps.cli", "tiermem.apps.demo", "tiermem.apps.plan.placement",
            "tiermem.apps.tune.cost", "tiermem.apps.bench.common"} <= apps
    assert "tiermem.rates" in package_imports(PACKAGE / "apps" / "tune" / "cost.py")
    assert app_imports_of_the_library({"tiermem.x": {"tiermem.apps.plan", "tiermem.names"},
                                       "tiermem.apps.y": {"tiermem.apps.plan"}}) == {
        "tiermem.x": ["tiermem.apps.plan"]}


def test_no_library_module_imports_an_application():
    graph = {name: package_imports(path) for name, path in ALL_MODULES.items()}
    upward = app_imports_of_the_library(graph)
    assert not upward, f"library modules importing applications (tiermem/apps): {upward}"
