"""The training program's tensor-parallel run: the small transformer split over --tp ranks
(tensor_parallel/model.py) and the bucketed DDP over the rest (a 2-D mesh); with --tp 1, plain
data parallelism. The loop is transformer.py's.

    python -m ddp_from_scratch.train --tp 2 --nproc 2                               # TP over 2 ranks
    python -m ddp_from_scratch.train --tp 2 --nproc 4 --epochs 2                    # TP x DP, 2 x 2
    python -m ddp_from_scratch.train --tp 2 --nproc 2 --sequence-parallel
    python -m ddp_from_scratch.train --tp 1 --nproc 2                               # DP over 2 ranks
    python -m ddp_from_scratch.train --tp 1 --nproc 1                               # the one-rank model, to compare

The loss logged is the global batch's mean (the DP replicas' means averaged); the summary also
gives the elements TP all-reduced in a step (the closed form of tensor_parallel/messages.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..steps.ddp import DistributedDataParallel
from ..tensor_parallel.messages import Shape
from ..tensor_parallel.mesh import Mesh2D
from ..tensor_parallel.model import TensorParallelTransformer
from ..tensor_parallel.operators import counting
from ..tensor_parallel.vocab import vocab_parallel_cross_entropy
from .compression import compress_of
from .places import element_places
from .transformer import Layout, train_transformer
from .transformer_args import HEADS, HIDDEN, LAYERS, SEQ, VOCAB, sizes  # noqa: F401  (the default sizes, for the tests)


class TPLayout(Layout):
    def __init__(self, env, config, full, autocast):
        self.config, self.autocast = config, autocast
        self.mesh = mesh = Mesh2D(tp=config.tp)
        split = lambda m: TensorParallelTransformer(m, mesh.tp, config.sequence_parallel) if config.tp > 1 else m  # noqa: E731
        self.places = element_places(full, lambda m: list(split(m).parameters()))
        self.split = split(full)
        self.model = DistributedDataParallel(self.split, group=mesh.dp, bucket_cap_mb=config.bucket_cap_mb,
                                             compress=compress_of(config)) if mesh.dp_size > 1 else self.split
        self.params = list(self.split.parameters())
        self.ddps = [self.model] if mesh.dp_size > 1 else []
        self.data_size, self.data_index = mesh.dp_size, mesh.dp_index
        self.tp_elements = None
        self.tokens_per_step = config.batch_size * mesh.dp_size * sizes(config)[4]

    def _loss(self, tokens, targets):
        with self.autocast():
            logits = self.model(tokens)
            if self.config.tp > 1:
                return vocab_parallel_cross_entropy(logits, targets, self.mesh.tp)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def _global_mean(self, loss) -> float:
        mean = loss.detach().float().clone()
        if self.mesh.dp_size > 1:
            dist.all_reduce(mean, group=self.mesh.dp)  # the global batch's mean loss
            mean /= self.mesh.dp_size
        return mean.item()

    def step(self, tokens, targets) -> float:
        with counting() as messages:
            loss = self._loss(tokens, targets)
            loss.backward()
        if self.config.sequence_parallel:
            self.split.sequence_parallel_grads()
        self.tp_elements = sum(n for _, n in messages)
        return self._global_mean(loss)

    def evaluate(self, tokens, targets) -> float:
        with torch.no_grad():
            return self._global_mean(self._loss(tokens, targets))

    def summary(self) -> dict:
        vocab, hidden, heads, layers, _ = sizes(self.config)
        return {"sequence_parallel": self.config.sequence_parallel, "tp_elements_per_step": self.tp_elements,
                "tp_closed_form_parameters": Shape(vocab, hidden, heads, layers, tokens=self.tokens_per_step).parameters(),
                "dp_buckets": len(self.model.buckets) if self.ddps else 0}


def train_tp(env, config) -> dict:
    """One rank of a --tp run; the summary on every rank."""
    return train_transformer(env, config, TPLayout)
