"""A real SLURM cluster on the test hosts (`collectives.cluster up --slurm`): sbatch of the
shipped job script trains bitwise equal to the same 4 ranks spawned on one host, srun runs the
bandwidth benchmark across the hosts, and scancel leaves nothing behind on either host.

Runs where this process is root with network namespaces and Debian's slurm-wlm and munge are
installed (apt-get install -y slurm-wlm munge); skipped with the reason elsewhere.

    pytest tests/multinode/test_slurm.py -q
"""

import json
import os
import re
import sys
import time

import pytest

from collectives import cluster
from collectives.cluster import slurm as slurm_cluster

from . import WHY_NOT as HOSTS_WHY_NOT
from .conftest import in_the_hosts_group

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if HOSTS_WHY_NOT:
    WHY_NOT = f"no test hosts here: {HOSTS_WHY_NOT}"
else:
    WHY_NOT = f"--slurm needs {', '.join(slurm_cluster.missing())}: {slurm_cluster.APT}" if slurm_cluster.missing() else ""
pytestmark = pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT)

TRAIN = ["--model", "small", "--synthetic", "--train-size", "256", "--test-size", "64", "--batch-size", "16",
         "--impl", "bucketed"]


@pytest.fixture(scope="module")
def slurm(request):
    in_the_hosts_group(request)
    cluster.up(2, slurm=True)
    yield
    cluster.down()


def _on_node0(argv, timeout=120, path=None):
    # the job scripts run $PYTHON: this interpreter, whether or not its venv is on PATH
    env = {**os.environ, "PYTHON": sys.executable, **({"PATH": path} if path else {})}
    out = cluster.run_on("node0", argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


def _wait_gone(job, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _on_node0(["squeue", "-h", "-j", job, "-o", "%T"]).strip():
            return
        time.sleep(1)
    raise AssertionError(f"job {job} still in squeue after {timeout} s")


def test_sbatch_of_the_shipped_script_is_bitwise_one_host(slurm, tmp_path, one_host):
    # a `python` first on PATH that is not this interpreter (as when the tests run as venv/bin/python
    # without the venv activated): the job must not use it
    other = tmp_path / "bin"
    other.mkdir()
    (other / "python").write_text("#!/bin/sh\necho 'the python on PATH ran' >&2\nexit 3\n")
    (other / "python").chmod(0o755)
    said = _on_node0(["sbatch", "--parsable", f"--output={tmp_path}/train-%j.out", f"--chdir={ROOT}",
                      "docs/slurm/train.sbatch", *TRAIN], path=f"{other}:{os.environ['PATH']}")
    job = said.strip().split(";")[0]
    _wait_gone(job)
    text = (tmp_path / f"train-{job}.out").read_text()
    summary = json.loads(next(line for line in text.splitlines() if line.startswith('{"impl"')))
    expected = one_host(TRAIN)
    assert summary["world_size"] == 4 and summary["weights_sha256"] == expected["weights_sha256"], (summary, expected)


def test_srun_runs_the_bandwidth_benchmark_across_the_hosts(slurm):
    out = _on_node0(["srun", "-N2", "--ntasks-per-node=1", f"--chdir={ROOT}", sys.executable, "-m",
                     "benchmarks.bandwidth", "-c", "all_reduce", "-b", "1K", "-e", "64K"], timeout=180)
    assert "# Out of bounds values : 0 OK" in out, out[-2000:]


def test_scancel_leaves_nothing_on_either_host(slurm, tmp_path):
    before = set(os.listdir("/dev/shm"))
    said = _on_node0(["sbatch", "--parsable", f"--output={tmp_path}/long-%j.out", f"--chdir={ROOT}",
                      "docs/slurm/train.sbatch", "--model", "small", "--synthetic", "--epochs", "100",
                      "--batch-size", "8", "--train-size", "4096"])  # not 50,000 made-up images per rank first
    job = said.strip().split(";")[0]
    log, deadline = tmp_path / f"long-{job}.out", time.monotonic() + 120
    while time.monotonic() < deadline and not (log.exists() and "step" in log.read_text(errors="replace")):
        time.sleep(0.5)  # until the ranks train
    assert _on_node0(["squeue", "-h", "-j", job, "-o", "%T"]).strip() == "RUNNING"
    _on_node0(["scancel", job])
    cancelled = time.monotonic()
    ours = re.compile(r"ddp_from_scratch|collectives")
    def ours_on(host):
        return [pid for pid, argv in cluster.processes(host).items() if ours.search(" ".join(argv))]

    left = None
    while time.monotonic() - cancelled < 30:
        left = {h: ours_on(h) for h in ("node0", "node1")}
        if not any(left.values()):
            break
        time.sleep(0.5)
    assert not any(left.values()), f"still running {time.monotonic() - cancelled:.0f} s after scancel: {left}"
    # what the job left stays; what other programs on the machine hold for a moment goes: look for 5 s
    new, deadline = None, time.monotonic() + 5
    while new != set() and time.monotonic() < deadline:
        new = set(os.listdir("/dev/shm")) - before
        time.sleep(0.2)
    assert not new, new
