"""collectives: checked wrappers over torch.distributed, a launcher, subgroups, a test harness.

    import collectives
    results = collectives.run(fn, world_size=4)     # fn(env) on 4 spawned ranks
    env = collectives.init_from_env()               # under torchrun / srun / plain python
"""

from .env import DistEnv, init_from_env
from .errors import CollectiveError, CollectiveMismatchError, RankFailure
from .launch import run
from .pool import RankPool

__all__ = [
    "DistEnv", "init_from_env", "run", "RankPool",
    "CollectiveError", "CollectiveMismatchError", "RankFailure",
]
