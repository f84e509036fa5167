"""Subgroups: new_group, a split into disjoint groups, and a grid of row and column groups.

Every rank must create every group (torch.distributed requires it), even the groups it is not
in; these helpers do that and hand each rank the group(s) it belongs to.

    rows = collectives.split([[0, 1], [2, 3]])     # rank 2 gets the group {2, 3}
    grid = collectives.RankGrid(2, 2)              # on 4 ranks: grid.row, grid.col
    collectives.all_reduce(t, group=grid.row)      # sum over this rank's row

Words: a grid "row" is the set of ranks that share a row index (rank // cols); a "column"
shares rank % cols. A tensor's "dim" is never called an axis here.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Union

import torch.distributed as dist

from .checks import NotInGroup
from .errors import CollectiveError

Group = Union[dist.ProcessGroup, NotInGroup]


def new_group(ranks: Sequence[int], backend: Optional[str] = None) -> Group:
    """torch.distributed.new_group with its ranks checked first. Call it on every rank.

    Returns the group; on ranks not in it, a NotInGroup placeholder that knows the group's ranks
    (torch gives back one number, the same for every group) and that the wrappers refuse by name.
    """
    ranks = list(ranks)
    world = dist.get_world_size()
    bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < world]
    if bad:
        raise CollectiveError(f"new_group: ranks {bad} are out of range for world_size {world}")
    if len(set(ranks)) != len(ranks):
        raise CollectiveError(f"new_group: ranks {ranks} name a rank twice")
    group = dist.new_group(ranks=sorted(ranks), backend=backend)
    return group if dist.get_rank() in ranks else NotInGroup(tuple(sorted(ranks)), f"new_group({sorted(ranks)})")


def split(partition: Sequence[Sequence[int]], backend: Optional[str] = None) -> Group:
    """Create one group per part of a partition of the ranks; return this rank's group.

    Args:
        partition: disjoint lists of global ranks, e.g. [[0, 1], [2, 3]]. A rank left out gets a
            NotInGroup (falsy, refused by every collective by name), never None, which would
            mean the world.
    """
    seen: List[int] = []
    for part in partition:
        seen += list(part)
    if len(set(seen)) != len(seen):
        raise CollectiveError(f"split: the parts {list(map(list, partition))} are not disjoint")
    mine: Group = NotInGroup((), f"split({[list(part) for part in partition]})")
    me = dist.get_rank()
    for part in partition:  # same order on every rank: group creation is collective
        group = new_group(part, backend=backend)
        if me in part:
            mine = group
    return mine


@dataclasses.dataclass
class RankGrid:
    """A rows x cols grid of the world's ranks, rank = row * cols + col.

    Attributes:
        row: this rank's row group (ranks with the same row index).
        col: this rank's column group (ranks with the same column index).
        row_index, col_index: this rank's coordinates.
    """

    rows: int
    cols: int

    def __post_init__(self):
        world = dist.get_world_size()
        if self.rows * self.cols != world:
            raise CollectiveError(f"RankGrid: {self.rows} x {self.cols} = {self.rows * self.cols} != world_size {world}")
        self.row_index, self.col_index = divmod(dist.get_rank(), self.cols)
        self.row = split([[r * self.cols + c for c in range(self.cols)] for r in range(self.rows)])
        self.col = split([[r * self.cols + c for r in range(self.rows)] for c in range(self.cols)])


def _ranks(group: Group) -> List[int]:
    return list(group.ranks) if isinstance(group, NotInGroup) else dist.get_process_group_ranks(group)


def group_rank(group: Group, global_rank: Optional[int] = None) -> int:
    """The index of `global_rank` (default: this rank) within `group`; -1 if not in it."""
    ranks = _ranks(group)
    global_rank = dist.get_rank() if global_rank is None else global_rank
    return ranks.index(global_rank) if global_rank in ranks else -1


def global_rank(group: Group, group_rank: int) -> int:
    """The global rank of the rank at index `group_rank` within `group`."""
    ranks = _ranks(group)
    if not 0 <= group_rank < len(ranks):
        raise CollectiveError(f"global_rank: group rank {group_rank} is out of range for a group of {len(ranks)}")
    return ranks[group_rank]
