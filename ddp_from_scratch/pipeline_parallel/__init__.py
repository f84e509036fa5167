"""Pipeline parallelism from point-to-point messages, read in this order:

    split.py       a model's layers cut into stages: balanced by parameter count, or sizes given
    schedule.py    schedules as data: each rank's list of actions (forward, backward of a
                   microbatch), GPipe and 1F1B, printed as a table
    stage.py       one rank's stage: the activations' shapes agreed once, then each action run with
                   its sends and receives (batched isend/irecv) and timed

    python -m pytest tests/ddp/test_pipeline_parallel.py -q   # bit for bit torch.distributed.pipelining

docs/pipeline-parallel.md walks through them with the bubble each schedule leaves.
"""
