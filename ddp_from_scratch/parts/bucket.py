"""Buckets: which gradients travel together, and where each one sits in its bucket's flat buffer.

A bucket is closed once it holds at least its byte limit (torch's rule; `runs_of_at_most` is the
other rule, closing before the cap, that the sharded stages use): a small first bucket (1 MiB) so that
communication starts early, then `bucket_cap_mb` (25 MiB by default). Parameters of different
dtypes or devices never share a bucket. The layouts are torch's (torch 2.13,
nn/parallel/distributed.py and the C++ Reducer), because with more than two ranks the sum's
rounding depends on where an element sits in the buffer, so only the same layout gives the same
bits:

- First iteration (`initial_layout`): one bucket holding every parameter in definition order.
  The definition order may not be the order gradients arrive in, so torch does not bucket until
  it has seen one backward. With find_unused_parameters=True (no rebuild follows), buckets of
  [first, cap] bytes are cut walking the definition order, and the list of buckets is reversed
  (the parameters inside a bucket stay in definition order).
- After the first backward (`rebuilt_layout`): buckets cut walking the order in which gradients
  actually became ready, [first, cap] bytes.

    layout = rebuilt_layout(params, ready_order, bucket_cap_bytes=25 << 20, first_bucket_bytes=1 << 20)
    print(describe(layout, params, names))
    buckets = build(params, layout)      # each: add() its gradients, launch() its all_reduce, unpack()

tests/ddp/test_bucket.py checks these against torch's own `_compute_bucket_assignment_by_size`.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

import collectives


@dataclasses.dataclass
class Bucket:
    """One flat buffer and the parameters whose gradients it carries, in buffer order.

    In each backward: add() writes each gradient into its slot as it arrives; once the last has
    arrived, launch() starts the buffer's all_reduce without waiting; after backward, unpack()
    waits for it and puts the averaged values into each parameter's .grad.
    """

    index: int
    param_indices: List[int]
    offsets: List[int]  # element offset of each parameter's gradient in the buffer
    buffer: torch.Tensor  # (total elements,)
    params: List[nn.Parameter] = dataclasses.field(default_factory=list)  # in buffer order
    pending: int = 0  # gradients still to arrive in this backward
    work: Optional[object] = None  # the async all_reduce in flight
    sent: Optional[torch.Tensor] = None  # the compressed copy on the wire (compress="fp16"/"bf16")
    views: List[torch.Tensor] = dataclasses.field(default_factory=list)  # each parameter's slot, shaped like it

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def view(self, position: int, like: torch.Tensor) -> torch.Tensor:
        """The slot of the `position`-th parameter of this bucket, shaped like it."""
        offset = self.offsets[position]
        return self.buffer[offset:offset + like.numel()].view_as(like)

    def add(self, position: int, grad: Optional[torch.Tensor], divisor: Optional[int]) -> None:
        """Put one gradient into its slot, divided by `divisor` (the world size) first, as torch's
        DDP does: the sum of world_size gradients then cannot overflow. divisor=None copies it as
        it is (compression divides after the cast, as torch's hooks do); grad=None (a parameter
        this forward did not use) writes zeros."""
        slot = self.views[position]
        if grad is None:
            slot.zero_()
        elif grad.data_ptr() == slot.data_ptr():  # gradient_as_bucket_view: already in place
            if divisor:
                slot.div_(divisor)
        elif divisor:
            torch.mul(grad, 1.0 / divisor, out=slot)
        else:
            slot.copy_(grad)
        self.pending -= 1

    def launch(self, group, world_size: int, compress: Optional[torch.dtype]) -> None:
        """Start the all_reduce of the buffer, or of a copy cast to `compress` (half the bytes)."""
        if compress is None:
            self.work = collectives.all_reduce(self.buffer, group=group, async_op=True)
        else:
            self.sent = self.buffer.to(compress).div_(world_size)  # cast, then divide: torch's hook order
            self.work = collectives.all_reduce(self.sent, group=group, async_op=True)

    def unpack(self, used: Optional[List[int]] = None, as_view: bool = False) -> None:
        """Wait for the all_reduce and put the averaged values into each parameter's .grad.

        used[i] == 0: no rank used parameter i, so its .grad stays as it is (torch does the same).
        A parameter with no .grad here (unused on this rank only) gets one; as_view=True makes
        it a view of its slot (gradient_as_bucket_view).
        """
        self.work.wait()
        if self.sent is not None:
            self.buffer.copy_(self.sent)  # decompress
        grads, views = [], []
        for i, p, slot in zip(self.param_indices, self.params, self.views):
            if used is not None and not used[i]:
                continue
            if p.grad is None:
                p.grad = slot if as_view else slot.clone()
            elif p.grad.data_ptr() != slot.data_ptr():
                grads.append(p.grad)
                views.append(slot)
        if grads:
            torch._foreach_copy_(grads, views)  # one call per bucket, not one per tensor


def runs_of_at_most(nbytes: Sequence[int], cap_bytes: float, order: Optional[Sequence[int]] = None) -> List[List[int]]:
    """Indices walking `order` (default 0, 1, ...), cut into consecutive runs of at most
    cap_bytes: a run closes *before* the index that would pass the cap, so only an item larger
    than the cap makes a run larger. ZeRO-1's and ZeRO-2's all-gathers after the step, ZeRO-2's
    reduce-scatter buckets and the buffer broadcast are cut this way. (torch's DDP buckets close
    *once* they reach their cap instead, and per dtype: `assign_buckets`.)"""
    runs: List[List[int]] = []
    now: List[int] = []
    size = 0
    for i in (range(len(nbytes)) if order is None else order):
        if now and size + nbytes[i] > cap_bytes:
            runs.append(now)
            now, size = [], 0
        now.append(i)
        size += nbytes[i]
    return runs + ([now] if now else [])


def assign_buckets(params: Sequence[torch.Tensor], order: Sequence[int], limits: Sequence[int]) -> List[List[int]]:
    """Parameter indices per bucket, walking `order`.

    Per (dtype, device): a bucket closes as soon as it holds at least its limit; that kind's k-th
    bucket has limit limits[min(k, len(limits) - 1)]. Closed buckets come in the order they
    closed, then the still-open ones (one per kind) in the order their kinds first appeared.
    """
    closed: List[List[int]] = []
    open_: Dict[tuple, List[int]] = {}
    size: Dict[tuple, int] = {}
    count: Dict[tuple, int] = {}  # buckets closed so far, per kind
    for i in order:
        p = params[i]
        kind = (p.dtype, p.device)
        open_.setdefault(kind, []).append(i)
        size[kind] = size.get(kind, 0) + p.numel() * p.element_size()
        if size[kind] >= limits[min(count.get(kind, 0), len(limits) - 1)]:
            closed.append(open_[kind])
            open_[kind], size[kind] = [], 0
            count[kind] = count.get(kind, 0) + 1
    return closed + [b for b in open_.values() if b]


def initial_layout(params: Sequence[torch.Tensor], bucket_cap_bytes: int, first_bucket_bytes: int,
                   find_unused_parameters: bool = False) -> List[List[int]]:
    """torch's layout for the first iteration (see the module docstring)."""
    if not find_unused_parameters:
        limits = [sys.maxsize]  # one bucket per kind
    elif first_bucket_bytes < bucket_cap_bytes:
        limits = [first_bucket_bytes, bucket_cap_bytes]
    else:
        limits = [bucket_cap_bytes]
    buckets = sorted(assign_buckets(params, range(len(params)), limits), key=min)
    return buckets[::-1]  # gradients arrive roughly in reverse definition order


def rebuilt_layout(params: Sequence[torch.Tensor], ready_order: Sequence[int], bucket_cap_bytes: int,
                   first_bucket_bytes: int) -> List[List[int]]:
    """torch's layout after the first backward: cut in the order gradients became ready."""
    return assign_buckets(params, ready_order, [first_bucket_bytes, bucket_cap_bytes])


def build(params: Sequence[torch.Tensor], layout: List[List[int]]) -> List[Bucket]:
    out = []
    for index, members in enumerate(layout):
        offsets, total = [], 0
        for i in members:
            offsets.append(total)
            total += params[i].numel()
        buffer = torch.zeros(total, dtype=params[members[0]].dtype, device=params[members[0]].device)
        b = Bucket(index, list(members), offsets, buffer, params=[params[i] for i in members], pending=len(members))
        b.views = [b.view(pos, params[i]) for pos, i in enumerate(members)]
        out.append(b)
    return out


def describe(layout: List[List[int]], params: Sequence[torch.Tensor], names: Sequence[str], verbose: bool = False) -> str:
    """The layout as a reader wants to see it: per bucket, its bytes and its parameters in buffer order.

    verbose=True lists every parameter with its element offset in the buffer, shape and bytes.
    """
    lines = []
    for index, members in enumerate(layout):
        nbytes = sum(params[i].numel() * params[i].element_size() for i in members)
        lines.append(f"bucket {index}: {len(members):3d} params, {nbytes / 2**20:8.3f} MiB  "
                     f"[{names[members[0]]} ... {names[members[-1]]}]")
        if verbose:
            offset = 0
            for i in members:
                p = params[i]
                lines.append(f"    {offset:>10d}  {names[i]:<40s} {str(tuple(p.shape)):<20s} {p.numel() * p.element_size():>10d} B")
                offset += p.numel()
    return "\n".join(lines)
