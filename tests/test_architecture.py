"""The import graph of ``memdoctor/`` against the allowed directions in ``docs/architecture.md``.

Read from the source (every ``import`` and ``from ... import``, inside functions and ``TYPE_CHECKING``
blocks too), never by importing it, so a lazy import cannot hide an edge. A node is a subpackage of
``memdoctor`` or a top-level module; ``memdoctor`` itself is the public facade. Pure AST: no child
processes.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "memdoctor"
DOC = ROOT / "docs" / "architecture.md"
LOADERS = {"import_module", "find_spec", "__import__"}


def allowed_imports(text: str) -> dict[str, set[str]]:
    """The ```imports block of the architecture doc: ``node: allowed nodes ...`` per line."""
    block = re.search(r"```imports\n(.*?)```", text, re.S)
    assert block, f"{DOC} has no ```imports block"
    table: dict[str, set[str]] = {}
    for line in block.group(1).splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            node, _, targets = line.partition(":")
            table[node.strip()] = set(targets.split())
    return table


def node_of(module: str) -> str:
    """``memdoctor.capture.session`` -> ``capture``, ``memdoctor.units`` -> ``units``, ``memdoctor``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> Iterator[tuple[str, str, int]]:
    """``(imported module, imported name or "", line)`` for every memdoctor import in ``path``."""
    name = module_name(path)
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "memdoctor":
                    yield alias.name, "", node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = resolve(name, is_package, node.module, node.level)
            if base.split(".")[0] != "memdoctor":
                continue
            for alias in node.names:
                # ``from memdoctor.x import y`` may name a submodule y: the edge is to x's node either way
                yield base, alias.name, node.lineno


def resolve(importer: str, is_package: bool, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    parts = importer.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def source_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def edges() -> list[tuple[str, str, str, str, int]]:
    """``(from node, to node, imported module, name, "path:line")`` across nodes."""
    out = []
    for path in source_files():
        here = node_of(module_name(path))
        for module, name, line in imports(path):
            there = node_of(module) if module != "memdoctor" or not name else name_node(name)
            out.append((here, there, module, name, f"{path.relative_to(ROOT)}:{line}"))
    return out


def name_node(name: str) -> str:
    """``from memdoctor import units`` names ``units``; ``from memdoctor import profile`` the facade."""
    return name if (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file() else "memdoctor"


def test_the_table_is_acyclic_and_names_every_node() -> None:
    table = allowed_imports(DOC.read_text())
    nodes = {node_of(module_name(p)) for p in source_files()}
    assert nodes - set(table) == set(), "nodes missing from docs/architecture.md's imports block"
    assert set(table) - nodes == set(), "the imports block names nodes that do not exist"
    assert find_cycle({k: v - {k} for k, v in table.items()}) is None


def test_every_import_goes_an_allowed_direction() -> None:
    table = allowed_imports(DOC.read_text())
    wrong = [
        f"{where}: {here} -> {there} ({module}{'.' + name if name else ''})"
        for here, there, module, name, where in edges()
        if here != there and there not in table.get(here, set())
    ]
    assert wrong == []


def test_no_cycle_between_packages() -> None:
    graph: dict[str, set[str]] = {}
    for here, there, *_ in edges():
        if here != there:
            graph.setdefault(here, set()).add(there)
    assert find_cycle(graph) is None


def test_no_private_name_crosses_a_package_line() -> None:
    crossing = [
        f"{where}: {module}.{name}"
        for here, there, module, name, where in edges()
        if here != there and is_private(name)
    ]
    assert crossing == []


def test_no_memdoctor_module_is_imported_by_name_string() -> None:
    """Registries are lists of imported modules: a missing module is an ImportError, not a note."""
    found = []
    for path in source_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and call_name(node) in LOADERS and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and str(arg.value).startswith("memdoctor"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {arg.value}")
    assert found == []


def call_name(node: ast.Call) -> str:
    fn = node.func
    return fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path of nodes, or None (depth-first search with colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_checker_sees_a_cycle_a_lazy_import_and_a_private_name(tmp_path: Path) -> None:
    """The checks themselves can fail: a two-node cycle, an import inside a function, a ``_name``."""
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    src = tmp_path / "memdoctor" / "plan" / "x.py"
    src.parent.mkdir(parents=True)
    src.write_text("def f():\n    from memdoctor.report.render import _env\n    from . import y\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = list(imports(src))
    finally:
        ROOT = saved
    assert found == [("memdoctor.report.render", "_env", 2), ("memdoctor.plan", "y", 3)]
    assert is_private("_env") and not is_private("__version__")
