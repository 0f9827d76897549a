"""The ``kiln.cli`` package imports one way: no cycle between its modules, no private name borrowed from another.

Read from the source with ``ast``, so an import inside a function counts like one at the top: laziness (torch off
the ``kiln --help``/``kiln validate`` path) is allowed, hiding a cycle is not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CLI = Path(__file__).resolve().parent.parent / "kiln" / "cli"
PACKAGE = "kiln.cli"


def _module_name(path: Path) -> str:
    return PACKAGE if path.stem == "__init__" else f"{PACKAGE}.{path.stem}"


def _imports(path: Path) -> list[tuple[str, str | None, int]]:
    """Every ``(module, name, line)`` that ``path`` imports from ``kiln.cli``, wherever the import stands.

    ``name`` is None where a whole module is imported (``import kiln.cli._x``, ``from kiln.cli import _x``).
    """
    submodules = {p.stem for p in CLI.glob("*.py")}
    found: list[tuple[str, str | None, int]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level in (0, 1), f"{path.name}:{node.lineno}: relative import beyond the package"
            module = (f"{PACKAGE}.{node.module}" if node.module else PACKAGE) if node.level else node.module or ""
            for alias in node.names:
                if module == PACKAGE and alias.name in submodules:
                    found.append((f"{PACKAGE}.{alias.name}", None, node.lineno))
                else:
                    found.append((module, alias.name, node.lineno))
    return [(module, name, line) for module, name, line in found if module.split(".")[:2] == ["kiln", "cli"]]


def _graph() -> dict[str, set[str]]:
    return {
        _module_name(path): {module for module, _, _ in _imports(path) if module != _module_name(path)}
        for path in sorted(CLI.glob("*.py"))
    }


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return [*stack[stack.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_check_finds_a_cycle_hidden_in_a_function(tmp_path):
    lazy = tmp_path / "_jobs.py"
    lazy.write_text("def run():\n    from kiln.cli._train import _config\n    from kiln.cli import _evals\n")
    assert _imports(lazy) == [("kiln.cli._train", "_config", 2), ("kiln.cli._evals", None, 3)]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_cli_modules_import_each_other_without_a_cycle_even_inside_functions():
    graph = _graph()
    assert f"{PACKAGE}._jobs" in graph[f"{PACKAGE}._train"]  # the check sees the edges it should
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_no_cli_module_imports_the_package_itself():
    for path in sorted(CLI.glob("*.py")):
        if path.stem in ("__init__", "__main__"):
            continue
        assert PACKAGE not in {module for module, _, _ in _imports(path)}, path.name


@pytest.mark.parametrize("path", sorted(CLI.glob("*.py")), ids=lambda path: path.name)
def test_no_cli_module_imports_a_private_name_of_another(path):
    borrowed = [
        f"line {line}: {module}.{name}"
        for module, name, line in _imports(path)
        if name is not None and name.startswith("_") and module != _module_name(path)
    ]
    assert not borrowed, f"{path.name} imports private names (give them a public name where they live): {borrowed}"


def test_the_package_is_split_into_one_module_per_command_group():
    assert sorted(path.stem for path in CLI.glob("*.py")) == [
        "__init__", "__main__", "_adapters", "_audit", "_checkpoints", "_client", "_evals", "_jobs", "_local", "_parser", "_replay",
        "_requests", "_rollouts", "_server", "_teachers", "_train", "_validate",
    ]  # fmt: skip
    assert not list(CLI.parent.glob("_cli_*.py")), "the flat kiln/_cli_*.py modules are gone"
