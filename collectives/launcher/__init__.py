"""The launcher: `collectives.run` and the rank pool under it.

    launch.py       run(fn, world_size) and run_or_join: spawn ranks, or join torchrun's / srun's
    pool.py         RankPool: ranks started once and reused, results in rank order, failures named
    rank_main.py    what each rank runs: join the group, run what the pool sends
    rank_report.py  how a failed or hung rank is described (exit, signal, where it was)
    reaper.py       a small process that kills whatever the ranks started, however the launcher ends
    agent_watch.py  under torchrun: a worker whose agent is gone says so
    env.py          DistEnv, reading torchrun's and SLURM's environment, picking the backend
    as_spawned.py   what a rank forked from the fork server runs first, so it starts as a spawned one

Nothing is imported here: `collectives` exports run, RankPool and DistEnv.
"""
