"""The small transformer (workload/transformer.py) split over a TP group, made from the one-rank
model so both start from the same weights.

    tp_model = TensorParallelTransformer(TinyTransformer(...), group)
    loss = tp_model.loss(tokens, targets)     # the same tokens on every rank of the group

The embedding is split by vocabulary, each block's attention by heads and its MLP by inner
features, and the head by vocabulary, its logits never gathered: the cross-entropy takes them
split (vocab.py). The LayerNorms stay whole on every rank: their inputs are whole and the same on
every rank of the group, so their gradients are too, and need no message.

With sequence_parallel=True the activations between the blocks are this rank's slice of the
sequence: the embedding reduce-scatters instead of all-reducing, each block all-gathers the
slices before its attention and MLP and reduce-scatters after them, the head all-gathers, and
after backward `sequence_parallel_grads()` all-reduces the gradients of the parameters every
rank holds whole (the LayerNorms, the biases added to a slice, the learned positions), which each
rank computed from its slice alone.

Messages per step, for L blocks on (batch, seq) tokens with hidden size h (closed form, checked
by tests/tensor_parallel/test_tensor_parallel.py): forward, 1 + 2L all_reduces of batch x seq x h elements
(the embedding, then g after each attention and MLP) and 3 of batch x seq (the cross-entropy);
backward, 2L + 1 of batch x seq x h (f before each attention and MLP, and before the head).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..workload.transformer import Block, TinyTransformer
from .attention import TensorParallelAttention
from .layers import ColumnParallelLinear
from .mlp import TensorParallelMLP
from .operators import all_reduced, gather_sequence
from .vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy


class _Block(Block):
    """The one-rank block's forward (residuals around attention and MLP) on split parts."""

    def __init__(self, full: Block, group, sequence_parallel: bool = False):
        nn.Module.__init__(self)
        self.ln1, self.ln2 = full.ln1, full.ln2
        self.attn = TensorParallelAttention(full.attn, group, sequence_parallel=sequence_parallel)
        self.mlp = TensorParallelMLP(full.mlp, group, sequence_parallel=sequence_parallel)


class TensorParallelTransformer(TinyTransformer):
    """The one-rank model's forward on split parts: it returns this rank's shard of the logits,
    (batch, seq, vocab / p), and its loss takes them split."""

    def __init__(self, full: TinyTransformer, group, sequence_parallel: bool = False):
        nn.Module.__init__(self)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.embed = VocabParallelEmbedding(full.embed, group, sequence_parallel=sequence_parallel)
        self.blocks = nn.ModuleList(_Block(b, group, sequence_parallel) for b in full.blocks)
        self.ln = full.ln
        self.head = ColumnParallelLinear(full.head, group, name="the head")
        self.pos = full.pos  # whole on every rank, as the LayerNorms: its gradient is too

    def forward(self, tokens: torch.Tensor, positions=None) -> torch.Tensor:
        if not self.sequence_parallel:
            return super().forward(tokens, positions)
        x = self.embed(tokens)  # this rank's slice of the sequence from here to the last LayerNorm
        if self.pos is not None:  # the places of this rank's slice
            places = positions if positions is not None else torch.arange(tokens.shape[1])
            k, r = x.shape[1], dist.get_rank(self.group)
            x = x + self.pos(places[r * k:(r + 1) * k])
        for block in self.blocks:
            x = block(x)
        whole = gather_sequence(self.ln(x), self.group)  # the head needs every position
        return F.linear(whole, self.head.weight)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(self(tokens), targets, self.group)

    def as_sequence(self, positions=None) -> nn.Sequential:
        if self.sequence_parallel:
            raise ValueError("a sequence-parallel model gathers the sequence before its head: its forward is not "
                             "a plain sequence of its modules, so it cannot be cut into pipeline stages")
        return super().as_sequence(positions)

    def sequence_parallel_grads(self) -> None:
        """With sequence parallelism, after backward: the parameters every rank holds whole (the
        LayerNorms, the biases added after a reduce_scatter, the learned positions) got a gradient from this rank's slice
        only; all-reduce them over the TP group (Megatron's step for its sequence-parallel
        parameters). One all_reduce per parameter."""
        if not self.sequence_parallel:
            return
        shared = [self.ln] + [m for b in self.blocks for m in (b.ln1, b.ln2)] + ([self.pos] if self.pos is not None else [])
        params = [p for m in shared for p in m.parameters()]
        params += [row.bias for b in self.blocks for row in (b.attn.out, b.mlp.down) if row.bias_needs_all_reduce()]
        for p in params:
            if p.grad is not None:
                p.grad.copy_(all_reduced(p.grad, self.group))
