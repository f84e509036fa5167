"""The vocabulary split over a TP group: the embedding's rows, and a cross-entropy computed from
each rank's shard of the logits without gathering them (Megatron's VocabParallelEmbedding and
vocab_parallel_cross_entropy).

    embed = VocabParallelEmbedding(nn.Embedding(vocab, hidden), group)  # rank r: tokens r*V/p .. (r+1)*V/p - 1
    x = embed(tokens)                                                   # (batch, seq, hidden), whole on every rank
    loss = vocab_parallel_cross_entropy(local_logits, targets, group)  # local_logits: (..., V/p), this rank's columns

The embedding: each rank looks up the tokens in its range, writes zeros for the others, and g
all-reduces: every token's row comes from exactly one rank and zeros from the rest, so the sum
is the one-rank lookup bit for bit. One all_reduce of batch x seq x hidden forward, none backward.

The cross-entropy of logits split by vocabulary, loss = log(sum_v e^(z_v - m)) - (z_target - m):
an all_reduce (max) of each token's local maximum gives m; an all_reduce (sum) of the local sums
of e^(z - m) gives the normaliser; an all_reduce (sum) of the target's shifted logit, which one
rank holds and the others give as 0, gives z_target - m. Three all_reduces of one number per
token, instead of gathering batch x seq x vocab logits. Backward needs none: the gradient of
rank r's logits is softmax - one_hot on its own columns, times the loss's gradient.

As F.cross_entropy and nn.Embedding: targets equal to `ignore_index` (-100 by default) count in
neither the loss, its mean nor the gradient, and a token or target outside the vocabulary raises
IndexError (on every rank alike: each holds all the tokens, so the check is local and costs no
message) instead of giving a row of zeros or a loss. A vocabulary the TP size does not divide is
refused, naming both numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .layers import split_size
from .operators import all_reduced, g, scatter_sequence


class VocabParallelEmbedding(nn.Module):
    def __init__(self, full: nn.Embedding, group, sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel  # the result: this rank's slice of the sequence
        p, r = dist.get_world_size(group), dist.get_rank(group)
        k = split_size(full.num_embeddings, p, "the embedding's vocabulary")
        self.group, self.start, self.end = group, r * k, (r + 1) * k
        self.weight = nn.Parameter(full.weight.detach()[self.start:self.end].clone())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _check_in_vocabulary(tokens, self.weight.shape[0] * dist.get_world_size(self.group), "token", self.group)
        mine = (tokens >= self.start) & (tokens < self.end)
        local = torch.where(mine, tokens - self.start, torch.zeros_like(tokens))
        rows = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return scatter_sequence(rows, self.group) if self.sequence_parallel else g(rows, self.group)


def _check_in_vocabulary(ids: torch.Tensor, vocabulary: int, what: str, group, ignore_index=None) -> None:
    """IndexError naming the first id outside [0, vocabulary) (ignore_index aside), as the one-rank
    nn.Embedding and F.cross_entropy refuse it, instead of a silent row of zeros or a loss."""
    outside = (ids < 0) | (ids >= vocabulary)
    if ignore_index is not None:
        outside &= ids != ignore_index
    if outside.any():
        bad = ids[outside]
        raise IndexError(f"rank {dist.get_rank()}: {what} {bad[0].item()} is outside the vocabulary of {vocabulary} "
                         f"(0 to {vocabulary - 1}; {bad.numel()} such {what}s)"
                         + (f"; a {what} to leave out of the loss is ignore_index={ignore_index}" if ignore_index is not None else ""))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, start, group, counted):
        m = all_reduced(logits.detach().amax(dim=-1), group, op="max")
        shifted = logits - m.unsqueeze(-1)
        exp = shifted.exp()
        total = all_reduced(exp.sum(dim=-1), group)
        k = logits.shape[-1]
        mine = (targets >= start) & (targets < start + k) & counted
        local = torch.where(mine, targets - start, torch.zeros_like(targets))
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine.to(shifted.dtype)
        target = all_reduced(picked, group)
        ctx.save_for_backward(exp / total.unsqueeze(-1), local, mine, counted)
        return torch.where(counted, total.log() - target, torch.zeros_like(target))

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine, counted = ctx.saved_tensors
        out = softmax.clone()
        out.scatter_add_(-1, local.unsqueeze(-1), -mine.to(out.dtype).unsqueeze(-1))
        # where, not a product: an all-ignored mean's gradient is inf there, and F.cross_entropy's is 0
        return out * torch.where(counted, grad, torch.zeros_like(grad)).unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, group,
                                 reduction: str = "mean", ignore_index: int = -100) -> torch.Tensor:
    """Cross-entropy of logits split by vocabulary over `group` (this rank: columns r*V/p to
    (r+1)*V/p - 1), as F.cross_entropy: per token (reduction="none", 0 where ignored), their sum
    ("sum"), or their mean over the targets not equal to ignore_index ("mean"; nan when all are).
    A target outside the vocabulary raises IndexError."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    p = dist.get_world_size(group)
    _check_in_vocabulary(targets, local_logits.shape[-1] * p, "target", group, ignore_index)
    start = dist.get_rank(group) * local_logits.shape[-1]
    counted = targets != ignore_index
    # float32 whatever the logits (under autocast, bfloat16): the softmax's sums need its precision,
    # as F.cross_entropy takes them in float32 under autocast
    per_token = _VocabParallelCrossEntropy.apply(local_logits.float(), targets, start, group, counted)
    if reduction == "none":
        return per_token
    return per_token.sum() / counted.sum() if reduction == "mean" else per_token.sum()
