"""The benchmarks: programs you run, and the helpers they share (no program imports another).

Programs (`python -m benchmarks.NAME --help`; their figures are in benchmarks/RESULTS.md):
    bandwidth            collective bandwidth in nccl-tests' format, backends side by side (the main job)
    bandwidth_agreement  do two bandwidth runs agree within their spread
    plot                 busbw and time against size from bandwidth JSON files
    algorithms           the from-scratch algorithms raced against the backend
    shm                  the shm backend against Gloo
    shm_native           shm's native path against its Python path, Gloo, a floor and DeepSpeed
    tensor_parallel      DP, TP, TP x DP and PP x DP of the small transformer: step time and bytes
    pipeline_parallel    GPipe, 1F1B, interleaved 1F1B and zero bubble: step time, bubble and activations against microbatches
    expert_parallel      a mixture-of-experts layer over ranks: load, all_to_all bytes and drops, balanced and skewed
    context_parallel     ring attention over ranks: memory per rank, causal balance, waits with and without overlap
    transformer_speed    the training program's transformer run: tokens/s and FLOP/s per layout against a bare product
    wrapper_overhead     what the checked wrappers add to a raw call
    ddp_step_time        DDP step time, torch's and ours
    sharded              ZeRO and FSDP memory and step time
    powersgd             what PowerSGD buys and costs
    cuda_determinism     is a CUDA step the same each time
Scripts: across_hosts.sh (runs on two namespace hosts), gpu_checks.sh (on a machine with a GPU).
The studies behind the results page's answers (how a wait, a path or a limit was chosen) are in
benchmarks/studies/, each listed there in one line.

The helpers they share (imported by the programs, never run) are in benchmarks/parts/, each
listed there in one line.
The pytest-benchmark latency test lives with the tests: tests/benchmarks/test_latency.py.
"""

PROGRAMS = ("bandwidth", "bandwidth_agreement", "plot", "algorithms", "shm", "shm_native", "tensor_parallel",
            "pipeline_parallel", "expert_parallel", "context_parallel", "transformer_speed", "wrapper_overhead", "ddp_step_time", "sharded", "powersgd", "cuda_determinism")
HELPERS = ()  # at the top: none (benchmarks/parts/ holds them)
