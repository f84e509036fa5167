"""Context parallelism in the small transformer: every attention module's attention becomes ring
attention over the context-parallel group; the rest of the model works token by token and needs
no change but the positions.

    model = TinyTransformer(vocab, hidden, heads, layers, positions=seq)   # learned positions
    context_parallel(model, group, balanced=True)                          # its attention, a ring
    logits = model(tokens_mine, positions(seq, rank, size, balanced=True)) # this rank's tokens, their places

Works on the one-rank model and on a tensor-parallel one (tensor_parallel/model.py): each TP rank
attends with its heads, so the ring runs per head group, over the CP group. A token's position is
its place in the whole sequence (layout.positions), so the position embedding sees what it would
on one rank.
"""

from __future__ import annotations

import torch
from torch import nn

from .ring import ring_attention


class RingAttend:
    """`attend(q, k, v, heads)` of workload/transformer.py, by ring attention over `group`:
    (batch, this rank's tokens, heads x head_dim) projections in, the same shape out. The ring runs in
    float32 whatever the projections' dtype (under --amp's autocast, bfloat16): its merge adds
    blocks weighted by exp(lse) in float32, and the result goes back to the projections' dtype."""

    def __init__(self, group, balanced: bool):
        self.group, self.balanced = group, balanced

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
        b, s, width = q.shape
        split = lambda t: t.view(b, s, heads, width // heads).transpose(1, 2).float()  # noqa: E731
        y = ring_attention(split(q), split(k), split(v), self.group, causal=True, balanced=self.balanced)
        return y.transpose(1, 2).reshape(b, s, width).to(q.dtype)


def context_parallel(model: nn.Module, group, balanced: bool = True) -> nn.Module:
    """Every module of `model` with an `attend` (the attention blocks) attends by the ring; in place."""
    ring = RingAttend(group, balanced)
    found = 0
    for module in model.modules():
        if hasattr(module, "attend") and hasattr(module, "heads"):
            module.attend = ring
            found += 1
    if not found:
        raise ValueError("context_parallel: the model has no attention module (a module with attend and heads)")
    return model
