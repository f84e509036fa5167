"""A cluster on one machine: test hosts as network namespaces on a bridge, for multi-node runs
that cross a real network interface (and a shaped link) without a second machine.

    python -m collectives.cluster up --nodes 2 [--link 1gbit] [--delay 100ms --loss 1% [--impair node1]] [--slurm] [--force]
    python -m collectives.cluster run node1 -- python -m benchmarks.bandwidth ...
    python -m collectives.cluster status
    python -m collectives.cluster down          # idempotent; also after a crash or a half-made `up`

Each host `nodeK` is a namespace `cpc-nodeK` with one interface, eth0, at 10.77.0.(K+1)/24 on the
bridge `cpcbr0`; the bridge has no address, so nothing is routed off the machine and the hosts
reach only each other. Inside a host, /etc/hosts (bind-mounted by `ip netns exec` from
/etc/netns/cpc-nodeK/hosts) names every host, and a command runs with the host's name as its
hostname (a UTS namespace of its own), so torchrun's master address (its hostname) is right on
every host and Gloo, which binds to the address its hostname resolves to, uses eth0 without
GLOO_SOCKET_IFNAME. `--link RATE` shapes each host's egress with a token bucket (tc tbf).
`--delay` and `--loss` do to an impaired host's egress what tc netem would, in user space
(collectives/cluster/wire.py: the kernels this is tested on are built without netem): that host's eth0 is
one end of a wire process instead of a veth. Needs root, iproute2 and, for a wire, /dev/net/tun.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional

from . import slurm as slurm_cluster, wire
from ..cli import ArgumentParser
from ..machine import alive
from ..rates import burst, shapeable

PREFIX = "cpc-"
BRIDGE = "cpcbr0"
SUBNET = "10.77.0"
STATE_DIR = os.environ.get("COLLECTIVES_CLUSTER_DIR", "/run/collectives-cluster")
NETNS_ETC = "/etc/netns"  # a host's own /etc files (its hosts file), which `ip netns exec` mounts in it


class ClusterError(RuntimeError):
    """What stops the cluster command, in one line."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and out.returncode:
        raise ClusterError(f"ip {' '.join(args)}: {out.stderr.strip() or out.stdout.strip()}")
    return out


def address(node: int) -> str:
    return f"{SUBNET}.{node + 1}"


def namespace(host: str) -> str:
    return PREFIX + host


def _state_path() -> str:
    return os.path.join(STATE_DIR, "state.json")


def load_state() -> Optional[dict]:
    try:
        with open(_state_path()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _save_state(state: dict) -> None:
    os.makedirs(STATE_DIR, exist_ok=True)
    with open(_state_path(), "w") as f:
        json.dump(state, f, indent=1)


def check_can_run() -> None:
    """Root, iproute2 and network namespaces, or a ClusterError saying which is missing."""
    if os.geteuid() != 0:
        raise ClusterError(f"collectives.cluster needs root to make network namespaces (this is uid {os.geteuid()})")
    try:
        _ip("-V")
    except FileNotFoundError:
        raise ClusterError("collectives.cluster needs iproute2's `ip` (apt-get install iproute2)") from None
    # a name of this call's own: pytest's controller and each of its workers probe at once as they
    # collect the tests, and one shared name made all but the first read "File exists" (and skip)
    probe = f"{PREFIX}probe-{os.getpid()}-{secrets.token_hex(3)}"
    out = _ip("netns", "add", probe, check=False)
    if out.returncode:
        raise ClusterError(f"this machine cannot make network namespaces: {out.stderr.strip()}")
    _ip("netns", "del", probe, check=False)


def shape(host: str, rate: Optional[str] = None) -> List[str]:
    """Shape a host's egress on eth0 to `rate` (replacing what was there); the tc commands run."""
    ns = namespace(host)
    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root"], capture_output=True)
    commands = []
    if rate:  # a token bucket: at most RATE, burst(RATE) at once, 50 ms of queue before dropping
        commands.append(["tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate, "burst", f"{burst(rate)}b",
                         "latency", "50ms"])
    for cmd in commands:
        out = subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True)
        if out.returncode:
            raise ClusterError(f"{host}: {' '.join(cmd)}: {out.stderr.strip()}")
    return [" ".join(c) for c in commands]


def busy() -> Dict[str, Dict[int, List[str]]]:
    """host -> pid -> argv of what runs on the hosts now, the cluster's own daemons (SLURM's)
    left out: what `up` or `down` would kill."""
    state = load_state() or {}
    own = set(((state.get("slurm") or {}).get("pids")) or [])
    found = {}
    for ns in _namespaces():
        host = ns[len(PREFIX):]
        running = {pid: argv for pid, argv in processes(host).items() if pid not in own}
        if running:
            found[host] = running
    return found


def up(nodes: int, rate: Optional[str] = None, delay: Optional[str] = None, loss: Optional[str] = None,
       slurm: bool = False, impair: Optional[List[str]] = None, force: bool = False) -> dict:
    """Make `nodes` hosts on the bridge. `rate` shapes every host's egress (tc tbf); `delay` and
    `loss` impair the egress of the hosts named in `impair` (default: every host) through a wire.
    A cluster that is up is replaced, unless something runs on its hosts (then a ClusterError,
    before anything is touched; `force` replaces it anyway, killing what runs)."""
    check_can_run()
    if slurm and slurm_cluster.missing():
        raise ClusterError(f"--slurm needs {', '.join(slurm_cluster.missing())}: {slurm_cluster.APT}")
    if not 1 <= nodes <= 200:
        raise ClusterError(f"--nodes must be 1-200, got {nodes}")
    hosts = [f"node{k}" for k in range(nodes)]
    for flag, value, parse in (("link", rate, shapeable), ("delay", delay, wire.parse_delay),
                               ("loss", loss, wire.parse_loss)):
        try:
            if value:
                parse(value)
        except ValueError as exc:
            raise ClusterError(f"--{flag}: {exc}") from None
    if impair is not None and not (delay or loss):
        raise ClusterError("--impair names the hosts that --delay and --loss apply to; give one of them")
    if delay or loss:
        unknown = sorted(set(impair or []) - set(hosts))
        if unknown:
            raise ClusterError(f"--impair: no host {', '.join(unknown)} among {', '.join(hosts)}")
        if not os.path.exists("/dev/net/tun"):
            raise ClusterError("--delay and --loss need /dev/net/tun (a TAP device for the wire); "
                               "--link RATE (tc tbf) works without it")
    impaired = set(hosts if impair is None else impair) if (delay or loss) else set()
    running = {} if force else busy()
    if running:
        said = "; ".join(f"{host}: " + ", ".join(f"{' '.join(argv)[:60]} (pid {pid})" for pid, argv in list(procs.items())[:2])
                         + (f" and {len(procs) - 2} more" if len(procs) > 2 else "") for host, procs in running.items())
        raise ClusterError(f"a cluster is up and busy ({said}); `up` would kill that: wait for it, or "
                           "`python -m collectives.cluster down`, or give --force")
    down()  # whatever an earlier cluster or a half-made `up` left
    state = {"nodes": [], "bridge": BRIDGE, "link": {"rate": rate, "delay": delay, "loss": loss},
             "impaired": sorted(impaired), "machine_hostname": socket.gethostname(),
             "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    _save_state(state)  # first, so that `down` finds a half-made cluster
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("link", "set", BRIDGE, "up")
    for k, host in enumerate(hosts):
        ns, veth = namespace(host), f"cpcv{k}"
        _ip("netns", "add", ns)
        state["nodes"].append({"name": host, "namespace": ns, "address": address(k), "veth": veth})
        _save_state(state)
        if host in impaired:  # eth0 is one end of a wire, cpcvK the other
            state["nodes"][-1]["wire"] = _start_wire(k, delay, loss)
            _save_state(state)
            _ip("link", "set", f"cpcw{k}", "netns", ns, "name", "eth0")
        else:
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", BRIDGE)
        _ip("link", "set", veth, "up")
        _ip("-n", ns, "addr", "add", f"{address(k)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        os.makedirs(os.path.join(NETNS_ETC, ns), exist_ok=True)
        with open(os.path.join(NETNS_ETC, ns, "hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n")
            f.writelines(f"{address(j)} {h}\n" for j, h in enumerate(hosts))
        if rate:
            state["nodes"][-1]["tc"] = shape(host, rate)
    _save_state(state)
    if slurm:
        _start_slurm(state, hosts)
    return state


def _start_wire(k: int, delay: Optional[str], loss: Optional[str]) -> dict:
    """Start node k's wire (collectives/cluster/wire.py): TAP devices cpcwK (for the host) and cpcvK."""
    try:
        return wire.start(f"cpcw{k}", f"cpcv{k}", delay or "0ms", loss or "0%",
                          stats=os.path.join(STATE_DIR, f"wire-node{k}.json"),
                          log=os.path.join(STATE_DIR, f"wire-node{k}.log"))
    except wire.WireError as exc:
        raise ClusterError(f"node{k}'s {exc}") from None


def _wires() -> List[int]:
    """pids of every wire process of a cluster (by command line: also after a lost state)."""
    return wire.find(bridge_prefix="cpcv")


def _listdir(path: str) -> List[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


_running = alive  # whether pid runs (a zombie does not: `up`'s own wires are its children until it exits)


def _start_slurm(state: dict, hosts: List[str]) -> None:
    """munged on the machine, slurmctld on the first host, a slurmd on each (slurm_cluster.py)."""
    conf = slurm_cluster.write_config(STATE_DIR, state["nodes"], os.cpu_count() or 1)
    state["slurm"] = {"conf": conf, "pids": []}
    try:
        was_running = subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0
        munged = slurm_cluster.start_munged()
        state["slurm"]["munged"] = None if was_running else munged
        _save_state(state)
        logs = slurm_cluster.config_dir(STATE_DIR)
        for host, argv in [(hosts[0], ["slurmctld", "-D"])] + [(h, ["slurmd", "-D", "-N", h]) for h in hosts]:
            with open(os.path.join(logs, f"{argv[0]}-{host}.out"), "w") as out:
                proc = subprocess.Popen(host_command(host, argv), stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)
            state["slurm"]["pids"].append(proc.pid)
            _save_state(state)
            if argv[0] == "slurmctld":
                time.sleep(2)  # its port open before the slurmds register
        state["slurm"]["sinfo"] = slurm_cluster.wait_idle(
            lambda argv, **kw: run_on(hosts[0], argv, **kw), hosts)
        _save_state(state)
    except slurm_cluster.SlurmError as exc:
        raise ClusterError(f"{exc} (logs: {slurm_cluster.config_dir(STATE_DIR)})") from None


def _namespaces() -> List[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def _veths() -> List[str]:
    out = _ip("-o", "link", "show", check=False).stdout
    return [name for line in out.splitlines() if (name := line.split(":")[1].strip().split("@")[0]).startswith(("cpcv", "cpcw"))]


def down() -> List[str]:
    """Stop every process in the hosts, remove them, the bridge, their /etc/netns files and the
    state; whatever exists of them (no state needed). What was removed."""
    removed = []
    names = _namespaces()
    munged = ((load_state() or {}).get("slurm") or {}).get("munged")
    if munged:  # started by `up --slurm`, outside the hosts
        try:
            os.kill(munged, signal.SIGTERM)
            removed.append(f"munged (pid {munged})")
        except ProcessLookupError:
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for ns in names for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if pids and sig == signal.SIGTERM:
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and any(_running(p) for p in pids):
                time.sleep(0.05)
        if pids:
            removed.append(f"{len(pids)} process(es) ({sig.name})")
    wires = _wires()  # outside the hosts: their TAP devices go with them
    for pid in wires:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_running(p) for p in wires):
        time.sleep(0.05)
    if wires:
        removed.append(f"{len(wires)} wire(s)")
    for ns in names:
        _ip("netns", "del", ns, check=False)
        removed.append(ns)
    # every host's /etc/netns files, its namespace there or not (a test, or a person, may have
    # deleted a namespace behind `up`'s back: its files stayed on the machine)
    for ns in sorted(n for n in _listdir(NETNS_ETC) if n.startswith(PREFIX)):
        shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)
        if ns not in names:
            removed.append(f"{ns}'s files in {NETNS_ETC}")
    # a namespace goes away in the kernel's own time, and its veth's other end with it: delete
    # those ends by name and wait, so that an `up` right after finds no name taken
    deadline = time.monotonic() + 10
    while (veths := _veths()) and time.monotonic() < deadline:
        for veth in veths:
            _ip("link", "del", veth, check=False)
        time.sleep(0.05)
    if _ip("link", "show", BRIDGE, check=False).returncode == 0:
        _ip("link", "del", BRIDGE, check=False)
        removed.append(BRIDGE)
    for name in [_state_path()] + [os.path.join(STATE_DIR, n) for n in _listdir(STATE_DIR) if n.startswith("wire-")]:
        try:
            os.remove(name)
        except OSError:
            pass
    shutil.rmtree(slurm_cluster.config_dir(STATE_DIR), ignore_errors=True)
    return removed


def run_on(host: str, command: List[str], env: Optional[dict] = None, **kwargs) -> subprocess.CompletedProcess:
    """Run a command on a host (in its namespace), as subprocess.run does."""
    if namespace(host) not in _namespaces():
        raise ClusterError(f"no host {host!r}: `python -m collectives.cluster status` lists them")
    return subprocess.run(host_command(host, command), env=env, **kwargs)


def processes(host: str) -> Dict[int, List[str]]:
    """pid -> argv of every process running in `host` now (`ip netns pids`, /proc/PID/cmdline)."""
    found = {}
    for pid in map(int, _ip("netns", "pids", namespace(host), check=False).stdout.split()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found[pid] = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:  # ended meanwhile
            pass
    return found


def host_command(host: str, command: List[str]) -> List[str]:
    """The argv that runs `command` on a host: in its network namespace, and in a UTS namespace of
    its own whose hostname is the host's name (torchrun publishes its hostname as the master
    address; Gloo binds to the address its hostname resolves to)."""
    conf = ((load_state() or {}).get("slurm") or {}).get("conf")
    env = ["env", f"SLURM_CONF={conf}"] if conf else []  # the cluster's SLURM, for sbatch, srun, sinfo
    return ["ip", "netns", "exec", namespace(host), *env, "unshare", "--uts", "--", "sh", "-c",
            'hostname "$0" && exec "$@"', host, *command]


def status() -> str:
    state, names = load_state(), _namespaces()
    if not state and not names:
        return "no cluster (python -m collectives.cluster up --nodes 2)"
    lines = []
    link = (state or {}).get("link", {})
    shaped = ", ".join(f"{k} {v}" for k, v in link.items() if v) or "not shaped"
    impaired = (state or {}).get("impaired")
    if impaired:
        shaped += f" (delay and loss on {', '.join(impaired)})"
    lines.append(f"{len(names)} host(s) on bridge {BRIDGE}, links {shaped}")
    for node in (state or {}).get("nodes", []):
        there = "up" if node["namespace"] in names else "MISSING"
        lines.append(f"  {node['name']}  {node['address']}  namespace {node['namespace']}  {there}")
        if node.get("wire"):
            lines.append("    " + wire.describe(node["wire"], node["wire"]["pid"] in _wires()))
    stray = sorted(set(names) - {n["namespace"] for n in (state or {}).get("nodes", [])})
    if stray:
        lines.append(f"  not in the state file: {', '.join(stray)} (`down` removes them)")
    return "\n".join(lines)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m collectives.cluster", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("up", help="make N hosts on a bridge")
    p.add_argument("--nodes", type=int, default=2, help="how many hosts (default 2)")
    p.add_argument("--link", default=None, help="each host's egress rate, tc's units: 1gbit, 100mbit")
    p.add_argument("--delay", default=None, help="added to an impaired host's egress, e.g. 100ms (netem's "
                   "delay, by a user-space wire: collectives/cluster/wire.py)")
    p.add_argument("--loss", default=None, help="share of an impaired host's egress frames dropped, e.g. 1%%")
    p.add_argument("--impair", default=None, help="the hosts --delay and --loss apply to, e.g. node1 or "
                   "node0,node1 (default: every host)")
    p.add_argument("--slurm", action="store_true", help="also a SLURM cluster on the hosts (slurm-wlm and munge)")
    p.add_argument("--force", action="store_true", help="replace a cluster that is up even while commands run "
                   "on its hosts (they are killed; without it `up` refuses)")
    p = sub.add_parser("run", help="run a command on a host: run node1 -- CMD ...")
    p.add_argument("host")
    p.add_argument("cmd", nargs="+", help="the command (after --)")
    sub.add_parser("status", help="the hosts, their addresses and links")
    sub.add_parser("down", help="remove everything `up` made (idempotent)")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            impair = [h for h in args.impair.split(",") if h] if args.impair is not None else None
            state = up(args.nodes, args.link, args.delay, args.loss, slurm=args.slurm, impair=impair,
                       force=args.force)
            print(status())
            print(f"run a command on a host: python -m collectives.cluster run {state['nodes'][0]['name']} -- CMD")
        elif args.command == "run":
            return run_on(args.host, args.cmd).returncode
        elif args.command == "status":
            print(status())
        else:
            removed = down()
            print("removed: " + ", ".join(removed) if removed else "nothing to remove")
    except ClusterError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        half = " before the cluster was made: `python -m collectives.cluster down` removes what was" \
            if args.command == "up" else ""
        print(f"\n{parser.prog} {args.command}: interrupted (Ctrl-C){half}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
