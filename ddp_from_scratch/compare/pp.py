"""The compare program's pipeline table (python -m ddp_from_scratch.compare --impl pp): each
schedule against its counterpart in torch.distributed.pipelining, and against the one-rank model,
bit for bit (pipeline_parallel/parity.py runs them).

    python -m ddp_from_scratch.compare --impl pp --world-sizes 2 4

Rows on p ranks: GPipe, 1F1B, interleaved 1F1B (2 chunks a rank) and zero bubble (1 and 2 chunks
a rank) with as many microbatches as ranks, twice as many, and an odd count, against torch's
ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble: every
loss and every gradient of every rank; then each schedule against
the whole model on one rank accumulating the same microbatches. A pipeline needs 2 ranks or more;
a world of 1 is a row that says so.
"""

from __future__ import annotations

from ..pipeline_parallel import parity

PP_IMPL = "pp"
RUNS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero-bubble", 1), ("zero-bubble", 2)]  # (schedule, chunks)
PP_HEADERS = ["pipeline schedule", "against", "ranks", "microbatches", "bitwise equal", "gradients compared"]


def pp_checks(env) -> list:
    """This rank's rows: (schedule, against, microbatches, bitwise here, gradients compared)."""
    p = env.world_size
    if p < 2:
        return []
    rows = []
    for name, chunks in RUNS:
        torch_name = parity.TORCH_SCHEDULES[name]
        counts = (p, 2 * p, parity.odd_count(name, p))
        for m, (grads, losses, _) in parity.against_torch(env, name, counts, chunks=chunks).items():
            rows.append((name + (f" (v={chunks})" if chunks > 1 else ""), f"torch {torch_name}", m,
                         all(same for _, same in grads) and all(losses), len(grads)))
        grads, losses, _ = parity.against_one_rank(env, name, 2 * p, 4 * chunks, None, chunks)
        rows.append((name + (f" (v={chunks})" if chunks > 1 else ""), "the one-rank model, gradients accumulated",
                     2 * p, all(grads) and all(losses), len(grads)))
    return rows


def table_rows(per_rank: list, p: int) -> tuple:
    """(rows, ok): every rank's rows merged (bitwise only if on every rank), and whether all are."""
    if p < 2:
        return [["every schedule", "-", p, "-", "not run", "a pipeline needs 2 ranks or more"]], True
    rows, ok = [], True
    for i, (name, against, m, _, _) in enumerate(per_rank[0]):
        everywhere = all(rank_rows[i][3] for rank_rows in per_rank)
        ok = ok and everywhere
        compared = sum(rank_rows[i][4] for rank_rows in per_rank)
        rows.append([name, against, p, m, "yes" if everywhere else "no", compared])
    return rows, ok
