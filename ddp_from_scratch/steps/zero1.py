"""Step 4 of the teaching path: ZeRO-1, the optimizer's state sharded.

Plain data parallelism keeps on every rank a full copy of the parameters, their gradients and
the optimizer's state (SGD's momentum: one more tensor per parameter; Adam's: two). Every rank
then runs the same update on the same numbers. ZeRO-1 (Rajbhandari et al. 2020) splits the
update instead: after the gradients are averaged as in step 2 (one flat all_reduce), rank r
updates only its shard of each parameter (sharding.py: rows r of every parameter) with optimizer
state for that shard alone, and an all_gather puts the updated shards back together on every
rank. The optimizer state per rank shrinks p times; the bytes sent grow by one all_gather.

    model = ZeroOneDataParallel(net)
    opt = model.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)   # state for this rank's shard
    loss.backward(); opt.step(); opt.zero_grad()

The update is elementwise, so updating each shard and gathering gives exactly the full update:
bitwise equal to torch's DDP at 2, 3 and 4 ranks (the same buckets, so the same sums;
tests/ddp/test_zero.py). Against torch's fully_shard it is bitwise at 2 ranks only: with more,
Gloo's all_reduce and its reduce_scatter add the ranks' values in different orders.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

from .ddp import DistributedDataParallel
from ..parts.sharding import ShardedStage


class ZeroOneDataParallel(ShardedStage, DistributedDataParallel):
    """The bucketed DDP (ddp.py), whose averaged gradients feed an optimizer over this rank's
    shards (sharding.py), and an all-gather of the updated shards after each step."""

    def __init__(self, module: nn.Module, group: Optional[dist.ProcessGroup] = None, broadcast_buffers: bool = True,
                 gather_cap_mb: float = 25, **ddp_options):
        """gather_cap_mb: the after-step all_gather goes in groups of at most this many MiB
        (sharding.py). Other options are DDP's (ddp.py): its buckets carry the gradients here."""
        super().__init__(module, group=group, broadcast_buffers=broadcast_buffers, **ddp_options)
        self._shard(gather_cap_mb)

    def grad_shards(self) -> List[Optional[torch.Tensor]]:
        """After DDP's all_reduce every rank has the whole averaged gradient: take its rows."""
        return [None if p.grad is None else self.shard_layout.shard(p.grad, i, self.rank)
                for i, p in enumerate(self.params)]
