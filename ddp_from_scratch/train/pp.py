"""The training program's pipeline-parallel run: the small transformer (workload/transformer.py)
on text or synthetic tokens (data.py), cut into --pp stages run by a schedule, TP over --tp ranks inside each stage,
and the bucketed DDP over the rest (pipeline_parallel/mesh3d.py lays the ranks out).

    python -m ddp_from_scratch.train --pp 2 --nproc 2 --synthetic                        # 1F1B over 2 stages
    python -m ddp_from_scratch.train --pp 2 --schedule zero-bubble --microbatches 8 --nproc 4 --synthetic   # PP x DP
    python -m ddp_from_scratch.train --pp 2 --tp 2 --nproc 8 --synthetic                 # PP x TP x DP, 2 x 2 x 2
    python -m ddp_from_scratch.train --pp 2 --cp 2 --nproc 4 --synthetic                 # PP x CP: ring attention in each stage
    python -m ddp_from_scratch.train --tp 1 --nproc 1 --synthetic                        # the one-rank model, to compare

The model's pieces in order, the embedding, each block, and the last LayerNorm with the head, are
cut into --pp x --chunks stages balanced by parameters (pipeline_parallel/split.py); with --tp
each piece is first split over the TP group (tensor_parallel/model.py), and the last stage's
loss is the vocabulary-parallel cross-entropy. Each step every DP replica takes its rows of one
global batch of --batch-size x (DP size) sequences (the same global batch whatever the layout)
and cuts them into --microbatches; the schedule runs them (pipeline_parallel/stage.py) under the
DDP's no_sync(), and the DDP all-reduces the gradients once, after the last microbatch
(DistributedDataParallel.sync_gradients). So the losses are the one-rank model's on the same
global batch, within float32 rounding (the test checks this). The summary (the last line on
stdout) lists every step's loss (the global batch's mean, on every rank) and each stage's
measured idle share beside the schedule's closed form.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..context_parallel.layout import positions, shard
from ..context_parallel.model import context_parallel
from ..pipeline_parallel.mesh3d import Mesh3D
from ..pipeline_parallel.schedule import bubble, make, stage_index
from ..pipeline_parallel.split import split
from ..pipeline_parallel.stage import Stage
from ..steps.ddp import DistributedDataParallel
from ..tensor_parallel.model import TensorParallelTransformer
from ..tensor_parallel.vocab import vocab_parallel_cross_entropy
from .args import DEFAULT_SEQUENCES, HEADS, HIDDEN, LAYERS, SEQ, VOCAB
from .data import Batches
from .progress import progress
from ..workload.transformer import TinyTransformer


def train_pp(env, config) -> dict:
    """One rank of a --pp run; the summary on every rank."""
    torch.manual_seed(config.seed)
    tp, cp = config.tp or 1, config.cp or 1
    mesh = Mesh3D(pp=config.pp, tp=tp, cp=cp)
    # the same seed on every rank: the same weights; with --cp, learned positions (train/cp.py's model)
    full = TinyTransformer(VOCAB, HIDDEN, HEADS, LAYERS, positions=SEQ if config.cp is not None else 0)
    model = TensorParallelTransformer(full, mesh.tp) if tp > 1 else full
    if cp > 1:
        context_parallel(model, mesh.cp, balanced=True)
    p, v, s = config.pp, config.chunks, mesh.stage  # chunks: 1 but for CHUNKED schedules (TrainConfig)
    places = positions(SEQ, mesh.cp_index, cp, balanced=True) if config.cp is not None else None
    cut = split(model.as_sequence(places), p * v)
    mine = [cut[stage_index(c, s, p)] for c in range(v)]  # stages s, p + s, ... of the p x v
    if mesh.dp_size > 1:
        mine = [DistributedDataParallel(m, group=mesh.dp, bucket_cap_mb=config.bucket_cap_mb) for m in mine]

    def loss_fn(logits, targets):
        if tp > 1:
            return vocab_parallel_cross_entropy(logits, targets, mesh.tp)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    stage = Stage(mine, s, p, group=mesh.pp, loss_fn=loss_fn)
    schedule = make(config.schedule, p, config.microbatches, v)
    opt = torch.optim.SGD([q for m in mine for q in m.parameters()], lr=config.lr, momentum=0.9)
    batches = Batches(config)
    per_step = config.batch_size * mesh.data_size  # the DP replicas of one data index share its rows (CP)
    steps = (config.train_size or DEFAULT_SEQUENCES) // per_step
    rows = slice(mesh.data_index * config.batch_size, (mesh.data_index + 1) * config.batch_size)
    losses, idle, start = [], [], time.perf_counter()
    for epoch in range(config.epochs):
        for step in range(steps):
            tokens, targets = batches(epoch * steps + step, per_step)
            tokens, targets = (shard(t[rows], mesh.cp_index, cp, balanced=True, dim=1) for t in (tokens, targets))
            xs = list(tokens.tensor_split(config.microbatches))
            ys = list(targets.tensor_split(config.microbatches))
            if step == 0 and epoch == 0:
                stage.agree_shapes(xs[0] if s == 0 else None)
            with _no_sync(mine):
                result = stage.run(schedule, xs if s == 0 else None, ys if s == p - 1 else None)
            for m in mine:  # once a step, after the last microbatch
                if isinstance(m, DistributedDataParallel):
                    m.sync_gradients()
            opt.step()
            opt.zero_grad()
            idle.append(result.idle_share)
            losses.append(_global_mean(result, mesh, config.microbatches))
            if env.rank == 0:
                progress(config, epoch, step, steps, losses[-1], per_step, start, label=batches.label)
    seconds = time.perf_counter() - start
    if env.rank == 0:
        print(file=sys.stderr)
    every_idle = [None] * env.world_size
    dist.all_gather_object(every_idle, statistics.median(idle) if idle else None)
    return {"model": "transformer", "pp": p, "schedule": config.schedule, "chunks": v,
            "microbatches": config.microbatches, "tp": tp, "cp": cp, "dp": mesh.data_size, "world_size": env.world_size,
            "backend": env.backend, "epochs": config.epochs, "batch_size_per_dp_rank": config.batch_size, "seq": SEQ,
            "steps": len(losses), "losses": losses,
            "idle_share_by_stage": [every_idle[mesh.rank_at(k, 0, 0)] for k in range(p)],
            "idle_share_by_rank": [{"stage": mesh.coordinates(r)[0], "idle_share": every_idle[r]}
                                   for r in range(env.world_size)],
            "bubble_closed_form": bubble(p, config.microbatches, v, split=config.schedule == "zero-bubble"),
            "dp_buckets": sum(len(m.buckets) for m in mine if isinstance(m, DistributedDataParallel)),
            "train_seconds": seconds,
            "tokens_per_second": len(losses) * per_step * SEQ / seconds if seconds else None,
            **batches.summary()}


def _no_sync(modules) -> contextlib.ExitStack:
    """Every DDP-wrapped chunk's no_sync() at once."""
    stack = contextlib.ExitStack()
    for m in modules:
        if isinstance(m, DistributedDataParallel):
            stack.enter_context(m.no_sync())
    return stack


def _global_mean(result, mesh: Mesh3D, microbatches: int) -> float:
    """The global batch's mean loss, on every rank: the last stage's mean over its microbatches,
    summed over the pipeline (the other stages add 0) and averaged over the DP replicas."""
    mean = torch.zeros(())
    if result.losses:
        mean = torch.stack([result.losses[i] for i in range(microbatches)]).mean()
    dist.all_reduce(mean, group=mesh.pp)
    if mesh.dp_size > 1:
        dist.all_reduce(mean, group=mesh.dp)
        mean /= mesh.dp_size
    return mean.item()
