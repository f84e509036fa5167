"""Subgroups: new_group, split, a 2x2 grid of ranks, rank translation, collectives on several subgroups at once.

    pytest tests/collectives/test_groups.py -q
"""

import pytest
import torch

import collectives as C
from collectives.errors import CollectiveError
from collectives.testing import distributed


@distributed(world_size=4)
def test_split_runs_collectives_on_disjoint_groups_at_once(env):
    r = env.rank
    pairs = C.split([[0, 1], [2, 3]])
    t = torch.tensor([r + 1.0])
    C.all_reduce(t, group=pairs)
    assert t.item() == (3.0 if r < 2 else 7.0)
    # interleaved pairs, and a gather inside each group, rooted at a global rank of that group
    evens_odds = C.split([[0, 2], [1, 3]])
    got = C.all_gather(torch.tensor([float(r)]), group=evens_odds)
    assert got.tolist() == ([0.0, 2.0] if r % 2 == 0 else [1.0, 3.0])
    root = 2 if r % 2 == 0 else 3
    t = torch.tensor([float(r)])
    C.broadcast(t, src=root, group=evens_odds)
    assert t.item() == root


@distributed(world_size=4)
def test_grid_rows_and_columns(env):
    grid = C.RankGrid(2, 2)
    r = env.rank
    assert (grid.row_index, grid.col_index) == divmod(r, 2)
    row_sum = C.all_reduce(torch.tensor([r + 1.0]), group=grid.row)
    col_sum = C.all_reduce(torch.tensor([r + 1.0]), group=grid.col)
    # row i holds ranks 2i, 2i+1; column j holds ranks j, j+2 (values are rank + 1)
    assert row_sum.item() == (2 * grid.row_index + 1) + (2 * grid.row_index + 2)
    assert col_sum.item() == (grid.col_index + 1) + (grid.col_index + 3)
    assert C.group_rank(grid.col) == grid.row_index
    assert C.global_rank(grid.row, 1) == 2 * grid.row_index + 1
    # reduce_scatter inside a row: each of the 2 ranks gets its half of the row's sum
    half = C.reduce_scatter(torch.arange(4.0) + r, group=grid.row)
    lo = 2 * C.group_rank(grid.row)
    assert half.tolist() == [2 * (lo + i) + (4 * grid.row_index + 1) for i in range(2)]


@distributed(world_size=4)
def test_odd_sized_group_and_left_out_rank(env):
    trio = C.split([[0, 1, 2]])
    if env.rank == 3:  # left out: a placeholder that is not None (None would mean the world)
        assert isinstance(trio, C.NotInGroup) and not trio
        with pytest.raises(C.CollectiveError, match=r"all_reduce: rank 3 called it on a group it is not in "
                                                    r"\(rank 3 was left out of split\(\[\[0, 1, 2\]\]\)"):
            C.all_reduce(torch.tensor([1.0]), group=trio)
    else:
        assert C.all_reduce(torch.tensor([1.0]), group=trio).item() == 3.0
        assert C.group_rank(trio) == env.rank
    assert C.all_reduce(torch.tensor([1.0])).item() == 4.0  # the world is still usable, rank 3 included
    assert C.group_rank(C.new_group([1, 3]), global_rank=2) == -1
    assert C.global_rank(C.new_group([2, 3]), 1) == 3  # on ranks 0 and 1 too: the placeholder knows the ranks


@distributed(world_size=2)
def test_group_errors(env):
    with pytest.raises(CollectiveError, match="not disjoint"):
        C.split([[0, 1], [1]])
    with pytest.raises(CollectiveError, match=r"ranks \[5\] are out of range for world_size 2"):
        C.new_group([0, 5])
    with pytest.raises(CollectiveError, match="2 x 2 = 4 != world_size 2"):
        C.RankGrid(2, 2)
    with pytest.raises(CollectiveError, match="group rank 2 is out of range"):
        C.global_rank(C.new_group([0, 1]), 2)


@distributed(world_size=4)
def test_rooted_collectives_in_a_subgroup_whose_ranks_are_shifted(env):
    """Group [1, 2, 3]: global rank r is group rank r - 1, so a root given as a global rank, or
    a chunk picked by global rank instead of group rank, shows up as a wrong value."""
    trio = C.split([[1, 2, 3]])
    if env.rank == 0:
        return
    r, g, members = env.rank, env.rank - 1, [1, 2, 3]
    for root in (2, 3):
        t = torch.tensor([10.0 * r, 1.0])
        C.broadcast(t, src=root, group=trio)
        assert t.tolist() == [10.0 * root, 1.0]
        t = torch.tensor([10.0 * r, 1.0])
        C.reduce(t, dst=root, group=trio)
        assert r != root or t.tolist() == [60.0, 3.0]
        got = C.gather(torch.full((r,), float(r)), dst=root, group=trio)  # uneven: rank r sends r rows
        assert got is None if r != root else got.tolist() == [1.0, 2.0, 2.0, 3.0, 3.0, 3.0]
        full = torch.arange(6.0) + 100 * root if r == root else None
        assert C.scatter(full, src=root, group=trio).tolist() == [100.0 * root + 2 * g, 100.0 * root + 2 * g + 1]
    assert C.all_gather(torch.tensor([float(r)]), group=trio).tolist() == [1.0, 2.0, 3.0]
    chunk = C.reduce_scatter(torch.arange(3.0) * r, group=trio)  # sum over members of i * r, for i = g
    assert chunk.tolist() == [g * sum(members)]
    sent = torch.tensor([10.0 * r + j for j in range(3)])  # chunk j goes to group rank j
    assert C.all_to_all(sent, group=trio).tolist() == [10.0 * m + g for m in members]


def test_a_renamed_public_name_still_works_with_a_warning_that_names_the_new_one():
    import warnings

    for old, new in C.RENAMED.items():
        with pytest.warns(FutureWarning, match=f"collectives.{old} is now collectives.{new}"):
            assert getattr(C, old) is getattr(C, new)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert C.RankGrid is not None  # the new name warns nothing
    with pytest.raises(AttributeError, match="module 'collectives' has no attribute 'Mesh3D'"):
        C.Mesh3D
    assert C.RENAMED["Mesh2D"] == "RankGrid"
