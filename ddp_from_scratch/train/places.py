"""Where each of a rank's parameter elements sits in the one-rank model: the map that puts a
tensor-, pipeline- or context-parallel model back together whole (for --sample) and lets a
checkpoint written on one layout load into another (train/sharded_checkpoint.py).

    places = element_places(full, build)       # build(model) -> the rank's parameters, made from `model`
    whole = gather_whole(params, places)       # the one-rank model's parameters as one flat vector, every rank
    load_flat(full_model, whole)               # ... into a one-rank model
    mine = take(whole, places)                 # the rank's parameters (or momentum) cut from one

The map is found, not written down per layout: a copy of the one-rank model, in float64, has
every element set to its own index in the model's flat parameter vector (the parameters in
`full.parameters()` order), and the layout's own code splits that copy as it splits the real
model. Each element a rank ends up with then holds the index of the element it came from. A
column-parallel weight's rows, a row-parallel weight's columns, a pipeline stage's layers, a
replicated LayerNorm: the same code finds them all, and a layout added later needs no entry here.
A parameter the split made up instead of copying (no whole-number indices in it) is refused.
"""

from __future__ import annotations

import copy
from typing import Callable, List, Sequence

import torch
import torch.distributed as dist
from torch import nn


def element_places(full: nn.Module, build: Callable[[nn.Module], Sequence[torch.Tensor]]) -> List[torch.Tensor]:
    """For each parameter `build` gives (build(copy of full) must make the rank's parameters as
    the run makes them from `full`), the int64 indices of its elements in the one-rank flat vector."""
    probe = copy.deepcopy(full).double()
    offset = 0
    with torch.no_grad():
        for p in probe.parameters():
            p.copy_(torch.arange(offset, offset + p.numel(), dtype=torch.float64).view_as(p))
            offset += p.numel()
    places = []
    for k, q in enumerate(build(probe)):
        flat = q.detach().reshape(-1)
        if flat.numel() and (not torch.equal(flat, flat.round()) or flat.min() < 0 or flat.max() >= offset):
            raise ValueError(f"parameter {k} of this rank ({tuple(q.shape)}) is not made of the one-rank model's "
                             "elements: the split must copy them (a new parameter has no place to go back to)")
        places.append(flat.long())
    return places


def size_of(full: nn.Module) -> int:
    return sum(p.numel() for p in full.parameters())


def take(whole: torch.Tensor, places: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The rank's tensors (flat, one per parameter) cut from a one-rank flat vector."""
    return [whole[idx].clone() for idx in places]


def assemble(pieces, total: int, what: str = "the ranks' parameters") -> torch.Tensor:
    """One flat vector of `total` elements from (indices, values) pairs; a ValueError naming how
    many elements no piece held. Replicas write the same place with the same value."""
    whole = torch.empty(total, dtype=torch.float32)
    covered = torch.zeros(total, dtype=torch.bool)
    for idx, values in pieces:
        whole[idx] = values.to(torch.float32)
        covered[idx] = True
    if not bool(covered.all()):
        raise ValueError(f"{what} cover {int(covered.sum())} of the one-rank model's {total} elements")
    return whole


def gather_whole(params: Sequence[torch.Tensor], places: Sequence[torch.Tensor], total: int,
                 group=None) -> torch.Tensor:
    """The one-rank model's flat parameter vector, on every rank of `group`, from every rank's parameters."""
    mine = (torch.cat([idx for idx in places]), torch.cat([p.detach().reshape(-1) for p in params]))
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return assemble([mine], total)
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return assemble(everyone, total)


def load_flat(model: nn.Module, whole: torch.Tensor) -> nn.Module:
    """Put a flat vector (full.parameters() order) into `model`'s parameters; returns the model."""
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            p.copy_(whole[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    return model
