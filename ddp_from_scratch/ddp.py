"""Step 3 of the teaching path: gradient buckets, all-reduced while backward is still running.

    model = DistributedDataParallel(resnet50(10), bucket_cap_mb=25)
    loss = criterion(model(x), y); loss.backward()   # every rank now holds the averaged gradient
    with model.no_sync(): ...                        # accumulate locally, sync on the next backward

How it works: a hook on each parameter fires as soon as its gradient has been accumulated
(`register_post_accumulate_grad_hook` hands the hook the parameter, not the gradient). The hook
copies grad / world_size into the parameter's slot of its bucket's flat buffer; when a bucket's
last gradient has arrived, its all_reduce starts asynchronously, in bucket order (every rank
must issue the same collectives in the same order). When the last gradient of the backward has
arrived, we wait for every bucket and copy the averaged values back into `param.grad`. After the
first backward, the buckets are rebuilt once from the order in which gradients actually became
ready (rank 0's order, broadcast so that every rank agrees).
"""

from __future__ import annotations

import contextlib
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

import collectives

from . import bucket as bucketing
from .base import DataParallelBase

MiB = 1 << 20


class DistributedDataParallel(DataParallelBase):
    def __init__(self, module: nn.Module, group: Optional[dist.ProcessGroup] = None, bucket_cap_mb: float = 25,
                 first_bucket_mb: float = 1, broadcast_buffers: bool = True, compress: Optional[str] = None):
        """Args:
            bucket_cap_mb: bucket size in MiB (the first bucket is first_bucket_mb).
            broadcast_buffers: send rank 0's buffers (BatchNorm statistics) before each forward.
            compress: None, "fp16" or "bf16": send each bucket in that dtype (half the bytes), as
                torch's fp16_compress_hook / bf16_compress_hook do.
        """
        super().__init__(module, group=group, broadcast_buffers=broadcast_buffers)
        if compress not in (None, "fp16", "bf16"):
            raise ValueError(f"compress must be None, 'fp16' or 'bf16', got {compress!r}")
        self.compress = {None: None, "fp16": torch.float16, "bf16": torch.bfloat16}[compress]
        self.bucket_cap_bytes = int(bucket_cap_mb * MiB)
        self.first_bucket_bytes = int(first_bucket_mb * MiB)
        self.names = [n for n, _ in self.named_params]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._set_layout(list(reversed(range(len(self.params)))))  # gradients arrive roughly in reverse
        self._ready_order: Optional[list] = []  # recorded during the first backward, then None
        self._next_launch = 0
        self._syncing = True
        self._seen: set = set()  # parameter indices whose gradient arrived in this backward
        self._callback_queued = False
        self.timeline: Optional[dict] = None  # the last backward's events (see trace.py)
        self.layouts = {"initial": self.layout()}

    def _set_layout(self, order) -> None:
        layout = bucketing.assign_buckets(self.params, order, self.bucket_cap_bytes, self.first_bucket_bytes)
        self.buckets = bucketing.build(self.params, layout)
        self._where = {}  # parameter index -> (bucket, offset)
        for b in self.buckets:
            for i, offset in zip(b.param_indices, b.offsets):
                self._where[i] = (b, offset)

    def layout(self) -> str:
        """The current bucket layout (parameters, bytes, order), for printing."""
        return bucketing.describe(self.buckets, self.names)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients accumulate locally inside the block; the next backward outside it syncs them all."""
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def forward(self, *args, **kwargs):
        if self._ready_order:  # the first backward has happened: rebuild once from what it showed
            order = torch.tensor(self._ready_order, dtype=torch.int64)
            collectives.broadcast(order, src=self.src, group=self.group)
            self._set_layout(order.tolist())
            self._ready_order = None
            self.layouts["rebuilt"] = self.layout()
        for b in self.buckets:
            b.pending, b.work = len(b.param_indices), None
        self._next_launch = 0
        self._seen, self._callback_queued = set(), False
        self.timeline = {"start": time.perf_counter(), "ready": [], "launch": {}, "done": {}, "end": None,
                         "buckets": [[self.names[i] for i in b.param_indices] for b in self.buckets],
                         "bytes": [b.nbytes for b in self.buckets]}
        return super().forward(*args, **kwargs)

    def _grad_ready(self, param: nn.Parameter) -> None:
        if not self._syncing:
            return
        i = self._index[id(param)]
        self._seen.add(i)
        if self.timeline is not None:
            self.timeline["ready"].append((self.names[i], self._where[i][0].index, time.perf_counter()))
        if not self._callback_queued:
            # Run _end_of_backward when autograd has finished this backward. There is no public
            # API for that; torch's own DDP and FSDP queue a callback on the engine the same way.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        if self._ready_order is not None:
            self._ready_order.append(i)
        b, offset = self._where[i]
        slot = b.buffer[offset:offset + param.numel()]
        if self.compress is None:
            # scale before the sum, as torch's DDP does: the sum of world_size gradients cannot overflow
            torch.mul(param.grad.reshape(-1), 1.0 / self.world_size, out=slot)
        else:
            slot.copy_(param.grad.reshape(-1))  # compressed at launch, then divided, as torch's hooks do
        b.pending -= 1
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
        if self._next_launch == len(self.buckets):  # the last bucket has been launched
            self._finish()

    def _launch(self, b) -> None:
        if self.compress is None:
            b.work = collectives.all_reduce(b.buffer, group=self.group, async_op=True)
        else:
            b.sent = b.buffer.to(self.compress).div_(self.world_size)  # half the bytes on the wire
            b.work = collectives.all_reduce(b.sent, group=self.group, async_op=True)
        if self.timeline is not None:
            timeline, index = self.timeline, b.index
            timeline["launch"][index] = time.perf_counter()
            future = b.work.get_future()
            if future is not None:  # completion as the backend reports it, not when we waited
                future.then(lambda _: timeline["done"].__setitem__(index, time.perf_counter()))

    def _end_of_backward(self) -> None:
        """Every gradient arrived (nothing to do), or some parameters got none: name them.

        torch's DDP only notices at the next forward; here the backward that skipped them fails.
        """
        missing = [self.names[i] for i in range(len(self.params)) if i not in self._seen]
        if not missing:
            return
        for b in self.buckets[: self._next_launch]:
            b.work.wait()  # leave no collective in flight: the group stays usable
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise RuntimeError(
            f"DistributedDataParallel on rank {dist.get_rank()}: {len(missing)} parameter(s) got no gradient in "
            f"this backward, so their buckets were never reduced: {shown}. Make every parameter take part in "
            "the loss, or set requires_grad=False on the ones you do not train."
        )

    def _finish(self) -> None:
        for b in self.buckets:
            b.work.wait()
            if self.compress is not None:
                b.buffer.copy_(b.sent)  # decompress
            for i, offset in zip(b.param_indices, b.offsets):
                p = self.params[i]
                p.grad.copy_(b.buffer[offset:offset + p.numel()].view_as(p.grad))
        if self.timeline is not None:
            self.timeline["end"] = time.perf_counter()
