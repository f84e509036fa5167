"""Tensor parallelism from the project's collectives, read in this order:

    operators.py   Megatron's f and g (and sequence parallelism's all_gather / reduce_scatter forms)
    layers.py      a column-parallel and a row-parallel Linear made from a whole nn.Linear
    mlp.py         the MLP block split over a TP group: one all_reduce forward, one backward
    attention.py   the self-attention block split by heads: one all_reduce forward, one backward
    vocab.py       the embedding split by vocabulary, and the cross-entropy of logits split the same way
    model.py       the small transformer (workload/transformer.py) split over a TP group
    mesh.py        ranks as DP x TP subgroups: TP inside a group, the bucketed DDP across them

    python -m pytest tests/tensor_parallel/test_tensor_parallel.py -q     # proven against one rank and torch's
"""
