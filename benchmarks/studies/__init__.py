"""The studies behind benchmarks/RESULTS.md: each measured how one part of the shm backend, the
harness, the pipeline executor or the suite was chosen or tuned. A user picking a backend or a
layout runs the programs one folder up; these answer how the project got there (`python -m benchmarks.studies.NAME --help`).

    shm_wait             how an shm rank waits (spin, yield, futex, sleep), and its spin's length
    shm_paths            the shm all_reduce's paths against the memory roofline
    shm_small_path       where shm's small all_reduce path should stop, limits side by side
    recorder_cost        what the flight record costs on shm (and torch's on Gloo)
    bridge_load          loading shm's built C++ bridge: from its stamp, or through torch's build tools
    race_ablation        what each part of the two-level cost model buys across hosts
    ddp_hook_cost        what a Python gradient hook costs the backward
    split_backward       where zero bubble's split backward (I + W) costs more than one backward
    harness_speed        multi-rank test cases a minute, by start method
    suite_durations      where the test suite's time goes, from pytest's --durations
    suite_cpu            where the test suite's CPU goes: each test's processes, read from /proc
    pool_idle            what the harness's pooled ranks cost while they wait, thread by thread
C programs (cc -O2, their headers say how to run them):
    lost_wake.c          a waker and a sleeper on the shm futex protocol: is a wake ever lost
    line_handoff.c       what passing a cache line between two cores costs, by ring size
"""

STUDIES = ("shm_wait", "shm_paths", "shm_small_path", "recorder_cost", "bridge_load", "race_ablation", "ddp_hook_cost",
           "harness_speed", "suite_durations", "suite_cpu", "pool_idle", "split_backward")
