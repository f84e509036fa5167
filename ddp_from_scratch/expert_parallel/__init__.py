"""Expert parallelism from all_to_all: a mixture-of-experts layer whose experts live on different
ranks, read in this order:

    router.py     a linear layer, softmax, top-k; its product cut into the ranks' blocks
    routing.py    the dispatch plan: capacity (drops counted), sort by expert, the balance loss
    moe.py        the one-rank layer: route, plan, experts, combine (the reference)
    dispatch.py   counts, then rows, by all_to_all with uneven splits; the outputs back
    layer.py      the expert-parallel layer: moe.py's steps with dispatch.py between them
    model.py      the transformer with MoE blocks, and the training run's step (train --ep)

    python -m pytest tests/expert_parallel -q    # bit for bit the one-rank layer, 2 and 4 ranks
    python -m benchmarks.expert_parallel         # the load and the bytes, balanced and skewed

docs/expert-parallel.md walks through them.
"""
