"""The ranks of an shm group agree on its layout before any byte moves (collectives/shm/layout.py):
the round size follows from the CPUs the ranks have between them, and ranks whose slot or round
settings differ all raise the same error, naming each rank's value, with the world still usable.

    pytest tests/shm/test_layout.py -q
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from collectives.shm import backend_of, layout, new_group_with
from collectives.testing import run_on_ranks


def _round_bytes_with_cpus(env, cpus_of_rank):
    """Each rank claims the CPUs cpus_of_rank[rank] while the group is made; its round size, and
    an all_reduce of 3 MiB on it (rounds of that size) checked against the closed form."""
    saved = layout.own_cpus
    layout.own_cpus = lambda: cpus_of_rank[env.rank]
    try:
        group = new_group_with({"COLLECTIVES_SHM_SLOT_MB": "8"})
    finally:
        layout.own_cpus = saved
    t = torch.arange(3 << 18, dtype=torch.float32) + env.rank
    dist.all_reduce(t, group=group)
    n = env.world_size
    right = bool(torch.equal(t, n * torch.arange(3 << 18, dtype=torch.float32) + n * (n - 1) / 2))
    engine = backend_of(group).state.engine
    return backend_of(group).round_bytes, right, engine.machine_cores if engine is not None else None


def test_ranks_with_a_core_each_go_in_1_mib_rounds_and_ranks_that_share_one_in_half_slots():
    """The union of the ranks' CPUs sets the round size, and is what the native wait holds the
    machine's runnable threads against: ranks pinned to fewer cores than the machine has stop
    spinning once a thread beside them wants those cores (native_wait.h's MachineLoad)."""
    online = os.cpu_count()
    for cpus, expected, cores in (([[0], [1]], 1 << 20, 2),      # two CPUs between the two ranks
                                  ([[0], [0]], 4 << 20, 1),      # both on CPU 0: half the 8 MiB slot
                                  ([[0, 1], [0]], 1 << 20, 2)):  # the union counts, not a rank's own
        got = run_on_ranks(_round_bytes_with_cpus, 2, args=(cpus,), backend="gloo")
        assert got == [(expected, True, min(cores, online))] * 2, (cpus, got)


def _disagreeing(env, var, values):
    try:
        new_group_with({var: values[env.rank]})
        said = "no error"
    except ValueError as exc:
        said = str(exc)
    t = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(t, group=new_group_with({}))  # a group made after it works
    return said, t.item()


def test_ranks_that_disagree_on_the_layout_all_raise_naming_each_ranks_value():
    for var, values, shown in (("COLLECTIVES_SHM_ROUND_KB", ["auto", "512"], "rank 0: auto, rank 1: 512"),
                               ("COLLECTIVES_SHM_SLOT_MB", ["8", "2"], "rank 0: 8, rank 1: 2"),
                               ("COLLECTIVES_SHM_REGIONS", ["2", "auto"], "rank 0: 2, rank 1: auto")):
        for said, total in run_on_ranks(_disagreeing, 2, args=(var, values), backend="gloo"):
            assert said.startswith(f"the shm group's ranks disagree on {var} ({shown})"), said
            assert total == 3.0
