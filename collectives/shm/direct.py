"""all_reduce straight into the native path: dist.all_reduce's result, without torch's dispatch.

    import collectives.shm
    collectives.shm.all_reduce(t, group=g)        # what dist.all_reduce(t, group=g) does, synchronously
    collectives.shm.all_reduce(t, dist.ReduceOp.MAX, g)
    collectives.shm.takes_all_reduce(t, group=g)  # True: the call above runs on the native path

dist.all_reduce reaches a backend through distributed_c10d.py's checks, torch's dispatcher, a Work
and its wait: several microseconds a call, more than the native path's own small all_reduce
(benchmarks/RESULTS.md, "How close to the machine's limit?"). C++ callers such as DDP's reducer skip
the Python part; a Python loop of small all_reduces (tensor-parallel inference, the case DeepSpeed's
inference_all_reduce is for) does not. This function hands the tensor to the group's native engine
itself: the same engine call, in the same order with the group's other calls, with the same checks
across ranks (a mismatch raises the same named error), the same flight record and the same bits.

Anything the native path does not take goes through dist.all_reduce unchanged: a group that is not
an shm group on the native path, a complex, non-contiguous or non-CPU tensor, an op it does not
reduce natively (premul_sum), or a dtype it does not sum. So it can replace dist.all_reduce
anywhere a synchronous all_reduce is wanted.

The check that the group's calls agree across ranks still runs, so every rank must make the same
call, through this function or dist.all_reduce: the two are the same collective on the group.
"""

import weakref

import torch
import torch.distributed as dist

_CPU = torch.device("cpu")
_NOT_NATIVE = object()
_engines: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> its native engine, or _NOT_NATIVE
# the ops as c10d's RedOpType numbers (premul_sum, a ReduceOp with a factor, is not among them)
_CODES = {op: int(op) for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN,
                                 dist.ReduceOp.MAX, dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR)}


def _engine_of(group):
    """The native engine behind `group` (a ProcessGroup), or None."""
    try:
        engine = _engines.get(group)
    except TypeError:  # not something a weak reference can name (a group is)
        return None
    if engine is None:
        engine = _NOT_NATIVE
        try:
            forward = group._get_backend(_CPU)
        except (AttributeError, RuntimeError, ValueError):  # not a group, or one with no CPU backend
            forward = None
        impl = getattr(forward, "impl", None)  # forward.cpp's ForwardBackend: an shm group
        if impl is not None and impl.state.engine is not None:
            engine = impl.state.engine
        _engines[group] = engine
    return None if engine is _NOT_NATIVE else engine


def takes_all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> bool:
    """Whether all_reduce(tensor, op, group) runs on the group's native path: the engine's own
    answer (native_takes.h, the one place it is decided, which every native call asks first), not
    a copy of its rule. False on a group that is not an shm group on the native path."""
    engine = _engine_of(dist.group.WORLD if group is None else group)
    code = _CODES.get(op) if isinstance(op, dist.ReduceOp.RedOpType) else None
    return engine is not None and code is not None and type(tensor) is torch.Tensor and \
        engine.takes_all_reduce(tensor, code)


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> None:
    """dist.all_reduce(tensor, op, group) with async_op=False; on an shm group's native path, called
    straight into its engine (see the top of this file)."""
    engine = _engine_of(dist.group.WORLD if group is None else group)
    code = _CODES.get(op) if isinstance(op, dist.ReduceOp.RedOpType) else None
    if engine is None or code is None or type(tensor) is not torch.Tensor or not engine.all_reduce(tensor, code):
        dist.all_reduce(tensor, op=op, group=group)
