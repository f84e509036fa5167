"""Tests across namespace hosts (collectives.cluster): they run where this process is root and can
make network namespaces, and are skipped with the reason elsewhere."""

import subprocess
import sys

import pytest

from collectives import cluster

try:
    cluster.check_can_run()
    WHY_NOT = ""
except (cluster.ClusterError, FileNotFoundError) as exc:
    WHY_NOT = str(exc)
needs_hosts = pytest.mark.skipif(bool(WHY_NOT), reason=f"no test hosts here: {WHY_NOT}")


def torchrun_on_hosts(hosts, program, rdzv_id, nproc=2, timeout=240):
    """torchrun on every host at once (c10d rendezvous on node0); each host's output."""
    procs = [subprocess.Popen(cluster.host_command(h, [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)), "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29500", "--rdzv-id", rdzv_id, *program]),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for h in hosts]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, out[-3000:]
        outs.append(out)
    return outs
