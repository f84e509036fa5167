"""send, recv and recv from any source on an shm group, on the native path (native_p2p.h) and the
Python path (point_to_point.py), and on a group whose ranks take different paths: both follow one
mailbox protocol, so every variant must deliver the same bytes, and a receive into a tensor of
another size must fail the same way on each, leaving the pair in step.

Hypothesis draws the messages (how many, their sizes from 0 bytes to a dozen mailbox halves of a
1 KiB mailbox, the dtype), whether each rank posts its receive before its send, whether each
message is waited for before the next is posted or all are posted first, which message a rank
receives into a tensor one element too long, and which one from any source. A rank that dies
while another waits for its message is named, on either path.

    pytest tests/shm/test_messages.py -q
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st

import collectives as C
from collectives.errors import CollectiveMismatchError
from collectives.launcher.pool import RankPool
from collectives.shm import backend_of, new_group_with
from collectives.testing import kept_groups, run_on_ranks

from . import PATHS

MAILBOX = {"COLLECTIVES_SHM_MAILBOX_KB": "1"}  # 512-byte pieces: a message of a few KiB goes in many


def _made(rank: int) -> dict:
    """This rank's native, Python and mixed groups, made once per pool for this module, in the same order on every rank."""
    def make():
        made = {}
        for variant in ("native", "python", "mixed"):
            path = variant if variant != "mixed" else ("native" if rank % 2 == 0 else "python")
            made[variant] = new_group_with({**MAILBOX, "COLLECTIVES_SHM_PATH": path})
            assert backend_of(made[variant]).path == path
        return made

    return kept_groups("native, python, mixed", make)


def _message(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    values = torch.arange(numel, dtype=torch.int64) * 7 + 1000 * rank + seed
    return (values % 2).bool() if dtype == torch.bool else values.to(dtype)


def _together(group, sizes, dtype, r, n, recv_first, mismatch_at):
    """Every message posted before any is waited for (some move in the caller at once, the rest
    queue behind them for the message thread, which must keep each pair's order); per message:
    True for the right bytes, or the error's type and text."""
    nxt, prv = (r + 1) % n, (r - 1) % n
    posted = []
    for i, numel in enumerate(sizes):
        into = torch.full((numel + (i == mismatch_at),), 3, dtype=dtype)
        posts = [lambda: dist.irecv(into, prv, group=group),
                 lambda: dist.isend(_message(i, r, numel, dtype), nxt, group=group)]
        posted.append((into, numel, [post() for post in (posts if recv_first else posts[::-1])]))
    outcomes = []
    for i, (into, numel, works) in enumerate(posted):
        try:
            for work in works:
                work.wait()
            outcomes.append(torch.equal(into, _message(i, prv, numel, dtype)))
        except Exception as exc:  # noqa: BLE001
            outcomes.append((type(exc).__name__, str(exc)))
    return outcomes


def _exchange(env, case):
    """Each message i: every rank sends to the next rank and receives from the one before (in the
    order the case says), each waited for before the next, or all posted first (`together`); per
    variant, per message: True for the right bytes, or the error's type and text. Then an
    all_reduce on the group, which must still work."""
    sizes, dtype_name, recv_first, mismatch_at, any_at, together = case
    n, r, dtype = env.world_size, env.rank, getattr(torch, dtype_name)
    nxt, prv = (r + 1) % n, (r - 1) % n
    said = {}
    for variant, group in _made(r).items():
        if together:
            said[variant] = _together(group, sizes, dtype, r, n, recv_first, mismatch_at)
            t = torch.ones(1)
            dist.all_reduce(t, group=group)
            said[variant].append(t.item() == n)
            continue
        outcomes = []
        for i, numel in enumerate(sizes):
            into = torch.full((numel + (i == mismatch_at),), 3, dtype=dtype)
            mine = _message(i, r, numel, dtype)
            try:
                if i == any_at:  # the send posted first, then a blocking receive from whoever sends
                    sent = dist.isend(mine, nxt, group=group)
                    src = dist.recv(into, group=group)
                    sent.wait()
                    ok = src == prv
                else:
                    posts = [lambda: dist.irecv(into, prv, group=group), lambda: dist.isend(mine, nxt, group=group)]
                    works = [post() for post in (posts if recv_first else posts[::-1])]
                    for work in works:
                        work.wait()
                    ok = True
                outcomes.append(ok and torch.equal(into, _message(i, prv, numel, dtype)))
            except Exception as exc:  # noqa: BLE001
                outcomes.append((type(exc).__name__, str(exc)))
        t = torch.ones(1)
        dist.all_reduce(t, group=group)
        outcomes.append(t.item() == n)
        said[variant] = outcomes
    return said


@st.composite
def exchanges(draw):
    sizes = draw(st.lists(st.integers(0, 1600), min_size=1, max_size=4))
    dtype = draw(st.sampled_from(["float32", "int64", "bfloat16", "bool"]))
    at = st.one_of(st.none(), st.integers(0, len(sizes) - 1))
    together = draw(st.booleans())
    # posted together, a receive from any source would race the receives from its rank for a message
    return sizes, dtype, draw(st.booleans()), draw(at), None if together else draw(at), together


@pytest.mark.parametrize("world_size", [2, 3])
@settings(max_examples=12, deadline=None)
@given(case=exchanges())
@example(case=([0, 1, 1600], "float32", False, None, None, False))   # 0 bytes, 1 element, 13 pieces
@example(case=([1500, 40], "int64", True, 0, 1, False))             # a long message received one element too long
@example(case=([300, 300, 2], "bool", False, 2, 0, False))           # from any source, then a short mismatch
@example(case=([1, 1500, 2, 0], "float32", False, 2, None, True))   # all posted: small ones behind a long one
@example(case=([2, 3, 4], "bfloat16", True, None, None, True))      # all posted, each small enough to move at once
def test_every_path_delivers_the_same_bytes_and_names_a_size_mismatch(world_size, case):
    sizes, dtype_name, _, mismatch_at, _, _ = case
    item = torch.empty(0, dtype=getattr(torch, dtype_name)).element_size()
    for rank, said in enumerate(run_on_ranks(_exchange, world_size, args=(case,), backend="gloo")):
        n = world_size
        for variant, outcomes in said.items():
            assert outcomes[-1] is True, (rank, variant, "the group did not work after", outcomes)
            for i, got in enumerate(outcomes[:-1]):
                if i != mismatch_at:
                    assert got is True, (rank, variant, i, got)
                    continue
                prv = (rank - 1) % n
                want = (f"recv on rank {rank} of the shm group: rank {prv} sent {sizes[i] * item} bytes, and this "
                        f"rank's tensor holds {(sizes[i] + 1) * item} bytes; nothing was written into it (the message "
                        f"was taken out, so the next one arrives in order)")
                assert got == (CollectiveMismatchError.__name__, want), (rank, variant, i, got)


def _recv_from_a_rank_that_dies(env):
    group = new_group_with({})
    if env.rank == 1:
        time.sleep(0.5)
        os._exit(3)
    dist.recv(torch.empty(4), 1, group=group)  # rank 1 never sends


@pytest.mark.parametrize("path", PATHS)
def test_a_receive_from_a_rank_that_died_names_it(path, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_SHM_PATH", path)
    pool = RankPool(2, backend="gloo").start()
    start = time.monotonic()
    with pytest.raises(C.RankFailure) as info:
        pool.submit(_recv_from_a_rank_that_dies, timeout=600)
    assert time.monotonic() - start < 300  # not the 600 s timeout
    message = str(info.value)
    assert "PeerFailure: a point-to-point message on rank 0: rank 1 (pid " in message, message
    assert "died while this rank waited for it" in message, message


def _recv_that_nobody_sends(env, path):
    from datetime import timedelta

    dist.barrier()  # the ranks come to the group's making together: its 1 s is the setup's, not a slow start's
    group = new_group_with({"COLLECTIVES_SHM_PATH": path}, timeout=timedelta(seconds=1))
    if env.rank == 1:
        return None  # alive, and never sends
    start = time.monotonic()
    try:
        dist.recv(torch.empty(4), 1, group=group)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "received"


@pytest.mark.parametrize("path", PATHS)
def test_a_receive_past_the_groups_timeout_says_the_peer_did_not_complete_it(path):
    """Either path gives up on a message after the group's timeout, in the same words: the
    message's peer did not complete it (not a step: messages have none)."""
    kind, text, waited = run_on_ranks(_recv_that_nobody_sends, 2, args=(path,), backend="gloo")[0]
    assert kind == "PeerFailure", (kind, text)
    assert text == ("a point-to-point message on rank 0: rank 1 did not complete it within the 1 s timeout "
                    "(is it in another collective, or stuck?)"), text
    assert 1 <= waited < 30, waited


def _neg_views_among_plain_messages(env):
    """Rank 0 posts sends of negative-bit views (torch._neg_view, what `.imag` of a conjugate gives
    when contiguous) between plain ones to rank 1, all before waiting; rank 1 receives them in
    order. The backend's own plain-tensor check would send a negative-bit tensor to the Python
    thread, a second mover for the same pair beside the native one, with no order between them:
    torch's dispatcher resolves the bit before the backend sees it, which this pins down by
    counting the Python path's sends."""
    from collectives.shm import process_group as pg

    group, calls, original = _made(env.rank)["native"], [], pg.ShmBackend.send
    pg.ShmBackend.send = lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
    try:
        sizes = [3, 1500, 1, 700, 2]  # 1500 float64: 24 mailbox pieces, the others move at once
        want = [torch.arange(n, dtype=torch.float64) + 100 * i for i, n in enumerate(sizes)]
        if env.rank == 0:
            works = [dist.isend(torch._neg_view(w) if i % 2 == 0 else w, 1, group=group) for i, w in enumerate(want)]
            got = None
        else:
            got = [torch.empty(n, dtype=torch.float64) for n in sizes]
            works = [dist.irecv(g, 0, group=group) for g in got]
        for work in works:
            work.wait()
        return len(calls), got and [torch.equal(g, -w if i % 2 == 0 else w) for i, (g, w) in enumerate(zip(got, want))]
    finally:
        pg.ShmBackend.send = original


def test_negative_bit_views_among_plain_messages_stay_on_the_native_path_in_order():
    (sent_by_python, _), (_, right) = run_on_ranks(_neg_views_among_plain_messages, 2, backend="gloo")
    assert sent_by_python == 0
    assert right == [True] * 5
