"""The layout rules of DESIGN.md "Layout", read from the source files
(nothing is imported): ``turn/`` imports nothing from ``media/``,
``voice/`` or ``web/``, ``media/`` nothing from the other three, ``voice/``
nothing from ``web/`` and nothing of aiortc (the agent session knows only
the transport seam, ``voice.transport``; DESIGN.md "Transports"), the shared
``clock`` none of them; its modules import each other without a cycle.
Size follows the concept (one concept, one module; a class is never split
across files to meet a line count): a module past 800 lines is named in a
warning, as a place to look for a second concept, not a failure.

Every import counts: at module level, inside functions and under
``if TYPE_CHECKING:``, absolute or relative.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("media", "voice", "web")
#: past this many lines a module is named in a warning (look for its second concept)
LOOK_AT_LINES = 800


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module name ``path`` (a module of ``package``) imports,
    resolved to an absolute dotted name; ``from pkg import name`` yields
    both ``pkg`` and ``pkg.name`` (the name may be a submodule)."""
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{alias.name}" for alias in node.names)
    return out


def import_graph(folder: Path) -> dict[str, set[str]]:
    """``module -> the modules of the same package it imports`` for the
    package in ``folder``."""
    package = folder.name
    modules = {p: (package if p.stem == "__init__" else f"{package}.{p.stem}") for p in sorted(folder.glob("*.py"))}
    names = set(modules.values())
    return {name: (imported_modules(path, package) & names) - {name} for path, name in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_turn_imports_nothing_from_the_layers_above() -> None:
    offenders = []
    for path in sorted((ROOT / "turn").glob("*.py")):
        for mod in imported_modules(path, "turn"):
            if mod.split(".")[0] in LAYERS:
                offenders.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert offenders == []


#: DESIGN.md "Layout": arrows point down only; the clock is below them all
MAY_NOT_IMPORT = {
    "clock": {"turn", "media", "voice", "web"},
    "media": {"turn", "voice", "web"},
    "voice": {"web", "aiortc"},  # aiohttp stays allowed: voice.openai_llm is an HTTP client
}


@pytest.mark.parametrize("package", sorted(MAY_NOT_IMPORT))
def test_no_layer_imports_one_above_it(package: str) -> None:
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for mod in imported_modules(path, package):
            if mod.split(".")[0] in MAY_NOT_IMPORT[package]:
                offenders.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert offenders == []


def test_voice_loads_no_aiortc_even_indirectly() -> None:
    """Importing every voice module (so everything they import, e.g. the
    media modules the session uses) loads no aiortc module."""
    code = (
        "import importlib, pkgutil, sys, voice\n"
        "for m in pkgutil.iter_modules(voice.__path__): importlib.import_module('voice.' + m.name)\n"
        "print(len([m for m in sys.modules if m.startswith('voice.')]), sorted(m for m in sys.modules if m.split('.')[0] == 'aiortc'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True).stdout.split(maxsplit=1)
    assert int(out[0]) > 10 and out[1].strip() == "[]"  # it imported the package; no aiortc


def test_turn_has_no_import_cycle() -> None:
    graph = import_graph(ROOT / "turn")
    assert len(graph) > 10  # it read the package
    assert find_cycle(graph) is None


def test_the_checks_see_a_cycle_and_a_layer_import(tmp_path: Path) -> None:
    """The graph sees imports inside functions, under TYPE_CHECKING and
    relative ones, so a cycle made of them is found."""
    pkg = tmp_path / "turn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from turn.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from .c import C\n    import voice.session\n")
    (pkg / "c.py").write_text("from turn import a\n")
    graph = import_graph(pkg)
    assert graph["turn.a"] == {"turn.b"} and graph["turn.b"] == {"turn.c"} and graph["turn.c"] == {"turn", "turn.a"}
    assert find_cycle(graph) == ["turn.a", "turn.b", "turn.c", "turn.a"]
    assert "voice.session" in imported_modules(pkg / "b.py", "turn")


def _long_modules(package: str) -> list[str]:
    return [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in sorted((ROOT / package).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > LOOK_AT_LINES
    ]


@pytest.mark.parametrize("package", ["turn", *LAYERS, "testkit", "client", "demo_shop"])
def test_modules_past_800_lines_are_named(package: str) -> None:
    long = _long_modules(package)
    if long:
        warnings.warn(f"past {LOOK_AT_LINES} lines, look for a second concept: {', '.join(long)}", stacklevel=1)
