"""The benchmarks: programs you run, and the helpers they share (no program imports another).

Programs (`python -m benchmarks.NAME --help`; their figures are in benchmarks/RESULTS.md):
    bandwidth            collective bandwidth in nccl-tests' format, backends side by side (the main job)
    bandwidth_agreement  do two bandwidth runs agree within their spread
    plot                 busbw and time against size from bandwidth JSON files
    algorithms           the from-scratch algorithms raced against the backend
    race_ablation        what each part of the two-level model buys across hosts
    shm                  the shm backend against Gloo
    shm_paths            the shm all_reduce's paths against the memory roofline
    shm_wait             how an shm rank waits (spin, yield, futex, sleep)
    shm_native           shm's native path against its Python path, Gloo, a floor and DeepSpeed
    shm_small_path       where shm's small all_reduce path should stop, limits side by side
    tensor_parallel      DP, TP and TP x DP of the small transformer: step time and bytes
    pipeline_parallel    GPipe, 1F1B and interleaved 1F1B: step time, bubble and activations against microbatches
    recorder_cost        what the flight record costs on shm
    bridge_load          loading shm's built C++ bridge: from its stamp, or through torch's build tools
    wrapper_overhead     what the checked wrappers add to a raw call
    harness_speed        multi-rank test cases a minute
    ddp_step_time        DDP step time, torch's and ours
    ddp_hook_cost        what a Python gradient hook costs the backward
    sharded              ZeRO and FSDP memory and step time
    powersgd             what PowerSGD buys and costs
    cuda_determinism     is a CUDA step the same each time
    suite_durations      where the test suite's time goes
Scripts: across_hosts.sh (runs on two namespace hosts), gpu_checks.sh (on a machine with a GPU).

Helpers (imported by the programs, never run):
    bandwidth_rounds, bandwidth_report, busbw_plot, cases, limits, nccl_format, prediction, sweep
The pytest-benchmark latency test lives with the tests: tests/benchmarks/test_latency.py.
"""

PROGRAMS = ("bandwidth", "bandwidth_agreement", "plot", "algorithms", "race_ablation", "shm", "shm_paths", "shm_wait", "shm_native", "shm_small_path",
            "tensor_parallel", "pipeline_parallel",
            "recorder_cost", "bridge_load", "wrapper_overhead", "harness_speed", "ddp_step_time", "ddp_hook_cost", "sharded",
            "powersgd", "cuda_determinism", "suite_durations")
HELPERS = ("bandwidth_rounds", "bandwidth_report", "busbw_plot", "cases", "limits", "nccl_format", "prediction", "sweep")
