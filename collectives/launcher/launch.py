"""Run a function on N local ranks: `collectives.run(fn, world_size)`.

    import collectives

    def hello(env):
        t = torch.tensor([env.rank + 1.0])
        return collectives.all_reduce(t).item()

    if __name__ == "__main__":
        print(collectives.run(hello, world_size=3))   # [6.0, 6.0, 6.0]

`fn` receives the rank's `DistEnv` first, then `args`. It must be defined at module level (each
rank imports the launcher's main module and unpickles `fn` by name). For programs started by torchrun or srun, use
`collectives.init_from_env()` instead, or `run_or_join`, which does whichever fits:

    result = collectives.run_or_join(main_body, world_size=args.nproc, args=(config,))
    if result is not None:      # this process reports: the spawner, or rank 0 under torchrun/srun
        print(result)
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import os

from .env import init_from_env, read_env, shutdown
from .call_checks import check_call
from .pool import RankPool


def run(
    fn: Callable,
    world_size: int,
    *,
    backend: Optional[str] = None,
    args: Sequence[Any] = (),
    timeout: float = 300.0,
    threads: int = 1,
    start_method: Optional[str] = None,
) -> List[Any]:
    """Spawn `world_size` ranks, run `fn(env, *args)` on each, return the results in rank order.

    Args:
        fn: a module-level function taking the rank's DistEnv and then `args`.
        world_size: how many ranks to spawn on this machine.
        backend: "gloo", "nccl" or "shm"; None picks NCCL only with one GPU per rank, else Gloo.
        args: extra positional arguments (must pickle).
        timeout: seconds the function may run on the ranks, counted from when every rank has
            unpickled it (imported its module); after that every rank's Python stack is dumped
            into the error and all ranks are killed.
        threads: torch threads per rank.
        start_method: "forkserver" (the default where the platform has it: each rank is forked
            from a server that imported torch once, so ranks start in tens of milliseconds) or
            "spawn" (each rank a fresh interpreter that imports torch itself, about a second);
            COLLECTIVES_START_METHOD sets it for a whole program. Either way a rank starts with
            the launcher's environment, stdout and stderr as they are at the call.

    Raises:
        RankFailure: a rank raised, died or hung; the message leads with the rank that failed
            first and why, and carries its traceback, signal or exit code, or stack. No rank is
            left running, and none outlives this process (even if it is killed).
        TypeError, ValueError: an argument is of the wrong type or out of range (before any
            rank starts).
    """
    check_call(fn, args, timeout)
    pool = RankPool(world_size, backend=backend, threads=threads, start_method=start_method)
    done = False
    try:  # not `with pool`, which starts the ranks: submit pickles (fn, args) first, refusing what cannot go
        result = pool.submit(fn, args=args, timeout=timeout)
        done = True
        return result
    finally:
        pool.close() if done else pool._kill()  # Ctrl-C or an error: no point waiting for the ranks


def run_or_join(fn: Callable, world_size: int, **run_kwargs) -> Any:
    """`fn(env, *args)` on every rank: here, joined to the other ranks, when torchrun or srun
    started this process; else on `world_size` ranks spawned by `run`.

    Args:
        fn: a module-level function taking the rank's DistEnv and then `args`.
        world_size: ranks to spawn when not started by torchrun or srun (ignored under them).
        run_kwargs: `run`'s keyword arguments (backend, args, timeout, threads); under
            torchrun/srun backend and args apply, and each rank uses OMP_NUM_THREADS torch
            threads when it is set (torchrun sets 1), else 1 as spawned ranks do: srun sets
            nothing, and a rank with every core's threads sums in another order (measured: a
            2-host srun training differed in its last bits from the same run spawned on one host).

    Returns:
        Rank 0's result in the process that should report it (the spawning process, or rank 0
        under torchrun/srun) and None in the other ranks of a torchrun/srun job.
    """
    if read_env(os.environ)["master_addr"] is None:
        return run(fn, world_size, **run_kwargs)[0]
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    env = init_from_env(backend=run_kwargs.get("backend"))
    result = fn(env, *run_kwargs.get("args", ()))
    shutdown()
    return result if env.rank == 0 else None
