"""Elastic restarts across two namespace hosts: `torchrun --nnodes 1:2 --max-restarts 2` runs the
training CLI with a checkpoint every few steps and --auto-resume. A worker on the second host
killed with SIGKILL mid-run: both agents restart the group, it resumes from the last checkpoint,
and the final weights are bitwise those of an uninterrupted 4-rank run on one host. A whole host
gone (its agent and workers killed): what torch does is measured here, and our side says it in
one line.

    pytest tests/multinode/test_elastic.py -q
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from collectives import cluster

try:
    cluster.check_can_run()
    WHY_NOT = ""
except (cluster.ClusterError, FileNotFoundError) as exc:
    WHY_NOT = str(exc)
pytestmark = pytest.mark.skipif(bool(WHY_NOT), reason=f"no test hosts here: {WHY_NOT}")

# 4 ranks x 16 images: 128 steps an epoch, ~4 s here; long enough to kill a worker mid-epoch
TRAIN = ["-m", "ddp_from_scratch.train", "--model", "small", "--synthetic", "--train-size", "8192", "--test-size", "64",
         "--batch-size", "16", "--epochs", "2"]


@pytest.fixture(scope="module")
def hosts():
    cluster.up(2)
    yield ["node0", "node1"]
    cluster.down()


def _elastic(hosts, folder, rdzv_id, extra=()):
    return [subprocess.Popen(cluster.host_command(h, [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
        "--max-restarts", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29500", "--rdzv-id", rdzv_id,
        *extra, *TRAIN, "--checkpoint", str(folder), "--checkpoint-every", "8", "--auto-resume"]),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True) for h in hosts]


def _pids(host, agent):
    """The torchrun agent (agent=True) or its training workers running on `host`."""
    out = subprocess.run(["ip", "netns", "pids", cluster.namespace(host)], capture_output=True, text=True).stdout
    found = []
    for pid in map(int, out.split()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except FileNotFoundError:
            continue
        is_agent = b"torch.distributed.run" in argv
        if (is_agent if agent else (b"ddp_from_scratch.train" in argv and not is_agent)):
            found.append(pid)
    return found


def _wait_for_checkpoint_step(folder, at_least, procs, timeout=120):
    import torch

    path = os.path.join(folder, "checkpoint.pt")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "torchrun ended before the fault"
        if os.path.exists(path):
            try:
                state = torch.load(path, weights_only=True)
            except Exception:  # written while read: the rename makes the next read whole
                state = None
            if state and state["epoch"] == 0 and state["step"] >= at_least:
                return state["step"]
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint of step {at_least} in {timeout} s")


def _summary(outs):
    text = next(o for o in outs if "weights_sha256" in o)
    return json.loads(next(line for line in text.splitlines() if line.startswith("{\"impl\"")))


def test_a_worker_killed_on_host_2_restarts_the_group_and_ends_bitwise(hosts, tmp_path):
    one = subprocess.run([sys.executable, *TRAIN, "--nproc", "4"], capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    procs = _elastic(hosts, tmp_path / "ckpt", "elastic-worker")
    try:
        step = _wait_for_checkpoint_step(tmp_path / "ckpt", 16, procs)
        victim = _pids("node1", agent=False)[0]
        os.kill(victim, signal.SIGKILL)
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    resumed, alone = _summary(outs), json.loads(one.stdout.splitlines()[-1])
    assert resumed["restarts"] >= 1 and resumed["world_size"] == 4
    assert resumed["resumed_from_epoch"] == 0 and resumed["resumed_from_step"] >= step  # not from the start
    assert resumed["weights_sha256"] == alone["weights_sha256"]
    assert not _pids("node0", agent=False) and not _pids("node1", agent=False)
