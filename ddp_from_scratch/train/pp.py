"""The training program's pipeline-parallel run: the small transformer (workload/transformer.py)
cut into --pp stages run by a schedule, TP over --tp ranks inside each stage, and the bucketed
DDP over the rest (pipeline_parallel/mesh3d.py lays the ranks out). The loop is transformer.py's.

    python -m ddp_from_scratch.train --pp 2 --nproc 2                        # 1F1B over 2 stages
    python -m ddp_from_scratch.train --pp 2 --schedule zero-bubble --microbatches 8 --nproc 4   # PP x DP
    python -m ddp_from_scratch.train --pp 2 --tp 2 --nproc 8                 # PP x TP x DP, 2 x 2 x 2
    python -m ddp_from_scratch.train --pp 2 --cp 2 --nproc 4                 # PP x CP: ring attention in each stage
    python -m ddp_from_scratch.train --tp 1 --nproc 1                        # the one-rank model, to compare

The model's pieces in order, the embedding, each block, and the last LayerNorm with the head, are
cut into --pp x --chunks stages balanced by parameters (pipeline_parallel/split.py); with --tp
each piece is first split over the TP group (tensor_parallel/model.py), and the last stage's
loss is the vocabulary-parallel cross-entropy. Each step every DP replica takes its rows of one
global batch of --batch-size x (DP size) sequences (the same global batch whatever the layout)
and cuts them into --microbatches; the schedule runs them (pipeline_parallel/stage.py) under the
DDP's no_sync(), and the DDP all-reduces the gradients once, after the last microbatch
(DistributedDataParallel.sync_gradients). So the losses are the one-rank model's on the same
global batch, within float32 rounding (the test checks this). The validation loss runs the
forward alone through the stages (pipeline_parallel/forward_only.py). The summary also gives each
stage's measured idle share beside the schedule's closed form.
"""

from __future__ import annotations

import contextlib
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..context_parallel.layout import positions, shard
from ..context_parallel.model import context_parallel
from ..pipeline_parallel.forward_only import forward_only
from ..pipeline_parallel.mesh3d import Mesh3D
from ..pipeline_parallel.schedule import bubble, make, stage_index
from ..pipeline_parallel.split import split
from ..pipeline_parallel.stage import Stage
from ..steps.ddp import DistributedDataParallel
from ..tensor_parallel.model import TensorParallelTransformer
from ..tensor_parallel.vocab import vocab_parallel_cross_entropy
from .compression import compress_of
from .places import element_places
from .transformer import Layout, train_transformer
from .transformer_args import sizes


class PPLayout(Layout):
    def __init__(self, env, config, full, autocast):
        self.env, self.config = env, config
        tp, cp = config.tp or 1, config.cp or 1
        self.mesh = mesh = Mesh3D(pp=config.pp, tp=tp, cp=cp)
        p, v, s = config.pp, config.chunks, mesh.stage  # chunks: 1 but for CHUNKED schedules (TrainConfig)
        self.cp = cp
        places = positions(sizes(config)[4], mesh.cp_index, cp, balanced=True)

        def mine(model):  # stages s, p + s, ... of the p x v
            model = TensorParallelTransformer(model, mesh.tp) if tp > 1 else model
            if cp > 1:
                context_parallel(model, mesh.cp, balanced=True)
            cut = split(model.as_sequence(places), p * v)
            return [cut[stage_index(c, s, p)] for c in range(v)]

        self.places = element_places(full, lambda m: [q for c in mine(m) for q in c.parameters()])
        chunks = mine(full)
        self.params = [q for c in chunks for q in c.parameters()]
        if mesh.dp_size > 1:
            chunks = [DistributedDataParallel(c, group=mesh.dp, bucket_cap_mb=config.bucket_cap_mb,
                                              compress=compress_of(config)) for c in chunks]
        self.chunks = chunks
        self.ddps = [c for c in chunks if isinstance(c, DistributedDataParallel)]

        def loss_fn(logits, targets):
            if tp > 1:
                return vocab_parallel_cross_entropy(logits, targets, mesh.tp)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

        self.stage = Stage(chunks, s, p, group=mesh.pp, loss_fn=loss_fn, autocast=autocast)
        self.schedule = make(config.schedule, p, config.microbatches, v)
        self.data_size, self.data_index = mesh.data_size, mesh.data_index
        self.idle, self.agreed = [], False

    def _microbatches(self, tokens, targets):
        tokens, targets = (shard(t, self.mesh.cp_index, self.cp, balanced=True, dim=1) for t in (tokens, targets))
        xs, ys = list(tokens.tensor_split(self.config.microbatches)), list(targets.tensor_split(self.config.microbatches))
        if not self.agreed:  # once, before the first step run (a resumed run's too)
            self.stage.agree_shapes(xs[0] if self.mesh.stage == 0 else None)
            self.agreed = True
        first, last = self.mesh.stage == 0, self.mesh.stage == self.config.pp - 1
        return (xs if first else None), (ys if last else None)

    def step(self, tokens, targets) -> float:
        xs, ys = self._microbatches(tokens, targets)
        with contextlib.ExitStack() as stack:
            for c in self.ddps:  # every chunk's no_sync() at once: the DDP reduces once a step
                stack.enter_context(c.no_sync())
            result = self.stage.run(self.schedule, xs, ys)
        for c in self.ddps:  # once a step, after the last microbatch
            c.sync_gradients()
        self.idle.append(result.idle_share)
        return self._global_mean(result.losses)

    def evaluate(self, tokens, targets) -> float:
        xs, ys = self._microbatches(tokens, targets)
        return self._global_mean(forward_only(self.stage, xs, ys, self.config.microbatches))

    def _global_mean(self, losses) -> float:
        """The global batch's mean loss, on every rank: the last stage's mean over its microbatches,
        summed over the pipeline (the other stages add 0) and averaged over the DP replicas."""
        mean = torch.zeros(())
        if losses:
            mean = torch.stack([losses[i].float() for i in range(self.config.microbatches)]).mean()
        dist.all_reduce(mean, group=self.mesh.pp)
        if self.mesh.dp_size > 1:
            dist.all_reduce(mean, group=self.mesh.dp)
            mean /= self.mesh.dp_size
        return mean.item()

    def summary(self) -> dict:
        p, mesh, config = self.config.pp, self.mesh, self.config
        every_idle = [None] * self.env.world_size
        dist.all_gather_object(every_idle, statistics.median(self.idle) if self.idle else None)
        return {"schedule": config.schedule, "chunks": config.chunks, "microbatches": config.microbatches,
                "idle_share_by_stage": [every_idle[mesh.rank_at(k, 0, 0)] for k in range(p)],
                "idle_share_by_rank": [{"stage": mesh.coordinates(r)[0], "idle_share": every_idle[r]}
                                       for r in range(self.env.world_size)],
                "bubble_closed_form": bubble(p, config.microbatches, config.chunks,
                                             split=config.schedule == "zero-bubble"),
                "dp_buckets": sum(len(c.buckets) for c in self.ddps)}


def train_pp(env, config) -> dict:
    """One rank of a --pp run; the summary on every rank."""
    return train_transformer(env, config, PPLayout)
