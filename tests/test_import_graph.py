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
         "collectives.shm.ops": {"collectives.algorithms.ring"}, "collectives.algorithms.ring": set()}
    assert import_graph.cycles(g) == [["collectives.errors", "collectives.ops"]]
    assert import_graph.upward(g) == ["collectives.errors (layer 0) -> collectives.ops (layer 2)",
                                      "collectives.shm.ops (layer 1) -> collectives.algorithms.ring (layer 3)"]


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
