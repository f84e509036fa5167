"""Step 3 of the teaching path: gradient buckets, all-reduced while backward is still running.

    model = DistributedDataParallel(resnet50(10))      # bucket_cap_mb=None: 25 MiB, first bucket 1 MiB
    loss = criterion(model(x), y); loss.backward()   # every rank now holds the averaged gradient
    with model.no_sync(): ...                        # accumulate locally, sync on the next backward
    print(model.layouts["initial"], model.layouts["rebuilt"])   # the bucket layout, before and after

How it works: a hook on each parameter fires as soon as its gradient has been accumulated
(`register_post_accumulate_grad_hook` hands the hook the parameter, not the gradient). The hook
writes grad / world_size into the parameter's slot of its bucket's flat buffer; when a bucket's
last gradient has arrived, its all_reduce starts asynchronously, in bucket order (every rank
must issue the same collectives in the same order). When the last bucket has been launched, we
wait for every bucket and copy the averaged values back into `param.grad`.

Buckets (bucket.py): the first iteration has one bucket, because the definition order of the
parameters need not be the order their gradients arrive in; the first backward shows that
order, and at the next forward the buckets are rebuilt from it (rank 0's order, broadcast so
that every rank agrees). This is what torch 2.13 does, and with more than two ranks only the
same layout gives the same bits (a ring all_reduce rounds differently at different offsets).

Options, with torch's names and meaning:
- find_unused_parameters=True: at the end of each forward, walk the autograd graph from the
  outputs; parameters it does not reach are marked ready (a zero slot) at the first hook of the
  backward. After the backward, the ranks all_reduce which parameters each one used: a
  parameter no rank used keeps its .grad untouched; one used elsewhere gets the average.
  Without it, a parameter that gets no gradient is an error at the end of that backward, naming
  it (torch only complains at the next forward).
- gradient_as_bucket_view=True: param.grad becomes a view into its bucket, which saves the copy
  back and the memory of a second gradient copy.
- compress="fp16"/"bf16": send each bucket in that dtype, as torch's fp16_compress_hook /
  bf16_compress_hook do.
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
DEFAULT_BUCKET_CAP_MB = 25
DEFAULT_FIRST_BUCKET_MB = 1


def _tensors_in(value):
    """Every tensor in a (nested) forward output."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v)


def reachable_parameters(output) -> set:
    """ids of the leaf tensors that backward from `output` would reach (its AccumulateGrad nodes)."""
    stack = [t.grad_fn for t in _tensors_in(output) if t.grad_fn is not None]
    seen, leaves = set(), set()
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # set on AccumulateGrad nodes only
        if variable is not None:
            leaves.add(id(variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions if next_fn is not None)
    return leaves


class DistributedDataParallel(DataParallelBase):
    def __init__(self, module: nn.Module, group: Optional[dist.ProcessGroup] = None,
                 bucket_cap_mb: Optional[float] = None, first_bucket_mb: Optional[float] = None,
                 broadcast_buffers: bool = True, find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = False, compress: Optional[str] = None, timeline: bool = True):
        """Args:
            bucket_cap_mb: bucket size in MiB. None (torch's default): 25 MiB with a 1 MiB first
                bucket; a number: every bucket that size, unless first_bucket_mb says otherwise
                (torch 2.13 uses the small first bucket only with the default cap).
            broadcast_buffers: send rank 0's buffers (BatchNorm statistics) before each forward.
            find_unused_parameters, gradient_as_bucket_view, compress: see the module docstring.
            timeline: record each backward's per-bucket events in `self.timeline` (see trace.py).
        """
        super().__init__(module, group=group, broadcast_buffers=broadcast_buffers)
        if compress not in (None, "fp16", "bf16"):
            raise ValueError(f"compress must be None, 'fp16' or 'bf16', got {compress!r}")
        self.compress = {None: None, "fp16": torch.float16, "bf16": torch.bfloat16}[compress]
        cap = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        if first_bucket_mb is None:
            first_bucket_mb = DEFAULT_FIRST_BUCKET_MB if bucket_cap_mb is None else cap
        self.bucket_cap_bytes = int(cap * MiB)
        self.first_bucket_bytes = int(first_bucket_mb * MiB)
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.names = [n for n, _ in self.named_params]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._set_layout(bucketing.initial_layout(self.params, self.bucket_cap_bytes, self.first_bucket_bytes,
                                                  find_unused_parameters))
        # torch rebuilds only when it does not search for unused parameters (then the ready order can change)
        self._ready_order: Optional[list] = None if find_unused_parameters else []
        self._next_launch = 0
        self._syncing = True
        self._seen = bytearray(len(self.params))  # 1 where a gradient arrived in this backward
        self._unused: list = []  # indices the graph walk did not reach in this forward
        self._callback_queued = False
        self.record_timeline = timeline
        self.timeline: Optional[dict] = None  # the last backward's events (see trace.py)
        self.layout_history = {"initial": [b.param_indices for b in self.buckets]}  # and "rebuilt" later

    def _set_layout(self, layout) -> None:
        old = getattr(self, "buckets", [])
        self.buckets = bucketing.build(self.params, layout)
        self._where = {}  # parameter index -> (bucket, position in it)
        for b in self.buckets:
            for pos, i in enumerate(b.param_indices):
                self._where[i] = (b, pos)
        if self.gradient_as_bucket_view and old:  # gradients already held move into the new buckets
            with torch.no_grad():
                for i, p in enumerate(self.params):
                    if p.grad is not None:
                        b, pos = self._where[i]
                        b.views[pos].copy_(p.grad)
                        p.grad = b.views[pos]
        self._bucket_names = [[self.names[i] for i in b.param_indices] for b in self.buckets]

    def layout(self, verbose: bool = False) -> str:
        """The current bucket layout (parameters, bytes, order), for printing."""
        return bucketing.describe([b.param_indices for b in self.buckets], self.params, self.names, verbose)

    @property
    def layouts(self) -> dict:
        """{"initial": text, "rebuilt": text (after the rebuild)}: the layout before and after."""
        return {when: bucketing.describe(layout, self.params, self.names) for when, layout in self.layout_history.items()}

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients accumulate locally inside the block; the next backward outside it syncs them all."""
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def forward(self, *args, **kwargs):
        if self._ready_order and self._syncing and torch.is_grad_enabled():
            # the first synced backward has happened: rebuild once from the order it showed
            order = torch.tensor(self._ready_order, dtype=torch.int64)
            collectives.broadcast(order, src=self.src, group=self.group)
            self._set_layout(bucketing.rebuilt_layout(self.params, order.tolist(), self.bucket_cap_bytes,
                                                      self.first_bucket_bytes))
            self._ready_order = None
            self.layout_history["rebuilt"] = [b.param_indices for b in self.buckets]
        for b in self.buckets:
            b.pending, b.work = len(b.param_indices), None
        self._next_launch = 0
        self._seen = bytearray(len(self.params))
        self._callback_queued = False
        self._unused = []
        if self.record_timeline:
            self.timeline = {"start": time.perf_counter(), "ready": [], "launch": {}, "done": {}, "end": None,
                             "buckets": self._bucket_names, "bytes": [b.nbytes for b in self.buckets]}
        output = super().forward(*args, **kwargs)
        if self.find_unused_parameters and self._syncing and torch.is_grad_enabled():
            reached = reachable_parameters(output)
            self._unused = [i for i, p in enumerate(self.params) if id(p) not in reached]
        return output

    def _grad_ready(self, param: nn.Parameter) -> None:
        if not self._syncing:
            return
        i = self._index[id(param)]
        if self.timeline is not None:
            self.timeline["ready"].append((self.names[i], self._where[i][0].index, time.perf_counter()))
        if not self._callback_queued:
            # Run _end_of_backward when autograd has finished this backward. There is no public
            # API for that; torch's own DDP and FSDP queue a callback on the engine the same way.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
            for j in self._unused:  # parameters this forward did not reach: ready now, as zeros
                self._mark_ready(j, None)
        if self._ready_order is not None:
            self._ready_order.append(i)
        self._mark_ready(i, param)

    def _mark_ready(self, i: int, param: Optional[nn.Parameter]) -> None:
        self._seen[i] = 1
        b, pos = self._where[i]
        slot = b.views[pos]
        if param is None:
            slot.zero_()
        elif param.grad.data_ptr() == slot.data_ptr():  # gradient_as_bucket_view: already in place
            if self.compress is None:
                slot.div_(self.world_size)
        elif self.compress is None:
            # scale before the sum, as torch's DDP does: the sum of world_size gradients cannot overflow
            torch.mul(param.grad, 1.0 / self.world_size, out=slot)
        else:
            slot.copy_(param.grad)  # compressed at launch, then divided, as torch's hooks do
        if param is not None and self.gradient_as_bucket_view and param.grad is not slot:
            param.grad = slot
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
        if self._next_launch == len(self.buckets):
            return
        missing = [self.names[i] for i in range(len(self.params)) if not self._seen[i]]
        for b in self.buckets[: self._next_launch]:
            b.work.wait()  # leave no collective in flight: the group stays usable
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        hint = ("find_unused_parameters=True found them reachable from the output, but the loss did not use "
                "them: build the loss from every output" if self.find_unused_parameters else
                "Make every parameter take part in the loss, pass find_unused_parameters=True, or set "
                "requires_grad=False on the ones you do not train")
        raise RuntimeError(
            f"DistributedDataParallel on rank {dist.get_rank()}: {len(missing)} parameter(s) got no gradient in "
            f"this backward, so their buckets were never reduced: {shown}. {hint}."
        )

    def _finish(self) -> None:
        used = None
        if self.find_unused_parameters:  # which parameters some rank used (every rank must take part)
            used = torch.ones(len(self.params), dtype=torch.int32)
            used[self._unused] = 0
            collectives.all_reduce(used, group=self.group)
            used = used.tolist()
        for b in self.buckets:
            b.work.wait()
            if self.compress is not None:
                b.buffer.copy_(b.sent)  # decompress
            grads, views = [], []
            for pos, i in enumerate(b.param_indices):
                p = self.params[i]
                if used is not None and not used[i]:
                    continue  # globally unused: .grad untouched, as torch does
                if p.grad is None:  # used by other ranks, not here
                    p.grad = b.views[pos] if self.gradient_as_bucket_view else b.views[pos].clone()
                elif p.grad.data_ptr() != b.views[pos].data_ptr():
                    grads.append(p.grad)
                    views.append(b.views[pos])
            if grads:
                torch._foreach_copy_(grads, views)  # the averaged values back into .grad, one call per bucket
        if self.timeline is not None:
            self.timeline["end"] = time.perf_counter()
