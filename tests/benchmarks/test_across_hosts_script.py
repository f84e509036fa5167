"""benchmarks/across_hosts.sh reads its arguments before it touches the cluster: --help prints
the usage, an unknown option is one line with exit 2, and neither runs any python (which would
tear a running cluster down first).

    pytest tests/benchmarks/test_across_hosts_script.py -q
"""

import os
import pathlib
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "across_hosts.sh"


@pytest.mark.parametrize("argv, code, says", [
    (["--help"], 0, "bash benchmarks/across_hosts.sh 500mbit 1gbit 2gbit 4gbit none"),
    (["-h"], 0, "each host's link shaped to RATE"),
    (["1gbit", "--fast"], 2, "across_hosts.sh: unknown option --fast"),
])
def test_arguments_are_read_before_the_cluster_is_touched(argv, code, says, tmp_path):
    marker = tmp_path / "python-ran"
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    fake.chmod(0o755)
    out = subprocess.run(["bash", str(SCRIPT), *argv], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"})
    assert out.returncode == code, out.stderr
    assert says in (out.stdout if code == 0 else out.stderr), (out.stdout, out.stderr)
    assert not marker.exists(), "the script ran python (the cluster's down) before reading its arguments"
