"""Context parallelism from point-to-point messages: the sequence cut over ranks, attention by a
ring of keys and values, read in this order:

    layout.py   the sequence cut: contiguous, or head-tail (one piece from each end) for causal balance
    merge.py    the online softmax: two blocks' attention merged by their log-sum-exps
    ring.py     ring attention, forward and backward, from batched isend/irecv

    python -m pytest tests/context_parallel -q     # bit for bit torch's own ring, 2 and 4 ranks
    python -m benchmarks.context_parallel           # memory per rank, wait against compute, the ring drawn

docs/context-parallel.md walks through them.
"""
