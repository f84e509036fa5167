import json
import os
import subprocess
import sys

import pytest

from collectives import cluster


def in_the_hosts_group(request) -> None:
    """Under pytest-xdist, a test that brings the hosts up must be in the one group that has them
    (see pytest_collection_modifyitems below): two workers' clusters would tear each other down."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    outside = [i.nodeid for i in request.session.items if i.path == request.path and not i.nodeid.endswith("@hosts")]
    if outside:
        pytest.fail(f"{outside[0]} runs outside the 'hosts' xdist group: run the suite with --dist loadgroup")


@pytest.fixture(scope="module")
def hosts(request):
    """Two test hosts, node0 and node1, for the tests of one module; removed after them."""
    in_the_hosts_group(request)
    cluster.up(2)
    yield ["node0", "node1"]
    cluster.down()


@pytest.fixture(scope="session")
def one_host():
    """`one_host(argv)`: the summary of `python -m ddp_from_scratch.train *argv --nproc 4` on this
    machine, the reference that the same training across hosts must equal bit for bit; run once
    per configuration, whichever module asks first."""
    summaries = {}

    def summary(argv):
        key = tuple(argv)
        if key not in summaries:
            out = subprocess.run([sys.executable, "-m", "ddp_from_scratch.train", *argv, "--nproc", "4"],
                                 capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr[-3000:]
            summaries[key] = json.loads(out.stdout.strip().splitlines()[-1])
        return summaries[key]

    return summary


@pytest.hookimpl(tryfirst=True)  # before xdist reads the group marks (pytest 9.2 calls it first otherwise)
def pytest_collection_modifyitems(config, items):
    """The test hosts are one set per machine (node0, node1, ...): under pytest-xdist every test
    that uses them runs in one worker, one after another (the suite runs with `--dist loadgroup`).
    They go first, so that their worker starts on them at once while the others share the rest:
    together they are the suite's longest chain, mostly waiting on torch's rendezvous and SLURM."""
    here = str(config.rootpath / "tests" / "multinode")
    ours = [item for item in items if str(item.path).startswith(here)]
    for item in ours:
        item.add_marker(pytest.mark.xdist_group("hosts"))
        item.add_marker(pytest.mark.slow)
    first = {id(item) for item in ours}
    items[:] = ours + [item for item in items if id(item) not in first]
