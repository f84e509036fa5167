"""A link with delay and loss in user space: what tc netem does, for kernels built without it.

    python -m collectives.cluster up --nodes 2 --delay 100ms --loss 1% --impair node1   # starts one

The cluster command starts one wire per impaired host. The wire opens two TAP devices, prints
"ready", and from then on carries every Ethernet frame between them; `up` moves one end into the
host's namespace as its eth0 and puts the other end (`cpcvK`, the name a plain host's veth has) on
the bridge. Frames the host sends wait `delay` and are dropped with probability `loss`, as netem
on the host's eth0 does to its egress; frames to the host pass as they come. The frames are
real: TCP sees the delay in its round trips and retransmits what is lost, Gloo sees both. A queue
longer than LIMIT frames drops the newest (netem's `limit`, 1000 there, more here). Killing the
wire removes both devices: the host's link is gone. Every second the wire writes what it carried
and dropped to --stats (JSON), which `cluster status` shows.

It is Python, so it carries what one core copies through it (measured in docs/multi-node.md), far
below a veth; with a link rate as well, tc tbf on the host's eth0 shapes what enters the wire.

The cluster's side is here too: `start()` launches a wire and waits for "ready", `find()` finds
running wires by command line (also after a lost state), `describe()` is `status`'s line. It
imports nothing but the standard library (it starts as `python -I -S .../wire.py`, in 0.1 s
rather than torch's 2). Run by hand (as root), e.g. to look at it:

    python collectives/cluster/wire.py --host-end cpcw1 --bridge-end cpcv1 --delay 100ms --loss 1%
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import re
import select
import signal
import struct
import subprocess
import sys
import time
from collections import deque
from typing import Callable, Dict, List, Optional


LIMIT = 20000  # frames waiting in the delay queue (netem's default is 1000)
TUNSETIFF, IFF_TAP, IFF_NO_PI = 0x400454CA, 0x0002, 0x1000
_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}


def parse_delay(text: str) -> float:
    """Seconds from tc's way of writing a time: 100ms, 1s, 250us (a bare number is microseconds,
    as tc reads it)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", text or "")
    if not m or (m.group(2) and m.group(2) not in _UNITS):
        raise ValueError(f"delay {text!r} is not one: a number and a unit, as tc writes them (100ms, 1s, 250us)")
    return float(m.group(1)) * _UNITS.get(m.group(2), 1e-6)


def parse_loss(text: str) -> float:
    """A probability from tc's way of writing a loss: 1%, 0.5% (a bare number is a percentage)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*%?\s*", text or "")
    if not m or float(m.group(1)) > 100:
        raise ValueError(f"loss {text!r} is not one: a percentage from 0 to 100 (1%, 0.5%)")
    return float(m.group(1)) / 100


def open_tap(name: str) -> int:
    """A new TAP device `name` in this process's network namespace; it lives while the fd is open."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    os.set_blocking(fd, False)
    return fd


def _frames(fd: int, at_most: int = 256):
    """The frames waiting on fd (one read each), at most `at_most`."""
    for _ in range(at_most):
        try:
            frame = os.read(fd, 65536)
        except (BlockingIOError, InterruptedError):
            return
        if not frame:
            return
        yield frame


def _put(fd: int, frame: bytes, stats: Dict[str, int]) -> None:
    try:
        os.write(fd, frame)
    except OSError:  # the device is down or full: the frame is lost, as on a wire
        stats["write_failed"] += 1


def carry(host_fd: int, bridge_fd: int, delay: float, loss: float, stop: Callable[[], bool],
          rng: Optional[random.Random] = None, stats: Optional[Dict[str, int]] = None,
          on_tick: Optional[Callable[[Dict[str, int]], None]] = None) -> Dict[str, int]:
    """Carry frames until stop(): host -> bridge delayed by `delay` seconds and dropped with
    probability `loss`, bridge -> host as they come. Any fds that keep frames apart (TAP devices,
    or a datagram socketpair in the tests). What was carried and dropped, counted in `stats`."""
    rng = rng or random.Random()
    stats = stats if stats is not None else {}
    for key in ("from_host", "dropped", "overflow", "to_bridge", "to_host", "write_failed"):
        stats.setdefault(key, 0)
    waiting: deque = deque()  # (due, frame): one delay for all, so first in is first due
    last_tick = time.monotonic()
    while not stop():
        now = time.monotonic()
        while waiting and waiting[0][0] <= now:
            _put(bridge_fd, waiting.popleft()[1], stats)
            stats["to_bridge"] += 1
        timeout = min(0.5, waiting[0][0] - now) if waiting else 0.5
        readable = select.select([host_fd, bridge_fd], [], [], max(0.0, timeout))[0]
        if bridge_fd in readable:
            for frame in _frames(bridge_fd):
                _put(host_fd, frame, stats)
                stats["to_host"] += 1
        if host_fd in readable:
            for frame in _frames(host_fd):
                stats["from_host"] += 1
                if loss and rng.random() < loss:
                    stats["dropped"] += 1
                elif len(waiting) >= LIMIT:
                    stats["overflow"] += 1
                else:
                    waiting.append((time.monotonic() + delay, frame))
        if on_tick and now - last_tick >= 1.0:
            on_tick(stats)
            last_tick = now
    return stats


def write_stats(path: str, stats: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(stats, f)
    os.replace(path + ".tmp", path)


class WireError(RuntimeError):
    """A wire that did not start, in one line."""


def start(host_end: str, bridge_end: str, delay: str, loss: str, stats: str, log: str, timeout: float = 30) -> dict:
    """Start a wire in a session of its own and wait until its two TAP devices exist; what to
    find it by later (pid, argv, stats and log files)."""
    argv = [sys.executable, "-I", "-S", os.path.abspath(__file__), "--host-end", host_end, "--bridge-end", bridge_end,
            "--delay", delay, "--loss", loss, "--stats", stats]
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    ready = select.select([proc.stdout], [], [], timeout)[0] and proc.stdout.readline().strip() == "ready"
    proc.stdout.close()
    if not ready:
        proc.kill()
        with open(log) as f:
            raise WireError(f"wire did not start: {f.read().strip() or f'no word in {timeout:g} s'}")
    return {"pid": proc.pid, "argv": argv[1:], "stats": stats, "log": log}


def find(bridge_prefix: str) -> List[int]:
    """pids of the wires whose bridge end's name starts with bridge_prefix (by command line)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            bridge = argv[argv.index(b"--bridge-end") + 1] if b"--bridge-end" in argv[:-1] else b""
            if any(a.endswith(b"collectives/cluster/wire.py") for a in argv) and bridge.startswith(bridge_prefix.encode()):
                pids.append(int(entry))
    return pids


def describe(started: dict, alive: bool) -> str:
    """One line on a wire that start() returned: alive or not, what it carried and dropped."""
    try:
        with open(started["stats"]) as f:
            st = json.load(f)
        counts = (f"{st['from_host']} frames sent, {st['dropped']} dropped ({st['dropped'] / max(1, st['from_host']):.1%}), "
                  f"{st['overflow']} over the queue, {st['to_host']} received")
    except (OSError, ValueError, KeyError):
        counts = "no counts yet"
    return f"wire pid {started['pid']} {'running' if alive else 'GONE (the link is down)'}: {counts}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m collectives.cluster.wire", description=__doc__.splitlines()[0])
    parser.add_argument("--host-end", required=True, help="TAP device to make for the host (moved in as eth0)")
    parser.add_argument("--bridge-end", required=True, help="TAP device to make for the bridge")
    parser.add_argument("--delay", default="0ms", help="added to every frame the host sends, e.g. 100ms")
    parser.add_argument("--loss", default="0%", help="share of the host's frames dropped, e.g. 1%%")
    parser.add_argument("--seed", type=int, default=None, help="seed of the losses (default: fresh)")
    parser.add_argument("--stats", default=None, help="JSON file to write the counts to every second")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        delay, loss = parse_delay(args.delay), parse_loss(args.loss)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        host_fd, bridge_fd = open_tap(args.host_end), open_tap(args.bridge_end)
    except OSError as exc:
        print(f"{parser.prog}: cannot make TAP devices {args.host_end}, {args.bridge_end}: {exc} "
              "(needs root and /dev/net/tun)", file=sys.stderr)
        return 1
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    print("ready", flush=True)
    sys.stdout = open(os.devnull, "w")  # whoever waited for "ready" may be gone
    stats = {"delay_s": delay, "loss": loss}
    tick = (lambda s: write_stats(args.stats, s)) if args.stats else None
    carry(host_fd, bridge_fd, delay, loss, lambda: bool(stopping), random.Random(args.seed), stats, tick)
    if tick:
        tick(stats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
