"""The layers of DESIGN.md, checked on the source: imports point only down, no cycles, no
private name taken across modules.

From the top: surfaces (the package, ``api``, ``cli``, ``conversion``, ``launcher``, ...),
``hooks``, ``loading``, ``execute``, ``targets`` (what a destination is), ``formats``, ``storage`` (where a checkpoint's bytes are,
local or remote), ``planner``, ``rules``, the op protocol and producers' own layouts
(``ops``, ``geometry``, ``keytext``, ``layouts``), ``inventory``, and the utilities everything may use (``errors``,
``config``, ``log``, ``progress``, ``extras``). A module may import its own layer or any layer below, never one above;
imports made inside functions count too (they run all the same).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import ckptshim

PACKAGE = Path(ckptshim.__file__).parent
#: Top to bottom; a module's layer is the first whose prefix names it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("ckptshim", "ckptshim.__main__", "ckptshim.api", "ckptshim.cli", "ckptshim.doctor", "ckptshim.venv",
     "ckptshim.launcher", "ckptshim.conversion"),
    ("ckptshim.hooks",),
    ("ckptshim.loading",),
    ("ckptshim.execute",),
    ("ckptshim.targets",),
    ("ckptshim.formats",),
    ("ckptshim.storage",),
    ("ckptshim.planner",),
    ("ckptshim.rules",),
    ("ckptshim.ops", "ckptshim.geometry", "ckptshim.keytext", "ckptshim.layouts"),
    ("ckptshim.inventory",),
    ("ckptshim.errors", "ckptshim.config", "ckptshim.log", "ckptshim.progress", "ckptshim.extras"),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> int:
    """0 for the top layer; the most specific prefix decides (``ckptshim.api`` before ``ckptshim``)."""
    best = None
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (rank, len(prefix))
    assert best is not None, f"{module} is in no layer; add it to LAYERS"
    return best[0]


def imports(module: str) -> Iterator[tuple[str, str | None, int]]:
    """``(imported module, name taken from it or None, line)`` for every ckptshim import."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("ckptshim"):
                    yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("ckptshim"):
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in MODULES:
                    yield submodule, None, node.lineno
                else:
                    yield base, alias.name, node.lineno


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_only_down(module):
    own = layer(module)
    upward = [f"line {line}: {target} ({LAYERS[layer(target)][0]} layer)"
              for target, _, line in imports(module) if layer(target) < own]
    assert not upward, f"{module} ({LAYERS[own][0]} layer) imports upward:\n" + "\n".join(upward)


def test_no_import_cycles():
    graph = {module: {target for target, _, _ in imports(module) if target != module and target in MODULES}
             for module in MODULES}
    # a package's __init__ importing its own submodules is how packages export; ignore that edge
    graph = {m: {t for t in targets if not t.startswith(m + ".")} for m, targets in graph.items()}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, stack + [target])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_name_crosses_modules(module):
    """``from ckptshim.x import _y`` and ``x._y`` (``x`` an imported ckptshim module) reach into
    another module's internals: make the name public there, or move the code."""
    found = [f"line {line}: {target}.{name}" for target, name, line in imports(module)
             if name is not None and name.startswith("_") and target != module]
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({(a.asname or a.name): a.name for a in node.names if a.name.startswith("ckptshim")})
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ckptshim"):
            aliases.update({(a.asname or a.name): f"{node.module}.{a.name}" for a in node.names
                            if f"{node.module}.{a.name}" in MODULES})
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr.startswith("_")
                and not node.attr.startswith("__") and aliases.get(node.value.id, module) != module):
            found.append(f"line {node.lineno}: {aliases[node.value.id]}.{node.attr}")
    assert not found, f"{module} uses private names of other modules:\n" + "\n".join(found)


def _type_only_imports(module: str) -> Iterator[str]:
    """The ckptshim modules ``module`` imports inside ``if TYPE_CHECKING:`` blocks."""
    path = MODULES[module]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for inner in node.body:
                if isinstance(inner, ast.ImportFrom) and (inner.module or "").startswith("ckptshim"):
                    yield from (f"{inner.module}.{a.name}" if f"{inner.module}.{a.name}" in MODULES else inner.module
                                for a in inner.names)
                elif isinstance(inner, ast.Import):
                    yield from (a.name for a in inner.names if a.name.startswith("ckptshim"))


def test_no_cycle_hidden_behind_type_checking():
    """An import made only for types (``if TYPE_CHECKING:``) is still a dependency: a package's
    ``__init__`` that imports a submodule for a type, where that submodule imports the package
    back, is a cycle the package-export exemption above would hide."""
    graph = {module: {target for target, _, _ in imports(module) if target != module and target in MODULES}
             for module in MODULES}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(graph.get(node, ()))
        return False

    hidden = [f"{module} -> {target}" for module in MODULES for target in _type_only_imports(module)
              if target in MODULES and reaches(target, module)]
    assert not hidden, "type-only imports that close a cycle:\n" + "\n".join(hidden)


#: Imports the layer order allows but the design rules out: (importer prefix, imported prefix, why).
FORBIDDEN: tuple[tuple[str, str, str], ...] = (
    ("ckptshim.formats", "ckptshim.rules", "formats recognise and read files; what a model's keys mean is the rules'"),
    ("ckptshim.formats", "ckptshim.planner", "formats list and read; planning is above them"),
    ("ckptshim.execute", "ckptshim.rules", "executors receive decisions (plans, the target's own buffers) and make none"),
    ("ckptshim.targets", "ckptshim.planner", "a destination is described before planning, for the planner"),
)


@pytest.mark.parametrize("importer, imported, why", FORBIDDEN)
def test_forbidden_imports(importer, imported, why):
    found = [f"{module} line {line}: {target}" for module in MODULES
             if module == importer or module.startswith(importer + ".")
             for target, _, line in imports(module) if target == imported or target.startswith(imported + ".")]
    assert not found, f"{importer} must not import {imported} ({why}):\n" + "\n".join(found)
