"""The engine's import graph, built from the source itself -- every import statement, including those inside
functions (an import placed in a function to dodge a cycle still counts) but not those under ``TYPE_CHECKING``:

* it has no cycle;
* no module imports a ``_``-prefixed name from another module, nor a ``_``-prefixed module of another package
  (``kiln.training._state`` is private to ``kiln.training``; a top-level ``kiln.documents.jsonio`` to ``kiln``): what two
  packages share gets a public name in the module that owns it.
"""

from __future__ import annotations

import ast
from pathlib import Path

KILN = Path(__file__).resolve().parent.parent / "kiln"


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(KILN.rglob("*.py")):
        parts = path.relative_to(KILN.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _package_of(name: str) -> str:
    return name if _is_package(name) else name.rpartition(".")[0]


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(name: str) -> list[tuple[str, str | None, int]]:
    """``(module, imported name or None, line)`` for every kiln import of module ``name``."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    skip = _type_checking_lines(tree)
    found = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "kiln":
                    found.append((alias.name, None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = _package_of(name).split(".")
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "kiln":
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in MODULES:
                    found.append((submodule, None, node.lineno))
                else:
                    found.append((base, alias.name, node.lineno))
    return found


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name in MODULES:
        for module, _, _ in _imports(name):
            target = module
            while target not in MODULES and "." in target:
                target = target.rpartition(".")[0]
            if target in MODULES and target != name:
                graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_the_graph_sees_imports_inside_functions():
    graph = _graph()
    assert "kiln.cli" in MODULES
    assert any("kiln.trainers" in targets or any(t.startswith("kiln.trainers.") for t in targets)
               for name, targets in graph.items() if name.startswith("kiln.server"))  # fmt: skip


def test_the_engine_has_no_import_cycle():
    assert _cycles(_graph()) == []


def test_a_cycle_would_be_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _private_imports() -> list[str]:
    found = []
    for name in MODULES:
        for module, imported, line in _imports(name):
            where = f"{MODULES[name].relative_to(KILN.parent)}:{line}"
            if imported is not None and imported.startswith("_") and not imported.startswith("__"):
                found.append(f"{where}: {name} imports {imported} from {module}")
            parts = module.split(".")
            for depth in range(1, len(parts)):
                if parts[depth].startswith("_") and not parts[depth].startswith("__"):
                    owner = ".".join(parts[:depth])
                    if not (name == owner or name.startswith(owner + ".")):
                        found.append(f"{where}: {name} imports {module}, private to {owner}")
                    break
    return found


def test_no_module_imports_a_private_name_of_another_module_or_package():
    assert _private_imports() == []
