"""ddp_from_scratch.parts.memory.HeldBytes counts what a rank holds, each storage once.

    pytest tests/ddp/test_memory.py -q
"""

import torch
from torch import nn

from ddp_from_scratch.parts.memory import HeldBytes
from collectives.testing import run_on_ranks


def test_parameters_the_optimizer_steps_count_even_when_no_module_holds_them():
    """FSDP2 swaps a gathered unit's sharded parameters for unsharded ones on the module and keeps
    the shards for the optimizer; missing them made fully_shard's peak look 1/p of a unit smaller."""
    model = nn.Linear(8, 4, bias=False)  # 128 bytes registered
    shard = nn.Parameter(torch.zeros(16))  # 64 bytes only the optimizer has
    opt = torch.optim.SGD([shard], lr=0.1)
    held = HeldBytes(model, opt)
    held.sample()
    assert held.peak["params"] == 128 + 64, held.peak


def test_a_storage_is_counted_once_however_many_tensors_view_it():
    model = nn.Linear(8, 4, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # the same parameter on the module and in the optimizer
    model.weight.grad = torch.ones(4, 8)
    held = HeldBytes(model, opt)
    held.sample(comm=[model.weight.grad.view(-1)])  # a collective's input that is the .grad itself
    assert held.peak == {"params": 128, "grads": 128, "optimizer": 0, "comm": 0, "total": 256}, held.peak


class _InFlight(nn.Module):
    """A wrapper with nothing registered but 1000 bytes in a collective that has not finished."""

    def bytes_in_flight(self) -> int:
        return 1000


def test_buffers_of_collectives_in_flight_count_as_comm():
    model = _InFlight()
    held = HeldBytes(model, torch.optim.SGD([nn.Parameter(torch.zeros(0))], lr=0.1))
    held.sample()
    assert held.peak == {"params": 0, "grads": 0, "optimizer": 0, "comm": 1000, "total": 1000}, held.peak


def _in_flight_at_each_sample(env):
    import torch.nn.functional as F

    from ddp_from_scratch.steps.fsdp import FullyShardedDataParallel
    from ddp_from_scratch.workload.models import SmallNet, batch
    from ddp_from_scratch.steps.zero2 import ZeroTwoDataParallel

    out = {}
    for name, cls in (("zero2", ZeroTwoDataParallel), ("fsdp", FullyShardedDataParallel)):
        torch.manual_seed(0)
        model = cls(SmallNet())
        opt = model.optimizer(torch.optim.SGD, lr=0.1)
        seen = []

        class Recording(HeldBytes):
            def sample(self, comm=()):
                seen.append(self.model.bytes_in_flight())
                super().sample(comm)

        held = Recording(model, opt)
        x, y = batch(0, env.rank, 4, 12)
        with held.watching_collectives():
            F.cross_entropy(model(x), y).backward()
            opt.step()
        out[name] = (set(seen), [model.unit_layouts[u].per_rank for u in range(len(model.units))], held.peak["comm"])
    return out


def test_the_wrappers_report_what_their_collectives_in_flight_hold():
    """On 2 ranks, a reduce-scatter in flight holds its packed input (2 rows) and its output (1
    row), a prefetched all_gather its row and its landing buffer (2 rows): 3 rows of 4-byte floats
    either way, 12 bytes per element of a rank's row. ZeRO-2 has one unit here (SmallNet's root);
    FSDP overlaps a unit's reduce-scatter with the next unit's prefetch, so some sample must see
    two units' buffers at once (a prefetch left uncounted would never show that)."""
    for seen_by_rank in run_on_ranks(_in_flight_at_each_sample, 2):
        seen, rows, peak_comm = seen_by_rank["zero2"]
        assert seen == {0, 12 * rows[0]}, (seen, rows)
        assert peak_comm >= 12 * rows[0]
        seen, rows, _ = seen_by_rank["fsdp"]
        singles = {12 * r for r in rows}
        pairs = {12 * (a + b) for i, a in enumerate(rows) for b in rows[i + 1:]}
        assert seen - {0} <= singles | pairs and seen & pairs - singles, (sorted(seen), rows)
