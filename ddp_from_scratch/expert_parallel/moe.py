"""The one-rank mixture-of-experts layer: the reference the expert-parallel layer is proven against.

    moe = MoE(hidden=64, experts=4, top_k=2, capacity_factor=1.25)
    y, aux = moe(x)              # x: (batch, seq, hidden); each sequence a group; aux: (batch,)
    moe.last.dropped             # (E,) pairs each expert had no room for in that call

One call, in four steps:

    1. route     probs, weights, chosen = router(x)           router.py: softmax, top-k
    2. plan      plan = make_plan(chosen, E, groups, cf)      routing.py: capacity, drops, sort
    3. experts   rows = x[plan.tokens_of_rows]                each expert reads its rows, in
                 out = run_experts(experts, rows, counts)     expert order, then token order
    4. combine   y_t = sum_k weight_k(t) x out(t, k)          a dropped pair adds nothing

The expert-parallel layer (layer.py) does the same four steps; between 3's gather and the
experts it sends each expert's rows to the rank that holds it, and the outputs back.

Groups: a 3-D input's sequences are its groups (each routes with its own capacity and balance
loss); a 2-D input of tokens is one group unless `groups` says otherwise. `blocks` cuts the
router's product as N ranks cut it (router.py), for the bit-for-bit proof.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch
from torch import nn

from .router import Router
from .routing import Plan, load_balancing_loss, make_plan


def expert_mlp(hidden: int, ffn: int) -> nn.Sequential:
    """One expert: Linear hidden -> ffn, GELU, Linear ffn -> hidden (the transformer's MLP)."""
    return nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))


@dataclasses.dataclass
class Stats:
    """What the last call routed (this rank's tokens), for logs and the benchmark."""

    routed: torch.Tensor  # (E,) pairs each expert was chosen for
    dropped: torch.Tensor  # (E,) pairs over its capacity
    aux: torch.Tensor  # (groups,) the balance loss, detached
    sent_rows: int = 0  # rows this rank sent to other ranks (dispatch, forward): 0 on one rank


def run_experts(experts: nn.ModuleList, rows: torch.Tensor, counts: List[int]) -> torch.Tensor:
    """Each expert on its own consecutive rows (counts[i] of them, in expert order); an expert
    with no rows is still run on an empty matrix, so its gradient is zeros on every layout."""
    return torch.cat([expert(part) for expert, part in zip(experts, rows.split(counts))])


def combine(rows: torch.Tensor, plan: Plan, weights: torch.Tensor) -> torch.Tensor:
    """y_t = sum over slots k of weights[t, k] x the expert output of pair (t, k), added in slot
    order (elementwise, so the same bits on every layout); a dropped pair's output is zero."""
    tokens, k = weights.shape
    slots = rows.new_zeros(tokens * k, rows.shape[1]).index_copy(0, plan.order, rows).view(tokens, k, -1)
    y = weights[:, 0:1] * slots[:, 0]
    for slot in range(1, k):
        y = y + weights[:, slot:slot + 1] * slots[:, slot]
    return y


def groups_of(x: torch.Tensor, groups: Optional[int]) -> int:
    return groups if groups is not None else (x.shape[0] if x.dim() == 3 else 1)


class MoE(nn.Module):
    def __init__(self, hidden: int, experts: int, top_k: int = 1, ffn: Optional[int] = None,
                 capacity_factor: Optional[float] = None):
        super().__init__()
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be above 0 (or None for no capacity), got {capacity_factor}")
        self.hidden, self.n_experts, self.top_k, self.capacity_factor = hidden, experts, top_k, capacity_factor
        self.router = Router(hidden, experts, top_k)
        self.experts = nn.ModuleList(expert_mlp(hidden, ffn or 4 * hidden) for _ in range(experts))
        self.last: Optional[Stats] = None

    def forward(self, x: torch.Tensor, groups: Optional[int] = None, blocks: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
        """(y shaped like x, the balance loss per group)."""
        tokens = x.reshape(-1, self.hidden)
        g = groups_of(x, groups)
        probs, weights, chosen = self.router(tokens, blocks)
        plan = make_plan(chosen, self.n_experts, g, self.capacity_factor)
        aux = load_balancing_loss(probs, chosen, self.n_experts, g)
        out = run_experts(self.experts, tokens.index_select(0, plan.tokens_of_rows), plan.counts.tolist())
        self.last = Stats(plan.routed, plan.dropped, aux.detach())
        return combine(out, plan, weights).view(x.shape), aux
