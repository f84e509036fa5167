"""The user-space wire (collectives/cluster/wire.py) on a pair of socketpairs standing in for its TAP
devices: what the host sends waits the delay, in order, and a share `loss` of it is dropped; what
comes to the host passes at once. No root needed.

    pytest tests/collectives/test_wire.py -q
"""

import random
import socket
import threading
import time

import pytest

from collectives.cluster import wire


class Ends:
    """carry() running between two socketpairs: `host` is what the host writes and reads, `bridge`
    what the bridge does; every frame out of the wire is kept with the time it came out."""

    def __init__(self, delay, loss, seed=0):
        self.host, host_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.bridge, bridge_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._keep = (host_end, bridge_end)
        for end in self._keep:
            end.setblocking(False)
        self.stop = threading.Event()
        self.stats = {}
        self.at_bridge, self.at_host = [], []
        self._threads = [
            threading.Thread(target=wire.carry, args=(host_end.fileno(), bridge_end.fileno(), delay, loss,
                                                       self.stop.is_set, random.Random(seed), self.stats)),
            threading.Thread(target=self._drain, args=(self.bridge, self.at_bridge)),
            threading.Thread(target=self._drain, args=(self.host, self.at_host))]
        for t in self._threads:
            t.start()

    def _drain(self, sock, into):
        sock.settimeout(0.05)
        while not self.stop.is_set():
            try:
                frame = sock.recv(65536)
                into.append((time.monotonic(), frame))
            except socket.timeout:
                pass

    def close(self, settle=0.0, until=None):
        """Stop after `settle` s, or once `until()` holds (at most 30 s: a loaded machine moves
        frames through these threads late, and a fixed wait would stop them half-way)."""
        if until is None:
            time.sleep(settle)
        else:
            deadline = time.monotonic() + 30
            while not until() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.1)  # anything more that would come (a copy, a frame too many) comes now
        self.stop.set()
        for t in self._threads:
            t.join(5)
        for s in (self.host, self.bridge, *self._keep):
            s.close()


@pytest.fixture
def ends():
    made = []
    yield lambda *a, **k: made.append(Ends(*a, **k)) or made[-1]
    for e in made:
        if not e.stop.is_set():
            e.close()


def test_what_the_host_sends_waits_the_delay_in_order_and_what_comes_to_it_does_not(ends):
    e = ends(0.3, 0.0)
    sent = []
    for i in range(5):
        sent.append(time.monotonic())
        e.host.send(b"frame %d" % i)
    time.sleep(0.05)
    back = time.monotonic()
    e.bridge.send(b"to the host")  # while the host's frames still wait
    e.close(until=lambda: len(e.at_bridge) >= 5 and e.at_host)
    assert [f for _, f in e.at_bridge] == [b"frame %d" % i for i in range(5)]
    for (arrived, _), left in zip(e.at_bridge, sent):
        # at least the delay; at most 0.25 s more, which a loaded machine's scheduling stays within
        # and the delay applied twice (0.6 s) does not
        assert 0.3 <= arrived - left < 0.55, arrived - left
    assert [f for _, f in e.at_host] == [b"to the host"]
    # not held: it comes out before the host's earlier frames, and sooner than the 0.3 s delay
    assert e.at_host[0][0] - back < 0.25 and e.at_host[0][0] < e.at_bridge[0][0]
    assert e.stats["from_host"] == e.stats["to_bridge"] == 5 and e.stats["dropped"] == 0


@pytest.mark.parametrize("loss", [0.0, 0.25, 1.0])
def test_a_share_loss_of_the_hosts_frames_is_dropped(ends, loss):
    e = ends(0.0, loss, seed=7)
    n = 3000

    def carried(k):  # the first k frames each way are through (or dropped)
        return len(e.at_bridge) + e.stats.get("dropped", 0) >= k and len(e.at_host) >= k

    for i in range(n):
        e.host.send(i.to_bytes(4, "little"))
        e.bridge.send(b"back")  # never dropped
        if i % 50 == 49:  # at most 50 frames in flight: a loaded machine drains these sockets late,
            deadline = time.monotonic() + 30  # and a full socket loses frames as a full device would
            while not carried(i + 1) and time.monotonic() < deadline:
                time.sleep(0.002)
    e.close(until=lambda: carried(n))
    arrived = [int.from_bytes(f, "little") for _, f in e.at_bridge]
    assert arrived == sorted(arrived) and len(set(arrived)) == len(arrived)  # no reordering, no copies
    assert len(arrived) + e.stats["dropped"] == n and e.stats["write_failed"] == 0
    mean, sd = n * (1 - loss), (n * loss * (1 - loss)) ** 0.5
    assert abs(len(arrived) - mean) <= 5 * sd, (len(arrived), mean, sd)  # exact at 0 and 1
    assert len(e.at_host) == n


def test_a_queue_longer_than_the_limit_drops_the_newest(ends, monkeypatch):
    monkeypatch.setattr(wire, "LIMIT", 10)
    e = ends(0.5, 0.0)
    for i in range(30):
        e.host.send(bytes([i]))
    e.close(until=lambda: len(e.at_bridge) >= 10)
    assert [f for _, f in e.at_bridge] == [bytes([i]) for i in range(10)]
    assert e.stats["overflow"] == 20


def test_delays_and_losses_are_read_as_tc_writes_them():
    assert wire.parse_delay("100ms") == pytest.approx(0.1) and wire.parse_delay("1s") == 1.0
    assert wire.parse_delay("250us") == pytest.approx(250e-6) and wire.parse_delay("1500") == pytest.approx(1.5e-3)
    assert wire.parse_loss("1%") == pytest.approx(0.01) and wire.parse_loss("0.5") == pytest.approx(0.005)
    with pytest.raises(ValueError, match=r"delay '100 parsecs' is not one: a number and a unit"):
        wire.parse_delay("100 parsecs")
    with pytest.raises(ValueError, match=r"loss '150%' is not one: a percentage from 0 to 100"):
        wire.parse_loss("150%")
