"""The training program's context-parallel run: the small transformer with learned positions, each
sequence cut over --cp ranks (the head-tail layout), attention by ring attention
(context_parallel/), TP over --tp ranks inside, and data parallelism over the rest.

    python -m ddp_from_scratch.train --cp 2 --nproc 2 --synthetic                  # each sequence over 2 ranks
    python -m ddp_from_scratch.train --cp 2 --nproc 4 --synthetic                  # CP x DP, 2 x 2
    python -m ddp_from_scratch.train --cp 2 --tp 2 --nproc 4 --synthetic           # CP x TP, 2 x 2
    python -m ddp_from_scratch.train --cp 1 --nproc 1 --synthetic                  # the one-rank model, to compare

The ranks are a grid, TP fastest: rank = (dp_index x cp + cp_index) x tp + tp_index. A TP group
splits the layers' widths; a CP group holds one sequence's pieces (each rank piece r and piece
2cp - 1 - r of 2cp: layout.py), and its ranks pass keys and values round for attention; the DP
index picks the rows of the global batch. Every rank embeds its tokens with their places in the
whole sequence (layout.positions), so the position embedding sees what one rank would.

Each rank's loss is the mean cross-entropy of its tokens. Every rank with the same TP index holds
the same parameters (CP and DP replicate them), and each saw an equal share of the global batch's
tokens, so after backward one flat all_reduce over those ranks, divided by their number, gives
the gradient of the global mean. The losses are the one-rank model's on the same global batch
within float32 rounding (the test checks CP x DP and CP x TP). The summary lists every step's loss
(the global mean, on every rank) and the activations a rank saved for backward in the first step.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

import collectives as C

from ..context_parallel.layout import positions, shard
from ..context_parallel.model import context_parallel
from ..pipeline_parallel.saved import SavedBytes
from ..tensor_parallel.model import TensorParallelTransformer
from ..tensor_parallel.vocab import vocab_parallel_cross_entropy
from .args import DEFAULT_SEQUENCES, HEADS, HIDDEN, LAYERS, SEQ, VOCAB
from .data import Batches, evaluation_due, validation_summary
from .progress import progress
from .gradients import average_gradients
from .sample import gathered_tp, one_rank_copy, write_sample
from ..workload.transformer import TinyTransformer


class CPMesh:
    """This rank's groups: TP (same DP and CP index), CP (same DP and TP index), and the replicas
    (same TP index: every rank holding the same parameters)."""

    def __init__(self, world_size: int, rank: int, cp: int, tp: int):
        dp = world_size // (cp * tp)
        at = lambda d, c, t: (d * cp + c) * tp + t  # noqa: E731
        self.dp_size, self.cp_size, self.tp_size = dp, cp, tp
        self.dp_index, rest = divmod(rank, cp * tp)
        self.cp_index, self.tp_index = divmod(rest, tp)
        self.tp = C.split([[at(d, c, t) for t in range(tp)] for d in range(dp) for c in range(cp)])
        self.cp = C.split([[at(d, c, t) for c in range(cp)] for d in range(dp) for t in range(tp)])
        self.replicas = C.split([[at(d, c, t) for d in range(dp) for c in range(cp)] for t in range(tp)])


def train_cp(env, config) -> dict:
    """One rank of a --cp run; the summary on every rank."""
    torch.manual_seed(config.seed)
    cp, tp = config.cp, config.tp or 1
    mesh = CPMesh(env.world_size, env.rank, cp, tp)
    full = TinyTransformer(VOCAB, HIDDEN, HEADS, LAYERS, positions=SEQ)  # the same seed everywhere: the same weights
    model = TensorParallelTransformer(full, mesh.tp) if tp > 1 else full
    if cp > 1:
        context_parallel(model, mesh.cp, balanced=True)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=config.lr, momentum=0.9)
    replicas = mesh.dp_size * cp
    batches = Batches(config)
    per_step = config.batch_size * mesh.dp_size
    steps = (config.train_size or DEFAULT_SEQUENCES) // per_step
    rows = slice(mesh.dp_index * config.batch_size, (mesh.dp_index + 1) * config.batch_size)
    places = positions(SEQ, mesh.cp_index, cp, balanced=True)
    losses, validation, saved_bytes, start = [], [], None, time.perf_counter()

    def loss_of(tokens, targets):
        logits = model(tokens, places)
        if tp > 1:
            return vocab_parallel_cross_entropy(logits, targets, mesh.tp)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    def global_mean(loss):
        mean = loss.detach().clone()
        if replicas > 1:
            C.all_reduce(mean, group=mesh.replicas)
            mean /= replicas
        return mean.item()

    def mine(tokens, targets):
        return (shard(t[rows], mesh.cp_index, cp, balanced=True, dim=1) for t in (tokens, targets))

    def evaluate(done):
        with torch.no_grad():
            validation.append({"step": done, "loss": global_mean(loss_of(*mine(*batches.validation(per_step))))})

    for epoch in range(config.epochs):
        for step in range(steps):
            tokens, targets = batches(epoch * steps + step, per_step)
            tokens, targets = mine(tokens, targets)
            saved = SavedBytes(params)
            with saved:
                loss = loss_of(tokens, targets)
            saved_bytes = saved_bytes or saved.peak
            loss.backward()
            average_gradients(params, mesh.replicas, replicas)
            opt.step()
            opt.zero_grad()
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
    written = None
    if config.sample:
        whole = gathered_tp(model, mesh.tp, positions=SEQ) if tp > 1 else one_rank_copy(model)
        written = write_sample(whole, batches, config, env.rank)
    return {"model": "transformer", "cp": cp, "tp": tp, "dp": mesh.dp_size, "world_size": env.world_size,
            "backend": env.backend, "epochs": config.epochs, "batch_size_per_dp_rank": config.batch_size, "seq": SEQ,
            "tokens_per_cp_rank": SEQ // cp, "steps": len(losses), "losses": losses,
            "saved_bytes_first_step": saved_bytes, "train_seconds": seconds, **validation_summary(validation),
            "sample": written,
            "tokens_per_second": len(losses) * per_step * SEQ / seconds if seconds else None, **batches.summary()}
