"""pyflakes' checks over the code (ruff's F rules): an undefined name, an unused import, a name
imported twice or shadowed. Each is a bug or the start of one: an import named like a pytest
fixture shadowed the fixture in every test that took it, and no test run showed it until the
test that used the import ran.

    python -m ruff check --select F collectives ddp_from_scratch benchmarks tests
"""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_pyflakes_finds_nothing():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F", "--no-cache", "--output-format",
                          "concise", "collectives", "ddp_from_scratch", "benchmarks", "tests"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
