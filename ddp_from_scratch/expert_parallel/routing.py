"""Where each token goes: the router's top-k choices turned into a dispatch plan, with the
capacity that drops tokens and the auxiliary loss that balances the load. Pure tensor arithmetic,
no messages: the one-rank layer and every expert-parallel rank run it on their own tokens.

    plan = make_plan(experts_chosen, experts=4, groups=2, capacity_factor=1.25)
    plan.order        # the kept (token, slot) pairs, sorted by expert, then token: what the experts read
    plan.counts       # (E,) kept pairs per expert
    plan.dropped      # (E,) pairs an expert had no room for
    aux = load_balancing_loss(probs, experts_chosen, experts=4, groups=2)   # (groups,)

Tokens come in `groups` of equal size (GShard's groups: here each sequence, or each rank's
block). Capacity and the balance loss are per group, so a group's routing never depends on
another group's tokens, and any layout of groups over ranks routes every token the same way.

Capacity (GShard, Switch): an expert takes at most C = ceil(capacity_factor x T x k / E) pairs
from a group of T tokens. Pairs claim places in priority order, every token's first choice
before any second choice, and by token within a choice; the pairs past C are dropped: that slot
of the token adds nothing to its output (the residual stream carries the token on), and the drop
is counted in `plan.dropped`, never lost without a word. capacity_factor=None: no capacity, no
drops.

The auxiliary load-balancing loss (Switch Transformer, eq. 4), per group:

    aux = E x sum_e f_e x P_e
    f_e = (pairs routed to expert e) / (T x k)      the share of the group's choices e got (no gradient)
    P_e = (1/T) sum_t p_e(t)                        the mean router probability of e

It is 1 when both are uniform (1/E each) and grows as the router favours the experts it already
sends most to; its gradient reaches the router through P. f counts the choices before any drop.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class Plan:
    """The dispatch of one layer's tokens (the rows of one rank, or all of them on one rank)."""

    order: torch.Tensor  # (kept,) flat pair indices t * k + slot, sorted by (expert, token)
    counts: torch.Tensor  # (E,) kept pairs per expert, in expert order: the rows each expert reads
    routed: torch.Tensor  # (E,) pairs routed to each expert before the capacity
    dropped: torch.Tensor  # (E,) routed - counts
    capacity: Optional[int]  # per expert per group; None without a capacity
    top_k: int

    @property
    def tokens_of_rows(self) -> torch.Tensor:
        """(kept,) the token each expert row is, in the rows' order."""
        return self.order // self.top_k


def capacity_of(group_tokens: int, top_k: int, experts: int, capacity_factor: Optional[float]) -> Optional[int]:
    """C = ceil(capacity_factor x T x k / E), or None without a capacity factor."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * group_tokens * top_k / experts)


def _per_group(tokens: int, groups: int) -> int:
    if groups < 1 or tokens % groups:
        raise ValueError(f"{tokens} tokens do not make {groups} equal groups")
    return tokens // groups


def make_plan(chosen: torch.Tensor, experts: int, groups: int = 1, capacity_factor: Optional[float] = None) -> Plan:
    """The plan for `chosen` (tokens, k), the experts each token picked (router.py).

    Args:
        chosen: (tokens, k) expert indices; tokens a multiple of `groups`.
        experts: E, the number of experts.
        groups: the tokens' equal groups, each with its own capacity.
        capacity_factor: C's factor, or None for no capacity.
    """
    tokens, k = chosen.shape
    per = _per_group(tokens, groups)
    hot = F.one_hot(chosen, experts)  # (tokens, k, E)
    routed = hot.sum(dim=(0, 1))
    keep = torch.ones(tokens, k, dtype=torch.bool)
    capacity = capacity_of(per, k, experts, capacity_factor)
    if capacity is not None:
        # places claimed in priority order inside each group: all first choices, then all second ...
        claims = hot.view(groups, per, k, experts).transpose(1, 2).reshape(groups, k * per, experts)
        place = (claims.cumsum(dim=1) * claims).sum(dim=-1) - 1  # (groups, k * per): the pair's place at its expert
        keep = (place < capacity).view(groups, k, per).transpose(1, 2).reshape(tokens, k)
    expert_of_pair = chosen.reshape(-1)
    token_of_pair = torch.arange(tokens).repeat_interleave(k)
    kept = keep.reshape(-1).nonzero().squeeze(1)
    key = expert_of_pair[kept] * tokens + token_of_pair[kept]  # sorted by expert, then by token
    order = kept[key.argsort()]
    counts = torch.bincount(expert_of_pair[order], minlength=experts)
    return Plan(order=order, counts=counts, routed=routed, dropped=routed - counts, capacity=capacity, top_k=k)


def load_balancing_loss(probs: torch.Tensor, chosen: torch.Tensor, experts: int, groups: int = 1) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, one value per group: E x sum_e f_e x P_e (the module's
    docstring). probs: (tokens, E) router probabilities; chosen: (tokens, k)."""
    tokens, k = chosen.shape
    per = _per_group(tokens, groups)
    f = F.one_hot(chosen, experts).view(groups, per * k, experts).sum(dim=1).to(probs.dtype) / (per * k)  # (G, E)
    p = probs.view(groups, per, experts).mean(dim=1)  # (G, E)
    return experts * (f * p).sum(dim=-1)
