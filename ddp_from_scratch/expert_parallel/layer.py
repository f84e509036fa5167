"""The mixture-of-experts layer with its experts over the ranks of a group (expert parallelism),
made from the one-rank layer so both start from the same weights.

    ep = ExpertParallelMoE(moe, group)     # rank j keeps experts j x E/N ... (j + 1) x E/N - 1
    y, aux = ep(x)                         # x: this rank's tokens; y: their outputs
    (y * dy).sum().backward()
    ep.sync_router_grad()                  # the router is on every rank: its gradient summed over the group

Each rank routes its own tokens (the router is replicated), sorts them by expert, sends each
expert's rows to the rank that holds it (dispatch.py), runs its own experts, sends the outputs
back and combines them in its tokens' order: moe.py's four steps with the exchange between the
gather and the experts. Capacity and the balance loss are per group of tokens (routing.py), so no
rank needs another's tokens to route its own.

The router's gradient on each rank covers its tokens only. sync_router_grad adds the ranks'
gradients in rank order (an all_gather, then a sum on every rank), the order the one-rank layer
with blocks=N adds its blocks' (router.py), so the two agree bit for bit. In a training run the
data-parallel all_reduce of every replicated parameter does this job instead.
"""

from __future__ import annotations

import copy
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

import collectives as C

from .dispatch import combine_back, dispatch
from .moe import MoE, Stats, combine, groups_of, run_experts
from .routing import load_balancing_loss, make_plan


class ExpertParallelMoE(nn.Module):
    def __init__(self, full: MoE, group):
        super().__init__()
        n, r = dist.get_world_size(group), dist.get_rank(group)
        if full.n_experts % n:
            raise ValueError(f"{full.n_experts} experts do not spread evenly over the {n} ranks of the expert-parallel "
                             f"group: use a multiple of {n} experts")
        per = full.n_experts // n
        self.group, self.rank, self.size = group, r, n
        self.hidden, self.n_experts, self.top_k = full.hidden, full.n_experts, full.top_k
        self.capacity_factor = full.capacity_factor
        self.first_expert = r * per
        self.router = copy.deepcopy(full.router)
        self.experts = nn.ModuleList(copy.deepcopy(full.experts[e]) for e in range(r * per, (r + 1) * per))
        self.last: Optional[Stats] = None

    def forward(self, x: torch.Tensor, groups: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """(y shaped like x, the balance loss of each of this rank's groups)."""
        tokens = x.reshape(-1, self.hidden)
        g = groups_of(x, groups)
        probs, weights, chosen = self.router(tokens)
        plan = make_plan(chosen, self.n_experts, g, self.capacity_factor)
        aux = load_balancing_loss(probs, chosen, self.n_experts, g)
        rows = tokens.index_select(0, plan.tokens_of_rows)  # sorted by expert: by destination rank
        mine, sent = dispatch(rows, plan.counts, self.group)
        out = combine_back(run_experts(self.experts, mine, sent.local_counts), sent)
        self.last = Stats(plan.routed, plan.dropped, aux.detach(), sent.sent_elsewhere(self.rank))
        return combine(out, plan, weights).view(x.shape), aux

    def sync_router_grad(self) -> None:
        """Every rank's router gradient becomes the sum of all of them, added in rank order."""
        grad = self.router.weight.grad
        if grad is None:
            raise RuntimeError("sync_router_grad: the router has no gradient yet; call it after backward")
        parts = C.all_gather(grad.unsqueeze(0), group=self.group)  # (N, E, hidden)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        grad.copy_(total)
