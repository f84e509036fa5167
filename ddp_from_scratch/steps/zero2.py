"""Step 5 of the teaching path: ZeRO-2, the gradients sharded too.

In ZeRO-1 every rank received the whole averaged gradient and then used only its shard of it.
ZeRO-2 asks for only that shard: once the last gradient of the backward has arrived, one
reduce_scatter (sharding.py's flat layout, FSDP2's) sums the gradients over the ranks, averages
them, and leaves on rank r just rows r of each parameter's gradient. It moves half the bytes of
an all_reduce, and the full gradients are freed as soon as the shard has arrived, so a rank
keeps 1/p of the gradients as well as of the optimizer state.

    model = ZeroTwoDataParallel(net)
    opt = model.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)

The whole model is one unit here, so until the last gradient arrives a rank holds every
gradient once (packed). With `bucket_cap_mb`, ZeRO-2 as DeepSpeed runs it: the parameters in
the order backward produces their gradients (reverse registration, as DDP's buckets) are cut into
buckets of at most that many MiB, and each bucket is reduce-scattered as soon as its gradients
are there, while backward goes on; a rank then holds its gradient shards and about two buckets
instead of a whole gradient (the stage named "zero2-bucketed" in wrap.py and the benchmarks).

    model = ZeroTwoDataParallel(net, bucket_cap_mb=25)

How it is built: the data-parallel base (base.py: the initial broadcast, the gradient-ready
hooks) and the sharding module (sharding.py: the shards, their optimizer, the all-gather after
the step); this file adds only the reduce-scatter, unit by unit. A unit is the set of parameters
reduce-scattered together: the whole model, a bucket of at most bucket_cap_mb, or (FSDP, fsdp.py,
which builds on this file and also shards the parameters) a module's parameters. DDP's options
(compress, gradient_as_bucket_view, find_unused_parameters) belong to the all_reduce and are
refused by name.

On 2 ranks bitwise equal to torch's DDP and to torch's fully_shard, bucketed or not; on 3 and 4
the one-unit form is bitwise equal to fully_shard with the model as one unit (the same layout,
the same op: Gloo averages after the sum), not to DDP, whose all_reduce adds in another order
(tests/ddp/test_zero.py); the bucketed form has no fully_shard twin there (its buckets are not
modules). A parameter that gets no gradient is an error at the end of that
backward, naming it: its unit's reduce_scatter would never be issued.
"""

from __future__ import annotations

import math
import time
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

import collectives

from ..parts.base import DataParallelBase
from ..parts.bucket import runs_of_at_most
from ..parts.sharding import ShardedStage, ShardLayout, refuse_ddp_options
from ..parts.timeline import Timeline


def reduce_buckets(nbytes: List[int], cap_mb: float) -> List[List[int]]:
    """Parameter indices in the order a plain backward produces their gradients (the last
    registered first), cut into runs of at most cap_mb MiB (bucket.runs_of_at_most)."""
    return runs_of_at_most(nbytes, cap_mb * (1 << 20), order=reversed(range(len(nbytes))))


class ZeroTwoDataParallel(ShardedStage, DataParallelBase):
    def __init__(self, module: nn.Module, group: Optional[dist.ProcessGroup] = None, broadcast_buffers: bool = True,
                 bucket_cap_mb: Optional[float] = None, gather_cap_mb: float = 25, timeline: bool = True,
                 unit_params: Optional[Sequence[Sequence[str]]] = None, **ddp_options):
        """Args:
            bucket_cap_mb: None, one reduce-scatter of the whole model after backward; else units
                of at most this many MiB (one unit if a parameter is larger), each reduce-scattered
                as soon as its gradients are there.
            gather_cap_mb: the all-gather after the step, in groups of at most this many MiB (sharding.py).
            broadcast_buffers, timeline: as DDP's (base.py, ddp.py).
            unit_params: the parameters (by name) of each unit, instead of bucket_cap_mb's cut:
                how FSDP (fsdp.py) reduce-scatters module by module.
        """
        refuse_ddp_options(type(self).__name__, ddp_options)
        if bucket_cap_mb is not None and (isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float))
                                          or not math.isfinite(bucket_cap_mb) or bucket_cap_mb <= 0):
            raise ValueError(f"{type(self).__name__}: bucket_cap_mb must be a positive number of MiB or None, "
                             f"got {bucket_cap_mb!r}")
        super().__init__(module, group=group, broadcast_buffers=broadcast_buffers, timeline=timeline)
        self._shard(gather_cap_mb)
        self.bucket_cap_mb = bucket_cap_mb
        if unit_params is not None:
            index = {n: i for i, n in enumerate(self.names)}
            self.units = [[index[n] for n in names] for names in unit_params]
        elif bucket_cap_mb is None:
            self.units = [list(range(len(self.params)))]  # one unit: the whole model
        else:
            self.units = reduce_buckets([p.numel() * p.element_size() for p in self.params], bucket_cap_mb)
        self.unit_layouts = [self.shard_layout if unit == list(range(len(self.params)))
                             else ShardLayout([self.params[i] for i in unit], self.world_size) for unit in self.units]
        self.unit_of = {i: u for u, unit in enumerate(self.units) for i in unit}
        self._place = {i: k for unit in self.units for k, i in enumerate(unit)}  # position within its unit
        self._arrived = bytearray(len(self.params))
        self._unit_ready = [0] * len(self.units)
        self._grad_shards: List[Optional[torch.Tensor]] = [None] * len(self.params)
        self._flat: List[Optional[torch.Tensor]] = [None] * len(self.units)  # reduce-scatter inputs being filled
        self._in_flight: list = []  # (unit, work, packed input, start) of reduce-scatters not yet waited for
        self._backward_open = False

    def forward(self, *args, **kwargs):
        self._unit_ready = [0] * len(self.units)
        self._arrived = bytearray(len(self.params))
        return super().forward(*args, **kwargs)

    # -- a unit's gradients are reduce-scattered as soon as they are all there ----------------
    def _grad_ready(self, param: nn.Parameter) -> None:
        if not self._syncing:
            return
        if not self._backward_open:  # check, once autograd is done, that every unit was sent
            torch.autograd.Variable._execution_engine.queue_callback(self._check_every_unit_sent)
            self._backward_open = True
        i = self._index[id(param)]
        u = self.unit_of[i]
        self._recorder.ready(self.names[i], u)
        # The gradient goes straight into its place in the unit's reduce-scatter buffer and the
        # parameter's own .grad is dropped: a rank never holds a gradient twice (packing them
        # all at the end would, briefly: measured at DDP's peak memory in benchmarks/sharded.py).
        self._arrived[i] = 1
        layout, k = self.unit_layouts[u], self._place[i]
        if self._flat[u] is None:  # empty, not zeros: pack_one writes every element, padding included
            self._flat[u] = param.grad.new_empty(self.world_size, layout.per_rank)
        layout.pack_one(param.grad, k, self._flat[u])
        param.grad = None
        self._unit_ready[u] += 1
        if self._unit_ready[u] == len(self.units[u]):
            self._reduce_scatter(u)

    def _reduce_scatter(self, u: int) -> None:
        """Start summing and averaging unit u's gradients over the ranks, without waiting: the
        backward of the next unit runs meanwhile. At most one is in flight (the previous one is
        finished first), as FSDP2 does, so a rank holds at most two units' packed gradients."""
        self._finish_reduce_scatters()
        flat = self._flat[u]  # (world_size, per_rank), chunk_cat order
        work = collectives.reduce_scatter(flat, op="avg", group=self.group, async_op=True)  # sum, then / p
        self._in_flight.append((u, work, flat, time.perf_counter()))
        self._flat[u] = flat = None

    def bytes_in_flight(self) -> int:
        """Bytes held by collectives started and not yet waited for (memory.py counts them as comm):
        each reduce-scatter's packed input and its output row."""
        return sum(flat.numel() * flat.element_size() * (1 + 1 / self.world_size) for _, _, flat, _ in self._in_flight)

    def _finish_reduce_scatters(self) -> None:
        """Wait for the reduce-scatters in flight; keep this rank's rows of each unit's gradients."""
        while self._in_flight:
            u, work, _, start = self._in_flight.pop(0)
            mine = work.wait()  # (1, per_rank); the packed input is dropped with the entry
            self._recorder.span(f"reduce_scatter unit {u}", f"unit {u}", start, time.perf_counter())
            for i, piece in zip(self.units[u], self.unit_layouts[u].unpack(mine[0], self.rank)):
                self._grad_shards[i] = piece

    def _check_every_unit_sent(self) -> None:
        self._backward_open = False
        self._finish_reduce_scatters()
        self._recorder.finished()
        missing = [self.names[i] for u, unit in enumerate(self.units) if self._unit_ready[u] < len(unit)
                   for i in unit if not self._arrived[i]]
        self._flat = [None] * len(self.units)
        if any(ready < len(unit) for ready, unit in zip(self._unit_ready, self.units)):
            raise collectives.CollectiveError(
                f"{type(self).__name__}: this backward gave no gradient to some parameters, so their unit's "
                f"reduce_scatter was never issued (no rank may skip one); parameters without a gradient: {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''}")

    def _new_timeline(self) -> Timeline:
        """Per unit instead of per bucket: its parameters and the bytes it reduce-scatters."""
        return Timeline([[self.names[i] for i in unit] for unit in self.units],
                        [layout.per_rank * self.world_size * self.params[0].element_size()
                         for layout in self.unit_layouts])

    def grad_shards(self) -> List[Optional[torch.Tensor]]:
        self._finish_reduce_scatters()
        return self._grad_shards

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._grad_shards = [None] * len(self.params)

    def shard_layout_text(self, rank: Optional[int] = None) -> str:
        """Unit by unit: which rows of which parameter each rank owns (or only `rank`)."""
        return "\n".join(f"unit {u}: " + layout.describe([self.names[i] for i in unit], rank)
                         for u, (unit, layout) in enumerate(zip(self.units, self.unit_layouts)))
