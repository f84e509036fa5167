"""A schedule's messages as data: each rank's list of actions with its sends and receives put in.

    lowered = with_messages(one_f_one_b(2, 4))
    print(table(lowered))          # rank 0: F0 F0>1 F1 F1>1 B0<1 B0 F2 ...   (>1: sent to rank 1, <1: received from it)
    check_messages(lowered)        # every receive meets the send it expects, in order; no deadlock
    simulate(lowered)              # the messages checked, then schedule.simulate on the actions

A forward on stage s sends its output to stage s+1's rank; a backward (or a split backward's I)
sends its input's gradient to stage s-1's rank; a rank whose own chunk is that stage passes it
on with no message. Between two ranks messages arrive in the order they were sent (the shm
backend matches no tags, and Gloo's order is the same), but with several chunks a rank may need
them in another order. So before an action that needs a message, its rank receives every message
its sender sends it up to that one, in the sender's order, and keeps those that come early: the
receives are placed once, here, from every rank's list, not worked out while the step runs. This
is what torch.distributed.pipelining does when it lowers a schedule to one with explicit send and
receive actions.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence, Tuple, Union

from . import schedule as plain
from .schedule import BACKWARD, FORWARD, GRADIENT_SENDERS, Action, chunks_of, stage_index

SEND, RECV = ">", "<"


@dataclasses.dataclass(frozen=True)
class Message:
    """A send or a receive of one tensor between two ranks: `what` is FORWARD (an activation, sent
    on by stage `stage`'s forward) or BACKWARD (a gradient, sent back by stage `stage`'s backward
    or I); `peer` the rank it goes to (SEND) or comes from (RECV)."""
    direction: str  # SEND or RECV
    what: str
    microbatch: int
    stage: int  # the stage that sends it
    peer: int

    @property
    def key(self) -> Tuple[str, int, int]:
        return (self.what, self.microbatch, self.stage)

    def __str__(self) -> str:
        return f"{self.what}{self.microbatch}{self.direction}{self.peer}"


Step = Union[Action, Message]


def _sent(actions: Sequence[Action], rank: int, ranks: int, stages: int) -> List[Message]:
    """The messages `rank` sends under its `actions`, in order (a SEND each)."""
    out = []
    for a in actions:
        stage = stage_index(a.chunk, rank, ranks)
        if a.kind == FORWARD and stage < stages - 1 and (stage + 1) % ranks != rank:
            out.append(Message(SEND, FORWARD, a.microbatch, stage, (stage + 1) % ranks))
        elif a.kind in GRADIENT_SENDERS and stage > 0 and (stage - 1) % ranks != rank:
            out.append(Message(SEND, BACKWARD, a.microbatch, stage, (stage - 1) % ranks))
    return out


def needs(a: Action, rank: int, ranks: int, stages: int):
    """The message key (what, microbatch, sending stage) that action `a` of `rank` receives from
    another rank, and that rank; None when its input is local (stage 0's microbatch, the last
    stage's loss, a W, or this rank's own chunk)."""
    stage = stage_index(a.chunk, rank, ranks)
    if a.kind == FORWARD and stage > 0 and (stage - 1) % ranks != rank:
        return (FORWARD, a.microbatch, stage - 1), (stage - 1) % ranks
    if a.kind in GRADIENT_SENDERS and stage < stages - 1 and (stage + 1) % ranks != rank:
        return (BACKWARD, a.microbatch, stage + 1), (stage + 1) % ranks
    return None


def with_messages(schedule: List[List[Action]]) -> List[List[Step]]:
    """Each rank's actions with its receives before the action that needs them (and before them
    the receives of what the same sender sent earlier) and its sends after the action that
    produces them."""
    ranks = len(schedule)
    stages = ranks * chunks_of(schedule)
    lowered = []
    for rank in range(ranks):
        incoming: Dict[int, List[Message]] = {
            src: [Message(RECV, m.what, m.microbatch, m.stage, src)
                  for m in _sent(schedule[src], src, ranks, stages) if m.peer == rank]
            for src in range(ranks) if src != rank}
        taken = {src: 0 for src in incoming}
        received = set()
        out: List[Step] = []
        sends = iter(_sent(schedule[rank], rank, ranks, stages))
        pending = next(sends, None)
        for a in schedule[rank]:
            need = needs(a, rank, ranks, stages)
            if need is not None:
                key, src = need
                while key not in received:
                    if taken[src] == len(incoming[src]):
                        raise ValueError(f"rank {rank}: {a} needs {key[0]}{key[1]} from rank {src}, which never "
                                         f"sends it")
                    m = incoming[src][taken[src]]
                    taken[src] += 1
                    received.add(m.key)
                    out.append(m)
            out.append(a)
            stage = stage_index(a.chunk, rank, ranks)
            if pending is not None and pending.microbatch == a.microbatch and pending.stage == stage and \
                    (pending.what == FORWARD) == (a.kind == FORWARD):
                out.append(pending)
                pending = next(sends, None)
        lowered.append(out)
    return lowered


def check_messages(lowered: List[List[Step]]) -> None:
    """A ValueError unless every receive meets the send it expects, first in line from its
    sender, and the ranks cannot all wait at once (a deadlock); actions of a rank run in order,
    a send never waits."""
    ranks = len(lowered)
    channel: Dict[Tuple[int, int], List[Tuple[str, int, int]]] = {}  # (src, dst) -> keys sent, not yet received
    at = [0] * ranks
    while any(at[r] < len(lowered[r]) for r in range(ranks)):
        progressed = False
        for r in range(ranks):
            while at[r] < len(lowered[r]):
                step = lowered[r][at[r]]
                if isinstance(step, Message) and step.direction == SEND:
                    channel.setdefault((r, step.peer), []).append(step.key)
                elif isinstance(step, Message):
                    line = channel.get((step.peer, r), [])
                    if not line:
                        break
                    if line[0] != step.key:
                        raise ValueError(f"rank {r} receives {step.what}{step.microbatch} of stage {step.stage} "
                                         f"from rank {step.peer}, which sent {line[0][0]}{line[0][1]} of stage "
                                         f"{line[0][2]} first")
                    line.pop(0)
                at[r] += 1
                progressed = True
        if not progressed:
            stuck = [f"rank {r} at {lowered[r][at[r]]}" for r in range(ranks) if at[r] < len(lowered[r])]
            raise ValueError(f"the messages deadlock: {', '.join(stuck)}")
    left = {k: v for k, v in channel.items() if v}
    if left:
        raise ValueError(f"messages sent and never received: {left}")


def simulate(lowered: List[List[Step]], **lengths) -> List[float]:
    """schedule.simulate on a schedule with its messages: the messages checked first
    (check_messages), then each rank's idle share with messages taking no time."""
    check_messages(lowered)
    return plain.simulate([[a for a in steps if isinstance(a, Action)] for steps in lowered], **lengths)
