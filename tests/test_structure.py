"""pargrad's structure matches docs/design.md: imports point one way, and the lock table
names exactly the locks the code makes.

Imports are read from the source with ``ast``: module-level and function-level ones alike
(a lazy import is still a dependency). Not counted: imports under ``if TYPE_CHECKING:``
(never executed; annotations only), and the implicit import of a module's parent package
(Python runs ``pargrad/__init__.py`` before any submodule; that is not an arrow of the
design).
"""

from __future__ import annotations

import ast
import re
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pargrad"
DESIGN = ROOT / "docs" / "design.md"

ALLOWED_UPWARD: dict[tuple[str, str], str] = {}
"""The imports that point up, each with its reason (each must be inside a function): none.
Where a lower module must reach a higher one, the higher one binds itself into the lower
at import (``tensor.bind_ops``, ``tensor.bind_backward``)."""


def module_paths(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of ``package``, by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Each import statement that can run, and whether it is inside a function."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, in_function = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend((child, in_function) for child in node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                  ast.Lambda))
        stack.extend((child, inside) for child in ast.iter_child_nodes(node))


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom,
             modules: Mapping[str, Path]) -> Iterator[str]:
    """The pargrad modules an import statement imports (``from pkg import sub``: sub)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[:len(base) - node.level + 1]
            source = ".".join([*base, node.module] if node.module else base)
        else:
            source = node.module or ""
        names = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                 for alias in node.names]
    for name in names:
        if name.split(".")[0] != module.split(".")[0]:
            continue
        while name not in modules:  # pargrad.graph.Node -> pargrad.graph
            name = name.rsplit(".", 1)[0]
        if name != module:
            yield name


def import_graph(package: Path = PACKAGE) -> dict[str, dict[str, bool]]:
    """``{module: {imported module of the same package: only inside functions}}`` for
    every module of ``package``."""
    modules = module_paths(package)
    graph: dict[str, dict[str, bool]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        tree = ast.parse(path.read_text(), str(path))
        for node, in_function in _runtime_imports(tree):
            for target in _targets(module, path.name == "__init__.py", node, modules):
                edges[target] = edges.get(target, True) and in_function
    return graph


def find_cycle(edges: Mapping[str, Iterator[str] | set[str] | list[str]]) -> list[str] | None:
    """A cycle of ``edges`` as a path ``[a, b, ..., a]``, or None if there is none."""
    graph = {node: list(targets) for node, targets in edges.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path = [start]
        stack = [iter(sorted(graph.get(start, ())))]
        state[start] = 1
        while stack:
            target = next(stack[-1], None)
            if target is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(target) == 1:
                return [*path[path.index(target):], target]
            elif target not in state:
                state[target] = 1
                path.append(target)
                stack.append(iter(sorted(graph.get(target, ()))))
    return None


def test_find_cycle_finds_cycles() -> None:
    assert find_cycle({"a": ["b"], "b": ["c"], "c": []}) is None
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b", "d"], "b": [], "d": ["d"]}) == ["d", "d"]


def test_the_import_graph_sees_lazy_imports_and_skips_type_checking() -> None:
    tree = ast.parse("import a\nif TYPE_CHECKING:\n    import b\n"
                     "def f():\n    import c\nlater = lambda: __import__('d')\n")
    found = {alias.name: inside for node, inside in _runtime_imports(tree)
             for alias in node.names}
    assert found == {"a": False, "c": True}
    graph = import_graph()
    assert graph["pargrad.tensor"]["pargrad.graph"] is False  # at the top
    assert "pargrad.engine.base" not in graph["pargrad.tensor"]  # TYPE_CHECKING only
    assert "pargrad.engine.trace" in graph["pargrad.engine.graph_task"]  # from pkg import


def test_no_import_cycles() -> None:
    graph = import_graph()
    for (source, target), reason in ALLOWED_UPWARD.items():
        assert graph[source].get(target) is True, (
            f"{source} -> {target} is allowed ({reason}) but is no longer a function-level "
            f"import: drop it from ALLOWED_UPWARD, or keep it inside the function")
    edges = {module: {t for t in targets if (module, t) not in ALLOWED_UPWARD}
             for module, targets in graph.items()}
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_no_import_cycles_in_the_benchmarks() -> None:
    # (compare.py imports inside its functions on purpose: its worker must put another
    # tree's pargrad first on sys.path before anything imports pargrad; they point down.)
    cycle = find_cycle(import_graph(ROOT / "benchmarks"))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def _table(heading: str) -> list[list[str]]:
    """The cells of the first Markdown table after the line starting with ``heading``."""
    lines = DESIGN.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    rows = []
    for line in lines[start:]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[2:]  # the header and the |---| line


def _module_of(path: str) -> str:
    """``engine/base.py`` -> ``pargrad.engine.base``; ``ops/__init__.py`` -> ``pargrad.ops``."""
    parts = ["pargrad", *path.removesuffix(".py").split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _short(module: str) -> str:
    return module.removeprefix("pargrad.") if module != "pargrad" else "pargrad"


def test_the_module_table_matches_the_imports_and_they_point_down() -> None:
    graph = import_graph()
    rows = _table("Modules and the direction of imports")
    order = [_module_of(row[0].strip("`")) for row in rows]
    assert sorted(order) == sorted(graph), (
        f"docs/design.md's module table lacks {sorted(set(graph) - set(order))} and names "
        f"{sorted(set(order) - set(graph))}, which do not exist")
    for row, module in zip(rows, order):
        listed = set(re.findall(r"`([\w.]+)`", row[-1]))
        actual = {_short(target) for target in graph[module]
                  if (module, target) not in ALLOWED_UPWARD}
        assert listed == actual, (
            f"{row[0]} imports " + ", ".join(f"`{name}`" for name in sorted(actual)) +
            f"; docs/design.md lists {sorted(listed)}")
        for target in graph[module]:
            if (module, target) not in ALLOWED_UPWARD:
                assert order.index(target) > order.index(module), (
                    f"{module} imports {target}, which docs/design.md's module table lists "
                    f"above it: imports must point down the table")



def layers(text: str) -> dict[str, int]:
    """The layer of each module in the diagram of ``text``: the first code block after the
    heading ``## Layers``, where a line starting with a number starts a layer and every
    ``path.py`` on it or on the lines after it (until the next number) is in that layer."""
    section = text[text.index("\n## Layers\n"):]
    block = section.split("```")[1]
    found: dict[str, int] = {}
    layer = None
    for line in block.splitlines():
        if start := re.match(r"\s*(\d+)\s", line):
            layer = int(start[1])
        for path in re.findall(r"[\w/]+\.py\b", line):
            assert layer is not None, f"the diagram names {path} before its first layer"
            module = _module_of(path)
            assert module not in found, f"the diagram names {path} twice"
            found[module] = layer
    return found


def upward(layer_of: Mapping[str, int], graph: Mapping[str, Mapping[str, bool]]) -> list[str]:
    """The imports of ``graph`` that point up the layers: ``a -> b`` with b's layer above
    a's (ALLOWED_UPWARD aside)."""
    return [f"{module} (layer {layer_of[module]}) -> {target} (layer {layer_of[target]})"
            for module, targets in graph.items() for target in targets
            if layer_of[target] > layer_of[module] and (module, target) not in ALLOWED_UPWARD]


def test_the_layer_check_sees_what_is_missing_and_what_points_up() -> None:
    text = "\n## Layers\n\n```\n 2  top  a.py  b.py\n         more/c.py\n 1  ground  d.py\n```\n"
    assert layers(text) == {"pargrad.a": 2, "pargrad.b": 2, "pargrad.more.c": 2, "pargrad.d": 1}
    graph = {"pargrad.a": {"pargrad.b": False, "pargrad.d": False},
             "pargrad.d": {"pargrad.a": True}}
    assert upward(layers(text), graph) == ["pargrad.d (layer 1) -> pargrad.a (layer 2)"]


def test_the_layer_diagram_names_every_module_and_imports_point_down() -> None:
    graph = import_graph()
    layer_of = layers(DESIGN.read_text())
    assert sorted(layer_of) == sorted(graph), (
        f"docs/design.md's layer diagram lacks {sorted(set(graph) - set(layer_of))} and "
        f"names {sorted(set(layer_of) - set(graph))}, which do not exist")
    wrong = upward(layer_of, graph)
    assert not wrong, ("these imports point up docs/design.md's layer diagram: move the "
                       "module, or have the higher one bind itself at import\n  "
                       + "\n  ".join(wrong))


LOCK_FACTORIES = {"Lock", "RLock", "Condition"}

MADE_ELSEWHERE = {
    "futures.BackwardFuture._condition":
        "made by concurrent.futures.Future.__init__, the base class",
}
"""Locks of the table that pargrad does not create itself, each with where it comes from."""


def _makes_lock(value: ast.expr | None) -> bool:
    """Whether ``value`` is ``threading.Lock()`` (``RLock``, ``Condition``), or the bare call."""
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    if isinstance(func, ast.Attribute):
        return (func.attr in LOCK_FACTORIES and isinstance(func.value, ast.Name)
                and func.value.id == "threading")
    return isinstance(func, ast.Name) and func.id in LOCK_FACTORIES


def locks_made(source: str, module: str) -> set[str]:
    """Where ``source`` stores each lock or condition it makes: ``module.name`` at module
    level, ``module.Class.attr`` for ``self.attr`` in a method, ``module.function.name``
    for a function's local."""
    found: set[str] = set()

    def visit(node: ast.AST, scope: list[str], in_class: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, [*scope, child.name], True)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                # a method's self.attr belongs to the class: keep the class as the scope
                visit(child, scope if in_class else [*scope, child.name], False)
                if not in_class:
                    continue
                for inner in ast.walk(child):
                    if isinstance(inner, (ast.Assign, ast.AnnAssign)) and _makes_lock(
                            inner.value):
                        targets = inner.targets if isinstance(inner, ast.Assign) else [
                            inner.target]
                        found.update(".".join([module, *scope, t.attr]) for t in targets
                                     if isinstance(t, ast.Attribute)
                                     and isinstance(t.value, ast.Name) and t.value.id == "self")
            elif isinstance(child, (ast.Assign, ast.AnnAssign)) and _makes_lock(child.value):
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                found.update(".".join([module, *scope, t.id]) for t in targets
                             if isinstance(t, ast.Name))
            else:
                visit(child, scope, in_class)

    visit(ast.parse(source), [], False)
    return found


def test_locks_made_names_each_kind_of_place() -> None:
    source = (
        "import threading\n"
        "_a = threading.Lock()\n"
        "_c: threading.Condition = threading.Condition(_a)\n"
        "class K:\n"
        "    def __init__(self):\n"
        "        self.lock = threading.RLock()\n"
        "        other = object()\n"
        "def f():\n"
        "    lock = threading.Lock()\n"
        "    def g():\n"
        "        pass\n"
    )
    assert locks_made(source, "m") == {"m._a", "m._c", "m.K.lock", "m.f.lock"}


def test_the_lock_table_names_exactly_the_locks_in_the_code() -> None:
    made: set[str] = set()
    for module, path in module_paths().items():
        made |= locks_made(path.read_text(), _short(module))
    named: set[str] = set()
    for row in _table("| lock (its module"):
        path = re.match(r"`([\w.]+)`", row[0])
        assert path, f"the lock table's row {row[0]!r} must start with the lock's `path`"
        named.add(path[1])
        scope = path[1].rsplit(".", 1)[0]
        named.update(f"{scope}.{name}" for name in re.findall(r"condition `(\w+)`", row[0]))
    assert named - made - set(MADE_ELSEWHERE) == set(), "the table names locks the code lacks"
    assert made - named == set(), "docs/design.md's lock table lacks these locks"
    from pargrad.futures import BackwardFuture

    assert isinstance(BackwardFuture()._condition, threading.Condition)
