"""Step 1 of the teaching path: one all_reduce per parameter, after backward.

The simplest correct data parallelism. It sends one message per parameter (161 for ResNet-50),
each paying the collective's fixed latency, and starts only when backward has finished, so no
communication overlaps computation. Step 2 (flat.py) fixes the first; step 3 (ddp.py) both.

    model = NaiveDataParallel(resnet50(10))   # then train as usual
"""

from __future__ import annotations

import collectives

from ..parts.base import DataParallelBase


class NaiveDataParallel(DataParallelBase):
    def _sync(self) -> None:
        for param in self.params:
            param.grad.mul_(1.0 / self.world_size)  # scale first, as torch's DDP does
            collectives.all_reduce(param.grad, group=self.group)
