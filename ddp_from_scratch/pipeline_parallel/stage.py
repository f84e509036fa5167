"""One rank's pipeline stage: the module it holds, where the activations come from and go, and
the executor that runs a schedule's actions (schedule.py) on it.

    stage = Stage(stages[rank], rank, num_stages, group, loss_fn=F.cross_entropy)
    stage.agree_shapes(microbatches[0])          # once: each stage learns its input's shape
    result = stage.run(one_f_one_b(p, m)[rank], microbatches, targets)
    result.losses                                 # the last stage's loss of each microbatch
    result.timeline, result.peak_saved_bytes      # what ran when; the activations held at most

A forward on stage s > 0 first receives its input from stage s-1; on stage s < p-1 it sends its
output to stage s+1 (isend: the stage goes on at once). A backward on the last stage starts from
its loss; on any other stage it first receives the output's gradient from stage s+1; on s > 0
it sends its input's gradient to stage s-1. Messages between two stages go one way each and in
microbatch order, so the receiver's order is always the sender's. After the last backward every
parameter's gradient is divided by the number of microbatches (a mean over them, as
torch.distributed.pipelining's scale_grads does with a mean loss).

Shapes are agreed once: stage 0 runs its module on a microbatch (in eval mode, without a graph:
BatchNorm's running statistics stay as they were) and sends the output's dtype and shape to stage
1, which does the same, and so on. The timeline records, per action, when it began waiting for
its message, when it began computing and when it ended; a rank's idle time is what its step spent
not computing. Saved activations are counted as autograd saves them for backward (parameters
excluded) and freed, so the peak is measured, not computed.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from .schedule import FORWARD, Action

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]
_META = 10  # dtype, ndim, then up to 8 dims


@dataclasses.dataclass
class StepResult:
    losses: Dict[int, torch.Tensor]  # microbatch -> loss (the last stage only)
    timeline: List[tuple]  # (action, waited from, computed from, ended), seconds since the step began
    step_s: float
    compute_s: float
    peak_saved_bytes: int
    peak_in_flight: int  # microbatches whose activations were held at once
    started: float = 0.0  # time.perf_counter() at the step's start (CLOCK_MONOTONIC: one clock for every rank here)

    @property
    def idle_share(self) -> float:
        """The share of the step this rank spent not computing (its bubble, measured)."""
        return 1.0 - self.compute_s / self.step_s if self.step_s > 0 else 0.0


class _Saved:
    """One tensor autograd saved for backward, counted while it lives."""

    def __init__(self, stage: "Stage", tensor: torch.Tensor):
        self.tensor, self.nbytes = tensor, tensor.numel() * tensor.element_size()
        stage._saved_bytes += self.nbytes
        stage._peak_bytes = max(stage._peak_bytes, stage._saved_bytes)
        weakref.finalize(self, Stage._release, weakref.ref(stage), self.nbytes)


class Stage:
    def __init__(self, module: nn.Module, stage_index: int, num_stages: int, group=None,
                 loss_fn: Optional[Callable] = None):
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage {stage_index} is not one of the pipeline's {num_stages} stages")
        self.module, self.index, self.num_stages, self.loss_fn = module, stage_index, num_stages, loss_fn
        self.group = group
        size = dist.get_world_size(group)
        if size != num_stages:
            raise ValueError(f"a pipeline of {num_stages} stages needs a group of {num_stages} ranks, got {size}")
        peer = lambda r: dist.get_global_rank(group, r) if group is not None else r  # noqa: E731
        self.prev = peer(stage_index - 1) if stage_index > 0 else None
        self.next = peer(stage_index + 1) if stage_index < num_stages - 1 else None
        self.is_last = self.next is None
        if self.is_last and loss_fn is None:
            raise ValueError("the last stage computes the loss: give loss_fn")
        self.input_meta = self.output_meta = None
        self._saved_bytes = self._peak_bytes = 0

    # -- shapes --------------------------------------------------------------------------------
    def agree_shapes(self, example: Optional[torch.Tensor] = None) -> None:
        """Learn this stage's input (from the stage before) and output (by running the module on
        a stand-in without a graph, in eval mode) dtypes and shapes; pass the output's on."""
        if self.prev is None:
            x = example
        else:
            meta = torch.zeros(_META, dtype=torch.int64)
            dist.recv(meta, self.prev, group=self.group)
            dtype, ndim = _DTYPES[int(meta[0])], int(meta[1])
            x = torch.zeros(*meta[2:2 + ndim].tolist(), dtype=dtype)
        self.input_meta = (x.dtype, tuple(x.shape))
        training = [m.training for m in self.module.modules()]
        self.module.eval()
        try:
            with torch.no_grad():
                y = self.module(x)
        finally:
            for m, was in zip(self.module.modules(), training):
                m.training = was
        self.output_meta = (y.dtype, tuple(y.shape))
        if self.next is not None:
            if y.dim() > _META - 2 or y.dtype not in _DTYPES:
                raise ValueError(f"stage {self.index}'s output {y.dtype} {tuple(y.shape)} cannot be described in "
                                 f"{_META - 2} dims of {', '.join(map(str, _DTYPES))}")
            meta = torch.zeros(_META, dtype=torch.int64)
            meta[0], meta[1] = _DTYPES.index(y.dtype), y.dim()
            meta[2:2 + y.dim()] = torch.tensor(y.shape)
            dist.send(meta, self.next, group=self.group)

    # -- the executor --------------------------------------------------------------------------
    @staticmethod
    def _release(stage_ref, nbytes: int) -> None:
        stage = stage_ref()
        if stage is not None:
            stage._saved_bytes -= nbytes

    def _recv(self, meta, peer: int) -> torch.Tensor:
        t = torch.empty(meta[1], dtype=meta[0])
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, peer, group=self.group)]):
            work.wait()
        return t

    def _send(self, t: torch.Tensor, peer: int) -> list:
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, t.contiguous(), peer, group=self.group)])

    def run(self, actions: List[Action], inputs: Optional[List[torch.Tensor]] = None,
            targets: Optional[List[torch.Tensor]] = None) -> StepResult:
        """Run one step of `actions` (this rank's list); `inputs`: the microbatches (stage 0),
        `targets`: their targets (the last stage)."""
        if self.input_meta is None:
            raise RuntimeError("call agree_shapes() once before run()")
        params = {p.data_ptr() for p in self.module.parameters()}

        def pack(t):
            return t if t.data_ptr() in params else _Saved(self, t)

        def unpack(saved):
            return saved.tensor if isinstance(saved, _Saved) else saved

        microbatches = sum(a.kind == FORWARD for a in actions)
        held: Dict[int, tuple] = {}  # microbatch -> (input, output or loss)
        losses: Dict[int, torch.Tensor] = {}
        sends, timeline = [], []
        compute = 0.0
        self._saved_bytes = self._peak_bytes = 0
        peak_in_flight = 0
        start = time.perf_counter()
        for a in actions:
            waited = time.perf_counter()
            if a.kind == FORWARD:
                if self.prev is None:
                    x = inputs[a.microbatch]
                else:
                    x = self._recv(self.input_meta, self.prev).requires_grad_()
                began = time.perf_counter()
                with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                    y = self.module(x)
                    if self.is_last:
                        y = self.loss_fn(y, targets[a.microbatch])
                        losses[a.microbatch] = y.detach()
                ended = time.perf_counter()
                held[a.microbatch] = (x, y)
                peak_in_flight = max(peak_in_flight, len(held))
                if self.next is not None:
                    sends += self._send(y.detach(), self.next)
            else:
                x, y = held.pop(a.microbatch)
                grad = None if self.is_last else self._recv(self.output_meta, self.next)
                began = time.perf_counter()
                torch.autograd.backward(y, grad)
                ended = time.perf_counter()
                if self.prev is not None:
                    sends += self._send(x.grad, self.prev)
                del x, y
            compute += ended - began
            timeline.append((a, waited - start, began - start, ended - start))
        for work in sends:
            work.wait()
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.div_(microbatches)
        return StepResult(losses, timeline, time.perf_counter() - start, compute, self._peak_bytes, peak_in_flight,
                          start)
