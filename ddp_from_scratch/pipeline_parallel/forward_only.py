"""A pipeline's forward alone, for evaluation: every microbatch through every stage in order, no
graph kept and no backward, so no schedule is needed (torch.distributed.pipelining's schedules
have `eval()` for the same job).

    stage.agree_shapes(example)                       # once, as for training
    losses = forward_only(stage, inputs, targets)     # the last stage: each microbatch's loss; others: {}

Each rank runs its chunks in stage order for microbatch 0, then microbatch 1, and so on; a chunk
receives its input from the stage before (its shape from agree_shapes) and sends its output to the
stage after. Every pair of ranks sends and receives its messages in that one order, so none
waits for a message that is sent later. A DDP-wrapped chunk runs as its module (no reduction).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .stage import Stage


def _module(chunk):
    return getattr(chunk, "module", chunk)


@torch.no_grad()
def forward_only(stage: Stage, inputs: Optional[List[torch.Tensor]], targets: Optional[List[torch.Tensor]],
                 microbatches: int) -> Dict[int, torch.Tensor]:
    """The forward of `microbatches` microbatches through the pipeline; the last stage's losses."""
    last, losses, sends, local = stage.num_stages - 1, {}, [], {}
    for i in range(microbatches):
        for chunk, k in zip(stage.chunks, stage.stages):
            if k == 0:
                x = inputs[i]
            elif stage.owner(k - 1) == stage.rank:  # this rank's own previous chunk
                x = local.pop(k)
            else:
                dtype, shape = stage.input_meta[k]
                x = torch.empty(shape, dtype=dtype)
                dist.recv(x, stage.peer(k - 1), group=stage.group)
            with stage.autocast():
                y = _module(chunk)(x)
                if k == last:
                    losses[i] = stage.loss_fn(y, targets[i])
            if k == last:
                continue
            if stage.owner(k + 1) == stage.rank:
                local[k + 1] = y
            else:
                y = y.contiguous()
                sends.append((dist.isend(y, stage.peer(k + 1), group=stage.group), y))  # y kept until sent
    for work, _ in sends:
        work.wait()
    return losses
