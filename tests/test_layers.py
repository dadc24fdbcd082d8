"""The package's folders are layers, and imports only point down (docs/architecture.md draws them).

util < algorithm < config < network < {training, observe, testing} < app < bench < sim < cli. Training, observation and
the testing aids are siblings that do not import each other, and production code reaches the testing aids
only through `p2pdiloco.testing.hooks`. Lazy imports inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import p2pdiloco

PACKAGE = Path(p2pdiloco.__file__).parent
BELOW = {
    "util": set(),
    "algorithm": {"util"},
    "config": {"algorithm", "util"},
    "network": {"config", "algorithm", "util"},
    "training": {"network", "config", "algorithm", "util"},
    "observe": {"network", "config", "algorithm", "util"},
    "testing": {"network", "config", "algorithm", "util"},
    "app": {"training", "observe", "testing", "network", "config", "algorithm", "util"},
    "bench": {"app", "training", "observe", "testing", "network", "config", "algorithm", "util"},
    "sim": {"bench", "app", "training", "observe", "testing", "network", "config", "algorithm", "util"},
}
PRODUCTION = ("util", "algorithm", "config", "network", "training", "observe", "app")
TEST_HOOK = "p2pdiloco.testing.hooks"


def _layer(dotted: str) -> str | None:
    """The layer a module of this package belongs to: its subpackage, or None for the root and cli.py."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in BELOW) else None


def _imports() -> list[tuple[str, str]]:
    """(importing module, imported p2pdiloco module) for every import statement in the package."""
    edges = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(("p2pdiloco", *path.relative_to(PACKAGE).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("p2pdiloco"):
                names = [node.module] if node.module != "p2pdiloco" else [f"p2pdiloco.{a.name}" for a in node.names]
                edges += [(module, n) for n in names]
            elif isinstance(node, ast.Import):
                edges += [(module, a.name) for a in node.names if a.name.startswith("p2pdiloco")]
    return edges


def test_the_package_is_the_layers_and_nothing_else():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(BELOW)
    loose = {p.name for p in PACKAGE.glob("*.py")}
    assert loose == {"__init__.py", "__main__.py", "cli.py"}


def test_imports_point_down():
    edges = _imports()
    assert len(edges) > 100  # the walk found the package's imports
    wrong = [
        (src, dst) for src, dst in edges
        if (a := _layer(src)) is not None and (b := _layer(dst)) is not None and b != a and b not in BELOW[a]
    ]
    assert wrong == []


def test_production_code_reaches_testing_aids_only_through_the_hook():
    edges = _imports()
    reaching = {(src, dst) for src, dst in edges if _layer(src) in PRODUCTION and _layer(dst) == "testing"}
    assert reaching == {("p2pdiloco.app.peer", TEST_HOOK)}


def test_no_function_over_80_lines_and_no_module_over_400():
    """A longer function is several steps that want names; a longer module, usually two concerns (STYLE.md)."""
    long_functions, long_modules = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        if len(source.splitlines()) > 400:
            long_modules.append(str(path.relative_to(PACKAGE)))
        for node in ast.walk(ast.parse(source, str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 80:
                long_functions.append(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert long_functions == [] and long_modules == []


def test_nothing_in_the_network_layer_hangs_on_a_context_variable():
    """One merge's state lives in its MergeSession (network/session.py), found by group id, not in task context."""
    users = [p.name for p in (PACKAGE / "network").glob("*.py") if "ContextVar" in p.read_text()]
    assert users == []
