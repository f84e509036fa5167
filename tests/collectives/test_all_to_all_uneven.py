"""all_to_all's uneven form (input_split_sizes, output_split_sizes), the exchange expert
parallelism runs on: random splits over 3 ranks (zero rows to some ranks, zero rows in all,
several trailing shapes and dtypes) give the closed form on Gloo and shm, in plain and checked
mode; splits that disagree between ranks, or that do not add up, are refused on every rank by
name, before any row moves, and the group works afterwards.

    pytest tests/collectives/test_all_to_all_uneven.py -q
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import collectives as C
from collectives.errors import CollectiveError, CollectiveMismatchError
from collectives.testing import distributed, kept_groups

N = 3


def _rows(src: int, dst: int, count: int, tail, dtype) -> torch.Tensor:
    """The rows rank src sends rank dst: each element names both."""
    return torch.full((count,) + tuple(tail), 10 * src + dst + 1).to(dtype)


@pytest.mark.parametrize("backend", ["gloo", "shm"])
@settings(max_examples=15, deadline=None)
@given(splits=st.lists(st.lists(st.integers(0, 4), min_size=N, max_size=N), min_size=N, max_size=N),
       tail=st.sampled_from([(), (2,), (2, 3)]), dtype=st.sampled_from([torch.float32, torch.int64, torch.bfloat16]),
       give_output=st.booleans(), checked=st.booleans())
@distributed(world_size=N)
def test_uneven_rows_arrive_in_rank_order(env, backend, splits, tail, dtype, give_output, checked):
    """splits[i][j]: the rows rank i sends rank j; rank r receives splits[0][r], splits[1][r], ..."""
    group = None
    if backend == "shm":  # the native path: it takes uneven splits itself (no call leaves it)
        from collectives.shm import backend_of, new_group_with
        group = kept_groups("native", lambda: new_group_with({"COLLECTIVES_SHM_PATH": "native"}))
    r = env.rank
    sends = splits[r]
    t = torch.cat([_rows(r, j, sends[j], tail, dtype) for j in range(N)])
    expects = [splits[i][r] for i in range(N)] if give_output else None
    with C.checked(checked):
        out = C.all_to_all(t, group=group, input_split_sizes=sends, output_split_sizes=expects)
    want = torch.cat([_rows(i, r, splits[i][r], tail, dtype) for i in range(N)])
    assert out.dtype == dtype and torch.equal(out, want), (splits, tail, dtype)
    if backend == "shm":
        assert backend_of(group).fallbacks() == {}


@distributed(world_size=N)
def test_splits_that_disagree_are_refused_on_every_rank_by_name(env):
    r = env.rank
    t = torch.ones(r + 1, 2)
    sends = [0] * N
    sends[(r + 1) % N] = r + 1  # each rank sends all its rows to the next
    expects = [0] * N
    expects[(r - 1) % N] = (r - 1) % N + 2  # ... which expects one row more than it is sent
    with pytest.raises(CollectiveMismatchError, match=r"rank 0 sends 1 row\(s\) to rank 1, which expects 2"):
        C.all_to_all(t, input_split_sizes=sends, output_split_sizes=expects)
    with pytest.raises(CollectiveError, match=r"rank\(s\) \[1\] failed a local check[\s\S]*add up to 9 rows, but the "
                                              r"tensor has 2"):
        C.all_to_all(t, input_split_sizes=[3, 3, 3] if r == 1 else sends)
    with pytest.raises(CollectiveMismatchError, match="same dtype and trailing dimensions"):
        C.all_to_all(torch.ones(r + 1, 2 + (r == 2)), input_split_sizes=sends)
    with pytest.raises(CollectiveError, match="has 2 entries for a group of 3 ranks"):
        C.all_to_all(t, input_split_sizes=[r + 1, 0])
    with pytest.raises(CollectiveError, match="output_split_sizes without input_split_sizes"):
        C.all_to_all(t, output_split_sizes=[1, 1, 1])
    out = C.all_to_all(t, input_split_sizes=sends)  # the group still works
    assert torch.equal(out, torch.ones((r - 1) % N + 1, 2))
