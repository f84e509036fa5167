"""Step 2 of the teaching path: every gradient in one flat buffer, one all_reduce after backward.

One message instead of one per parameter, so the fixed latency is paid once; but it still waits
for the whole backward, and needs a copy in and out of the flat buffer. Step 3 (ddp.py) splits
the buffer into buckets sent while backward is still running.

    model = FlatDataParallel(resnet50(10))
"""

from __future__ import annotations

import torch

import collectives

from ..parts.base import DataParallelBase


class FlatDataParallel(DataParallelBase):
    def _sync(self) -> None:
        grads = [p.grad for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads]).mul_(1.0 / self.world_size)  # (total elements,)
        collectives.all_reduce(flat, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
