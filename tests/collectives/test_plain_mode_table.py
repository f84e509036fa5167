"""docs/collectives.md, "What each mode catches when the ranks disagree": the plain-mode column
measured, not remembered. Each case calls torch.distributed directly on Gloo, 2 ranks, with the
ranks disagreeing, and checks that Gloo does what the table says: a silent wrong answer (which
one), an abort of a named rank (SIGABRT), or a hang until the timeout. If torch or Gloo changes
its behaviour, this fails and the table must be measured again.

    pytest tests/collectives/test_plain_mode_table.py -q

Rows that leave the ranks usable share one run; each abort or hang costs a fresh pool (~3 s).
"""

import pytest
import torch
import torch.distributed as dist

import collectives as C

HANG_TIMEOUT_S = 4.0


def _quiet_disagreements(env):
    """The rows where Gloo finishes with a wrong answer; returns what each rank got."""
    got = {}
    t = torch.tensor([env.rank + 1.0, 5.0])  # op: SUM on rank 0, MAX on rank 1
    dist.all_reduce(t, op=dist.ReduceOp.SUM if env.rank == 0 else dist.ReduceOp.MAX)
    got["op"] = t.tolist()
    t = torch.tensor([1.5, 2.5]) if env.rank == 0 else torch.tensor([1, 2], dtype=torch.int32)
    dist.all_reduce(t)  # float32 on rank 0, int32 (same byte size) on rank 1
    got["dtype"] = t.tolist()
    t = torch.arange(4.0) if env.rank == 0 else torch.full((6,), -1.0)
    dist.broadcast(t, src=0)  # src sends 4 elements, the other rank expects 6
    got["broadcast 4 into 6"] = t.tolist()
    t = torch.ones(2) if env.rank == 0 else torch.ones(2, dtype=torch.int32)
    out = [torch.empty_like(t) for _ in range(2)]
    dist.all_gather(out, t)  # all_gather, float32 on rank 0, int32 on rank 1
    got["all_gather dtype"] = [o.tolist() for o in out]
    return got


@pytest.mark.slow
def test_disagreements_gloo_finishes_with_a_wrong_answer():
    rank0, rank1 = C.run(_quiet_disagreements, world_size=2, backend="gloo", timeout=60)
    assert rank0["op"] == rank1["op"] == [3.0, 10.0]  # both got the SUM, nobody the MAX
    assert rank0["dtype"] == [1.5, 2.5]
    assert rank1["dtype"] == torch.tensor([1.5, 2.5]).view(torch.int32).tolist()  # float bits read as ints
    assert rank1["broadcast 4 into 6"] == [0.0, 1.0, 2.0, 3.0, -1.0, -1.0]  # 4 of 6 written, the rest untouched
    one_bits = torch.tensor(1.0).view(torch.int32).item()
    assert rank0["all_gather dtype"][1] == [torch.tensor(1, dtype=torch.int32).view(torch.float32).item()] * 2
    assert rank1["all_gather dtype"][0] == [one_bits] * 2


def _broadcast_6_into_4(env):
    t = torch.arange(6.0) if env.rank == 0 else torch.zeros(4)
    dist.broadcast(t, src=0)


def _all_gather_dtype_sizes(env):
    t = torch.ones(2, dtype=torch.float32 if env.rank == 0 else torch.float64)
    dist.all_gather([torch.empty_like(t) for _ in range(2)], t)


def _all_reduce_4_and_6(env):
    dist.all_reduce(torch.ones(4 if env.rank == 0 else 6))


def _all_gather_trailing_dims(env):
    t = torch.ones(2, 3 if env.rank == 0 else 4)
    dist.all_gather([torch.empty_like(t) for _ in range(2)], t)


def _different_collectives(env):
    t = torch.ones(4)
    dist.all_reduce(t) if env.rank == 0 else dist.broadcast(t, src=0)


def _different_src(env):
    dist.broadcast(torch.ones(4), src=env.rank)


def _different_dst(env):
    dist.reduce(torch.ones(4), dst=env.rank)


def _one_rank_fails_a_local_check(env):
    rows = 3 if env.rank == 1 else 2  # reduce_scatter of 3 rows on 2 ranks: refused on rank 1 only
    try:
        C.reduce_scatter(torch.ones(rows))
    except C.CollectiveError:
        return "refused"  # and rank 0 is left waiting in the collective


@pytest.mark.parametrize("fn, headline", [
    (_broadcast_6_into_4, "died from SIGABRT in broadcast"),
    (_all_reduce_4_and_6, "died from SIGABRT in all_reduce"),
    (_all_gather_trailing_dims, "died from SIGABRT in all_gather"),
    (_all_gather_dtype_sizes, "died from SIGABRT in all_gather"),
], ids=["broadcast 6 into 4", "all_reduce 4 vs 6", "all_gather trailing dims", "all_gather float32 vs float64"])
def test_disagreements_that_abort_a_rank(fn, headline):
    with pytest.raises(C.RankFailure) as info:
        C.run(fn, world_size=2, backend="gloo", timeout=60)
    assert headline in str(info.value).splitlines()[0], str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("fn, waiting_in", [
    (_different_collectives, "waiting in "),
    (_different_src, "waiting in broadcast"),
    (_different_dst, "waiting in reduce"),
    (_one_rank_fails_a_local_check, "waiting in reduce_scatter"),
], ids=["all_reduce vs broadcast", "src of broadcast", "dst of reduce", "one rank fails a local check"])
def test_disagreements_that_hang_until_the_timeout(fn, waiting_in):
    with pytest.raises(C.RankFailure) as info:
        C.run(fn, world_size=2, backend="gloo", timeout=HANG_TIMEOUT_S)
    message = str(info.value)
    assert f"within the {HANG_TIMEOUT_S:g} s timeout" in message and waiting_in in message, message
