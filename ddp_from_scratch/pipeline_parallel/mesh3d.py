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
torch.distributed requires.
"""

from __future__ import annotations

import torch.distributed as dist

import collectives as C


class Mesh3D:
    def __init__(self, pp: int, tp: int = 1, backend=None):
        world = dist.get_world_size()
        if pp < 1 or tp < 1 or world % (pp * tp):
            raise ValueError(f"a mesh of {pp} pipeline stage(s) x {tp} tensor-parallel rank(s) does not fit "
                             f"{world} ranks: pp x tp must divide the number of ranks")
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

    def rank_at(self, stage: int, d: int, t: int) -> int:
        return (stage * self.dp_size + d) * self.tp_size + t

    def coordinates(self, rank: int) -> tuple:
        """(stage, dp index, tp index) of a rank."""
        rest, t = divmod(rank, self.tp_size)
        stage, d = divmod(rest, self.dp_size)
        return stage, d, t
