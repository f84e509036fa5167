"""Network faults across two namespace hosts: a link taken down in the middle of an all_reduce,
and a host that disappears (its link deleted, its processes killed, its namespace removed).

torchrun runs one rank per host (Gloo, a 10 s process-group timeout) doing 4 MiB all_reduces in
a loop; then node1's link goes down (`ip link set cpcv1 down`, the host side of its veth). Every
rank must end with a BackendFailure naming its rank, its host and the collective within the
timeout plus 5 s, and no rank may be left on either host. node1's torchrun agent, which cannot
reach the rendezvous store on node0 while the link is down, stays until the link is back (then
ends, exit 1, ~2 s later): torch's agent, measured and checked here. (A slow or lossy link:
test_delay_and_loss.py.)

    pytest tests/multinode/test_faults.py -q
"""

import os
import signal
import subprocess
import sys
import textwrap
import time


from collectives import cluster

from . import needs_hosts

pytestmark = needs_hosts

TIMEOUT_S = 10
PROGRAM = textwrap.dedent(f"""
    import datetime, os, sys, time
    import torch, collectives
    from collectives.launcher.env import init_from_env

    out = sys.argv[1]
    env = init_from_env(backend="gloo", timeout=datetime.timedelta(seconds={TIMEOUT_S}))
    t = torch.ones(1 << 20)
    collectives.all_reduce(t)
    open(os.path.join(out, f"running{{env.rank}}"), "w").close()
    try:
        while True:
            collectives.all_reduce(t)
    except collectives.BackendFailure as exc:
        with open(os.path.join(out, f"failed{{env.rank}}"), "w") as f:
            f.write(f"{{time.time()}}\\n{{exc}}")
        os._exit(1)
""")


def _ranks(host, program):
    return [pid for pid, argv in cluster.processes(host).items()
            if program in argv and "torch.distributed.run" not in argv]


def _start(hosts, tmp_path, rdzv_id):
    """torchrun on both hosts running PROGRAM; returns once both ranks are in the loop."""
    program = tmp_path / "loop.py"
    program.write_text(PROGRAM)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(cluster.__file__))))
    env = {**os.environ, "PYTHONPATH": root}  # the program lives in tmp_path: import this checkout
    procs = [subprocess.Popen(cluster.host_command(h, [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "node0:29500", "--rdzv-id", rdzv_id, str(program), str(tmp_path)]),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env) for h in hosts]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"running{r}").exists() for r in (0, 1)):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            raise AssertionError("the loop never ran")
        time.sleep(0.1)
    time.sleep(1.0)
    return procs, str(program)


def _failure(tmp_path, rank):
    failed_at, message = (tmp_path / f"failed{rank}").read_text().split("\n", 1)
    return float(failed_at), message


def test_a_link_down_mid_all_reduce_fails_every_rank_naming_it(hosts, tmp_path):
    procs, program = _start(hosts, tmp_path, "link-down")
    try:
        subprocess.run(["ip", "link", "set", "cpcv1", "down"], check=True)
        down_at = time.time()
        while time.time() - down_at < TIMEOUT_S + 5 and (_ranks("node0", program) or _ranks("node1", program)):
            time.sleep(0.2)
        left = _ranks("node0", program) + _ranks("node1", program)
        assert not left, f"ranks still running {TIMEOUT_S + 5} s after the link went down: {left}"
        for rank, host in ((0, "node0"), (1, "node1")):
            failed_at, message = _failure(tmp_path, rank)
            assert failed_at - down_at <= TIMEOUT_S + 5
            assert message.startswith(f"rank {rank} on host {host}: all_reduce over 2 ranks (gloo) failed in the "
                                      "backend: "), message
        out0 = procs[0].communicate(timeout=30)[0]
        assert procs[0].returncode == 1, out0[-2000:]
        # node1's torchrun agent cannot reach the rendezvous store on node0 while the link is
        # down, and stays; once the link is back it ends too
        assert procs[1].poll() is None
        subprocess.run(["ip", "link", "set", "cpcv1", "up"], check=True)
        procs[1].communicate(timeout=30)  # measured: 1.9 s
        assert procs[1].returncode == 1
    finally:
        subprocess.run(["ip", "link", "set", "cpcv1", "up"])
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


def test_a_host_that_disappears_fails_the_other_naming_it(hosts, tmp_path):
    """node1 goes as a machine that loses power: its link first (no FIN or RST reaches node0),
    then every process in it, then its namespace. Last in this module: node1 is gone after it."""
    procs, program = _start(hosts, tmp_path, "host-gone")
    try:
        subprocess.run(["ip", "link", "delete", "cpcv1"], check=True)
        gone_at = time.time()
        for pid in cluster.processes("node1"):
            os.kill(pid, signal.SIGKILL)
        subprocess.run(["ip", "netns", "delete", cluster.namespace("node1")], check=True)
        out0 = procs[0].communicate(timeout=TIMEOUT_S + 30)[0]
        failed_at, message = _failure(tmp_path, 0)
        assert failed_at - gone_at <= TIMEOUT_S + 5
        assert message.startswith("rank 0 on host node0: all_reduce over 2 ranks (gloo) failed in the backend: "), message
        assert procs[0].returncode == 1, out0[-2000:]
        assert not _ranks("node0", program)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
