"""msllm's own import graph, read from the source with ``ast`` (nothing is imported): every
``import`` / ``from ... import`` of an ``msllm`` module anywhere in a file, inside functions too,
except under ``if TYPE_CHECKING:`` (annotations only, never run)."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO

PACKAGE = Path(REPO) / "msllm"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set:
    """The ``msllm...`` modules ``path`` imports (for ``from msllm.x import y``: ``msllm.x``, or
    ``msllm.x.y`` when that is a module)."""
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            skipped |= {id(x) for stmt in node.body for x in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("msllm")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("msllm"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists() else node.module)
    return found


def import_graph(under: str = "msllm") -> dict:
    """``{module: {imported msllm modules}}`` for every module of ``under`` (a package name)."""
    root = PACKAGE.parent / under.replace(".", "/")
    return {module_name(p): imports_of(p) for p in sorted(root.rglob("*.py"))}


def find_cycle(graph: dict):
    """One import cycle of ``graph`` as a list of modules (first == last), or None. Imports of
    modules outside ``graph`` and of a package by its own modules (``__init__``) are ignored."""
    done, stack = set(), []

    def visit(m):
        if m in stack:
            return stack[stack.index(m):] + [m]
        if m in done:
            return None
        stack.append(m)
        for dep in sorted(graph[m]):
            if dep in graph and not m.startswith(dep + "."):
                cycle = visit(dep)
                if cycle:
                    return cycle
        stack.pop()
        done.add(m)
        return None

    for m in graph:
        cycle = visit(m)
        if cycle:
            return cycle
    return None
