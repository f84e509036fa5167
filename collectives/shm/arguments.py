"""What the shm backend checks in a raw torch.distributed call's arguments before it moves a byte,
as Gloo checks them: every tensor on the CPU, outputs that fit their inputs (sizes, list
lengths, dtypes) and can be written element by element, and an op that makes sense for the dtype. Each check returns "" when the arguments are fine, else what is wrong, for
ShmBackend to refuse the call with (protocol.ShmArgumentError, naming the call and the rank).

    why = wrong_sizes(output, input, world_size, "output", "input")   # all_gather_into_tensor
    aliased = overlap(output, input)                                    # reduce_scatter into its own input
"""

from __future__ import annotations

from typing import List

import torch

from collectives.errors import CollectiveError
from collectives.reduce_ops import check_op_dtype


def _span(t: torch.Tensor):
    """The bytes a tensor's elements can touch, as (start, end) addresses."""
    extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def _first(tensors: dict, is_bad, say) -> str:
    """say(where, tensor) for the first tensor that is_bad(tensor) ("" if none): tensors are
    {name: a tensor or a list of them (lists nested)}, named name[i] inside a list. On every
    call's path, so the name is only made for a tensor found wrong."""
    for name, value in tensors.items():
        if not isinstance(value, (list, tuple)):
            if is_bad(value):
                return say(name, value)
            continue
        for i, t in enumerate(value):
            if isinstance(t, (list, tuple)):
                found = _first({f"{name}[{i}]": t}, is_bad, say)
                if found:
                    return found
            elif is_bad(t):
                return say(f"{name}[{i}]", t)
    return ""


def wrong_devices(**tensors) -> str:
    """"" when every tensor is a dense tensor on the CPU (lists allowed), else which one is not and
    what to do instead."""
    return _first(tensors, lambda t: t.layout != torch.strided,
                  lambda where, t: f"{where} is a sparse tensor ({str(t.layout).replace('torch.', '')}); the shm backend "
                                   "moves dense tensors only: pass t.to_dense(), or use a Gloo group, which sums "
                                   "sparse COO tensors") or \
        _first(tensors, lambda t: t.device.type != "cpu",
               lambda where, t: f"{where} is on {t.device}; the shm backend moves CPU tensors only")


def _shares_elements(t: torch.Tensor) -> bool:
    """Whether two of a tensor's elements are one memory location (an expand()ed or stride-0
    view): writing the result into it cannot work, and torch's copy refuses it mid-call. A
    contiguous tensor cannot (the common case, answered first)."""
    if t.is_contiguous():
        return False
    if any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):
        return True
    has_overlap = getattr(torch, "_debug_has_internal_overlap", None)
    return bool(has_overlap) and has_overlap(t) == 1  # 1: yes; 0: no; 2: too hard to tell (then no)


def unwritable(**tensors) -> str:
    """"" when every output (lists allowed) can take a result element by element, else which
    one cannot."""
    return _first(tensors, _shares_elements,
                  lambda where, t: f"{where} has elements that share memory (an expanded or stride-0 view, strides "
                                   f"{list(t.stride())}), so the result cannot be written into it; pass a tensor that "
                                   "owns its elements (.clone() or .contiguous())")


def wrong_op(op: str, collective: str, tensors) -> str:
    """"" when `op` makes sense for every tensor's dtype (the rule every backend here applies,
    reduce_ops.check_op_dtype), else why not."""
    for t in tensors:
        try:
            check_op_dtype(op, t.dtype, collective)
        except CollectiveError as exc:
            return str(exc).split(": ", 1)[1]
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


def wrong_splits(output: torch.Tensor, input: torch.Tensor, out_splits: List[int], in_splits: List[int],
                 size: int) -> str:
    """all_to_all_single: rows of the same shape and dtype on both sides, split sizes (one per
    rank, adding up to the rows) or rows that split evenly over the ranks."""
    if output.dtype != input.dtype:
        return f"output is {output.dtype} and input {input.dtype}; they must be the same dtype"
    if output.dim() == 0 or input.dim() == 0:
        return "output and input must have at least one dimension (their rows are split over the ranks)"
    if output.shape[1:] != input.shape[1:]:
        return f"output rows are {list(output.shape[1:])} and input rows {list(input.shape[1:])}; they must match"
    for name, t, splits in (("output", output, out_splits), ("input", input, in_splits)):
        if splits:
            if len(splits) != size:
                return f"{name}_split_sizes has {len(splits)} entries; it must have one per rank ({size})"
            if min(splits) < 0 or sum(splits) != t.shape[0]:
                return f"{name}_split_sizes {list(splits)} must be >= 0 and add up to {name}'s {t.shape[0]} rows"
        elif t.shape[0] % size:
            return (f"{name} has {t.shape[0]} rows, which do not split evenly over {size} ranks; "
                    f"give {name}_split_sizes")
    return ""
