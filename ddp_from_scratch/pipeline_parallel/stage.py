"""One rank's part of a pipeline: the model chunk (or chunks) it holds, where the activations come
from and go, and the executor that runs any schedule (schedule.py) on it.

    stage = Stage(stages[rank], rank, p, group, loss_fn=F.cross_entropy)
    stage = Stage([stages[rank], stages[p + rank]], rank, p, ...)   # interleaved: chunk c is stage c*p + rank
    stage.agree_shapes(microbatches[0])          # once: each stage learns its input's shape
    result = stage.run(one_f_one_b(p, m), microbatches, targets)   # the whole schedule: every rank's actions
    result.losses                                 # the last stage's loss of each microbatch
    result.timeline, result.peak_saved_bytes      # what ran when; the activations held at most
    stage.run(schedule, microbatches, targets, count_saved=False)   # a step as torch's: nothing counted

A forward on stage s > 0 first receives its input from stage s-1; on any stage but the last it
sends its output to stage s+1 (isend: the rank goes on at once). A backward on the last stage
starts from its loss; on any other stage it first receives the output's gradient from stage s+1;
on s > 0 it sends its input's gradient to stage s-1. A split backward (zero bubble) does all that
in its I, the input's gradient (two_part_backward.py), and its W later adds the weights'
gradients, with no message. The sends and receives are placed in each rank's list once, before
the step runs (messages.py: with_messages), so the executor runs one list of actions and
messages in order, keeping a message that comes before its action needs it. After the last backward every parameter's gradient is divided by the
number of microbatches (a mean over them, as torch.distributed.pipelining's scale_grads does with
a mean loss).

Shapes are agreed once: stage 0 runs its module on a microbatch (in eval mode, without a graph:
BatchNorm's running statistics stay as they were) and sends the output's dtype and shape to stage
1, which does the same, and so on through every chunk. The timeline records, per action, when it began waiting for
its message, when it began computing and when it ended; a rank's idle time is what its step spent
not computing. Saved activations are counted as autograd saves them for backward (parameters
excluded) and freed, so the peak is measured, not computed. Counting runs Python on every tensor
autograd saves and frees (about 2% of the pipeline benchmark's step: benchmarks/RESULTS.md), so
run(..., count_saved=False) leaves it out: benchmarks/pipeline_parallel.py counts in its warm-up
round and times steps without it, as torch's schedules run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from .messages import RECV, Message, check_messages, with_messages
from .saved import SavedBytes
from .schedule import BACKWARD, FORWARD, INPUT, WEIGHT, Action, check, chunks_of, stage_index
from .two_part_backward import SplitBackward

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]
_META = 10  # dtype, ndim, then up to 8 dims


@dataclasses.dataclass
class StepResult:
    losses: Dict[int, torch.Tensor]  # microbatch -> loss (the last stage only)
    timeline: List[tuple]  # (action, waited from, computed from, ended), seconds since the step began
    step_s: float
    compute_s: float
    peak_saved_bytes: Optional[int]  # None where the step ran with count_saved=False
    peak_in_flight: int  # microbatches whose activations were held at once
    started: float = 0.0  # time.perf_counter() at the step's start (CLOCK_MONOTONIC: one clock for every rank here)

    @property
    def idle_share(self) -> float:
        """The share of the step this rank spent not computing (its bubble, measured)."""
        return 1.0 - self.compute_s / self.step_s if self.step_s > 0 else 0.0


@dataclasses.dataclass
class _Step:
    """What one run() of the executor keeps between its actions."""
    inputs: Optional[List[torch.Tensor]]
    targets: Optional[List[torch.Tensor]]
    held: Dict[tuple, tuple] = dataclasses.field(default_factory=dict)  # (microbatch, chunk) -> (input, output or loss)
    weights_later: Dict[tuple, Callable[[], None]] = dataclasses.field(default_factory=dict)  # its W, after its I
    losses: Dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    sends: list = dataclasses.field(default_factory=list)
    peak_in_flight: int = 0
    counting: contextlib.AbstractContextManager = dataclasses.field(default_factory=contextlib.nullcontext)


def _check_output(stage: int, y) -> None:
    """A ValueError unless `y`, the output stage `stage` passes on, is one floating-point tensor."""
    if not isinstance(y, torch.Tensor):
        raise ValueError(f"stage {stage} returned a {type(y).__name__}: a stage that passes its output on must return "
                         f"one tensor (the next stage's input); return extra outputs from the last stage, or carry "
                         f"them inside the tensor")
    if not (y.is_floating_point() or y.is_complex()):
        raise ValueError(f"stage {stage}'s output is {y.dtype}: the output a stage passes on must be floating point, "
                         f"since the next stage sends its gradient back through it (integer token ids belong in "
                         f"stage 0's input)")


def _check_microbatches(what: str, given, microbatches: int, meta) -> None:
    """A ValueError unless `given` holds `microbatches` tensors, each (for the inputs) of the dtype
    and shape agree_shapes() was given."""
    if given is None:
        raise ValueError(f"this rank holds the {'first' if what == 'inputs' else 'last'} stage: run() needs its "
                         f"{what}, one a microbatch")
    if len(given) != microbatches:
        raise ValueError(f"the schedule runs {microbatches} microbatches; run() got {len(given)} {what}")
    if meta is None:
        return
    for i, t in enumerate(given):
        if (t.dtype, tuple(t.shape)) != meta:
            raise ValueError(f"microbatch {i} is {t.dtype} {tuple(t.shape)}, but agree_shapes() was given "
                             f"{meta[0]} {meta[1]}: every microbatch must have that shape (tensor_split of 5 rows "
                             f"into 2 gives 3 and 2: take a batch the microbatch count divides)")


class Stage:
    def __init__(self, modules, rank: int, ranks: int, group=None, loss_fn: Optional[Callable] = None,
                 autocast: Optional[Callable] = None):
        """`autocast`: a context a forward (and its loss) runs in, made anew each time (mixed
        precision: `lambda: torch.autocast("cpu", torch.bfloat16)`); backwards run outside it."""
        self.autocast = autocast or contextlib.nullcontext
        self.chunks = list(modules) if isinstance(modules, (list, tuple)) else [modules]
        if not 0 <= rank < ranks:
            raise ValueError(f"rank {rank} is not one of the pipeline's {ranks} ranks")
        size = dist.get_world_size(group)
        if size != ranks:
            raise ValueError(f"a pipeline over {ranks} ranks needs a group of {ranks} ranks, got {size}")
        self.rank, self.ranks, self.group, self.loss_fn = rank, ranks, group, loss_fn
        self.num_stages = ranks * len(self.chunks)
        self._split = [SplitBackward() for _ in self.chunks]  # zero bubble's I and W, a chunk each
        self._global = [dist.get_global_rank(group, r) if group is not None else r for r in range(ranks)]
        if self.num_stages - 1 in self.stages and loss_fn is None:
            raise ValueError("the last stage computes the loss: give loss_fn")
        self.input_meta: Dict[int, tuple] = {}  # stage -> (dtype, shape) of its input; output_meta alike
        self.output_meta: Dict[int, tuple] = {}
        self.saved = SavedBytes(self.parameters())  # what autograd saves for backward, counted

    @property
    def stages(self) -> List[int]:
        return [stage_index(c, self.rank, self.ranks) for c in range(len(self.chunks))]

    def owner(self, stage: int) -> int:
        return stage % self.ranks

    def peer(self, stage: int) -> int:
        """The global rank that holds `stage` (for a message to or from it)."""
        return self._global[self.owner(stage)]

    @property
    def module(self) -> nn.Module:
        """The rank's one chunk (without interleaving)."""
        return self.chunks[0]

    def parameters(self):
        return (p for chunk in self.chunks for p in chunk.parameters())

    # -- shapes --------------------------------------------------------------------------------
    def agree_shapes(self, example: Optional[torch.Tensor] = None) -> None:
        """Learn each chunk's input (from the stage before) and output (by running the chunk on a
        stand-in without a graph, in eval mode) dtypes and shapes; pass the output's on."""
        sends = []
        for chunk, stage in zip(self.chunks, self.stages):
            if stage == 0:
                x = example
            else:
                if self.owner(stage - 1) == self.rank:  # this rank's own previous chunk (one rank, several chunks)
                    meta = self._local_meta
                else:
                    meta = torch.zeros(_META, dtype=torch.int64)
                    dist.recv(meta, self._global[self.owner(stage - 1)], group=self.group)
                dtype, ndim = _DTYPES[int(meta[0])], int(meta[1])
                x = torch.zeros(*meta[2:2 + ndim].tolist(), dtype=dtype)
            self.input_meta[stage] = (x.dtype, tuple(x.shape))
            training = [m.training for m in chunk.modules()]
            chunk.eval()
            try:
                with torch.no_grad():
                    y = chunk(x)
            finally:
                for m, was in zip(chunk.modules(), training):
                    m.training = was
            if stage < self.num_stages - 1:
                _check_output(stage, y)
            if isinstance(y, torch.Tensor):
                self.output_meta[stage] = (y.dtype, tuple(y.shape))
            if stage < self.num_stages - 1:
                if y.dim() > _META - 2 or y.dtype not in _DTYPES:
                    raise ValueError(f"stage {stage}'s output {y.dtype} {tuple(y.shape)} cannot be described in "
                                     f"{_META - 2} dims of {', '.join(map(str, _DTYPES))}")
                meta = torch.zeros(_META, dtype=torch.int64)
                meta[0], meta[1] = _DTYPES.index(y.dtype), y.dim()
                meta[2:2 + y.dim()] = torch.tensor(y.shape)
                if self.owner(stage + 1) == self.rank:  # one rank, several chunks: no message
                    self._local_meta = meta
                else:
                    sends.append(dist.isend(meta, self._global[self.owner(stage + 1)], group=self.group))
        for work in sends:
            work.wait()

    # -- messages (messages.py places them; these move them) ---------------------------------------
    def _receive(self, m: Message) -> None:
        """A RECV: the tensor `m` names, from its rank, into the inbox until its action takes it."""
        dest = m.stage + 1 if m.what == FORWARD else m.stage - 1
        dtype, shape = self.input_meta[dest] if m.what == FORWARD else self.output_meta[dest]
        t = torch.empty(shape, dtype=dtype)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, self._global[m.peer], group=self.group)]):
            work.wait()
        self._inbox[m.key] = t

    def _send(self, step: "_Step", m: Message) -> None:
        """A SEND: the tensor the action before it left in the outbox, to its rank (isend: the rank
        goes on at once; the step waits for every send at its end)."""
        t = self._outbox.pop(m.key)
        step.sends += dist.batch_isend_irecv([dist.P2POp(dist.isend, t.contiguous(), self._global[m.peer],
                                                         group=self.group)])

    def _pass_on(self, key: tuple, t: torch.Tensor, dest_stage: int) -> None:
        """What an action produces for stage `dest_stage`: to this rank's own inbox when that stage
        is one of its chunks (no message), else to the outbox for the SEND after the action."""
        if self.owner(dest_stage) == self.rank:
            self._inbox[key] = t.detach().clone()
        else:
            self._outbox[key] = t

    # -- the executor --------------------------------------------------------------------------
    def _check_run(self, schedule: List[List[Action]], inputs, targets) -> int:
        """The schedule's microbatch count, once its actions are checked (each (microbatch, chunk)
        forward then backward once on every rank, no deadlock: schedule.check) and this rank's
        inputs or targets fit it; a ValueError naming the mistake otherwise, before any message."""
        forwards = [a for a in schedule[self.rank] if a.kind == FORWARD]
        microbatches = 1 + max((a.microbatch for a in forwards), default=-1)
        key = tuple(tuple(acts) for acts in schedule)
        if key != getattr(self, "_checked", None):
            check(schedule, microbatches)
            self._lowered = with_messages(schedule)  # the sends and receives, placed once
            check_messages(self._lowered)
            self._checked = key
        if 0 in self.stages:
            _check_microbatches("inputs", inputs, microbatches, self.input_meta[0])
        if self.num_stages - 1 in self.stages:
            _check_microbatches("targets", targets, microbatches, None)
        return microbatches


    def run(self, schedule: List[List[Action]], inputs: Optional[List[torch.Tensor]] = None,
            targets: Optional[List[torch.Tensor]] = None, count_saved: bool = True) -> StepResult:
        """Run this rank's actions of `schedule` (every rank's lists: the order peers send in comes
        from theirs); `inputs`: the microbatches (stage 0's rank), `targets`: their targets (the
        last stage's rank). Each action is one small method (ACTIONS); the loop around them times
        it: from when it began waiting for its message, from when it began computing, to its end.
        `count_saved`: count the activations autograd saves (the result's peak_saved_bytes); False
        runs the forwards without that count's hooks, the same arithmetic, peak_saved_bytes None."""
        if not self.input_meta:
            raise RuntimeError("call agree_shapes() once before run()")
        if len(schedule) != self.ranks:
            raise ValueError(f"the schedule has {len(schedule)} ranks' actions; this pipeline has {self.ranks} ranks")
        if chunks_of(schedule) != len(self.chunks):  # a chunk no action runs would wait for ever for its messages
            raise ValueError(f"the schedule runs {chunks_of(schedule)} chunk(s) a rank; this rank holds "
                             f"{len(self.chunks)}")
        microbatches = self._check_run(schedule, inputs, targets)
        self._inbox: Dict[tuple, torch.Tensor] = {}  # messages (and own chunks' outputs) until taken
        self._outbox: Dict[tuple, torch.Tensor] = {}  # an action's output until the SEND after it
        step, timeline, compute = _Step(inputs, targets), [], 0.0
        self.saved.reset(self.parameters())
        if count_saved:
            step.counting = self.saved
        start = time.perf_counter()
        waited = None  # when the receives before the next action began
        for a in self._lowered[self.rank]:
            if isinstance(a, Message):
                if a.direction == RECV:
                    waited = time.perf_counter() if waited is None else waited
                    self._receive(a)
                else:
                    self._send(step, a)
                continue
            waited = time.perf_counter() if waited is None else waited
            began, ended = self.ACTIONS[a.kind](self, step, a)
            compute += ended - began
            timeline.append((a, waited - start, began - start, ended - start))
            waited = None
        for work in step.sends:
            work.wait()
        for p in self.parameters():
            if p.grad is not None:
                p.grad.div_(microbatches)  # a mean over microbatches, as torch's scale_grads
        return StepResult(step.losses, timeline, time.perf_counter() - start, compute,
                          self.saved.peak if count_saved else None, step.peak_in_flight, start)

    def _forward(self, step: _Step, a: Action) -> tuple:
        """F: the input (stage 0's microbatch, or the activation the stage before sent), the chunk
        (and the loss, on the last stage) with what it saves counted, the output sent on."""
        stage, last = stage_index(a.chunk, self.rank, self.ranks), self.num_stages - 1
        if stage == 0:
            x = step.inputs[a.microbatch]
        else:
            x = self._inbox.pop((FORWARD, a.microbatch, stage - 1)).requires_grad_()
        began = time.perf_counter()
        with step.counting, self.autocast():
            y = self.chunks[a.chunk](x)
            if stage == last:
                y = self.loss_fn(y, step.targets[a.microbatch])
                step.losses[a.microbatch] = y.detach()
        ended = time.perf_counter()
        step.held[(a.microbatch, a.chunk)] = (x, y)
        step.peak_in_flight = max(step.peak_in_flight, len(step.held))
        if stage < last:
            self._pass_on((FORWARD, a.microbatch, stage), y.detach(), stage + 1)
        return began, ended

    def _backward(self, step: _Step, a: Action) -> tuple:
        """B, or a split backward's I: the output's gradient (the last stage starts from its loss),
        the input's gradient (I keeps the weights' side for its W), sent back."""
        stage, last = stage_index(a.chunk, self.rank, self.ranks), self.num_stages - 1
        key = (a.microbatch, a.chunk)
        x, y = step.held[key] if a.kind == INPUT else step.held.pop(key)
        grad = None if stage == last else self._inbox.pop((BACKWARD, a.microbatch, stage + 1))
        began = time.perf_counter()
        if a.kind == INPUT:
            split, chunk = self._split[a.chunk], self.chunks[a.chunk]
            dx, step.weights_later[key] = split.input_gradient(y, grad, x, chunk.parameters())
        else:
            torch.autograd.backward(y, grad)
            dx = x.grad
        ended = time.perf_counter()
        if stage > 0:
            self._pass_on((BACKWARD, a.microbatch, stage), dx, stage - 1)
        return began, ended

    def _weight(self, step: _Step, a: Action) -> tuple:
        """W: the weights' gradients of a split backward, after its I; nothing to receive or send."""
        began = time.perf_counter()
        step.weights_later.pop((a.microbatch, a.chunk))()
        ended = time.perf_counter()
        del step.held[(a.microbatch, a.chunk)]  # the activations the weights' side kept
        return began, ended

    ACTIONS = {FORWARD: _forward, BACKWARD: _backward, INPUT: _backward, WEIGHT: _weight}
