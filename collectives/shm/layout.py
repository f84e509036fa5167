"""How the ranks of an shm group agree on its layout before they map the segment.

Every rank posts, under its own key of the group's store, its layout settings
(COLLECTIVES_SHM_SLOT_MB, _ROUND_KB, _REGIONS) and the CPUs it may run on; then reads every
rank's. A rank that differs in a setting would put its data where the others do not look, so
every rank raises the same ValueError, naming each rank's value, before any byte moves. The
round size follows from the CPUs the ranks have between them (the union of their affinities):
config.ShmConfig.round_bytes. The same union is the number of cores the native wait compares the
machine's runnable threads with (native_wait.h's MachineLoad): ranks pinned to 2 of 16 cores stop
spinning once a third thread wants those 2.

    round_bytes, cores = agree(store, rank, world_size, config, timeout)   # ShmBackend does this
"""

from __future__ import annotations

import json
from datetime import timedelta

from ..machine import cpu_set
from .config import ShmConfig

KEY = "shm-layout"


def own_cpus() -> list:
    """The CPUs this process may run on, as the other ranks read them (tests replace it)."""
    return sorted(cpu_set())


def agree(store, rank: int, world_size: int, config: ShmConfig, timeout: timedelta) -> tuple:
    """(the group's round size in bytes, the CPUs its ranks may run on between them), the same on
    every rank; a ValueError on every rank where the ranks' layout settings differ."""
    mine = {"slot_bytes": config.slot_bytes, "round_kb": config.round_kb, "regions": config.regions,
            "cpus": own_cpus()}
    store.set(f"{KEY}/{rank}", json.dumps(mine))
    keys = [f"{KEY}/{r}" for r in range(world_size)]
    store.wait(keys, timeout)
    posted = [json.loads(store.get(k).decode()) for k in keys]
    for field, var in (("slot_bytes", "COLLECTIVES_SHM_SLOT_MB"), ("round_kb", "COLLECTIVES_SHM_ROUND_KB"),
                       ("regions", "COLLECTIVES_SHM_REGIONS")):
        values = [p[field] for p in posted]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {r}: {_shown(field, v)}" for r, v in enumerate(values))
            raise ValueError(f"the shm group's ranks disagree on {var} ({shown}): every rank of a group "
                             f"must have the same value, since it sets where each rank's data lies")
    cores = len(set().union(*(p["cpus"] for p in posted)))
    return config.round_bytes(world_size, cores), cores


def _shown(field: str, value) -> str:
    return f"{value / 2**20:g}" if field == "slot_bytes" else str(value)
