"""The small transformer (workload/transformer.py) split over a TP group, made from the one-rank
model so both start from the same weights.

    tp_model = TensorParallelTransformer(TinyTransformer(...), group)
    loss = tp_model.loss(tokens, targets)     # the same tokens on every rank of the group

The embedding is split by vocabulary, each block's attention by heads and its MLP by inner
features, and the head by vocabulary, its logits never gathered: the cross-entropy takes them
split (vocab.py). The LayerNorms stay whole on every rank: their inputs are whole and the same on
every rank of the group, so their gradients are too, and need no message.

Messages per step, for L blocks on (batch, seq) tokens with hidden size h (closed form, checked
by tests/ddp/test_tensor_parallel.py): forward, 1 + 2L all_reduces of batch x seq x h elements
(the embedding, then g after each attention and MLP) and 3 of batch x seq (the cross-entropy);
backward, 2L + 1 of batch x seq x h (f before each attention and MLP, and before the head).
"""

from __future__ import annotations

import torch
from torch import nn

from ..workload.transformer import Block, TinyTransformer
from .attention import TensorParallelAttention
from .layers import ColumnParallelLinear
from .mlp import TensorParallelMLP
from .vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy


class _Block(Block):
    """The one-rank block's forward (residuals around attention and MLP) on split parts."""

    def __init__(self, full: Block, group):
        nn.Module.__init__(self)
        self.ln1, self.ln2 = full.ln1, full.ln2
        self.attn = TensorParallelAttention(full.attn, group)
        self.mlp = TensorParallelMLP(full.mlp, group)


class TensorParallelTransformer(TinyTransformer):
    """The one-rank model's forward on split parts: it returns this rank's shard of the logits,
    (batch, seq, vocab / p), and its loss takes them split."""

    def __init__(self, full: TinyTransformer, group):
        nn.Module.__init__(self)
        self.group = group
        self.embed = VocabParallelEmbedding(full.embed, group)
        self.blocks = nn.ModuleList(_Block(b, group) for b in full.blocks)
        self.ln = full.ln
        self.head = ColumnParallelLinear(full.head, group, name="the head")

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(self(tokens), targets, self.group)
