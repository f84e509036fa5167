"""The training program's context-parallel run: the small transformer, each sequence cut over --cp
ranks (the head-tail layout), attention by ring attention (context_parallel/), TP over --tp ranks
inside, and data parallelism over the rest. The loop is transformer.py's.

    python -m ddp_from_scratch.train --cp 2 --nproc 2                  # each sequence over 2 ranks
    python -m ddp_from_scratch.train --cp 2 --nproc 4                  # CP x DP, 2 x 2
    python -m ddp_from_scratch.train --cp 2 --tp 2 --nproc 4           # CP x TP, 2 x 2
    python -m ddp_from_scratch.train --cp 1 --nproc 1                  # the one-rank model, to compare

The ranks are a grid, TP fastest: rank = (dp_index x cp + cp_index) x tp + tp_index. A TP group
splits the layers' widths; a CP group holds one sequence's pieces (each rank piece r and piece
2cp - 1 - r of 2cp: layout.py), and its ranks pass keys and values round for attention; the DP
index picks the rows of the global batch. Every rank embeds its tokens with their places in the
whole sequence (layout.positions), so the position embedding sees what one rank would.

Each rank's loss is the mean cross-entropy of its tokens. Every rank with the same TP index holds
the same parameters (CP and DP replicate them), and each saw an equal share of the global batch's
tokens, so after backward one flat all_reduce over those ranks, divided by their number, gives
the gradient of the global mean. The losses are the one-rank model's on the same global batch
within float32 rounding (the test checks CP x DP and CP x TP). The summary also gives the
activations a rank saved for backward in the first step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import collectives as C

from ..context_parallel.layout import positions, shard
from ..context_parallel.model import context_parallel
from ..pipeline_parallel.saved import SavedBytes
from ..tensor_parallel.model import TensorParallelTransformer
from ..tensor_parallel.vocab import vocab_parallel_cross_entropy
from .gradients import average_gradients
from .places import element_places
from .transformer import Layout, train_transformer
from .transformer_args import VOCAB, sizes


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


class CPLayout(Layout):
    def __init__(self, env, config, full, autocast):
        self.config, self.autocast = config, autocast
        self.cp, self.tp = config.cp, config.tp or 1
        self.mesh = mesh = CPMesh(env.world_size, env.rank, self.cp, self.tp)
        split = lambda m: TensorParallelTransformer(m, mesh.tp) if self.tp > 1 else m  # noqa: E731
        self.places = element_places(full, lambda m: list(split(m).parameters()))
        self.model = split(full)
        if self.cp > 1:
            context_parallel(self.model, mesh.cp, balanced=True)
        self.params = list(self.model.parameters())
        self.replicas = mesh.dp_size * self.cp
        self.data_size, self.data_index = mesh.dp_size, mesh.dp_index
        self.ddps, self.saved_bytes = [], None
        self.places_here = positions(sizes(config)[4], mesh.cp_index, self.cp, balanced=True)

    def _mine(self, t):
        return shard(t, self.mesh.cp_index, self.cp, balanced=True, dim=1)

    def _loss(self, tokens, targets):
        with self.autocast():
            logits = self.model(self._mine(tokens), self.places_here)
            if self.tp > 1:
                return vocab_parallel_cross_entropy(logits, self._mine(targets), self.mesh.tp)
            return F.cross_entropy(logits.reshape(-1, VOCAB), self._mine(targets).reshape(-1))

    def _global_mean(self, loss) -> float:
        mean = loss.detach().float().clone()
        if self.replicas > 1:
            C.all_reduce(mean, group=self.mesh.replicas)
            mean /= self.replicas
        return mean.item()

    def step(self, tokens, targets) -> float:
        saved = SavedBytes(self.params)
        with saved:
            loss = self._loss(tokens, targets)
        self.saved_bytes = self.saved_bytes or saved.peak
        loss.backward()
        average_gradients(self.params, self.mesh.replicas, self.replicas)
        return self._global_mean(loss)

    def evaluate(self, tokens, targets) -> float:
        with torch.no_grad():
            return self._global_mean(self._loss(tokens, targets))

    def summary(self) -> dict:
        return {"tokens_per_cp_rank": sizes(self.config)[4] // self.cp, "saved_bytes_first_step": self.saved_bytes}


def train_cp(env, config) -> dict:
    """One rank of a --cp run; the summary on every rank."""
    return train_transformer(env, config, CPLayout)
