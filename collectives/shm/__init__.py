"""A shared-memory backend for ranks on one machine, registered with torch.distributed as "shm".

    import collectives.shm
    collectives.shm.register()                         # once per process (RankPool and init_from_env do it)
    dist.init_process_group("shm", init_method=..., rank=r, world_size=n)
    collectives.run(fn, world_size=4, backend="shm")   # or through this project's launcher
    collectives.shm.all_reduce(t, group=g)             # dist.all_reduce without torch's dispatch (direct.py)
    collectives.shm.takes_all_reduce(t, group=g)       # whether that call runs on the native path

On one machine Gloo still goes through TCP. Here the ranks map one segment of shared memory
(segment.py) and each collective is copies and adds in it (python_path.py), waiting for each other
on futexes (wait.py), behind a torch Backend (process_group.py, with its C++ bridge forward.cpp; creator.py makes and finds groups)
that torch's DDP, fully_shard, DTensor and the functional collectives run on. A rank that dies mid-collective makes the others raise PeerFailure naming
it; nothing is left in /dev/shm, however the ranks end. Settings: config.py (ShmConfig, the
COLLECTIVES_SHM_* variables, read once per group).

Words: the *segment* is the one shared mapping of a group; a *slot* is one rank's part of its data
area, used in two *halves* that alternate from round to round; a *round* is one pass of a
collective through the slots (a buffer larger than half a slot takes several); a *piece* is the
part of a slice summed while it stays in cache (python_path.py, step 3); a *mailbox* carries
point-to-point messages between one ordered pair of ranks (transport.py); *cma* is cross-memory
attach (cma.py: reading and writing another rank's tensor directly).
"""

import torch.distributed as dist

from .direct import all_reduce, takes_all_reduce
from .creator import backend_of, create, new_group_with
from .process_group import ShmBackend
from .segment import leftovers, sweep
from .wait import PeerFailure

BACKEND = "shm"


def register() -> None:
    """Make "shm" a torch.distributed backend in this process (idempotent)."""
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(BACKEND, create, devices=["cpu"])


register()

__all__ = ["BACKEND", "register", "all_reduce", "takes_all_reduce", "ShmBackend", "backend_of", "new_group_with", "PeerFailure", "leftovers", "sweep"]
