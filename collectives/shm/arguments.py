"""What the shm backend checks in a raw torch.distributed call's arguments before it moves a byte,
as Gloo checks them: every tensor on the CPU, and outputs that fit their inputs (sizes, list
lengths, dtypes). Each check returns "" when the arguments are fine, else what is wrong, for
ProcessGroupShm to refuse the call with (ops.ShmArgumentError, naming the call and the rank).

    why = wrong_sizes(output, input, world_size, "output", "input")   # all_gather_into_tensor
    aliased = overlap(output, input)                                    # reduce_scatter into its own input
"""

from __future__ import annotations

from typing import List

import torch


def _span(t: torch.Tensor):
    """The bytes a tensor's elements can touch, as (start, end) addresses."""
    extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def wrong_devices(**tensors) -> str:
    """"" when every tensor is on the CPU (lists allowed), else which one is not."""
    for name, value in tensors.items():
        for i, t in enumerate(value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(t, (list, tuple)):
                bad = wrong_devices(**{f"{name}[{i}]": t})
                if bad:
                    return bad
            elif t.device.type != "cpu":
                where = f"{name}[{i}]" if isinstance(value, (list, tuple)) else name
                return f"{where} is on {t.device}; the shm backend moves CPU tensors only"
    return ""


def wrong_sizes(whole: torch.Tensor, part: torch.Tensor, size: int, whole_name: str, part_name: str) -> str:
    """What is wrong ("" if nothing) with a pair where `whole` must hold world_size of `part`, as
    Gloo checks it: all_gather's output and input, reduce_scatter's input and output."""
    if whole.dtype != part.dtype:
        return f"{whole_name} is {whole.dtype} and {part_name} {part.dtype}; they must be the same dtype"
    if whole.numel() != size * part.numel():
        return (f"{whole_name} has {whole.numel()} elements; it must have world_size x {part_name}'s, "
                f"{size} x {part.numel()} = {size * part.numel()}")
    return ""


def wrong_list(tensors: List[torch.Tensor], like: torch.Tensor, size: int, name: str) -> str:
    """What is wrong with a list that must hold one tensor per rank, each like `like`."""
    if len(tensors) != size:
        return f"{name} has {len(tensors)} tensors; it must have one per rank ({size})"
    for q, t in enumerate(tensors):
        if t.dtype != like.dtype or t.numel() != like.numel():
            return (f"{name}[{q}] is {t.numel()} x {t.dtype}; every one must match the other side's "
                    f"{like.numel()} x {like.dtype}")
    return ""
