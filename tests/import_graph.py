"""The project's import graph, read from the source (no module is imported), and its layers.

    python -m tests.import_graph            # every module by layer, with what it imports
    python -m tests.import_graph --check    # exit 1 on a cycle or an arrow that points up

Every `import` and `from ... import` counts, module-level or inside a function (a lazy import
is still a dependency; only `if TYPE_CHECKING:` blocks are skipped). A node is one .py file;
importing `pkg.mod` is an arrow to pkg/mod.py, not to pkg/__init__.py. LAYERS orders the parts
from the bottom up: a module may import from its own layer or any layer below, never above,
and the whole graph has no cycle. tests/test_import_graph.py checks both, and that
docs/architecture.md shows the graph as it is.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import sys
from pathlib import Path
from typing import Dict, List, Optional, Set

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("collectives", "ddp_from_scratch", "benchmarks")

# Bottom first. A module's layer is the first whose patterns match its dotted name.
LAYERS = [
    ("base: errors, dtypes, op table, chunk bounds, settings",
     ["collectives.errors", "collectives.dtypes", "collectives.reduce_ops", "collectives.chunks", "collectives.p2p",
      "collectives.output_files", "collectives.cli", "collectives.compat", "collectives.rates", "collectives.names", "collectives.launcher.agent_watch",
      "collectives.launcher", "collectives.machine", "collectives.settings"]),
    ("shm backend", ["collectives.shm", "collectives.shm.*"]),
    ("checks, environment, wrappers, launcher",
     ["collectives.checks", "collectives.checked_mode", "collectives.exchange", "collectives.splits", "collectives.groups",
      "collectives.ops", "collectives.launcher.*", "collectives.flight_recorder", "collectives.flight_verdict", "collectives.testing",
      "collectives"]),
    ("from-scratch algorithms", ["collectives.algorithms", "collectives.algorithms.*"]),
    ("programs on the collectives", ["collectives.demo", "collectives.cluster", "collectives.cluster.*"]),
    ("data parallel: parts", ["ddp_from_scratch.workload", "ddp_from_scratch.workload.*", "ddp_from_scratch.parts",
                              "ddp_from_scratch.parts.*"]),
    ("data parallel: the steps", ["ddp_from_scratch.steps", "ddp_from_scratch.steps.*"]),
    ("data parallel: the registry", ["ddp_from_scratch.wrap"]),
    ("data parallel: programs", ["ddp_from_scratch", "ddp_from_scratch.*"]),
    ("benchmarks", ["benchmarks", "benchmarks.*"]),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> Dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _resolve(current: str, is_package: bool, level: int, target: Optional[str]) -> str:
    if level == 0:
        return target or ""
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _type_checking_lines(tree: ast.AST) -> Set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skip.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return skip


def imports_of(name: str, path: Path, known: Set[str]) -> Set[str]:
    """The project modules `name` imports (anywhere in the file)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_lines(tree)
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, is_package, node.level, node.module)
            # `from pkg import mod` names a module; `from mod import thing` names the module itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import a.b.c` where c is not ours: the nearest module that is
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph() -> Dict[str, Set[str]]:
    found = modules()
    known = set(found)
    return {name: imports_of(name, path, known) for name, path in found.items()}


def layer_of(name: str) -> int:
    for k, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            return k
    raise KeyError(f"{name} is in no layer of tests/import_graph.py's LAYERS: add it where it belongs")


def cycles(g: Dict[str, Set[str]]) -> List[List[str]]:
    """Every strongly connected component of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def upward(g: Dict[str, Set[str]]) -> List[str]:
    """Every arrow from a module to one in a higher layer, as text."""
    return [f"{a} (layer {layer_of(a)}) -> {b} (layer {layer_of(b)})"
            for a in sorted(g) for b in sorted(g[a]) if layer_of(b) > layer_of(a)]


def render(g: Dict[str, Set[str]]) -> str:
    """The graph by layer, bottom first: each module and the project modules it imports."""
    lines = []
    for k, (title, _) in enumerate(LAYERS):
        members = sorted(m for m in g if layer_of(m) == k)
        if not members:
            continue
        lines.append(f"layer {k}: {title}")
        for m in members:
            lines.append(f"  {m}" + (f" -> {', '.join(sorted(g[m]))}" if g[m] else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Show the project's import graph by layer; --check: "
                                                 "exit 1 on a cycle or an upward arrow.")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    g = graph()
    bad = [f"cycle: {' <-> '.join(c)}" for c in cycles(g)] + [f"upward: {u}" for u in upward(g)]
    if args.check:
        print("\n".join(bad) or f"{len(g)} modules, no cycle, no upward arrow")
        return 1 if bad else 0
    print(render(g))
    return 0


if __name__ == "__main__":
    sys.exit(main())
