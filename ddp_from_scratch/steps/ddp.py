"""Step 3 of the teaching path: gradient buckets, all-reduced while backward is still running.

    model = DistributedDataParallel(resnet50(10))      # bucket_cap_mb=None: 25 MiB, first bucket 1 MiB
    loss = criterion(model(x), y); loss.backward()   # every rank now holds the averaged gradient
    with model.no_sync(): ...                        # accumulate locally, sync on the next backward
    model.sync_gradients()                           # or now, outside any backward (a pipeline's step)
    print(model.layouts["initial"], model.layouts["rebuilt"])   # the bucket layout, before and after

How it works, top to bottom in this file:
1. forward(): rebuild the buckets once from the order the first backward showed; reset the
   per-backward state.
2. _grad_ready(param), a hook that fires as soon as param's gradient is accumulated (base.py):
   the gradient goes into its bucket's slot; when a bucket is complete, and every bucket before
   it has been launched (all ranks must issue the same collectives in the same order), its
   all_reduce starts without waiting.
3. _finish(), once the last bucket has been launched: wait for each bucket and copy the averaged
   values back into param.grad.

Buckets (bucket.py): the first iteration has one bucket, because the definition order of the
parameters need not be the order their gradients arrive in; the first backward shows that
order, and at the next forward the buckets are rebuilt from it (rank 0's order, broadcast so
that every rank agrees). This is what torch 2.13 does, and with more than two ranks only the
same layout gives the same bits (a ring all_reduce rounds differently at different offsets).

Options, with torch's names and meaning:
- find_unused_parameters=True: at the end of each forward, walk the autograd graph from the
  outputs (unused.py); parameters it does not reach are marked ready (a zero slot) at the first
  hook of the backward. After the backward, the ranks all_reduce which parameters each one used:
  a parameter no rank used keeps its .grad untouched; one used elsewhere gets the average.
  Without it, a parameter that gets no gradient is an error at the end of that backward, naming
  it (torch only complains at the next forward).
- gradient_as_bucket_view=True: param.grad becomes a view into its bucket, which saves the copy
  back and the memory of a second gradient copy.
- compress="fp16"/"bf16": send each bucket in that dtype, as torch's fp16_compress_hook /
  bf16_compress_hook do; compress="powersgd" or a PowerSGD(...) with its options: low-rank
  compression, as torch's powerSGD_hook does (powersgd.py).
- timeline=True: record each backward's events in `self.timeline` (timeline.py; trace.py draws them).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

import collectives

from ..parts import bucket as bucketing
from ..parts.base import DataParallelBase
from .powersgd import PowerSGD
from ..parts.timeline import Timeline
from ..parts.unused import reachable_parameters

MiB = 1 << 20
DEFAULT_BUCKET_CAP_MB = 25
DEFAULT_FIRST_BUCKET_MB = 1
COMPRESS = {None: None, "fp16": torch.float16, "bf16": torch.bfloat16}


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
            find_unused_parameters, gradient_as_bucket_view, compress, timeline: see above.
        """
        super().__init__(module, group=group, broadcast_buffers=broadcast_buffers, timeline=timeline)
        if isinstance(compress, PowerSGD) or compress == "powersgd":
            # its own copy: the state (memories, step count, random draws) belongs to this model
            self.compress = copy.deepcopy(compress) if isinstance(compress, PowerSGD) else PowerSGD()
        elif compress in COMPRESS:
            self.compress = COMPRESS[compress]
        else:
            raise ValueError(f"compress must be None, 'fp16', 'bf16', 'powersgd' or a PowerSGD, got {compress!r}")
        cap = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        if first_bucket_mb is None:
            first_bucket_mb = DEFAULT_FIRST_BUCKET_MB if bucket_cap_mb is None else cap
        self.bucket_cap_bytes, self.first_bucket_bytes = int(cap * MiB), int(first_bucket_mb * MiB)
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self._set_layout(bucketing.initial_layout(self.params, self.bucket_cap_bytes, self.first_bucket_bytes,
                                                  find_unused_parameters))
        self.layout_history = {"initial": [b.param_indices for b in self.buckets]}  # and "rebuilt" later
        # torch rebuilds only when it does not search for unused parameters (then the order can change)
        self._ready_order: Optional[list] = None if find_unused_parameters else []
        self._arrivals: list = []  # the order gradients arrived in the latest backward under no_sync()

    def _new_timeline(self) -> Timeline:
        return Timeline(self._bucket_names, [b.nbytes for b in self.buckets])

    def _set_layout(self, layout) -> None:
        old = getattr(self, "buckets", [])
        self.buckets = bucketing.build(self.params, layout)
        self._where = {i: (b, pos) for b in self.buckets for pos, i in enumerate(b.param_indices)}
        self._bucket_names = [[self.names[i] for i in b.param_indices] for b in self.buckets]
        if self.gradient_as_bucket_view and old:  # gradients already held move into the new buckets
            with torch.no_grad():
                for i, p in enumerate(self.params):
                    if p.grad is not None:
                        b, pos = self._where[i]
                        p.grad = b.views[pos].copy_(p.grad)

    def layout(self, verbose: bool = False) -> str:
        """The current bucket layout (parameters, bytes, order), for printing."""
        return bucketing.describe([b.param_indices for b in self.buckets], self.params, self.names, verbose)

    @property
    def layouts(self) -> dict:
        """{"initial": text, "rebuilt": text (after the rebuild)}: the layout before and after."""
        return {when: bucketing.describe(layout, self.params, self.names) for when, layout in self.layout_history.items()}

    def bucket_layout_state(self) -> Optional[list]:
        """The rebuilt layout (parameter indices per bucket), None before the rebuild. A checkpoint
        keeps it: a resumed run that bucketed afresh would reduce its first step in the one
        initial bucket, and a ring all_reduce on 3 or more ranks rounds by offset, so its bits
        would differ from the uninterrupted run's (2 ranks add a + b either way)."""
        return None if self._ready_order is not None else self.layout_history.get("rebuilt")

    def load_bucket_layout_state(self, layout: Optional[list]) -> None:
        """Bucket as `bucket_layout_state()` gave (None: keep the initial layout and rebuild)."""
        if layout is None:
            return
        self._set_layout([list(b) for b in layout])
        self._ready_order = None
        self.layout_history["rebuilt"] = [b.param_indices for b in self.buckets]

    # -- 1. forward ---------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        will_sync = self._syncing and torch.is_grad_enabled()
        if self._ready_order and will_sync:  # the first synced backward has happened: rebuild once
            self._rebuild()
        for b in self.buckets:
            b.pending, b.work, b.sent = len(b.param_indices), None, None
        self._next_launch, self._callback_queued = 0, False
        self._seen = bytearray(len(self.params))  # 1 where a gradient arrived in this backward
        self._unused: list = []  # indices this forward's output does not reach
        output = super().forward(*args, **kwargs)
        if self.find_unused_parameters and will_sync:
            reached = reachable_parameters(output)
            self._unused = [i for i, p in enumerate(self.params) if id(p) not in reached]
        return output

    def _rebuild(self) -> None:
        """The buckets laid out again from the order the first synced backward showed (rank 0's)."""
        order = torch.tensor(self._ready_order, dtype=torch.int64, device=self.meta_device)
        collectives.broadcast(order, src=self.src, group=self.group)
        self._set_layout(bucketing.rebuilt_layout(self.params, order.tolist(), self.bucket_cap_bytes,
                                                  self.first_bucket_bytes))
        self._ready_order = None
        self.layout_history["rebuilt"] = [b.param_indices for b in self.buckets]

    # -- 2. each gradient as it arrives -------------------------------------------------------
    def _grad_ready(self, param: nn.Parameter) -> None:
        i = self._index[id(param)]
        if not self._syncing:  # noted for sync_gradients(): a parameter seen again starts the next backward
            self._arrivals = [i] if i in self._arrivals else self._arrivals + [i]
            return
        self._recorder.ready(self.names[i], self._where[i][0].index)
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
        b.add(pos, None if param is None else param.grad, None if self.compress else self.world_size)
        if param is not None and self.gradient_as_bucket_view and param.grad is not b.views[pos]:
            param.grad = b.views[pos]
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
        if self._next_launch == len(self.buckets):  # the last bucket has been launched
            self._finish()

    def _launch(self, b: bucketing.Bucket) -> None:
        if isinstance(self.compress, PowerSGD):
            b.work = self.compress.launch(b, self.group, self.world_size, last=b.index == len(self.buckets) - 1)
        else:
            b.launch(self.group, self.world_size, self.compress)
        self._recorder.launched(b.index, b.work)

    # -- 3. after the last bucket -------------------------------------------------------------
    def _finish(self) -> None:
        used = None
        if self.find_unused_parameters:  # which parameters some rank used (every rank must take part)
            used = torch.ones(len(self.params), dtype=torch.int32, device=self.meta_device)
            used[self._unused] = 0
            used = collectives.all_reduce(used, group=self.group).tolist()
        for b in self.buckets:
            b.unpack(used, as_view=self.gradient_as_bucket_view)
        self._recorder.finished()

    def sync_gradients(self) -> None:
        """All-reduce the gradients the parameters hold now, bucket by bucket as a backward
        would, outside any backward. A pipeline (pipeline_parallel/) runs its microbatches'
        forwards and backwards under no_sync() in the order its schedule says, and calls this
        once after the step's last one. Every parameter must hold a gradient.

        The buckets live as with backwards: the first call reduces in the first-iteration layout,
        the second rebuilds them, as a forward after the first synced backward does, from the
        order the gradients arrived in the last backward before the first call (rank 0's), or,
        where autograd's hooks did not see them all (a weight gradient added by hand, as a
        zero-bubble W does), the parameters in reverse, the order a chain of layers gives."""
        missing = [n for n, p in self.named_params if p.grad is None]
        if missing:
            raise RuntimeError(f"DistributedDataParallel on rank {dist.get_rank()}: sync_gradients() with "
                               f"{len(missing)} parameter(s) holding no gradient: {', '.join(missing[:10])}; run "
                               "the step's backwards first")
        if self._ready_order:  # after the first call: rebuild once
            self._rebuild()
        for b in self.buckets:
            b.pending, b.work, b.sent = len(b.param_indices), None, None
        self._next_launch, self._seen, self._unused = 0, bytearray(len(self.params)), []
        for b in self.buckets:
            for i in b.param_indices:
                self._mark_ready(i, self.params[i])
        if self._ready_order == []:  # the first call: the order to rebuild from at the next
            seen_all = sorted(self._arrivals) == list(range(len(self.params)))
            self._ready_order = list(self._arrivals) if seen_all else list(reversed(range(len(self.params))))

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


def rebuilt_bucket_count(module: torch.nn.Module, example, loss_fn, bucket_cap_mb: Optional[float] = None) -> int:
    """How many buckets torch's DDP cuts `module` into after its first backward, found in this
    process with no process group: one backward of loss_fn(module(example)), the order its
    gradients become ready, then torch's rule (`rebuilt_layout`, with DDP's default caps when
    bucket_cap_mb is None: a 1 MiB first bucket, then 25 MiB). Used to refuse, before any rank
    starts, what cannot run with more than one bucket."""
    params = [p for p in module.parameters() if p.requires_grad]
    order: list = []
    handles = [p.register_post_accumulate_grad_hook(lambda _p, i=i: order.append(i)) for i, p in enumerate(params)]
    try:
        loss_fn(module(example)).backward()
    finally:
        for h in handles:
            h.remove()
    cap = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
    first = DEFAULT_FIRST_BUCKET_MB if bucket_cap_mb is None else cap
    order += [i for i in range(len(params)) if i not in order]  # unused ones go last
    return len(bucketing.rebuilt_layout(params, order, int(cap * MiB), int(first * MiB)))
