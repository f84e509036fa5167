"""Buckets: which gradients travel together, and where each one sits in its bucket's flat buffer.

Gradients are grouped in the order they are expected to become ready (reverse parameter order
at first, then the order actually seen in the first backward), and a bucket is closed once it
holds at least its byte cap: a small first bucket (1 MiB) so that communication starts early,
then `bucket_cap_mb` (25 MiB by default). Parameters of different dtypes never share a bucket.

    layout = assign_buckets(params, order, bucket_cap_bytes=25 << 20, first_bucket_bytes=1 << 20)
    print(describe(layout, names))
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

import torch


@dataclasses.dataclass
class Bucket:
    """One flat buffer and the parameters whose gradients it carries, in buffer order."""

    index: int
    param_indices: List[int]
    offsets: List[int]  # element offset of each parameter's gradient in the buffer
    buffer: torch.Tensor  # (total elements,)
    pending: int = 0  # gradients still to arrive in this backward
    work: Optional[object] = None  # the async all_reduce in flight
    sent: Optional[torch.Tensor] = None  # the compressed copy on the wire (compress="fp16"/"bf16")

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def assign_buckets(params: Sequence[torch.Tensor], order: Sequence[int], bucket_cap_bytes: int,
                   first_bucket_bytes: int) -> List[List[int]]:
    """Parameter indices per bucket, walking `order`; a bucket closes once it reaches its cap."""
    buckets: List[List[int]] = []
    open_by_dtype: Dict[torch.dtype, List[int]] = {}
    size_by_dtype: Dict[torch.dtype, int] = {}
    for i in order:
        p = params[i]
        current = open_by_dtype.setdefault(p.dtype, [])
        current.append(i)
        size_by_dtype[p.dtype] = size_by_dtype.get(p.dtype, 0) + p.numel() * p.element_size()
        cap = first_bucket_bytes if not buckets else bucket_cap_bytes
        if size_by_dtype[p.dtype] >= cap:
            buckets.append(current)
            open_by_dtype[p.dtype], size_by_dtype[p.dtype] = [], 0
    buckets += [b for b in open_by_dtype.values() if b]
    return buckets


def build(params: Sequence[torch.Tensor], layout: List[List[int]]) -> List[Bucket]:
    out = []
    for index, members in enumerate(layout):
        offsets, total = [], 0
        for i in members:
            offsets.append(total)
            total += params[i].numel()
        buffer = torch.zeros(total, dtype=params[members[0]].dtype, device=params[members[0]].device)
        out.append(Bucket(index, list(members), offsets, buffer, pending=len(members)))
    return out


def describe(buckets: List[Bucket], names: Sequence[str]) -> str:
    """The layout as a reader wants to see it: per bucket, its bytes and its parameters in order."""
    lines = []
    for b in buckets:
        first, last = names[b.param_indices[0]], names[b.param_indices[-1]]
        lines.append(f"bucket {b.index}: {len(b.param_indices):3d} params, {b.nbytes / 2**20:8.3f} MiB  "
                     f"[{first} ... {last}]")
    return "\n".join(lines)
