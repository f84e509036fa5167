"""The pipeline proven: our executor against torch.distributed.pipelining's schedules on the same
stages and data, and against the whole model on one rank accumulating the same microbatches.
Every loss and every gradient is compared bit for bit.

    per_count = against_torch(env, "1f1b", counts=(2, 4, 5))      # on every rank of a p-rank world
    grads, losses, _ = against_one_rank(env, "gpipe", m=4, depth=4, sizes=None)

tests/pipeline_parallel/test_pipeline_parallel.py runs them over backends, ranks and microbatch counts, and
`python -m ddp_from_scratch.compare --impl pp` prints them as a table.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from .schedule import CHUNKED, make, stage_index
from .split import split
from .stage import Stage

WIDTH, CLASSES = 16, 5
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "zero-bubble": "ScheduleInterleavedZeroBubble"}


def mlp(depth: int = 4, seed: int = 0) -> nn.Sequential:
    """depth Linear+Tanh pairs and a Linear to CLASSES: 2 depth + 1 layers, the same on every rank."""
    torch.manual_seed(seed)
    layers = [m for _ in range(depth) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())]
    return nn.Sequential(*layers, nn.Linear(WIDTH, CLASSES))


def data(microbatches: int, per_microbatch: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    n = microbatches * per_microbatch
    return torch.randn(n, WIDTH, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def odd_count(name: str, p: int) -> int:
    """An odd microbatch count each schedule takes on p ranks: 2p+1, or p+1 interleaved and zero
    bubble (their rounds of about p must divide the count, as torch's do)."""
    return p + 1 if name in CHUNKED else 2 * p + 1


def run_ours(env, stage_modules, name: str, m: int, x, y, chunks: int = 1, count_saved: bool = True):
    p, r = env.world_size, env.rank
    stage = Stage(stage_modules, r, p, loss_fn=F.cross_entropy)
    xs, ys = list(x.tensor_split(m)), list(y.tensor_split(m))
    stage.agree_shapes(xs[0] if r == 0 else None)
    return stage.run(make(name, p, m, chunks), xs if r == 0 else None, ys if r == p - 1 else None,
                     count_saved=count_saved)


def _stages(p: int, chunks: int, depth: int):
    n = p * chunks  # interleaved: a Linear and its Tanh a stage (balanced, a stage could be a Tanh alone)
    return split(mlp(depth), n) if chunks == 1 else split(mlp(n), n, [2] * (n - 1) + [3])


def against_torch(env, name: str, counts, depth: int = 4, chunks: int = 1) -> dict:
    """For each microbatch count: ours and torch's schedule on copies of this rank's stage (or its
    chunks: stages r, p + r, ...); {m: ([(parameter, same bits)], [loss same bits] (last rank), losses)}."""
    import torch.distributed.pipelining as pipelining

    p, r = env.world_size, env.rank
    out = {}
    for m in counts:
        stages = _stages(p, chunks, depth)
        mine = [stages[stage_index(c, r, p)] for c in range(chunks)]
        theirs = copy.deepcopy(mine)
        x, y = data(m)
        torch_stages = [pipelining.PipelineStage(t, stage_index(c, r, p), p * chunks, torch.device("cpu"))
                        for c, t in enumerate(theirs)]
        schedule = getattr(pipelining, TORCH_SCHEDULES[name])(
            torch_stages if name in CHUNKED else torch_stages[0], m, loss_fn=F.cross_entropy)
        losses = []
        if r == 0:
            schedule.step(x)
        elif r == p - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        result = run_ours(env, mine, name, m, x, y, chunks)
        grads = [(f"chunk {c} {n}", torch.equal(a.grad, b.grad)) for c in range(chunks)
                 for (n, a), b in zip(mine[c].named_parameters(), theirs[c].parameters())]
        same_losses = [torch.equal(result.losses[i], losses[i]) for i in range(m)] if r == p - 1 else []
        out[m] = (grads, same_losses, len(result.losses))
    return out


def against_one_rank(env, name: str, m: int, depth: int, sizes, chunks: int = 1, count_saved: bool = True):
    """Ours against the whole model on one rank, accumulating the same microbatches in the same
    order and dividing by their count: (every gradient same bits, every loss same bits (last rank),
    the most microbatch-chunks held). count_saved: whether our step counts its saved activations."""
    p, r = env.world_size, env.rank
    n = p * chunks
    whole = mlp(depth)
    x, y = data(m)
    one_losses = []
    for xi, yi in zip(x.tensor_split(m), y.tensor_split(m)):
        loss = F.cross_entropy(whole(xi), yi)
        loss.backward()
        one_losses.append(loss.detach())
    for q in whole.parameters():
        q.grad.div_(m)
    want = [split(whole, n, sizes)[stage_index(c, r, p)] for c in range(chunks)]
    mine = [split(mlp(depth), n, sizes)[stage_index(c, r, p)] for c in range(chunks)]
    result = run_ours(env, mine, name, m, x, y, chunks, count_saved)
    assert (result.peak_saved_bytes is None) == (not count_saved), result.peak_saved_bytes
    grads = [torch.equal(a.grad, b.grad) for c in range(chunks) for a, b in zip(mine[c].parameters(), want[c].parameters())]
    losses = [torch.equal(result.losses[i], one_losses[i]) for i in range(m)] if r == p - 1 else []
    return grads, losses, result.peak_in_flight
