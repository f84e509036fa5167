"""Collective algorithms from point-to-point messages: ring, trees, recursive doubling and
halving, Rabenseifner, Bruck, pairwise exchange, written once and run on real ranks or simulated.

    import collectives.algorithms as A
    A.all_reduce(t, op="sum", algorithm="ring")           # on real ranks (torch.distributed p2p)
    A.all_reduce(t, algorithm="auto")                     # the cheapest by the fitted cost model
    outs, result = A.simulate("all_reduce", "ring", inputs, op="sum")   # 64 ranks in one process

    python -m collectives.algorithms.show all_reduce --algorithm ring --world-size 4

Each family is one module whose docstring draws it and gives its cost: ring.py, recursive.py
(recursive doubling and halving, Rabenseifner), tree.py (binomial trees, NCCL's double binary
tree), chain.py (pipelined chain, scatter + all-gather), pairwise.py, bruck.py, hierarchical.py
(within each host, then across hosts, then within). They are written against the point-to-point
interface only (collectives/p2p.py: Comm); comm.DistComm runs them on torch.distributed (any
backend, any group; an shm group's mailboxes, shm/transport.py), sim.Simulator on a virtual
clock (cost.CostModel, or topology.Topology: which host each rank is on and the links within and
between hosts). Every element count works (chunks need not be equal), every world size
(recursive ones fold the extra ranks), every op the wrappers take.

Words: a *chunk* is one rank's piece of a buffer (collectives/chunks.py: the first numel % size
chunks one element longer); a *step* is one yield of an algorithm (the messages posted between
two waits); the *fold* (fold.py) maps a world that is not a power of two onto one that is;
alpha, beta and gamma are the cost model's seconds per message, per byte moved and per byte
reduced.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import reduce_ops
from ..checks import check_root, check_tensor, resolve_group
from ..errors import CollectiveError
from ..names import GATHERING, IN_PLACE, REDUCING, ROOTED
from . import bruck, chain, hierarchical, pairwise, recursive, ring, tree
from .comm import DistComm, comm_for, run_on_ranks
from .cost import CostModel, choose
from ..chunks import bounds
from .sim import SimResult, Simulator
from .topology import Topology

ALGORITHMS: Dict[str, Dict[str, Callable]] = {
    "all_reduce": {"ring": ring.all_reduce, "recursive_doubling": recursive.all_reduce_doubling,
                   "rabenseifner": recursive.all_reduce_rabenseifner, "binomial": tree.all_reduce_binomial,
                   "double_binary_tree": tree.all_reduce_double_tree, "hierarchical": hierarchical.all_reduce},
    "reduce_scatter": {"ring": ring.reduce_scatter, "recursive_halving": recursive.reduce_scatter_halving,
                       "pairwise": pairwise.reduce_scatter_pairwise},
    "all_gather": {"ring": ring.all_gather, "recursive_doubling": recursive.all_gather_doubling,
                   "bruck": bruck.all_gather_bruck},
    "broadcast": {"binomial": tree.broadcast_binomial, "chain": chain.broadcast_chain,
                  "scatter_allgather": chain.broadcast_scatter_allgather},
    "reduce": {"binomial": tree.reduce_binomial, "rabenseifner": recursive.reduce_rabenseifner},
    "gather": {"binomial": tree.gather_binomial},
    "scatter": {"binomial": tree.scatter_binomial},
    "all_to_all": {"pairwise": pairwise.all_to_all_pairwise, "bruck": bruck.all_to_all_bruck},
}


def algorithm_for(collective: str, algorithm: str, nbytes: int, world_size: int,
                  model: Optional[CostModel] = None) -> Tuple[str, Callable]:
    """(name, generator) for `algorithm` ("auto": the cheapest predicted by the cost model)."""
    if collective not in ALGORITHMS:
        raise CollectiveError(f"no from-scratch algorithms for {collective!r}; one of {', '.join(ALGORITHMS)}")
    if algorithm == "auto":
        algorithm = choose(collective, nbytes, world_size, model or CostModel.load())
    if algorithm not in ALGORITHMS[collective]:
        raise CollectiveError(f"{collective}: unknown algorithm {algorithm!r}; one of "
                              f"{', '.join(ALGORITHMS[collective])} or 'auto'")
    return algorithm, ALGORITHMS[collective][algorithm]


def _buffers(collective: str, flat: torch.Tensor, rank: int, size: int):
    """What the generator works on for this rank's flat input (the simulator's: fresh buffers).

    Returns (working buffer, extra buffer or None). all_gather and gather take every rank's
    equal-sized input and lay it at its place in a buffer p times larger; all_to_all receives
    into a second buffer.
    """
    if collective in ("all_gather", "gather"):
        buf = flat.new_zeros(size * flat.numel())
        a, b = bounds(buf.numel(), size)[rank]
        buf[a:b] = flat
        return buf, None
    if collective == "all_to_all":
        return flat.clone(), torch.zeros_like(flat)
    return flat.clone(), None


def _rank_buffers(collective: str, flat: torch.Tensor, comm, root: Optional[int], in_place: bool,
                  out: Optional[torch.Tensor]):
    """The same on a real rank, with as few copies and new allocations as the collective allows:
    the in-place ones work in the caller's memory, the gathers straight into `out`, and scratch
    space comes from the process's reused workspace (comm.workspace)."""
    p, r = comm.size, comm.rank
    if collective in IN_PLACE:
        return (flat if in_place else flat.clone()), None
    if collective in ("all_gather", "gather"):
        if out is not None:
            buf = out.reshape(-1)
        elif collective == "gather" and r != root:
            buf = comm.workspace(flat, p * flat.numel(), slot="input")  # only its own chunk matters here
        else:
            buf = flat.new_empty(p * flat.numel())
        a, b = bounds(buf.numel(), p)[r]
        buf[a:b] = flat
        return buf, None
    if collective in ("reduce_scatter", "scatter"):  # the whole buffer is scratch; the input stays as it was
        scratch = comm.workspace(flat, flat.numel(), slot="input")
        if collective == "reduce_scatter" or r == root:
            scratch.copy_(flat)
        return scratch, None
    return flat, (out.reshape(-1) if out is not None else torch.empty_like(flat))  # all_to_all


def _args(collective: str, buf, extra, op: Optional[str], root: Optional[int]) -> tuple:
    if collective == "all_to_all":
        return (buf, extra)
    args = (buf,)
    if collective in REDUCING:
        args += (op,)
    if collective in ROOTED:
        args += (root,)
    return args


def _output(collective: str, buf, extra, rank: int, size: int, root: Optional[int]):
    """This rank's result, flat: the whole buffer, its chunk, or None (off the root)."""
    if collective in ("reduce_scatter", "scatter"):
        a, b = bounds(buf.numel(), size)[rank]
        return buf[a:b]
    if collective == "all_to_all":
        return extra
    if collective in ("reduce", "gather") and rank != root:
        return None
    return buf


def simulate(collective: str, algorithm: str, inputs: Sequence[torch.Tensor], op: str = "sum", root: int = 0,
             model: Optional[CostModel] = None, watch: Optional[Callable] = None, **kwargs) -> Tuple[List, SimResult]:
    """Run `algorithm` for `collective` on len(inputs) simulated ranks.

    Args:
        inputs: one flat tensor per rank (all_gather/gather: its own part; others: the buffer).
        op, root: as for the collective (root is a rank of the simulated world).
        model: the cost model (default: CostModel.load()), or a Topology (which host each
            rank is on, a model within hosts and one between them).
        watch: watch(buffer) is kept for each rank after every step (result.snapshots): the
            working buffer (all_to_all: the receive buffer), e.g. draw.chunk_sets.
        kwargs: the algorithm's own options (pieces=...).

    Returns:
        (each rank's output, flat, or None off the root; the SimResult).
    """
    size = len(inputs)
    nbytes = inputs[0].numel() * inputs[0].element_size() * (size if collective in ("all_gather", "gather") else 1)
    if algorithm == "auto" and isinstance(model, Topology):
        raise CollectiveError("simulate: 'auto' chooses by one cost model's closed forms; with a Topology, name the "
                              "algorithm (or simulate each and compare their result.time)")
    _, generator = algorithm_for(collective, algorithm, nbytes, size, model)
    bufs = [_buffers(collective, x, r, size) for r, x in enumerate(inputs)]
    sim = Simulator(size, model if model is not None else CostModel.load())
    seen = None if watch is None else (lambda r: watch(bufs[r][1] if collective == "all_to_all" else bufs[r][0]))
    result = sim.run(generator, [_args(collective, b, e, op, root) for b, e in bufs], watch=seen, **kwargs)
    return [_output(collective, b, e, r, size, root) for r, (b, e) in enumerate(bufs)], result


def run_collective(collective: str, tensor: Optional[torch.Tensor], op: Optional[str] = None, root: Optional[int] = None,
                   group: Optional[dist.ProcessGroup] = None, algorithm: str = "auto",
                   out: Optional[torch.Tensor] = None, **kwargs):
    """The shared body of the public calls below, on this rank (see all_reduce for the arguments)."""
    name = f"{collective} (algorithm {algorithm!r})"
    info = resolve_group(group, name)
    check_tensor(tensor, name, info)
    op_name = None
    if collective in REDUCING:
        op_name = reduce_ops.op_name(op, name)
        reduce_ops.check_op_dtype(op_name, tensor.dtype, name)
    group_root = None
    if collective in ROOTED:
        check_root(root, "dst" if collective in ("reduce", "gather") else "src", name, info)
        group_root = info.ranks.index(root)
    if collective in ("reduce_scatter", "scatter", "all_to_all") and (tensor.dim() == 0 or tensor.shape[0] % info.size):
        raise CollectiveError(f"{name} on rank {info.global_rank}: the first dimension of shape {tuple(tensor.shape)} "
                              f"does not divide by the group size {info.size}")
    flat = tensor.detach().reshape(-1).contiguous()
    comm = comm_for(group)
    nbytes = flat.numel() * flat.element_size() * (info.size if collective in GATHERING else 1)
    _, generator = algorithm_for(collective, algorithm, nbytes, info.size)
    # the in-place collectives work in the caller's memory when it is contiguous: no copy in or out
    in_place = collective in IN_PLACE and tensor.is_contiguous() and op_name != "avg"
    buf, extra = _rank_buffers(collective, flat, comm, group_root, in_place, out)
    wire_op = "sum" if op_name == "avg" else op_name
    run_on_ranks(generator, comm, *_args(collective, buf, extra, wire_op, group_root), **kwargs)
    result = _output(collective, buf, extra, comm.rank, comm.size, group_root)
    if collective in ("reduce_scatter", "scatter"):  # out of the reused workspace before the next call
        result = out.reshape(-1).copy_(result) if out is not None else result.clone()
    if result is not None and op_name == "avg":
        result = result / info.size
    return result


def _into(tensor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The result into the caller's tensor, unless the algorithm already worked in its memory."""
    if out.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(out.view_as(tensor))
    return tensor


def all_reduce(tensor: torch.Tensor, op="sum", group=None, algorithm: str = "auto", **kwargs) -> torch.Tensor:
    """Reduce `tensor` over the group in place with a from-scratch algorithm; returns it.

    Args:
        tensor: same shape and dtype on every rank (any view).
        op: "sum", "avg", "min", "max", "product", "band", "bor", "bxor" or a ReduceOp.
        group: process group (default: the world).
        algorithm: a name in ALGORITHMS["all_reduce"], or "auto" (the cheapest predicted).
        kwargs: the algorithm's options (pieces=... for ring and double_binary_tree).
    """
    out = run_collective("all_reduce", tensor, op=op, group=group, algorithm=algorithm, **kwargs)
    return _into(tensor, out)


def reduce(tensor: torch.Tensor, dst: int = 0, op="sum", group=None, algorithm: str = "auto", **kwargs) -> torch.Tensor:
    """Reduce into `dst`'s tensor (in place there); returns the tensor on every rank."""
    out = run_collective("reduce", tensor, op=op, root=dst, group=group, algorithm=algorithm, **kwargs)
    return tensor if out is None else _into(tensor, out)


def broadcast(tensor: torch.Tensor, src: int = 0, group=None, algorithm: str = "auto", **kwargs) -> torch.Tensor:
    """Copy `src`'s tensor into every rank's (in place); returns it."""
    out = run_collective("broadcast", tensor, root=src, group=group, algorithm=algorithm, **kwargs)
    return _into(tensor, out)


def reduce_scatter(tensor: torch.Tensor, op="sum", group=None, algorithm: str = "auto", out=None,
                   **kwargs) -> torch.Tensor:
    """This rank's chunk of dim 0 of the reduction (dim 0 divisible by the group size); written
    into `out` when given (contiguous, of the chunk's size)."""
    out = run_collective("reduce_scatter", tensor, op=op, group=group, algorithm=algorithm, out=out, **kwargs)
    return out.view((tensor.shape[0] // dist.get_world_size(group),) + tuple(tensor.shape[1:]))


def all_gather(tensor: torch.Tensor, group=None, algorithm: str = "auto", out=None, **kwargs) -> torch.Tensor:
    """Every rank's tensor (all the same shape) concatenated on dim 0, in group-rank order;
    written into `out` when given (contiguous, group size times the input's elements)."""
    out = run_collective("all_gather", tensor, group=group, algorithm=algorithm, out=out, **kwargs)
    rows = tensor.reshape(1, *tensor.shape) if tensor.dim() == 0 else tensor
    return out.view((-1,) + tuple(rows.shape[1:]))


def gather(tensor: torch.Tensor, dst: int = 0, group=None, algorithm: str = "auto", **kwargs):
    """On `dst`, every rank's tensor concatenated on dim 0; None elsewhere."""
    out = run_collective("gather", tensor, root=dst, group=group, algorithm=algorithm, **kwargs)
    rows = tensor.reshape(1, *tensor.shape) if tensor.dim() == 0 else tensor
    return None if out is None else out.view((-1,) + tuple(rows.shape[1:]))


def scatter(tensor: torch.Tensor, src: int = 0, group=None, algorithm: str = "auto", **kwargs) -> torch.Tensor:
    """This rank's chunk of dim 0 of `src`'s tensor (every rank passes one of the same shape)."""
    out = run_collective("scatter", tensor, root=src, group=group, algorithm=algorithm, **kwargs)
    return out.view((tensor.shape[0] // dist.get_world_size(group),) + tuple(tensor.shape[1:]))


def all_to_all(tensor: torch.Tensor, group=None, algorithm: str = "auto", out=None, **kwargs) -> torch.Tensor:
    """Chunk j of dim 0 goes to group rank j; chunk i of the result came from group rank i;
    written into `out` when given (contiguous, shaped like the input)."""
    out = run_collective("all_to_all", tensor, group=group, algorithm=algorithm, out=out, **kwargs)
    return out.view_as(tensor)


__all__ = ["ALGORITHMS", "CostModel", "DistComm", "Simulator", "Topology", "simulate", "comm_for", "algorithm_for", "all_reduce", "reduce", "broadcast",
           "reduce_scatter", "all_gather", "gather", "scatter", "all_to_all"]
