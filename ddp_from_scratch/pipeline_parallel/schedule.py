"""Schedules as data: for each rank of the pipeline, the list of actions it runs in order.

    actions = gpipe(stages=4, microbatches=8)       # actions[rank]: [F0, F1, ..., F7, B0, ..., B7]
    actions = one_f_one_b(stages=4, microbatches=8)
    print(table(actions))                           # a row a rank, an action a column

An action is a forward or a backward of one microbatch on the rank's stage. Its messages are
implied by where the stage sits (stage.py): a forward receives its input from the stage before
and sends its output to the stage after; a backward receives its output's gradient from the
stage after and sends its input's gradient to the stage before. One executor runs any schedule.

- GPipe (Huang et al., 2019): every forward, then every backward. A rank holds the activations of
  all m microbatches at once; the bubble, the share of a step a rank idles, is (p-1)/(m+p-1).
- 1F1B (PipeDream-flush, Narayanan et al., 2021): rank s runs min(m, p-s) forwards, then one
  backward and one forward in turn, then the backwards left. The same bubble, but a rank holds
  at most p microbatches' activations instead of m. Ranks and the order of each rank's backwards
  are torch.distributed.pipelining.Schedule1F1B's, so the gradients add up in the same order.

Both run the backwards of a rank in microbatch order 0, 1, ..., m-1: a parameter's gradient is
the sum over microbatches in that order, as in one-rank gradient accumulation.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List

FORWARD, BACKWARD = "F", "B"


@dataclasses.dataclass(frozen=True)
class Action:
    kind: str  # FORWARD or BACKWARD
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def _check(stages: int, microbatches: int) -> None:
    if stages < 1 or microbatches < 1:
        raise ValueError(f"a schedule needs at least 1 stage and 1 microbatch, got {stages} and {microbatches}")


def gpipe(stages: int, microbatches: int) -> List[List[Action]]:
    """Every rank: all forwards, then all backwards."""
    _check(stages, microbatches)
    one = [Action(FORWARD, i) for i in range(microbatches)] + [Action(BACKWARD, i) for i in range(microbatches)]
    return [list(one) for _ in range(stages)]


def one_f_one_b(stages: int, microbatches: int) -> List[List[Action]]:
    """Rank s: min(m, p - s) forwards to fill the pipe, then a backward and a forward in turn,
    then the backwards left. Needs m >= p (as torch's Schedule1F1B): with fewer, the pipe never
    fills and GPipe is the same schedule."""
    _check(stages, microbatches)
    if microbatches < stages:
        raise ValueError(f"1F1B needs at least as many microbatches as stages: {microbatches} microbatches for "
                         f"{stages} stages (with fewer the pipe never fills: use gpipe)")
    out = []
    for s in range(stages):
        warmup = min(microbatches, stages - s)
        actions = [Action(FORWARD, i) for i in range(warmup)]
        forward, backward = warmup, 0
        while backward < microbatches:
            actions.append(Action(BACKWARD, backward))
            backward += 1
            if forward < microbatches:
                actions.append(Action(FORWARD, forward))
                forward += 1
        out.append(actions)
    return out


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def check(actions: List[List[Action]], microbatches: int) -> None:
    """ValueError unless every rank runs each microbatch's forward, then its backward, once each."""
    for rank, acts in enumerate(actions):
        seen: Dict[str, List[int]] = {FORWARD: [], BACKWARD: []}
        for a in acts:
            if a.kind == BACKWARD and a.microbatch not in seen[FORWARD]:
                raise ValueError(f"rank {rank}: {a} comes before F{a.microbatch}")
            seen[a.kind].append(a.microbatch)
        for kind, done in seen.items():
            if sorted(done) != list(range(microbatches)):
                raise ValueError(f"rank {rank} runs {kind} of microbatches {done}, not each of 0 to {microbatches - 1} once")


def table(actions: List[List[Action]]) -> str:
    """The schedule as rows of actions, one row a rank, in the order each rank runs them (not
    aligned in time: stage.py's timeline is the schedule as it ran)."""
    width = max(len(str(a)) for acts in actions for a in acts)
    return "\n".join(f"rank {r}: " + " ".join(str(a).rjust(width) for a in acts) for r, acts in enumerate(actions))


def peak_in_flight(actions: List[Action]) -> int:
    """The most microbatches whose activations a rank holds at once under `actions` (a forward
    keeps them until its backward): m for GPipe, at most p for 1F1B."""
    held = peak = 0
    for a in actions:
        held += 1 if a.kind == FORWARD else -1
        peak = max(peak, held)
    return peak


def bubble(stages: int, microbatches: int) -> float:
    """The closed form of the share of a step a rank idles under GPipe and 1F1B, with a backward
    the same length on every stage: (p-1)/(m+p-1)."""
    return (stages - 1) / (microbatches + stages - 1)
