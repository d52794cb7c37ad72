"""The layering of ``hubsoup/`` as a contract (issue 33): the import graph, counting imports inside functions and
under ``TYPE_CHECKING`` too, has no cycle, few edges pointing back up the declared layer order, and few levels.

A cycle is one of imports that run (at module top or inside functions); an import under ``if TYPE_CHECKING:``
runs never, so it cannot close a cycle, but it is an edge like any other for the layer order and the levels.

The graph is at the granularity of architecture review 2: a top-level module (``api``, ``recipe``) or a top-level
package (``sources``, ``engine``) is one node; ``hubsoup/__init__.py`` (the lazily importing facade) and
``__main__.py`` are left out. ``python tests/test_layers.py`` prints the numbers and the offending edges.

Measured with this test (its final layer order) on main abbe807, before issue 33's moves: 23 nodes, 120 edges; one
cycle of 13 nodes (api card engine eval exemplars formats hub methods options output recipe sources workflows; 16
modules at module granularity); 12 edges up the order below; 12 levels without them; 264 imports at module top, 272
inside functions. After: no cycle, 1 edge up (type-only), 9 levels, 25 nodes (+ hubclient, public), 122 edges,
320 imports at top, 183 inside functions.
"""

from __future__ import annotations

import ast
import functools
import os
import sys
from collections import defaultdict

from paths import ROOT
PKG = os.path.join(ROOT, "hubsoup")

# Bottom first. A node may import nodes of its own layer or below; an import of a node above is a back edge.
# Within a layer, nodes must still not form a cycle.
LAYERS: list[list[str]] = [
    ["errors", "untrusted", "linalg", "arch", "public", "hubclient", "startup"],  # leaves: no hubsoup imports of note
    ["progress", "options", "plan", "footprint"],
    ["sources", "exemplars", "eval"],
    ["methods"],
    ["engine"],
    ["output"],
    ["recipe"],
    ["card"],
    ["hub"],
    ["session"],
    ["api"],
    ["formats"],
    ["testing", "workflows", "demo"],
    ["space", "cli"],
]
MAX_BACK_EDGES = 5
MAX_LEVELS = 10


def modules() -> dict[str, str]:
    """Dotted module name -> file path, for every module under hubsoup/."""
    out = {}
    for d, _, files in os.walk(PKG):
        for fn in files:
            if fn.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, fn), ROOT)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(d, fn)
    return out


def _target(name: str, mods: dict[str, str]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


@functools.lru_cache(maxsize=None)  # every test reads the same graph: parse the package once per variant
def module_edges(runtime_only: bool = False) -> tuple[dict[str, set[str]], int, int]:
    """(module -> imported hubsoup modules, imports at module top, imports inside functions); with ``runtime_only``,
    imports under ``if TYPE_CHECKING:`` left out."""
    mods = modules()
    edges: dict[str, set[str]] = defaultdict(set)
    top = inner = 0
    for mod, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        is_pkg = path.endswith("__init__.py")
        imports: list[tuple[ast.AST, bool]] = []  # (import statement, inside a function)

        def walk(node: ast.AST, in_func: bool, type_only: bool) -> None:
            # one pass over the statements (imports are statements; expressions hold none): a statement is
            # inside a function below a def, type-only in an `if TYPE_CHECKING:` body
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not (runtime_only and type_only):
                imports.append((node, in_func))
            below_func = in_func or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            checking = isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                for child in getattr(node, field, None) or ():
                    if isinstance(child, ast.AST):
                        walk(child, below_func, type_only or (checking and field == "body"))

        walk(tree, False, False)
        for node, in_func in imports:
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.split(".")[0] == "hubsoup"]
            else:
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    pkg = ".".join(base + ([node.module] if node.module else []))
                else:
                    pkg = node.module or ""
                if pkg.split(".")[0] == "hubsoup":
                    targets = [f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in mods else pkg for a in node.names]
            found = {t for t in (_target(x, mods) for x in targets) if t and t != mod}
            if found:
                if in_func:
                    inner += 1
                else:
                    top += 1
                edges[mod].update(found)
    return edges, top, inner


def node_of(mod: str) -> str | None:
    parts = mod.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return None
    return parts[1]


def _facade_out(medges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph without the facade ``hubsoup/__init__.py``: every module imports it first anyway
    (``from hubsoup import __version__``), and its own imports of the public face are lazy or type-only."""
    return {a: {b for b in bs if b != "hubsoup"} for a, bs in medges.items() if a != "hubsoup"}


def node_edges(runtime_only: bool = False) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """(node, node) -> the module edges behind it."""
    medges, _, _ = module_edges(runtime_only)
    out: dict[tuple[str, str], list[tuple[str, str]]] = defaultdict(list)
    for a, bs in medges.items():
        for b in bs:
            na, nb = node_of(a), node_of(b)
            if na and nb and na != nb:
                out[(na, nb)].append((a, b))
    return out


def sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []
    nodes = set(graph) | {b for bs in graph.values() for b in bs}
    counter = 0
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    comps.append(sorted(comp))
    return comps


def levels(graph: dict[str, set[str]]) -> int:
    """Floors of the condensed graph: leaves are floor 1, a node sits one above the highest it imports."""
    comps = sccs(graph)
    comp_of = {n: i for i, c in enumerate(comps) for n in c}
    floor: dict[int, int] = {}
    for i, c in enumerate(comps):  # Tarjan emits components dependencies first
        deps = {comp_of[b] for n in c for b in graph.get(n, ()) if comp_of[b] != i}
        floor[i] = 1 + max((floor[d] for d in deps), default=0)
    return max(floor.values(), default=0)


@functools.lru_cache(maxsize=None)
def report() -> dict:
    medges, top, inner = module_edges()
    medges = _facade_out(medges)
    run_medges = _facade_out(module_edges(runtime_only=True)[0])
    nedges = node_edges()
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in nedges:
        graph[a].add(b)
    run_graph: dict[str, set[str]] = defaultdict(set)
    for a, b in node_edges(runtime_only=True):
        run_graph[a].add(b)
    rank = {n: i for i, layer in enumerate(LAYERS) for n in layer}
    nodes = sorted(set(graph) | {b for bs in graph.values() for b in bs})
    back = sorted((a, b) for a, b in nedges if rank.get(a, -1) < rank.get(b, -1))
    return {
        "nodes": nodes,
        "edges": len(nedges),
        "node_cycles": [c for c in sccs(run_graph) if len(c) > 1],
        "node_cycles_with_type_only": [c for c in sccs(graph) if len(c) > 1],
        "module_cycles": [c for c in sccs(run_medges) if len(c) > 1],
        "levels": levels(graph),
        "levels_without_back_edges": levels({a: {b for b in bs if (a, b) not in set(back)} for a, bs in graph.items()}),
        "cross_node_module_cycles": [c for c in sccs(run_medges) if len({node_of(m) for m in c}) > 1],
        "back_edges": back,
        "back_detail": {e: nedges[e] for e in back},
        "imports_top": top,
        "imports_in_functions": inner,
        "unplaced": [n for n in nodes if n not in rank],
    }


def test_every_node_has_a_layer():
    r = report()
    assert not r["unplaced"], f"put these in a layer of tests/test_layers.py: {r['unplaced']}"


def test_no_import_cycle():
    r = report()
    assert not r["node_cycles"], f"import cycles between packages/modules: {r['node_cycles']}"
    # a package's __init__ and its own modules may import each other (the package is one node)
    assert not r["cross_node_module_cycles"], f"import cycles between modules: {r['cross_node_module_cycles']}"


def test_few_edges_point_back_up():
    r = report()
    assert len(r["back_edges"]) <= MAX_BACK_EDGES, "\n".join(
        f"{a} -> {b}: {r['back_detail'][(a, b)]}" for a, b in r["back_edges"])


def test_levels():
    assert report()["levels"] <= MAX_LEVELS


def test_the_checks_can_fail():
    assert sccs({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert levels({"a": {"b"}, "b": {"c"}, "c": set()}) == 3
    assert _target("hubsoup.engine.nothing", {"hubsoup.engine": ""}) == "hubsoup.engine"


if __name__ == "__main__":
    r = report()
    print(f"nodes {len(r['nodes'])}, edges {r['edges']}, levels {r['levels']} "
          f"({r['levels_without_back_edges']} without the back edges), "
          f"imports at top {r['imports_top']}, inside functions {r['imports_in_functions']}")
    print("node cycles:", r["node_cycles"], "(counting type-only imports:", r["node_cycles_with_type_only"], ")")
    print("module cycles:")
    for c in r["module_cycles"]:
        print(f"  ({len(c)})", " ".join(m.removeprefix("hubsoup.") for m in c))
    print(f"back edges ({len(r['back_edges'])}):")
    for e in r["back_edges"]:
        print(f"  {e[0]} -> {e[1]}:", ", ".join(f"{a.removeprefix('hubsoup.')}->{b.removeprefix('hubsoup.')}"
                                                for a, b in r["back_detail"][e]))
    print("unplaced:", r["unplaced"])
    sys.exit(0)
