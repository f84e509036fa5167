"""Across hosts for real: `collectives.cluster` makes network-namespace hosts on a bridge, and
torchrun runs the training CLI and the bandwidth benchmark on two of them. torch's DDP on 2 hosts x
2 ranks ends with weights bitwise equal to torch's DDP on 4 ranks on one host: the hosts change no
bit. Our bucketed DDP across the hosts ends there too: test_elastic.py's runs train it across the
same two hosts (one of them resumed after a fault) and end bitwise equal to torch's DDP on one
host, which a third, plain run here would only repeat.

Runs where this process is root and can make network namespaces (CI on this project's machines
can); skipped with the reason elsewhere.

    pytest tests/multinode -q
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import collectives.algorithms as A
from collectives import cluster, rates
from collectives.cluster import hosts as cluster_hosts
from collectives.algorithms.cost import CostModel
from collectives.algorithms.topology import Topology, link_beta, link_burst

from . import needs_hosts, torchrun_on_hosts as _torchrun_on_both

pytestmark = needs_hosts

TRAIN = ["-m", "ddp_from_scratch.train", "--model", "small", "--synthetic", "--train-size", "256", "--test-size", "64",
         "--batch-size", "16"]


def _summary(text):
    return json.loads(next(line for line in text.splitlines() if line.startswith("{\"impl\"")))


def test_the_probe_for_namespaces_answers_many_callers_at_once():
    """pytest's controller and its workers each ask whether this machine can make the hosts, at
    the same moment: every one must hear yes, or the test hosts' tests are skipped."""
    from concurrent.futures import ThreadPoolExecutor

    def probe(_):
        try:
            cluster.check_can_run()
            return None
        except cluster.ClusterError as exc:
            return str(exc)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(probe, range(32)))
    assert answers == [None] * 32, [a for a in answers if a]
    assert not [ns for ns in cluster_hosts._namespaces() if "probe" in ns]  # none left behind


def test_the_hosts_reach_each_other_and_nothing_else(hosts):
    server = subprocess.Popen(cluster.host_command("node0", [sys.executable, "-c", (
        "import socket; s = socket.socket(); s.bind(('10.77.0.1', 29611)); s.listen(); c, a = s.accept(); "
        "print(a[0], c.recv(5).decode(), socket.gethostname())")]), stdout=subprocess.PIPE, text=True)
    time.sleep(1.5)
    client = cluster.run_on("node1", [sys.executable, "-c", (
        "import socket; s = socket.create_connection(('node0', 29611), timeout=10); s.sendall(b'hello')")],
        capture_output=True, text=True, timeout=30)
    assert client.returncode == 0, client.stderr
    assert server.communicate(timeout=30)[0].split() == ["10.77.0.2", "hello", "node0"]
    routes = cluster.run_on("node1", ["ip", "route"], capture_output=True, text=True).stdout
    assert routes.strip().splitlines() == ["10.77.0.0/24 dev eth0 proto kernel scope link src 10.77.0.2"], routes
    bridge = subprocess.run(["ip", "-4", "addr", "show", cluster.BRIDGE], capture_output=True, text=True).stdout
    assert "inet " not in bridge, bridge  # no address on the machine's side: nothing is routed off it


def test_torchs_ddp_on_two_hosts_is_bitwise_four_ranks_on_one(hosts, one_host):
    out = _torchrun_on_both(hosts, [*TRAIN, "--impl", "torch"], rdzv_id="train-torch")
    two = _summary(out[0] if "weights_sha256" in out[0] else out[1])
    alone = one_host([*TRAIN[2:], "--impl", "torch"])
    assert two["world_size"] == alone["world_size"] == 4
    assert two["weights_sha256"] == alone["weights_sha256"], (two, alone)


def test_the_bandwidth_benchmark_runs_across_hosts(hosts):
    out = _torchrun_on_both(hosts, ["-m", "benchmarks.bandwidth", "-c", "all_reduce", "-b", "1K", "-e", "64K"],
                            rdzv_id="bandwidth", nproc=1)
    text = out[0] + out[1]
    assert "# Out of bounds values : 0 OK" in text, text[-3000:]


def test_the_algorithms_race_across_hosts_predicts_with_the_two_level_topology(hosts, tmp_path):
    """2 hosts x 2 ranks: the ranks find their hosts by hostname, every algorithm (hierarchical
    among them) gives exact results across the hosts, and each prediction is the simulator's on
    the topology the ranks found (the fitted model within a host, --link between hosts through
    the cluster's token bucket, every CPU cost scaled for the 4 ranks on this machine's cores:
    the namespace hosts share one kernel, so its boot_id counts all 4)."""
    race = tmp_path / "race.json"
    _torchrun_on_both(hosts, ["-m", "benchmarks.algorithms", "-c", "all_reduce", "-b", "256K", "-e", "256K",
                              "--link", "1gbit", "--json", str(race)], rdzv_id="race")
    run = json.loads(race.read_text())
    assert run["hosts"] == [0, 0, 1, 1] and run["link"] == "1gbit" and run["world_size"] == 4
    share = max(1.0, 4 / len(os.sched_getaffinity(0)))
    assert run["cpu_share"] == share and run["burst"] == link_burst("1gbit")
    intra = CostModel(**{k: run["model"][k] for k in ("alpha", "beta", "gamma")}).sharing(share)
    topology = Topology.of_hosts([0, 0, 1, 1], intra, CostModel(intra.alpha, link_beta("1gbit"), intra.gamma),
                                 link_burst("1gbit"))
    (row,) = run["rows"]
    assert row["backend_wrong"] == 0 and "hierarchical" in row["algorithms"]
    for name, m in row["algorithms"].items():
        assert m["wrong"] == 0, name
        simulated = A.simulate("all_reduce", name, [torch.zeros(row["size"] // 4)] * 4, model=topology)[1].time
        assert m["predicted_s"] == pytest.approx(simulated, rel=1e-9), name


def test_down_removes_a_half_made_cluster_and_is_idempotent(hosts):
    subprocess.run(["ip", "netns", "add", cluster.PREFIX + "node9"], check=True)  # as if `up` died early
    assert "not in the state file: cpc-node9" in cluster.status()
    removed = cluster.down()
    assert cluster.PREFIX + "node9" in removed and cluster.PREFIX + "node1" in removed
    assert cluster.down() == [] and cluster.status().startswith("no cluster")
    cluster.up(len(hosts))  # the module's hosts again, for the tests after this one


def test_down_removes_the_files_of_a_host_whose_namespace_was_deleted_behind_its_back(hosts):
    subprocess.run(["ip", "netns", "del", cluster.namespace(hosts[1])], check=True)  # as a test of hosts that vanish does
    assert os.path.exists(os.path.join(cluster.NETNS_ETC, cluster.namespace(hosts[1]), "hosts"))
    removed = cluster.down()
    assert f"{cluster.namespace(hosts[1])}'s files in {cluster.NETNS_ETC}" in removed, removed
    assert [n for n in os.listdir(cluster.NETNS_ETC) if n.startswith(cluster.PREFIX)] == []
    cluster.up(len(hosts))  # the module's hosts again, for the tests after this one


def test_what_cannot_be_done_is_said_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(cluster.ClusterError, match=r"needs root to make network namespaces \(this is uid 1000\)"):
        cluster.check_can_run()
    monkeypatch.undo()
    for args, line in [
        (["--link", "fast"], "--link: link rate 'fast' is not one: a positive number and a unit, as tc writes them "
                             "(100mbit, 1gbit, 2.5gbit)"),
        (["--delay", "fast"], "--delay: delay 'fast' is not one: a number and a unit, as tc writes them "
                              "(100ms, 1s, 250us)"),
        (["--loss", "2x"], "--loss: loss '2x' is not one: a percentage from 0 to 100 (1%, 0.5%)"),
        (["--delay", "1ms", "--impair", "node7"], "--impair: no host node7 among node0, node1"),
        (["--impair", "node1"], "--impair names the hosts that --delay and --loss apply to; give one of them"),
        (["--link", "99999999gbit"], "--link: link rate '99999999gbit' is more than tc's token bucket can shape (at "
                                     "most 8590gbit: its burst, 4 ms of the rate, must fit in 4 GiB)")]:
        assert cluster.main(["up", *args]) == 1, args
        assert capsys.readouterr().err == f"python -m collectives.cluster: {line}\n", args


def test_up_refuses_to_kill_what_runs_on_a_cluster_unless_forced(hosts, capsys):
    """`up` again used to tear the hosts down under a running command without a word; a link tc
    cannot shape failed halfway through `up`, after the old cluster was gone."""
    sleeper = subprocess.Popen(cluster.host_command("node0", ["sleep", "60"]))
    try:
        deadline = time.monotonic() + 10
        while sleeper.pid not in cluster.processes("node0") and time.monotonic() < deadline:
            time.sleep(0.05)
        for args in (["--nodes", "2"], ["--nodes", "2", "--link", "99999999gbit"]):
            assert cluster.main(["up", *args]) == 1
            err = capsys.readouterr().err
            assert err.count("\n") == 1, err
            assert sleeper.poll() is None and cluster.status().startswith("2 host(s)"), err  # nothing was touched
        assert "a cluster is up and busy (node0: sleep 60 (pid " in err or "more than tc's token bucket" in err, err
        assert cluster.main(["up", "--nodes", "2"]) == 1
        assert f"a cluster is up and busy (node0: sleep 60 (pid {sleeper.pid})); `up` would kill that: wait for it, " \
               "or `python -m collectives.cluster down`, or give --force" in capsys.readouterr().err
        assert cluster.main(["up", "--nodes", "2", "--force"]) == 0
        assert sleeper.wait(10) != 0  # killed by the forced `up`
    finally:
        sleeper.kill()
    assert cluster.busy() == {}


def test_ctrl_c_during_up_is_one_line_saying_how_to_clean_up(hosts, monkeypatch, capsys):
    calls = []
    real_ip = cluster_hosts._ip

    def interrupted(*args, **kwargs):
        calls.append(args)
        if len(calls) == 12:  # well into making the hosts
            raise KeyboardInterrupt
        return real_ip(*args, **kwargs)

    monkeypatch.setattr(cluster_hosts, "_ip", interrupted)
    assert cluster.main(["up", "--nodes", "2", "--force"]) == 130
    assert capsys.readouterr().err == ("\npython -m collectives.cluster up: interrupted (Ctrl-C) before the cluster was "
                                       "made: `python -m collectives.cluster down` removes what was\n")
    monkeypatch.undo()
    cluster.up(len(hosts), force=True)  # the module's hosts again


def test_the_token_bucket_tc_holds_is_the_one_asked_for(hosts):
    """The link tests time long transfers, which a bucket 8 times too large (bits for bytes)
    barely changes: read the bucket back from tc."""
    try:
        for rate in ("1gbit", "80mbit", "2.5gbit"):
            cluster.shape("node0", rate)
            shown = json.loads(subprocess.run(["ip", "netns", "exec", cluster.namespace("node0"), "tc", "-j", "qdisc",
                                               "show", "dev", "eth0"], capture_output=True, text=True,
                                              check=True).stdout)
            options = next(q for q in shown if q["kind"] == "tbf")["options"]
            assert options["burst"] == pytest.approx(rates.burst(rate), rel=1e-3), (rate, options)  # tc rounds to its ticks
            assert options["rate"] * 8 == rates.link_rate(rate), (rate, options)
    finally:
        cluster.shape("node0", None)


def test_the_token_bucket_holds_4_ms_of_the_rate_and_at_least_64_kib():
    """A 64 KiB bucket let a 4gbit link carry about half its rate (rates.burst's docstring)."""
    assert rates.burst("4gbit") == 2_000_000 and rates.burst("1gbit") == 500_000
    assert rates.burst("80mbit") == rates.burst("1kbit") == 64 << 10


def test_a_shaped_link_carries_at_most_its_rate(hosts):
    """--link RATE (tc tbf on the sender's eth0): 8 MB from node1 to node0 at 80 Mbit/s take at
    least 0.8 s; unshaped, the same bytes go several times faster."""
    def send_seconds():
        server = subprocess.Popen(cluster.host_command("node0", [sys.executable, "-c", (
            "import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            "s.bind(('10.77.0.1', 29612)); s.listen(); c, a = s.accept(); n = 0\n"
            "while True:\n    b = c.recv(1 << 20)\n    n += len(b)\n    if not b: break\nprint(n)")]),
            stdout=subprocess.PIPE, text=True)
        time.sleep(1.5)
        client = cluster.run_on("node1", [sys.executable, "-c", (
            "import socket, time; s = socket.create_connection(('node0', 29612), timeout=30); t = time.perf_counter(); "
            "s.sendall(bytes(8 << 20)); s.shutdown(socket.SHUT_WR); s.recv(1); print(time.perf_counter() - t)")],
            capture_output=True, text=True, timeout=60)
        assert client.returncode == 0, client.stderr
        assert server.communicate(timeout=30)[0].strip() == str(8 << 20)
        return float(client.stdout)

    free = send_seconds()
    cluster.shape("node1", rate="80mbit")
    try:
        shaped = send_seconds()
    finally:
        cluster.shape("node1")  # unshaped again
    line_seconds = (8 << 20) * 8 / 80e6  # 0.84 s at the line rate
    assert shaped >= 0.9 * line_seconds, (shaped, line_seconds)
    assert shaped > 2 * free, (shaped, free)


def test_up_takes_the_clusters_own_slurm_daemons_for_no_command(monkeypatch):
    """What `up` and `down` would kill: commands on the hosts, never the cluster's own SLURM
    daemons (an idle SLURM cluster was taken for a busy one by a planted check, and no test ran
    `up` beside a SLURM cluster). Read from the state's pids and each host's processes."""
    daemons = {11: ["slurmctld", "-D"], 12: ["slurmd", "-D"], 21: ["slurmd", "-D"]}
    command = {31: ["python", "-m", "benchmarks.bandwidth"]}
    table = {"node0": {11: daemons[11], 12: daemons[12]}, "node1": {21: daemons[21]}}
    monkeypatch.setattr(cluster_hosts, "load_state", lambda: {"slurm": {"pids": [11, 12, 21]}})
    monkeypatch.setattr(cluster_hosts, "_namespaces", lambda: [cluster_hosts.PREFIX + h for h in table])
    monkeypatch.setattr(cluster_hosts, "processes", lambda host: table[host])
    assert cluster_hosts.busy() == {}  # an idle SLURM cluster
    table["node1"] = {**table["node1"], **command}
    assert cluster_hosts.busy() == {"node1": command}
    monkeypatch.setattr(cluster_hosts, "load_state", lambda: {})  # no SLURM: its daemons would be commands
    assert cluster_hosts.busy() == {"node0": {11: daemons[11], 12: daemons[12]}, "node1": {21: daemons[21], **command}}
