"""The router of a mixture-of-experts layer: a linear layer (no bias), a softmax over the experts,
and each token's top k.

    router = Router(hidden=64, experts=4, top_k=2)
    probs, weights, experts = router(x)      # x: (tokens, hidden)
    # probs (tokens, experts); weights and experts (tokens, k): the k largest probs and whose they are

The weights a token's expert outputs are summed with are the router's softmax probabilities of
the chosen experts, not renormalized over the k (Switch Transformer's and GShard's choice; a
top-1 token's output is its expert's output times p, so the router learns from the main loss).

`skew` is a fixed logit added to each expert (a buffer, never trained): zeros by default; the
benchmark biases it toward expert 0 to make a skewed load, and a large skew sends every token to
one expert.

The row count of a matrix product decides how CPU kernels block it, so a product over all
tokens and the same product cut into the ranks' blocks can differ in the last bit (on torch 2.13
they differ at one row, and a sum over tokens, the weight's gradient, differs whenever it is
cut). `blocked_linear` makes the cut explicit: the product block by block, and the weight's
gradient as the blocks' gradients added in block order. An expert-parallel rank runs its own
tokens as one block, the ranks add their blocks' gradients in rank order
(layer.ExpertParallelMoE.sync_router_grad), and the one-rank layer given blocks=N does the same
arithmetic, so the two agree bit for bit.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn


class _BlockedLinear(torch.autograd.Function):
    # under autocast (--amp) the router still runs in float32, as Switch Transformer keeps it
    # ("selective precision"): a token's expert must not hang on bfloat16 rounding
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, blocks: int) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.blocks = blocks
        return torch.cat([F.linear(b, weight) for b in x.chunk(blocks)]) if blocks > 1 else F.linear(x, weight)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        xs, gs = x.chunk(ctx.blocks), grad.chunk(ctx.blocks)
        dx = torch.cat([g @ weight for g in gs]) if ctx.blocks > 1 else grad @ weight
        dw = gs[0].t() @ xs[0]
        for g, b in zip(gs[1:], xs[1:]):  # in block order, as the ranks add theirs
            dw = dw + g.t() @ b
        return dx, dw, None


def blocked_linear(x: torch.Tensor, weight: torch.Tensor, blocks: int = 1) -> torch.Tensor:
    """x @ weight.T with x's rows cut into `blocks` equal blocks, each multiplied alone; the
    weight's gradient is the blocks' gradients added in block order."""
    if x.shape[0] % blocks:
        raise ValueError(f"{x.shape[0]} tokens do not cut into {blocks} equal blocks")
    return _BlockedLinear.apply(x, weight, blocks)


class Router(nn.Module):
    def __init__(self, hidden: int, experts: int, top_k: int):
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k {top_k} must be between 1 and the {experts} experts")
        self.experts, self.top_k = experts, top_k
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        nn.init.normal_(self.weight, std=hidden ** -0.5)
        self.register_buffer("skew", torch.zeros(experts), persistent=False)

    def forward(self, x: torch.Tensor, blocks: int = 1) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probs (tokens, E), weights (tokens, k), experts (tokens, k)) for x: (tokens, hidden)."""
        logits = blocked_linear(x, self.weight, blocks) + self.skew
        probs = logits.softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        return probs, weights, experts
