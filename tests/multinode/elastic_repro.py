"""Reproducer, NOT collected by pytest (it fails today): elastic restarts across two namespace
hosts. `torchrun --nnodes 1:2 --max-restarts 2` runs the training CLI with a checkpoint every 8
steps and --auto-resume; a worker on the second host is SIGKILLed mid-run; the claim to prove is
that both agents restart the group, it resumes from the last checkpoint, and the final weights are
bitwise those of an uninterrupted 4-rank run on one host.

What it measured on 2026-11-24 (torch 2.13.0+cpu, Gloo, 2 namespace hosts on this 2-core VM):
once the group restarted and resumed (that run found the bucket-layout bug fixed in
ddp_from_scratch/ddp.py's bucket_layout_state); in the 3 runs after, the restarted ranks' Gloo
connectFullMesh failed with "Connection refused" to an address of a node0 rank that was not
listening there (the ports of the attempt before, read back from the agent's store), the agents
used up --max-restarts, and both torchruns exited 1. A PrefixStore per TORCHELASTIC_RESTART_COUNT
did not help: the agents' restart counts differ when one restarts for a failure and the other for
a membership change, so the count does not name the round. Not yet solved; run it to see:

    python -m pytest tests/multinode/elastic_repro.py -q
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
