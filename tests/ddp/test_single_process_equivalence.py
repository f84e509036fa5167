"""Data parallelism changes nothing but the speed: the gradient our DDP leaves on every rank is the
gradient one process computes on all ranks' batches together (for a model without BatchNorm,
whose output does not depend on how the batch is split), and `no_sync()` accumulation equals one
step on the larger batch. Not bitwise: the sums run in a different order, so assert_close.

    pytest tests/ddp/test_single_process_equivalence.py -q
"""

import torch
import torch.nn.functional as F
from torch import nn

from ddp_from_scratch.steps.ddp import DistributedDataParallel
from collectives.testing import run_on_ranks


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _data(rank, micro, size=5):
    g = torch.Generator().manual_seed(100 * rank + micro)
    return torch.randn(size, 6, generator=g), torch.randint(0, 3, (size,), generator=g)


def _equivalence(env, micro_batches):
    n = env.world_size
    ddp = DistributedDataParallel(_mlp(), bucket_cap_mb=0.001, first_bucket_mb=0.0005)
    with ddp.no_sync():
        for m in range(micro_batches - 1):
            F.cross_entropy(ddp(*_data(env.rank, m)[:1]), _data(env.rank, m)[1]).backward()
    x, y = _data(env.rank, micro_batches - 1)
    F.cross_entropy(ddp(x), y).backward()

    # one process, every rank's micro-batches together, mean loss over all of them
    single = _mlp()
    xs, ys = zip(*[_data(r, m) for r in range(n) for m in range(micro_batches)])
    F.cross_entropy(single(torch.cat(xs)), torch.cat(ys)).backward()
    for (name, p), q in zip(ddp.module.named_parameters(), single.parameters()):
        # each micro-batch's loss is a mean, and accumulation adds them: micro_batches x the full mean
        torch.testing.assert_close(p.grad, micro_batches * q.grad, rtol=1e-5, atol=1e-6, msg=name)
    return True


def test_gradient_equals_one_process_on_the_concatenated_batch():
    for n in (2, 3):
        assert run_on_ranks(_equivalence, n, args=(1,)) == [True] * n


def test_no_sync_accumulation_equals_one_step_on_the_larger_batch():
    assert run_on_ranks(_equivalence, 2, args=(3,)) == [True, True]
