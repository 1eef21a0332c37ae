"""The product packages (turn, media, voice, web) never import test tooling
(testkit, tests, bench), the headless client (client) nor the demo shop
example, at module level or inside a function. Two exceptions: web/app.py
wires the demo shop behind the ``demo_shop`` setting, and may import
``demo_shop.shop`` only inside ``demo_shop_for`` (when the setting is on) and
under ``if TYPE_CHECKING:``; web/cli.py's ``main`` loads ``client.command``
for ``turnkeeper call`` only.

Every module is parsed with :mod:`ast`, so imports that never run in a test
(function-local ones, ``importlib.import_module("...")``) are seen too."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("turn", "media", "voice", "web")
EXAMPLE = "demo_shop"
#: top-level names the product must not import: the tooling packages, the
#: example, and the modules tests/ and bench/ put on sys.path themselves
FORBIDDEN = frozenset(
    {"testkit", "tests", "bench", "client", EXAMPLE}
    | {p.stem for p in (ROOT / "tests").glob("*.py")}
    | {p.stem for p in (ROOT / "bench").glob("*.py")}
)
#: the one allowed place: (module path, enclosing function or "TYPE_CHECKING", imported module)
ALLOWED = frozenset({
    ("web/app.py", "demo_shop_for", "demo_shop.shop"),
    ("web/app.py", "TYPE_CHECKING", "demo_shop.shop"),
    ("web/cli.py", "main", "client.command"),  # `turnkeeper call` runs the headless client
})


@dataclass(frozen=True)
class Found:
    """One import: where (file, line, enclosing function or TYPE_CHECKING
    block, "" at module level) and the full name of the imported module."""

    path: str
    line: int
    where: str
    module: str


def imports(path: str, source: str) -> list[Found]:
    """Every import in ``source`` (the module at ``path``, relative to the
    repository, for resolving relative imports), including function-local
    ones and ``importlib.import_module`` / ``__import__`` with a literal name."""
    package = path.removesuffix(".py").split("/")[:-1]  # the package a relative import starts from
    out: list[Found] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = child.name
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.body:
                    visit(ast.Module(body=[sub], type_ignores=[]), "TYPE_CHECKING")
                for sub in child.orelse:
                    visit(ast.Module(body=[sub], type_ignores=[]), where)
                continue
            if isinstance(child, ast.Import):
                out.extend(Found(path, child.lineno, where, a.name) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package[: len(package) - (child.level - 1)] if child.level > 1 else package
                    module = ".".join([*base, *([child.module] if child.module else [])])
                else:
                    module = child.module or ""
                if module:
                    out.append(Found(path, child.lineno, where, module))
                else:  # ``from .. import testkit``: the names are the modules
                    out.extend(Found(path, child.lineno, where, a.name) for a in child.names)
            elif isinstance(child, ast.Call) and _dynamic_import(child) is not None:
                out.append(Found(path, child.lineno, where, _dynamic_import(child) or ""))
            visit(child, inner)

    visit(ast.parse(source, filename=path), "")
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _dynamic_import(call: ast.Call) -> str | None:
    fn = call.func
    name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
    if name in ("import_module", "__import__") and call.args:
        arg = call.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
    return None


def violations(found: list[Found]) -> list[Found]:
    """The imports of a forbidden top-level name outside :data:`ALLOWED`."""
    return [f for f in found if f.module.split(".")[0] in FORBIDDEN and (f.path, f.where, f.module) not in ALLOWED]


def product_imports() -> list[Found]:
    found: list[Found] = []
    for package in PRODUCT:
        for file in sorted((ROOT / package).rglob("*.py")):
            rel = file.relative_to(ROOT).as_posix()
            found.extend(imports(rel, file.read_text()))
    return found


def test_the_product_imports_no_test_tooling_and_no_example() -> None:
    found = product_imports()
    assert len({f.path for f in found}) > 40  # every product module was read
    bad = violations(found)
    assert not bad, "\n".join(f"{f.path}:{f.line} ({f.where or 'module'}) imports {f.module}" for f in bad)


def test_the_exceptions_are_where_they_are_allowed() -> None:
    """web/app.py reaches the example only behind the setting (inside
    demo_shop_for, and for type checking), web/cli.py the headless client only
    in its ``call`` command; nowhere else."""
    seen = {(f.path, f.where, f.module) for f in product_imports() if f.module.split(".")[0] in (EXAMPLE, "client")}
    assert seen == ALLOWED


def test_the_check_sees_every_kind_of_import() -> None:
    """Not blind: module-level, function-local, relative, ``from x import``,
    dynamic and TYPE_CHECKING imports of forbidden names are all caught;
    the allowed one only in its function."""
    source = '''
import testkit.fuzz
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from bench import store
def f():
    from demo_shop.tools import demo_tools
async def g():
    import importlib
    importlib.import_module("tests.listening")
class C:
    def m(self):
        from conftest import free_port
def demo_shop_for():
    from demo_shop.shop import DemoShop
'''
    bad = violations(imports("web/app.py", source))
    assert {(f.where, f.module.split(".")[0]) for f in bad} == {
        ("", "testkit"), ("TYPE_CHECKING", "bench"), ("f", "demo_shop"), ("g", "tests"), ("m", "conftest"),
    }
    assert violations(imports("web/peer.py", "def demo_shop_for():\n    from demo_shop.shop import DemoShop\n"))
    assert [f.module for f in imports("voice/x.py", "from .. import testkit\n")] == ["testkit"]
    assert [f.module for f in imports("voice/x.py", "from .llm import tokenize\n")] == ["voice.llm"]
    assert violations(imports("voice/x.py", "from .. import testkit\n"))
