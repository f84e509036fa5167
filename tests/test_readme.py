"""Every Python example in the README runs as pasted, and prints what its comment says.

A block that defines a @distributed test is run with pytest; any other block is run as a script.
A line `print(...)  # text` must print text (for the first example: `# [6.0, 6.0, 6.0]`).

    pytest tests/test_readme.py -q
"""

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def expected_output(block: str):
    """The `# text` after each print(...) at the end of a line."""
    return [m.group(1).strip() for m in re.finditer(r"^\s*print\(.*\)\s+#\s*(.+)$", block, flags=re.M)]


def test_the_readme_has_examples():
    assert len(BLOCKS) >= 5, "the README lost its examples (or the pattern no longer finds them)"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs_as_pasted(index, tmp_path):
    block = BLOCKS[index]
    if "@distributed" in block:
        path = tmp_path / "test_readme_example.py"
        path.write_text(block)
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)]
    else:
        path = tmp_path / "example.py"
        path.write_text(block)
        argv = [sys.executable, str(path)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, f"README example {index} failed:\n{block}\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}"
    for text in expected_output(block):
        assert text in out.stdout, f"README example {index} should print {text!r}; it printed:\n{out.stdout}"
