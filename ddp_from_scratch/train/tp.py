"""The training program's tensor-parallel run: the small transformer (workload/transformer.py) on
text as bytes or synthetic tokens (data.py), TP over --tp ranks and the bucketed DDP over the rest (a 2-D mesh).

    python -m ddp_from_scratch.train --tp 2 --nproc 2 --synthetic                  # TP over 2 ranks
    python -m ddp_from_scratch.train --tp 2 --nproc 4 --synthetic --epochs 2       # TP x DP, 2 x 2
    python -m ddp_from_scratch.train --tp 2 --nproc 2 --synthetic --sequence-parallel
    python -m ddp_from_scratch.train --tp 1 --nproc 1 --synthetic                  # the one-rank model, to compare

Each step every DP rank takes its rows of one global batch of --batch-size x (DP size) sequences
of SEQ tokens (token_batch(step, 0, ...): the same global batch whatever the layout), so a run's
losses are the one-rank model's within float32 rounding, whatever --tp and --nproc are (the test
checks this). The loss logged is the global batch's mean; the summary (the last line on stdout)
lists every step's loss and the elements TP all-reduced in a step (the closed form of
tensor_parallel/messages.py). --train-size counts sequences (default 512); the run trains on --text
FILE (default: Python's documentation, workload/text.py) or on --synthetic tokens, and takes no
checkpoint, compression or mixed precision yet.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..steps.ddp import DistributedDataParallel
from ..tensor_parallel.messages import Shape
from ..tensor_parallel.mesh import Mesh2D
from ..tensor_parallel.model import TensorParallelTransformer
from ..tensor_parallel.operators import counting
from ..tensor_parallel.vocab import vocab_parallel_cross_entropy
from .data import Batches, evaluation_due, validation_summary
from .progress import progress
from .sample import gathered_tp, write_sample
from .args import DEFAULT_SEQUENCES, HEADS, HIDDEN, LAYERS, SEQ, VOCAB  # the sizes, with the --tp flag checks
from ..workload.transformer import TinyTransformer


def train_tp(env, config) -> dict:
    """One rank of a --tp run; the summary on every rank."""
    torch.manual_seed(config.seed)
    mesh = Mesh2D(tp=config.tp)
    full = TinyTransformer(VOCAB, HIDDEN, HEADS, LAYERS)  # the same seed on every rank: the same weights
    split = TensorParallelTransformer(full, mesh.tp, config.sequence_parallel) if config.tp > 1 else full
    model = DistributedDataParallel(split, group=mesh.dp, bucket_cap_mb=config.bucket_cap_mb) if mesh.dp_size > 1 \
        else split
    opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9)
    batches = Batches(config)
    per_step = config.batch_size * mesh.dp_size
    steps = (config.train_size or DEFAULT_SEQUENCES) // per_step
    rows = slice(mesh.dp_index * config.batch_size, (mesh.dp_index + 1) * config.batch_size)
    losses, validation, tp_elements, start = [], [], None, time.perf_counter()

    def loss_of(tokens, targets):
        logits = model(tokens)
        if config.tp > 1:
            return vocab_parallel_cross_entropy(logits, targets, mesh.tp)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def global_mean(loss):
        mean = loss.detach().clone()
        if mesh.dp_size > 1:
            dist.all_reduce(mean, group=mesh.dp)  # the global batch's mean loss
            mean /= mesh.dp_size
        return mean.item()

    def evaluate(done):
        tokens, targets = batches.validation(per_step)
        with torch.no_grad():
            validation.append({"step": done, "loss": global_mean(loss_of(tokens[rows], targets[rows]))})

    for epoch in range(config.epochs):
        for step in range(steps):
            tokens, targets = batches(epoch * steps + step, per_step)
            tokens, targets = tokens[rows], targets[rows]
            with counting() as messages:
                loss = loss_of(tokens, targets)
                loss.backward()
            if config.sequence_parallel:
                split.sequence_parallel_grads()
            opt.step()
            opt.zero_grad()
            tp_elements = sum(n for _, n in messages)
            losses.append(global_mean(loss))
            done = epoch * steps + step + 1
            if evaluation_due(config, done, steps * config.epochs):
                evaluate(done)
            if env.rank == 0:
                progress(config, epoch, step, steps, losses[-1], per_step, start, label=batches.label,
                         validation=validation)
    seconds = time.perf_counter() - start
    if env.rank == 0:
        print(file=sys.stderr)
    written = write_sample(gathered_tp(split, mesh.tp) if config.sample and config.tp > 1 else split, batches, config,
                           env.rank)
    shape = Shape(VOCAB, HIDDEN, HEADS, LAYERS, tokens=per_step * SEQ)
    return {"model": "transformer", "tp": config.tp, "dp": mesh.dp_size, "world_size": env.world_size,
            "sequence_parallel": config.sequence_parallel, "backend": env.backend, "epochs": config.epochs,
            "batch_size_per_dp_rank": config.batch_size, "seq": SEQ, "steps": len(losses), "losses": losses,
            "tp_elements_per_step": tp_elements, "parameters": shape.parameters(),
            "dp_buckets": len(model.buckets) if mesh.dp_size > 1 else 0, "train_seconds": seconds,
            "tokens_per_second": len(losses) * per_step * SEQ / seconds if seconds else None,
            **validation_summary(validation), "sample": written, **batches.summary()}
