"""The collectives by name, and what kind each one is: the one table that checked mode, the demo,
the shm backend, the algorithms and the benchmarks read.

    from collectives.names import COLLECTIVES, REDUCING, ROOTED
    collective in ROOTED      # broadcast, reduce, gather, scatter: one rank sends to or receives from all
"""

COLLECTIVES = ("broadcast", "all_reduce", "reduce", "all_gather", "reduce_scatter", "gather", "scatter", "all_to_all",
               "barrier")
# combine the ranks' values with an op (sum, max, ...)
REDUCING = ("all_reduce", "reduce", "reduce_scatter")
# one rank, the root (src or dst), sends to or receives from every rank
ROOTED = ("broadcast", "reduce", "gather", "scatter")
# torch.distributed writes the result into the input tensor itself
IN_PLACE = ("all_reduce", "broadcast", "reduce")
# a buffer of one equal chunk per rank (the gathered output, the scattered input, the send buffer)
PER_RANK_CHUNKS = ("all_gather", "reduce_scatter", "all_to_all")
# where every rank gets every rank's tensor: the output is world_size times the input
GATHERING = ("all_gather", "gather")
