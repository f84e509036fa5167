"""The import graph has no cycle and no arrow pointing up a layer, and docs/architecture.md shows it as it is.

    python -m tests.import_graph          # the graph, layer by layer
"""

from __future__ import annotations

import re
from pathlib import Path

from tests import import_graph

DOC = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def test_no_cycles_and_no_upward_arrows():
    g = import_graph.graph()
    assert import_graph.cycles(g) == []
    assert import_graph.upward(g) == []


def test_the_checker_sees_a_planted_cycle_and_an_upward_arrow():
    g = {"collectives.errors": {"collectives.ops"}, "collectives.ops": {"collectives.errors"},
         "collectives.shm.python_path": {"collectives.algorithms.ring"}, "collectives.algorithms.ring": set()}
    assert import_graph.cycles(g) == [["collectives.errors", "collectives.ops"]]
    assert import_graph.upward(g) == ["collectives.errors (layer 0) -> collectives.ops (layer 2)",
                                      "collectives.shm.python_path (layer 1) -> collectives.algorithms.ring (layer 3)"]


def test_lazy_imports_count(tmp_path, monkeypatch):
    """An import inside a function is still an arrow (a lazy import hides a cycle, it does not break it)."""
    pkg = tmp_path / "collectives"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("def f():\n    from . import ops\n")
    (pkg / "ops.py").write_text("from .errors import f\n")
    monkeypatch.setattr(import_graph, "ROOT", tmp_path)
    monkeypatch.setattr(import_graph, "PACKAGES", ("collectives",))
    g = import_graph.graph()
    assert g["collectives.errors"] == {"collectives.ops"} and g["collectives.ops"] == {"collectives.errors"}


def test_docs_show_the_graph_as_it_is():
    text = DOC.read_text()
    shown = re.search(r"<!-- import-graph -->\n```\n(.*?)\n```", text, re.S)
    assert shown, "docs/architecture.md lost its import-graph block"
    assert shown.group(1) == import_graph.render(import_graph.graph()), \
        "the import graph changed: paste `python -m tests.import_graph` into docs/architecture.md"


def _from_imports(path: Path):
    """(line, module as written, names) of every `from X import ...` in a file."""
    import ast

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            yield node.lineno, "." * node.level + (node.module or ""), [a.name for a in node.names]


def _library_files():
    root = import_graph.ROOT
    return [p for pkg in import_graph.PACKAGES for p in sorted((root / pkg).rglob("*.py"))]


def test_no_module_imports_a_private_name_from_another():
    """A name with a leading underscore is its file's own: another file that needs it needs a
    public name for it (the shm transport's futex call was imported as _SYS_FUTEX, _libc and
    _Timespec by three files)."""
    found = [f"{p.relative_to(import_graph.ROOT)}:{line}: from {mod} import {name}"
             for p in _library_files() for line, mod, names in _from_imports(p)
             for name in names if name.startswith("_") and not name.startswith("__")]
    assert not found, "\n".join(found)


def _is_program(path: Path) -> bool:
    text = path.read_text()
    return "def main(" in text or 'if __name__ == "__main__"' in text


def test_no_benchmark_program_imports_another():
    """Programs share helpers (sweep.py, cases.py, prediction.py, ...), never each other."""
    bench = import_graph.ROOT / "benchmarks"
    programs = {p.stem for p in bench.glob("*.py") if _is_program(p)}
    found = []
    for p in sorted(bench.glob("*.py")):
        if p.stem not in programs:
            continue
        for line, mod, names in _from_imports(p):
            targets = [mod.lstrip(".")] if mod.strip(".") else names  # from .x import y / from . import x
            if mod.startswith("benchmarks."):
                targets = [mod.split(".", 1)[1]]
            found += [f"benchmarks/{p.name}:{line} imports the program {t}" for t in targets
                      if (mod.startswith(".") or mod.startswith("benchmarks")) and t.split(".")[0] in programs]
    assert "bandwidth" in programs and "sweep" not in programs
    assert not found, "\n".join(found)


def test_every_program_builds_its_parser_in_build_parser():
    """`build_parser()` beside each `main`: the help of every program is one call away (the
    docs' and tests' way to read a program's flags) and main stays about what the program does."""
    def has_parser(text: str) -> bool:  # its own, or its command line's module's (train.py: train/args.py)
        return "def build_parser(" in text or any(line.startswith("from .") and "build_parser" in line
                                                     for line in text.splitlines())

    missing = [str(p.relative_to(import_graph.ROOT)) for p in _library_files()
               if "def main(" in p.read_text() and not has_parser(p.read_text())
               and p.name not in ("reaper.py", "cli.py")]  # reaper: one positional; cli: the decorator's docs
    assert not missing, missing


def test_benchmarks_lists_its_programs_and_its_parts_folder_its_helpers():
    """benchmarks/__init__.py lists the programs (each a main), which are every module at the top:
    a file added there says it is one; benchmarks/parts/__init__.py lists the helpers (none a
    program), every module in that folder."""
    import benchmarks
    from benchmarks import parts

    bench = import_graph.ROOT / "benchmarks"
    modules = {p.stem for p in bench.glob("*.py") if p.stem != "__init__"}
    assert set(benchmarks.PROGRAMS) == modules and benchmarks.HELPERS == ()
    for name in modules:
        assert _is_program(bench / f"{name}.py"), name
        assert f"    {name} " in benchmarks.__doc__, name
    helpers = {p.stem for p in (bench / "parts").glob("*.py") if p.stem != "__init__"}
    assert helpers
    for name in helpers:
        assert not _is_program(bench / "parts" / f"{name}.py") and f"    {name}.py " in parts.__doc__, name
    assert not list(bench.glob("test_*.py"))  # tests live in tests/


def test_the_studies_folder_lists_every_study():
    """benchmarks/studies/__init__.py names each study (each a program) in its one-line index, and
    nothing one folder up imports a study: the programs stand without them."""
    from benchmarks import studies

    folder = import_graph.ROOT / "benchmarks" / "studies"
    modules = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    assert set(studies.STUDIES) == modules
    for name in modules:
        assert _is_program(folder / f"{name}.py") and f"    {name} " in studies.__doc__, name
    for c in folder.glob("*.c"):
        assert f"    {c.name} " in studies.__doc__, c.name
    graph = import_graph.graph()
    users = [m for m, deps in graph.items() if m.startswith("benchmarks.") and not m.startswith("benchmarks.studies")
             and any(d.startswith("benchmarks.studies") for d in deps)]
    assert not users, users
