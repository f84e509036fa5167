"""The ranks laid out in three dimensions, pipeline x data x tensor parallel, with each rank's
three groups, from the project's checked subgroups.

    mesh = Mesh3D(pp=2, tp=2)        # 8 ranks: 2 stages, each 2 DP replicas of a 2-rank TP group
    mesh.stage, mesh.dp_index, mesh.tp_index          # this rank's place
    Stage(module, mesh.stage, mesh.pp_size, group=mesh.pp)        # the pipeline runs over mesh.pp
    DistributedDataParallel(module, group=mesh.dp)                # gradients average over mesh.dp
    TensorParallelTransformer(full, mesh.tp)                      # layers split over mesh.tp

Rank = (stage x dp + d) x tp + t, as Megatron-LM orders them: the TP ranks are neighbours (they
exchange activations inside every layer, so they get the fastest links), then the DP replicas of
a stage, and the stages outermost (a pipeline sends one activation a microbatch between stages:
the slowest links, between machines, take the least traffic). The pipeline group of a rank holds
the ranks with its (d, t) at every stage; its DP group, its (stage, t) in every replica; its TP
group, its (stage, d) at every t. Every rank makes every group in the same order, as
torch.distributed requires. With cp > 1 the DP replicas are also context-parallel: replica d
holds piece d % cp of each sequence of data index d // cp, and gradients still average over all
of them (each saw an equal share of the global batch's tokens).
"""

from __future__ import annotations

import torch.distributed as dist

import collectives as C


class Mesh3D:
    def __init__(self, pp: int, tp: int = 1, backend=None, cp: int = 1):
        world = dist.get_world_size()
        if pp < 1 or tp < 1 or cp < 1 or world % (pp * tp * cp):
            raise ValueError(f"a mesh of {pp} pipeline stage(s) x {tp} tensor-parallel rank(s) x {cp} "
                             f"context-parallel rank(s) does not fit {world} ranks: pp x tp x cp must divide the "
                             "number of ranks")
        self.pp_size, self.tp_size, self.dp_size = pp, tp, world // (pp * tp)
        dp = self.dp_size
        at = self.rank_at
        self.tp_groups = {(s, d): C.new_group([at(s, d, t) for t in range(tp)], backend=backend)
                          for s in range(pp) for d in range(dp)}
        self.dp_groups = {(s, t): C.new_group([at(s, d, t) for d in range(dp)], backend=backend)
                          for s in range(pp) for t in range(tp)}
        self.pp_groups = {(d, t): C.new_group([at(s, d, t) for s in range(pp)], backend=backend)
                          for d in range(dp) for t in range(tp)}
        self.stage, self.dp_index, self.tp_index = self.coordinates(dist.get_rank())
        s, d, t = self.stage, self.dp_index, self.tp_index
        self.tp, self.dp, self.pp = self.tp_groups[(s, d)], self.dp_groups[(s, t)], self.pp_groups[(d, t)]
        # context parallelism splits the DP replicas: replica d holds piece d % cp of the rows of
        # data index d // cp; the replicas of one data index are its CP group
        self.cp_size, self.data_size = cp, dp // cp
        self.data_index, self.cp_index = divmod(d, cp)
        self.cp = None
        if cp > 1:
            self.cp_groups = {(s_, i, t_): C.new_group([at(s_, i * cp + c, t_) for c in range(cp)], backend=backend)
                              for s_ in range(pp) for i in range(dp // cp) for t_ in range(tp)}
            self.cp = self.cp_groups[(s, self.data_index, t)]

    def rank_at(self, stage: int, d: int, t: int) -> int:
        return (stage * self.dp_size + d) * self.tp_size + t

    def coordinates(self, rank: int) -> tuple:
        """(stage, dp index, tp index) of a rank."""
        rest, t = divmod(rank, self.tp_size)
        stage, d = divmod(rest, self.dp_size)
        return stage, d, t
