"""DistComm hands a step's receives to torch before its sends, whatever order the algorithm
wrote them in (comm.py's docstring: with the sends first, Gloo carried the two directions of an
exchange one after the other across hosts, half the rate). Checked on torch.distributed's own
isend/irecv replaced by recorders, so the order of the calls is what is asserted, in one process.

    python -m pytest tests/algorithms/test_post_order.py
"""

import pytest
import torch

import collectives.algorithms.comm as comm_module
from collectives.algorithms import ring
from collectives.algorithms.comm import DistComm, run_on_ranks


class _Done:
    def wait(self):
        pass


@pytest.fixture
def posts(monkeypatch):
    """The (call, peer) of every isend/irecv DistComm makes, in order."""
    calls = []
    monkeypatch.setattr(comm_module.dist, "isend", lambda t, peer, group=None: calls.append(("isend", peer)) or _Done())
    monkeypatch.setattr(comm_module.dist, "irecv", lambda t, peer, group=None: calls.append(("irecv", peer)) or _Done())
    return calls


def _comm(rank, size):
    comm = DistComm.__new__(DistComm)  # a group of `size` ranks without a process group
    comm.group, comm.ranks, comm.rank, comm.size = None, list(range(size)), rank, size
    comm.backend, comm.record, comm.messages, comm._unposted = "gloo", True, [], []
    return comm


def test_a_receive_written_after_a_send_is_posted_first(posts):
    comm = _comm(0, 2)
    sent = comm.send(torch.ones(4), 1)
    got = comm.recv(torch.empty(4), 1)
    assert posts == [("irecv", 1)]  # the receive at once, the send at the first wait
    sent.wait()
    got.wait()
    assert posts == [("irecv", 1), ("isend", 1)]
    assert [m.src for m in comm.messages] == [0, 1]  # both recorded once, as they completed


def test_waiting_on_a_receive_alone_still_sends(posts):
    """A pipelined algorithm waits on a receive while its send of the step before is pending:
    had only a send's wait posted sends, both ranks would wait forever."""
    comm = _comm(1, 2)
    comm.send(torch.ones(4), 0)
    comm.recv(torch.empty(4), 0).wait()
    assert posts == [("irecv", 0), ("isend", 0)]


def test_a_send_never_waited_for_goes_out_when_the_algorithm_returns(posts):
    def fire_and_forget(comm):
        comm.send(torch.ones(2), 1)
        return "done"
        yield

    assert run_on_ranks(fire_and_forget, _comm(0, 2)) == "done"
    assert posts == [("isend", 1)]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_every_step_of_the_ring_receives_before_it_sends(posts, size):
    run_on_ranks(ring.all_reduce, _comm(0, size), torch.arange(12.0), "sum")
    assert len(posts) == 4 * (size - 1)  # 2(p-1) steps, one send and one receive each
    for step in range(2 * (size - 1)):
        assert posts[2 * step:2 * step + 2] == [("irecv", size - 1), ("isend", 1)]
