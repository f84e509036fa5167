"""The expert- and context-parallel runs' gradient average: one flat all_reduce over the ranks that
hold the same parameters, divided by the number of ranks whose losses the gradient covers (which
is larger than the group for an expert: its gradient already holds its row's tokens).

    average_gradients(dense, group=None, divisor=world_size)      # every rank holds them
    average_gradients(experts, group=column, divisor=world_size)  # the ranks holding the same experts
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import collectives as C


def average_gradients(params, group, divisor: int) -> None:
    """Sum the parameters' gradients over `group` (skipped for a group of one), then divide by `divisor`."""
    grads = [p.grad for p in params]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if dist.get_world_size(group) > 1:
        C.all_reduce(flat, group=group)
    flat /= divisor
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
