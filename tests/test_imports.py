"""The package's import graph: no cycles, and every import of an mtjax module at module level.

Imports are read from the source (ast), so the graph includes imports written inside
functions: a function-level import is how a cycle is usually hidden, and it is refused
here whether or not it hides one.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mtjax"

# Function-level imports of mtjax modules not yet moved to module level, as (importing
# module, imported module). They are left out of both checks below. To be emptied.
ALLOWED_FUNCTION_IMPORTS: frozenset[tuple[str, str]] = frozenset({
})


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    names = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(names)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(modules: dict, importer: str, is_package: bool, node) -> list[str]:
    """The mtjax modules an import statement loads (the most specific module each name is)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name == "mtjax" or a.name.startswith("mtjax.")]
    if node.level:  # relative: from the importer's package, `level` packages up
        base = importer.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source != "mtjax" and not source.startswith("mtjax."):
        return []
    return sorted({f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names})


def _imports(modules: dict) -> list[tuple[str, str, bool, int]]:
    """(importer, imported, inside a function, line) for every import of an mtjax module."""
    found = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"

        def visit(node, in_function):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _resolve(modules, name, is_package, child):
                        found.append((name, target, in_function, child.lineno))
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(tree, False)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path a -> ... -> a) per strongly connected component that has one."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def connect(v):  # Tarjan's algorithm; the graph is small, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                components.append(set(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_path_through(graph, c) for c in components]


def _path_through(graph: dict, component: set) -> list[str]:
    """A cycle inside `component`, found by breadth-first search back to its first module."""
    start = min(component)
    parent, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ()) & component):
                if w == start:
                    path = [v]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in component {sorted(component)}")


def test_the_import_graph_is_read_from_the_source():
    """The reader sees the package as it is: a known module-level edge and every module."""
    modules = _modules()
    edges = {(a, b) for a, b, _, _ in _imports(modules)}
    assert {"mtjax", "mtjax.cli", "mtjax.stream.update", "mtjax.store.store"} <= set(modules)
    assert ("mtjax.stream.update", "mtjax.stream.fused_adamw") in edges  # `from mtjax.stream import fused_adamw`
    assert ("mtjax.cli", "mtjax.errors") in edges  # `from mtjax.errors import MtjaxError`


def test_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert sorted(map(tuple, _cycles(graph))) == [("a", "b", "c", "a"), ("e", "e")]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    """Counting imports inside functions: a cycle they hide is still a cycle."""
    graph: dict[str, set[str]] = {}
    for a, b, in_function, _ in _imports(_modules()):
        if a != b and not (in_function and (a, b) in ALLOWED_FUNCTION_IMPORTS):
            graph.setdefault(a, set()).add(b)
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_function_level_imports_of_mtjax_modules():
    modules = _modules()
    inside = [(a, b, line) for a, b, in_function, line in _imports(modules) if in_function]
    offenders = sorted(f"{modules[a].relative_to(ROOT)}:{line}: imports {b}" for a, b, line in inside
                       if (a, b) not in ALLOWED_FUNCTION_IMPORTS)
    assert not offenders, "imports of mtjax modules inside functions (move them to module level):\n" + \
        "\n".join(offenders)
    stale = ALLOWED_FUNCTION_IMPORTS - {(a, b) for a, b, _ in inside}
    assert not stale, f"allowed but no longer present (remove from the list): {sorted(stale)}"
