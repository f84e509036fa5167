"""A slow and a lossy link across two namespace hosts: `up --delay/--loss --impair node1` puts a
user-space wire (collectives/cluster/wire.py) on node1's link, since the kernels here have no netem.

- 100 ms of delay on node1's egress: every round trip between the hosts takes 100 ms more, and
  the bandwidth benchmark across them (torchrun, Gloo) still checks every value and shows it: an
  8-byte all_reduce takes at least 100 ms (node1's share has to cross once).
- 5% loss: that share of node1's frames is dropped (the wire's counts), TCP retransmits, and the
  benchmark's results are exact.
- `down` stops the wires and their devices go; a wire that dies takes its host's link with it.

    pytest tests/multinode/test_delay_and_loss.py -q
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from collectives import cluster
from collectives.cluster import hosts as cluster_hosts

from . import needs_hosts, torchrun_on_hosts

pytestmark = needs_hosts
HOSTS = ["node0", "node1"]
CONNECT = ("import socket, sys, time\n"  # seconds to be refused by port 9 of a host (a SYN, a RST back); best of 3
           "best = 99\n"
           "for _ in range(3):\n"
           "    s = socket.socket(); s.settimeout(5); t = time.perf_counter()\n"
           "    try: s.connect((sys.argv[1], 9))\n"
           "    except ConnectionRefusedError: best = min(best, time.perf_counter() - t)\n"
           "    except OSError as e: print(repr(e))\n"
           "print(best)")


@pytest.fixture(scope="module", autouse=True)
def _cleanup():
    yield
    cluster.down()


def _round_trip(src, dst):
    out = cluster.run_on(src, [sys.executable, "-c", CONNECT, dst], capture_output=True, text=True, timeout=60)
    return float(out.stdout.split()[-1])


def _bandwidth(tmp_path, rdzv_id, *args):
    path = tmp_path / f"{rdzv_id}.json"
    torchrun_on_hosts(HOSTS, ["-m", "benchmarks.bandwidth", "-c", "all_reduce", *args, "--json", str(path)],
                      rdzv_id=rdzv_id, nproc=1)
    return json.loads(path.read_text())["rows"]


def _wire_counts(host):
    state = cluster.load_state()
    node = next(n for n in state["nodes"] if n["name"] == host)
    time.sleep(1.2)  # the wire writes its counts every second
    with open(node["wire"]["stats"]) as f:
        return json.load(f)


def test_a_delayed_link_adds_its_delay_to_each_round_trip_and_the_benchmark_shows_it(tmp_path):
    cluster.up(2)
    plain = _round_trip("node0", "node1")
    cluster.up(2, delay="100ms", impair=["node1"])
    assert "wire pid" in cluster.status() and "running" in cluster.status()
    for src, dst in [("node0", "node1"), ("node1", "node0")]:  # the SYN or the RST crosses node1's wire
        assert 0.1 <= _round_trip(src, dst) < 0.1 + plain + 0.03, (src, dst, plain)
    rows = _bandwidth(tmp_path, "delay", "-b", "8", "-e", "64", "-f", "8", "-n", "3", "-w", "1")
    assert [r["size"] for r in rows] == [8, 64]
    for r in rows:
        assert r["ip"]["wrong"] == 0 and r["ip"]["time_us"] >= 100_000, r
    assert plain < 0.01, plain


def test_a_lossy_link_drops_its_share_and_the_collectives_stay_exact(tmp_path):
    cluster.up(2, loss="5%", impair=["node1"])
    rows = _bandwidth(tmp_path, "loss", "-b", "64K", "-e", "4M", "-f", "4", "-n", "5", "-w", "1", "--rounds", "3")
    assert len(rows) == 4 and all(r["ip"]["wrong"] == 0 for r in rows), rows
    counts = _wire_counts("node1")
    assert counts["from_host"] > 2000, counts
    share = counts["dropped"] / counts["from_host"]
    assert 0.03 <= share <= 0.075, counts  # 5% of > 2000 frames: within 4.5 standard deviations
    assert counts["loss"] == 0.05 and counts["delay_s"] == 0


def test_down_stops_the_wires_and_a_wire_that_dies_takes_its_link(tmp_path):
    cluster.up(2, delay="1ms")  # every host impaired: two wires
    assert len(cluster_hosts._wires()) == 2
    assert _round_trip("node0", "node1") < 1
    os.kill(cluster.load_state()["nodes"][1]["wire"]["pid"], signal.SIGKILL)
    time.sleep(0.5)
    assert "GONE (the link is down)" in cluster.status()
    out = cluster.run_on("node1", ["ip", "-o", "link", "show", "eth0"], capture_output=True, text=True)
    assert out.returncode != 0, out.stdout  # the host's eth0 went with its wire
    removed = cluster.down()
    assert "1 wire(s)" in removed, removed
    assert cluster_hosts._wires() == []
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert "cpcv" not in links and "cpcw" not in links, links
