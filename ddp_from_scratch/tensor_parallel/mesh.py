"""A 2-D mesh of subgroups: the ranks laid out as data-parallel x tensor-parallel, with a TP group
and a DP group for every rank, from the project's checked subgroups.

    mesh = Mesh2D(tp=2)                      # every rank calls it; 4 ranks: TP groups [0, 1] and [2, 3],
    mlp = TensorParallelMLP(full, mesh.tp)   #                          DP groups [0, 2] and [1, 3]
    model = DistributedDataParallel(mlp, group=mesh.dp)   # the bucketed DDP all-reduces over the DP dimension

Rank = d x tp + t: the ranks of a TP group are neighbours (on a real machine, the GPUs that share
the fastest links: TP sends activations inside every layer), and a DP group holds the ranks with
the same shard of every layer (t), which all-reduce their gradients. Every rank makes every group,
in the same order, as torch.distributed requires.

A TP size that does not divide the number of ranks, or a rank outside the mesh, is refused,
naming the numbers.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch.distributed as dist

import collectives as C


class Mesh2D:
    """Every rank of the world makes it (torch.distributed requires every rank to make every
    group); a rank outside `ranks` gets no groups (tp and dp are None)."""

    def __init__(self, tp: int, ranks: Optional[Sequence[int]] = None, backend: Optional[str] = None):
        world = dist.get_world_size()
        ranks = list(range(world)) if ranks is None else list(ranks)
        outside = [r for r in ranks if not 0 <= r < world]
        if outside or len(set(ranks)) != len(ranks):
            raise ValueError(f"the mesh's ranks {ranks} must be distinct ranks of the world of {world} "
                             f"(0 to {world - 1}){f'; {outside} are not' if outside else ''}")
        if tp < 1 or len(ranks) % tp:
            raise ValueError(f"a mesh with tensor-parallel size {tp} does not fit {len(ranks)} ranks: the TP size "
                             f"must divide the number of ranks")
        self.ranks, self.tp_size, self.dp_size = ranks, tp, len(ranks) // tp
        self.tp_groups = [C.new_group(ranks[d * tp:(d + 1) * tp], backend=backend) for d in range(self.dp_size)]
        self.dp_groups = [C.new_group(ranks[t::tp], backend=backend) for t in range(tp)]
        me = dist.get_rank()
        self.tp = self.dp = None
        if me in ranks:
            self.dp_index, self.tp_index = self.coordinates(me)
            self.tp, self.dp = self.tp_groups[self.dp_index], self.dp_groups[self.tp_index]

    def coordinates(self, rank: int) -> tuple:
        """(dp index, tp index) of a rank of the mesh."""
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not in the mesh's ranks {self.ranks}")
        return divmod(self.ranks.index(rank), self.tp_size)
