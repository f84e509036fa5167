"""Pipeline parallelism from point-to-point messages, read in this order:

    split.py       a model's layers cut into stages: balanced by parameter count, or sizes given
    schedule.py    schedules as data: each rank's list of actions (forward, backward of a
                   microbatch on a chunk), GPipe, 1F1B and interleaved 1F1B, printed as a table and
                   simulated
    messages.py    a schedule's sends and receives as data, placed in each rank's list and checked
    saved.py       the activations a stage holds: what autograd saves for backward, counted live
    stage.py       one rank's part (a stage, or chunks): shapes agreed once, then each action run with
                   its sends and receives (batched isend/irecv) and timed
    timeline.py    a step as it ran: every rank on one time axis, a PNG and a Chrome trace
    parity.py      the proof: against torch.distributed.pipelining's schedules and the one-rank model

    python -m pytest tests/pipeline_parallel/test_pipeline_parallel.py -q   # bit for bit torch.distributed.pipelining

docs/pipeline-parallel.md walks through them with the bubble each schedule leaves.
"""
