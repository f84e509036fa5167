"""collectives: checked wrappers over torch.distributed, a launcher, subgroups, a test harness.

    import collectives
    results = collectives.run(fn, world_size=4)     # fn(env) on 4 spawned ranks
    env = collectives.init_from_env()               # under torchrun / srun / plain python
    collectives.all_reduce(t, op="sum")             # checked wrapper, same answer on Gloo and NCCL

Importing it registers "shm", a shared-memory backend for ranks on one machine, with
torch.distributed (collectives/shm/). From-scratch algorithms: collectives/algorithms/. The
layers and what may import what: docs/architecture.md.

Words: *rank*, *world_size*, *group*, *src*, *dst* mean what they mean in torch.distributed; a
*group rank* is a rank's index within a subgroup, a *global rank* its index in the world; the
*op table* (reduce_ops.COMBINE) is how every path applies a reduction op; *checked mode* adds one
small all_gather per call so that ranks that disagree are told instead of hanging.
"""

from .checked_mode import checked, is_checked
from .checks import NotInGroup
from .launcher.env import DistEnv, init_from_env, shutdown
from .errors import BackendFailure, CollectiveError, CollectiveMismatchError, RankFailure
from .groups import RankGrid, global_rank, group_rank, new_group, split
from .launcher.launch import run, run_or_join
from .ops import (
    Work, all_gather, all_reduce, all_to_all, barrier, broadcast, gather, reduce, reduce_scatter, scatter,
)
from .launcher.pool import RankPool
from . import shm  # noqa: F401 - registers the "shm" backend with torch.distributed

__all__ = [
    "DistEnv", "init_from_env", "shutdown", "run", "run_or_join", "RankPool",
    "broadcast", "all_reduce", "reduce", "all_gather", "reduce_scatter", "gather", "scatter", "all_to_all",
    "barrier", "Work", "checked", "is_checked",
    "new_group", "split", "RankGrid", "group_rank", "global_rank", "NotInGroup",
    "BackendFailure", "CollectiveError", "CollectiveMismatchError", "RankFailure",
]

RENAMED = {"Mesh2D": "RankGrid"}  # old public name -> new: kept working, with a warning that names the new one


def __getattr__(name: str):
    if name in RENAMED:
        import warnings

        warnings.warn(f"collectives.{name} is now collectives.{RENAMED[name]}; the old name will be removed",
                      FutureWarning, stacklevel=2)
        return globals()[RENAMED[name]]
    raise AttributeError(f"module 'collectives' has no attribute {name!r}")
