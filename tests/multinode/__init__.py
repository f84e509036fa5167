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
    outs, late = [], None
    for h, p in zip(hosts, procs):
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            late = h
            break
        outs.append(out)
    if late is not None:  # every host's output, not only the first late one's: which host hung, and where
        tails = []
        for i, (h, p) in enumerate(zip(hosts, procs)):
            if i < len(outs):
                tails.append(f"--- {h} (exit {p.returncode}):\n{outs[i][-6000:]}")
                continue
            p.terminate()  # torchrun stops its workers on SIGTERM (a SIGKILL would leave them holding the pipe)
            try:
                out = p.communicate(timeout=30)[0]
            except subprocess.TimeoutExpired:
                p.kill()
                out = "(no output: still running 30 s after SIGTERM)"
            tails.append(f"--- {h} (exit {p.returncode}):\n{(out or '')[-6000:]}")
        pytest.fail(f"torchrun on {late} still running after {timeout} s; each host's output:\n" + "\n".join(tails))
    for h, p, out in zip(hosts, procs, outs):
        assert p.returncode == 0, f"{h}: {out[-3000:]}"
    return outs
