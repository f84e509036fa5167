"""ddp_from_scratch.memory.HeldBytes counts what a rank holds, each storage once.

    pytest tests/ddp/test_memory.py -q
"""

import torch
from torch import nn

from ddp_from_scratch.memory import HeldBytes


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
