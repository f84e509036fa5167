"""Schedules as data: for each rank of the pipeline, the list of actions it runs in order.

    actions = gpipe(stages=4, microbatches=8)          # actions[rank]: [F0, F1, ..., F7, B0, ..., B7]
    actions = one_f_one_b(stages=4, microbatches=8)
    actions = interleaved(stages=4, microbatches=8, chunks=2)   # each rank holds 2 stages of 8
    print(table(actions))                              # a row a rank, an action a column
    simulate(actions, forward=1, backward=2)           # each rank's idle share, with actions of those lengths

An action is a forward or a backward of one microbatch on one of the rank's model chunks (chunk c
of rank r is stage c*p + r of the p*v stages; without interleaving every rank has one chunk).
Its messages are implied by where the stage sits (stage.py): a forward receives its input from
the stage before and sends its output to the stage after; a backward receives its output's
gradient from the stage after and sends its input's gradient to the stage before. One executor
runs any schedule.

- GPipe (Huang et al., 2019): every forward, then every backward. A rank holds the activations of
  all m microbatches at once; the bubble, the share of a step a rank idles, is (p-1)/(m+p-1).
- 1F1B (PipeDream-flush, Narayanan et al., 2021): rank s runs min(m, p-s) forwards, then one
  backward and one forward in turn, then the backwards left. The same bubble, but a rank holds
  at most p microbatches' activations instead of m. Its order is torch's Schedule1F1B's.
- Interleaved 1F1B (Narayanan et al., 2021, Megatron-LM): each rank holds v chunks, stages p
  apart, so a microbatch passes every rank v times. The microbatches go in rounds of g (m split
  evenly, g about p); a round runs each chunk's forwards in turn, chunk 0 first, and its
  backwards from the last chunk back. Rank r first runs (v-1) g + 2 (p-1-r) + 1 forwards, then
  one backward and one forward in turn. The bubble shrinks to (p-1)/(v m+p-1), for more messages.

Every schedule runs a chunk's backwards (or its Ws) in microbatch order 0, 1, ..., m-1: a
parameter's gradient is the sum over microbatches in that order, as in one-rank gradient
accumulation.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

FORWARD, BACKWARD = "F", "B"
INPUT, WEIGHT = "I", "W"  # a backward split in two: the input's gradient, then the weights'
GRADIENT_SENDERS = (BACKWARD, INPUT)  # the actions that send a gradient to the stage before


def stage_index(chunk: int, rank: int, ranks: int) -> int:
    """The stage that chunk `chunk` of rank `rank` is, of a pipeline over `ranks` ranks: chunk * p + r
    (each rank holds stages r, p + r, 2p + r, ..., as torch's interleaved schedules place them)."""
    return chunk * ranks + rank


@dataclasses.dataclass(frozen=True)
class Action:
    kind: str  # FORWARD, BACKWARD, or INPUT then WEIGHT
    microbatch: int
    chunk: int = 0  # which of the rank's model chunks (interleaved): stage_index(chunk, rank, p)

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f":{self.chunk}" if self.chunk else "")


def _check(stages: int, microbatches: int, chunks: int = 1) -> None:
    for name, value in (("stages", stages), ("microbatches", microbatches), ("chunks a rank", chunks)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"a schedule's {name} must be a whole number, got {value!r}")
    if stages < 1 or microbatches < 1:
        raise ValueError(f"a schedule needs at least 1 stage and 1 microbatch, got {stages} and {microbatches}")
    if chunks < 1:
        raise ValueError(f"a schedule needs at least 1 chunk a rank, got {chunks}")


def gpipe(stages: int, microbatches: int) -> List[List[Action]]:
    """Every rank: all forwards, then all backwards."""
    _check(stages, microbatches)
    one = [Action(FORWARD, i) for i in range(microbatches)] + [Action(BACKWARD, i) for i in range(microbatches)]
    return [list(one) for _ in range(stages)]


def _alternate(forwards: List[Action], backwards: List[Action], warmup: int) -> List[Action]:
    """`warmup` forwards, then a backward and a forward in turn, then the backwards left."""
    actions, f, b = list(forwards[:warmup]), warmup, 0
    while b < len(backwards):
        actions.append(backwards[b])
        b += 1
        if f < len(forwards):
            actions.append(forwards[f])
            f += 1
    return actions


def one_f_one_b(stages: int, microbatches: int) -> List[List[Action]]:
    """Rank s: min(m, p - s) forwards to fill the pipe, then a backward and a forward in turn,
    then the backwards left. Needs m >= p (as torch's Schedule1F1B): with fewer, the pipe never
    fills and GPipe is the same schedule."""
    _check(stages, microbatches)
    if microbatches < stages:
        raise ValueError(f"1F1B needs at least as many microbatches as stages: {microbatches} microbatches for "
                         f"{stages} stages (with fewer the pipe never fills: use gpipe)")
    forwards = [Action(FORWARD, i) for i in range(microbatches)]
    backwards = [Action(BACKWARD, i) for i in range(microbatches)]
    return [_alternate(forwards, backwards, min(microbatches, stages - s)) for s in range(stages)]


def rounds_of(stages: int, microbatches: int) -> int:
    """How many rounds the interleaved schedule splits the microbatches into: m // p (at least 1),
    which must divide m (torch's ScheduleInterleaved1F1B takes the same)."""
    return max(1, microbatches // stages)


def _rounds(schedule: str, stages: int, microbatches: int):
    """(rounds, microbatches a round) of a schedule that runs them in rounds; ValueError unless the
    rounds divide them."""
    rounds = rounds_of(stages, microbatches)
    if microbatches % rounds:
        raise ValueError(f"{schedule} runs the microbatches in rounds of about one a stage: {microbatches} "
                         f"microbatches on {stages} stages make {rounds} rounds, which must divide them (take a "
                         f"multiple of {rounds}, or of {stages})")
    return rounds, microbatches // rounds


def interleaved(stages: int, microbatches: int, chunks: int = 2) -> List[List[Action]]:
    """Interleaved 1F1B with `chunks` (v) model chunks a rank (see the module docstring)."""
    _check(stages, microbatches, chunks)
    rounds, g = _rounds("interleaved 1F1B", stages, microbatches)
    forwards = [Action(FORWARD, k * g + i, c) for k in range(rounds) for c in range(chunks) for i in range(g)]
    backwards = [Action(BACKWARD, k * g + i, c) for k in range(rounds) for c in reversed(range(chunks))
                 for i in range(g)]
    total = microbatches * chunks
    # Megatron's warm-up, (v-1) g + 2 (p-1-r) forwards before it alternates forward then backward:
    # one more here, where the alternation starts with the backward
    return [_alternate(forwards, backwards, min(total, (chunks - 1) * g + 2 * (stages - 1 - r) + 1) if chunks > 1
                       else min(microbatches, stages - r)) for r in range(stages)]


def zero_bubble(stages: int, microbatches: int, chunks: int = 1) -> List[List[Action]]:
    """Zero bubble with `chunks` (v) model chunks a rank, 1 or more (see the module docstring)."""
    _check(stages, microbatches, chunks)
    rounds, g = _rounds("zero bubble", stages, microbatches)
    forwards = [Action(FORWARD, k * g + i, c) for k in range(rounds) for c in range(chunks) for i in range(g)]
    inputs = [Action(INPUT, k * g + i, c) for k in range(rounds) for c in reversed(range(chunks)) for i in range(g)]
    total = microbatches * chunks
    out = []
    for r in range(stages):
        warmup = min(total, (chunks - 1) * g + stages - 1 - r)
        actions = list(forwards[:warmup])
        for k, i in enumerate(inputs):
            if warmup + k < total:
                actions.append(forwards[warmup + k])
            actions.append(i)
            if k >= r:  # rank r holds back r Ws: they fill its wait in the cool-down
                actions.append(Action(WEIGHT, inputs[k - r].microbatch, inputs[k - r].chunk))
        actions += [Action(WEIGHT, i.microbatch, i.chunk) for i in inputs[max(0, total - r):]]
        out.append(actions)
    return out


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zero-bubble": zero_bubble}
CHUNKED = ("interleaved", "zero-bubble")  # the schedules that take several chunks a rank


def make(name: str, stages: int, microbatches: int, chunks: int = 1) -> List[List[Action]]:
    """The schedule called `name` (a key of SCHEDULES); `chunks` a rank for those in CHUNKED."""
    if name in CHUNKED:
        return SCHEDULES[name](stages, microbatches, chunks)
    return SCHEDULES[name](stages, microbatches)


def chunks_of(actions: List[List[Action]]) -> int:
    return 1 + max(a.chunk for acts in actions for a in acts if isinstance(a, Action))


def check(actions: List[List[Action]], microbatches: int) -> None:
    """ValueError unless every rank runs each (microbatch, chunk)'s forward, then its backward (or
    its I, then its W), once each, and the schedule cannot deadlock (simulate)."""
    v = chunks_of(actions)
    before = {BACKWARD: FORWARD, INPUT: FORWARD, WEIGHT: INPUT}
    for rank, acts in enumerate(actions):
        seen: Dict[str, List[Tuple[int, int]]] = {FORWARD: [], BACKWARD: [], INPUT: [], WEIGHT: []}
        for a in acts:
            if a.kind not in seen:
                raise ValueError(f"rank {rank}: {a} is not one of the actions {', '.join(seen)}")
            if a.kind in before and (a.microbatch, a.chunk) not in seen[before[a.kind]]:
                raise ValueError(f"rank {rank}: {a} comes before its {'I' if a.kind == WEIGHT else 'forward'}")
            seen[a.kind].append((a.microbatch, a.chunk))
        want = sorted((i, c) for i in range(microbatches) for c in range(v))
        split = bool(seen[INPUT] or seen[WEIGHT])
        for kind, done in seen.items():
            if kind in ((BACKWARD,) if split else (INPUT, WEIGHT)):
                if done:
                    raise ValueError(f"rank {rank} mixes whole backwards with split ones (I and W)")
                continue
            if sorted(done) != want:
                raise ValueError(f"rank {rank} runs {kind} of {sorted(done)}, not each (microbatch, chunk) once")
    simulate(actions)


def simulate(actions: List[List[Action]], forward: float = 1.0, backward: float = 2.0,
             weight: Optional[float] = None) -> List[float]:
    """Run the schedule with every forward `forward` long and every backward `backward` long (a
    split one: its W `weight` long, half the backward unless given, and its I the rest), each
    action starting once its rank is free and its inputs exist (the previous stage's forward of
    that microbatch; the next stage's backward or I; a W, its own I); messages take no time. Each
    rank's idle share of the whole; a ValueError naming the ranks stuck if it cannot finish (a
    deadlock). messages.simulate takes the lists with their sends and receives."""
    p, v = len(actions), chunks_of(actions)
    last = p * v - 1
    weight = backward / 2 if weight is None else weight
    lengths = {FORWARD: forward, BACKWARD: backward, INPUT: backward - weight, WEIGHT: weight}
    done: Dict[Tuple[str, int, int], float] = {}  # (kind, microbatch, stage) -> when it ended
    at, free, busy = [0] * p, [0.0] * p, [0.0] * p
    while any(at[r] < len(actions[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while at[r] < len(actions[r]):
                a = actions[r][at[r]]
                stage = stage_index(a.chunk, r, p)
                if a.kind == FORWARD:
                    needs = [(FORWARD, a.microbatch, stage - 1)] if stage > 0 else []
                elif a.kind == WEIGHT:
                    needs = [(INPUT, a.microbatch, stage)]
                else:  # the gradient the stage after sent: its backward's, or its I's
                    needs = [(FORWARD, a.microbatch, stage)] + ([("grad", a.microbatch, stage + 1)]
                                                                if stage < last else [])
                if any(n not in done for n in needs):
                    break
                start = max([free[r]] + [done[n] for n in needs])
                done[(a.kind, a.microbatch, stage)] = free[r] = start + lengths[a.kind]
                if a.kind in GRADIENT_SENDERS:
                    done[("grad", a.microbatch, stage)] = free[r]
                busy[r] += lengths[a.kind]
                at[r] += 1
                progressed = True
        if not progressed:
            stuck = [f"rank {r} at {actions[r][at[r]]}" for r in range(p) if at[r] < len(actions[r])]
            raise ValueError(f"the schedule deadlocks: {', '.join(stuck)}")
    end = max(free)
    return [1.0 - b / end for b in busy]


def table(actions: List[List[Action]]) -> str:
    """The schedule as rows of actions, one row a rank, in the order each rank runs them (F3:1 is
    microbatch 3's forward on chunk 1); stage.py's timeline is the schedule as it ran."""
    width = max(len(str(a)) for acts in actions for a in acts)
    return "\n".join(f"rank {r}: " + " ".join(str(a).rjust(width) for a in acts) for r, acts in enumerate(actions))


def peak_in_flight(actions: List[Action]) -> int:
    """The most (microbatch, chunk) pairs whose activations a rank holds at once under `actions`
    (a forward keeps them until its backward, or its W): m for GPipe, at most p for 1F1B."""
    held = peak = 0
    for a in actions:
        if a.kind == INPUT:
            continue  # the weights' side of the graph stays until the W
        held += 1 if a.kind == FORWARD else -1
        peak = max(peak, held)
    return peak


def bubble(stages: int, microbatches: int, chunks: int = 1, split: bool = False) -> float:
    """The closed form of the share of a step a rank idles, every stage's forward and backward
    taking the same time: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m+p-1) interleaved; with the
    backward split (zero bubble) and a forward, an I and a W as long, (p-1)/(3 v m+p-1)."""
    return (stages - 1) / ((3 if split else 1) * chunks * microbatches + stages - 1)
