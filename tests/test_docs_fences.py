"""Every page a user reads renders its code blocks as written: each fence that opens a block is
closed by a line of its own (CommonMark: a closing fence takes no text after it, so "``` A
forward ..." closes nothing, and the prose after it renders as code until the next fence).

    pytest tests/test_docs_fences.py -q
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md", *(ROOT / "docs").rglob("*.md")])
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


def fence_problems(text: str) -> list:
    """(line number, what is wrong) for each fence that is never closed, and each line inside a
    block that starts with the block's fence and goes on with text (meant to close it, it does not)."""
    problems, opened = [], None  # opened: (line number, fence)
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if not m:
            continue
        fence, rest = m.groups()
        if opened is None:
            if fence[0] == "`" and "`" in rest:
                continue  # inline code at a line's start (``` in an info string is not allowed)
            opened = (number, fence)
        elif fence[0] == opened[1][0] and len(fence) >= len(opened[1]):
            if rest.strip():
                problems.append((number, f"a fence with text after it ({line.strip()[:40]!r}) does not close the "
                                         f"block opened at line {opened[0]}"))
            else:
                opened = None
    if opened is not None:
        problems.append((opened[0], "a block opened here is never closed"))
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_code_block_is_closed_by_a_fence_of_its_own(page):
    assert fence_problems(page.read_text()) == [], page


@pytest.mark.parametrize("text, problems", [
    ("```python\nx = 1\n```\nprose\n", []),
    ("```python\nx = 1\n``` A forward on stage s\nprose\n```python\ny\n```\n",
     [(3, "a fence with text after it ('``` A forward on stage s') does not close the block opened at line 1"),
      (5, "a fence with text after it ('```python') does not close the block opened at line 1")]),
    ("text\n```\ncode\n", [(2, "a block opened here is never closed")]),
    ("````\n```\nnested\n```\n````\n", []),  # a longer fence holds shorter ones
])
def test_the_check_finds_an_unclosed_block_and_a_fence_with_text(text, problems):
    assert fence_problems(text) == problems
