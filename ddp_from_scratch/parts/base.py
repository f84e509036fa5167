"""What every data-parallel wrapper here shares; the subclasses differ only in how gradients move.

- At construction: check that every rank has the same parameter names and shapes (an error
  naming the ranks that differ, not a hang), then broadcast parameters and buffers from the
  group's first rank, so every replica starts equal.
- Before each forward: broadcast buffers (BatchNorm running statistics) from that rank, as
  torch's DDP does with broadcast_buffers=True, packed into one message per dtype.
- During backward: a hook on every parameter fires after its gradient is accumulated
  (`register_post_accumulate_grad_hook` hands the hook the *parameter*; its gradient is
  `param.grad`).

A subclass says how gradients move through one of two extension points:
- `_sync()`: after backward, once every gradient has arrived (steps 1 and 2, naive.py and
  flat.py, override this);
- `_grad_ready(param)`: each gradient as it arrives (step 3, ddp.py, overrides this to start
  communication while backward is still running; the default counts arrivals and calls
  `_sync()` after the last).

Every wrapper also has `no_sync()` (gradients accumulate locally inside it; the next backward
outside it syncs them) and `timeline` (the last backward's events, timeline.py; None unless the
wrapper records one).

Gradients are scaled by 1 / world_size before they are summed, as torch's DDP does, so that the
sum cannot overflow in low precision and the result matches torch's bit for bit.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

import collectives

from .bucket import runs_of_at_most
from .timeline import NoTimeline, Timeline


class DataParallelBase(nn.Module):
    """Wrap `module`; after backward every rank holds the gradient averaged over the group."""

    def __init__(self, module: nn.Module, group: Optional[dist.ProcessGroup] = None, broadcast_buffers: bool = True,
                 timeline: bool = False):
        super().__init__()
        self.module = module
        self.group = group
        self.broadcast_buffers = broadcast_buffers
        self.world_size = dist.get_world_size(group)
        self.src = dist.get_process_group_ranks(group or dist.group.WORLD)[0]
        self.named_params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in self.named_params]
        self._index = {id(p): i for i, (_, p) in enumerate(self.named_params)}  # parameter -> its position
        self.record_timeline = timeline
        self._recorder: Timeline = NoTimeline()
        self._syncing = True
        # where small bookkeeping tensors (checksums, orders, flags) go: NCCL takes CUDA tensors only
        first = next(module.parameters(), None)
        self.meta_device = first.device if first is not None and first.is_cuda and \
            str(dist.get_backend(group)).lower() == "nccl" else torch.device("cpu")
        self._check_same_parameters()
        self._broadcast_coalesced([t.data for t in list(module.parameters()) + list(module.buffers())])
        self._buffers_to_sync = list(module.buffers())
        self._ready = 0
        for _, param in self.named_params:
            param.register_post_accumulate_grad_hook(self._grad_ready)

    @property
    def params(self) -> List[nn.Parameter]:
        return [p for _, p in self.named_params]

    @property
    def timeline(self) -> Optional[dict]:
        """The last backward's events (timeline.py; trace.py draws them), or None when not recorded."""
        return self._recorder.events

    def _new_timeline(self) -> Timeline:  # pragma: no cover - each recording wrapper says what its lanes are
        """Extension point: an empty recorder for the next backward (timeline=True only)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients accumulate locally inside the block; the next backward outside it syncs them all."""
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def _check_same_parameters(self) -> None:
        signature = repr([(n, tuple(p.shape), str(p.dtype)) for n, p in self.named_params])
        mine = torch.tensor([zlib.crc32(signature.encode())], dtype=torch.int64, device=self.meta_device)
        everyone = collectives.all_gather(mine, group=self.group).tolist()
        if len(set(everyone)) > 1:
            ranks = dist.get_process_group_ranks(self.group or dist.group.WORLD)
            groups = {}
            for rank, value in zip(ranks, everyone):
                groups.setdefault(value, []).append(rank)
            raise collectives.CollectiveError(
                f"{type(self).__name__}: the ranks' models differ in parameter names, shapes or dtypes; "
                f"ranks grouped by identical models: {sorted(groups.values())}"
            )

    def _broadcast_coalesced(self, tensors: List[torch.Tensor], chunk_bytes: int = 250 << 20) -> None:
        """Broadcast `tensors` from the group's first rank, packed into few flat messages.

        One collective per dtype (and per 250 MiB, as torch's DDP does) instead of one per tensor:
        ResNet-50 has 159 BatchNorm buffers, and each collective costs tens of microseconds.
        """
        by_kind = {}
        for t in tensors:
            by_kind.setdefault((t.dtype, t.device), []).append(t)
        with torch.no_grad():
            for group_of_kind in by_kind.values():
                runs = runs_of_at_most([t.numel() * t.element_size() for t in group_of_kind], chunk_bytes)
                chunks = [[group_of_kind[i] for i in run] for run in runs]
                for chunk in chunks:
                    flat = torch.cat([t.reshape(-1) for t in chunk])
                    collectives.broadcast(flat, src=self.src, group=self.group)
                    pieces = flat.split([t.numel() for t in chunk])
                    torch._foreach_copy_(chunk, [p.view_as(t) for p, t in zip(pieces, chunk)])  # one call, not one per tensor

    def forward(self, *args, **kwargs):
        if self.record_timeline:  # before the buffers' broadcast: the timeline starts with the forward
            self._recorder = self._new_timeline()
        if self.broadcast_buffers and self.world_size > 1 and self._buffers_to_sync:
            self._broadcast_coalesced(self._buffers_to_sync)
        self._ready = 0
        return self.module(*args, **kwargs)

    def _grad_ready(self, param: nn.Parameter) -> None:
        """Extension point: one parameter's gradient has just been accumulated."""
        if not self._syncing:
            return
        self._ready += 1
        if self._ready == len(self.named_params):
            self._sync()

    def _sync(self) -> None:  # pragma: no cover - each subclass says how gradients move
        """Extension point: every gradient of this backward has arrived."""
        raise NotImplementedError
