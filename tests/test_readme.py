"""Every Python example in the README and in docs/ runs as pasted, and prints what its comment says.

A block that defines a @distributed test is run with pytest; any other block is run as a script.
A line `print(...)  # text` must print text (for the first example: `# [6.0, 6.0, 6.0]`).

    pytest tests/test_readme.py -q

Each example runs in a fork of a warm interpreter that imported torch once (tests/warm_python.py,
the `warm_python` fixture),
as `python FILE` would run it: a fresh interpreter per example would spend most of its time
importing torch again.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(page.relative_to(ROOT).as_posix(), block) for page in PAGES
          for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)]
# A block pasted on two pages (the README's first example opens docs/collectives.md too) is one
# program: it runs once, under the index of its first place, and a failure names every place.
PLACES: dict = {}
for _i, (_page, _block) in enumerate(BLOCKS):
    PLACES.setdefault(_block, []).append((_i, _page))


def expected_output(block: str):
    """The `# text` after each print(...) at the end of a line."""
    return [m.group(1).strip() for m in re.finditer(r"^\s*print\(.*\)\s+#\s*(.+)$", block, flags=re.M)]


def test_the_readme_and_docs_have_examples():
    pages = {page for page, _ in BLOCKS}
    assert "README.md" in pages and len(pages) >= 6 and len(BLOCKS) >= 10, \
        f"examples lost (or the pattern no longer finds them): {sorted(pages)}, {len(BLOCKS)} blocks"


# The README's first example (the front door) runs in the quick run; every other one is slow:
# each is a fresh interpreter that starts ranks, a few seconds apiece.
FIRSTS = [places[0] for places in PLACES.values()]


@pytest.mark.parametrize("index", [pytest.param(i, marks=() if i == 0 else pytest.mark.slow) for i, _ in FIRSTS],
                         ids=[f"{page}-{i}" for i, page in FIRSTS])
def test_readme_example_runs_as_pasted(index, tmp_path, warm_python):
    _, block = BLOCKS[index]
    page = " and ".join(f"{page} (block {i})" for i, page in PLACES[block])
    if "@distributed" in block:
        path = tmp_path / "test_readme_example.py"
        path.write_text(block)
        argv = ["-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)]
    else:
        path = tmp_path / "example.py"
        path.write_text(block)
        argv = [str(path)]
    out = warm_python.run(argv, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, f"the example at {page} failed:\n{block}\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}"
    for text in expected_output(block):
        assert text in out.stdout, f"the example at {page} should print {text!r}; it printed:\n{out.stdout}"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_to_a_page_and_a_section_finds_them():
    """Links between the README, docs/ and benchmarks/RESULTS.md: the page exists and, with
    #section, so does a heading of that name (sections move between pages)."""
    pages = PAGES + [ROOT / "benchmarks" / "RESULTS.md"]
    broken = []
    for page in pages:
        for target, anchor in re.findall(r"\]\(([^)#\s]+\.md)(?:#([^)\s]+))?\)", page.read_text()):
            path = (page.parent / target).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} does not exist")
            elif anchor:
                headings = {_anchor(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)}
                if anchor not in headings:
                    broken.append(f"{page.relative_to(ROOT)}: {target}#{anchor}: no such section")
    assert not broken, "\n".join(broken)


def test_every_picture_and_file_a_page_links_to_is_there():
    """Links to anything but a page (a plot, a results file, a source file): the file exists. A
    results file renamed or measured again under a new date must take the pages' links along."""
    pages = PAGES + [ROOT / "benchmarks" / "RESULTS.md"]
    links = [(page, target) for page in pages
             for target in re.findall(r"\]\(([^)#\s:]+)\)", page.read_text()) if not target.endswith(".md")]
    assert any(target.endswith(".png") for _, target in links), "no picture found: the pattern lost them"
    missing = [f"{page.relative_to(ROOT)}: {target}" for page, target in links if not (page.parent / target).exists()]
    assert not missing, "\n".join(missing)
