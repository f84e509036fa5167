"""Thin, checked wrappers over torch.distributed's collectives, same answer on Gloo and NCCL.

Names and argument order follow torch.distributed. In-place collectives (broadcast, all_reduce,
reduce) return the tensor; the others return a new tensor. With async_op=True each returns a
`Work` whose wait() gives that result.

    t = torch.full((4,), env.rank + 1.0)
    collectives.all_reduce(t, op="sum")                 # every rank: n(n+1)/2
    chunk = collectives.reduce_scatter(torch.ones(8))   # this rank's (8 / n,) chunk of the sum
    everyone = collectives.all_gather(torch.ones(env.rank + 1))  # uneven dim 0 is fine

`src`/`dst` are global ranks, as in torch.distributed. Run with `collectives.run(fn, n)`.
"""

from __future__ import annotations

import zlib
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from . import checked_mode as _checked
from . import _compat, reduce_ops
from .checks import GroupInfo, check_divisible, check_root, check_tensor, resolve_group
from .errors import CollectiveError, CollectiveMismatchError

Group = Optional[dist.ProcessGroup]


class Work:
    """The handle of an async collective. wait() blocks until it is done and returns its result."""

    def __init__(self, works: List, finish: Callable[[], object]):
        self._works, self._finish, self._done, self._result = works, finish, False, None

    def wait(self):
        if not self._done:
            for work in self._works:
                work.wait()
            self._result, self._done = self._finish(), True
        return self._result

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)

    def get_future(self):
        """torch's Future of the underlying collective (None when the wrapper did the work itself)."""
        return self._works[-1].get_future() if self._works else None


def _finish(work, finish: Callable[[], object], async_op: bool):
    """Return the result now, or a Work that produces it on wait()."""
    if not async_op:
        return finish()  # a synchronous torch call has already completed
    return Work([work] if work is not None else [], finish)


def _begin(collective: str, group: Group, tensor=None, op=None, root=None, root_kind="src", divisible=False):
    """Resolve the group, run the local checks, and in checked mode compare with the other ranks.

    Returns (group info, op name or None). Kept lean: it runs before every collective.
    """
    info = resolve_group(group, collective)
    sequence = _checked.next_sequence(info)
    name = error = None
    try:
        if tensor is not None:
            check_tensor(tensor, collective, info)
        if op is not None:
            name = reduce_ops.op_name(op, collective)
            reduce_ops.check_op_dtype(name, tensor.dtype, collective)
        if root is not None:
            check_root(root, root_kind, collective, info)
        if divisible:
            check_divisible(tensor, collective, info)
    except CollectiveError as exc:
        if not _checked.is_checked():
            raise
        error = str(exc)
    if _checked.is_checked():  # raises on every rank if any rank differs or failed
        _checked.verify(_checked.Call(collective, info, sequence, tensor, name, root, error))
    return info, name


def _staged(info: GroupInfo, tensor: torch.Tensor) -> torch.Tensor:
    # Gloo runs broadcast and all_reduce on CUDA tensors; for the rest we go through host memory.
    return tensor.cpu() if info.backend == "gloo" and tensor.is_cuda else tensor


def broadcast(tensor: torch.Tensor, src: int = 0, group: Group = None, async_op: bool = False):
    """Copy `src`'s tensor into every rank's tensor (in place). Returns the tensor.

    Args:
        tensor: same shape and dtype on every rank; src's contents are sent.
        src: global rank that sends.
        group: process group (default: the world).
        async_op: return a Work instead of waiting.
    """
    _begin("broadcast", group, tensor, root=src)
    work = dist.broadcast(tensor, src, group=group, async_op=async_op)
    return _finish(work, lambda: tensor, async_op)


# (group, op, dtype) -> (GroupInfo, torch op) for CPU all_reduces on Gloo that passed every check:
# what those checks decide cannot change for the same key, so later calls skip straight to torch.
_all_reduce_ready: dict = {}


def all_reduce(tensor: torch.Tensor, op="sum", group: Group = None, async_op: bool = False):
    """Reduce `tensor` over the group with `op`; every rank gets the result in place.

    Args:
        tensor: same shape and dtype on every rank.
        op: "sum", "avg", "min", "max", "product", "band", "bor", "bxor" or a ReduceOp.
        group: process group (default: the world).
        async_op: return a Work instead of waiting.
    """
    if not _checked.is_checked() and type(tensor) is torch.Tensor and tensor.is_cpu and tensor.layout is torch.strided:
        try:
            ready = _all_reduce_ready.get((group, op, tensor.dtype))
        except TypeError:  # an unhashable ReduceOp instance
            ready = None
        if ready is not None and (group is not None or ready[0].group is dist.group.WORLD):
            ready[0].calls[0] += 1
            work = dist.all_reduce(tensor, op=ready[1], group=group, async_op=async_op)
            return Work([work], lambda: tensor) if async_op else tensor
    info, name = _begin("all_reduce", group, tensor, op=op)
    if not reduce_ops.backend_supports(info.backend, name):
        stacked = _gather_equal(info, tensor)  # (group size, *tensor.shape)
        tensor.copy_(reduce_ops.fold(name, list(stacked.unbind(0))))
        return _finish(None, lambda: tensor, async_op)
    if info.backend == "gloo" and tensor.is_cpu and not _checked.is_checked():
        try:
            _all_reduce_ready[(group, op, tensor.dtype)] = (info, reduce_ops.TORCH_OPS[name])
        except TypeError:
            pass
    work = dist.all_reduce(tensor, op=reduce_ops.TORCH_OPS[name], group=group, async_op=async_op)
    return Work([work], lambda: tensor) if async_op else tensor


def reduce(tensor: torch.Tensor, dst: int = 0, op="sum", group: Group = None, async_op: bool = False):
    """Reduce `tensor` over the group into `dst`'s tensor. Returns the tensor on every rank;
    only dst's holds the result (the backend may use the others' as scratch space)."""
    info, name = _begin("reduce", group, tensor, op=op, root=dst, root_kind="dst")
    if not reduce_ops.backend_supports(info.backend, name):
        stacked = _gather_equal(info, tensor)
        if info.global_rank == dst:
            tensor.copy_(reduce_ops.fold(name, list(stacked.unbind(0))))
        return _finish(None, lambda: tensor, async_op)
    staged = _staged(info, tensor)
    work = dist.reduce(staged, dst, op=reduce_ops.TORCH_OPS[name], group=group, async_op=async_op)
    return _finish(work, lambda: tensor.copy_(staged) if staged is not tensor else tensor, async_op)


def _gather_equal(info: GroupInfo, tensor: torch.Tensor) -> torch.Tensor:
    """All ranks' equal-shaped tensors stacked: (group size, *shape). Used to fill op gaps."""
    # Gloo takes only the concatenated form of the output (not the stacked one), so gather flat.
    flat = tensor.reshape(-1).contiguous()
    out = flat.new_empty(info.size * flat.numel())
    _compat.all_gather_single(out, flat, group=info.group)
    return out.view((info.size,) + tuple(tensor.shape))


def _exchange_dim0(info: GroupInfo, tensor: torch.Tensor, collective: str) -> List[int]:
    """Every rank's first dimension; refuses (on every rank) trailing shapes or dtypes that differ.

    One small all_gather of a fixed size, so ranks that passed mismatched tensors learn it
    before the data collective, which Gloo would abort on.
    """
    dims = list(tensor.shape) if tensor.dim() else [1]
    # crc32, not hash(): Python salts str hashes per process, so ranks would disagree.
    key = zlib.crc32(repr((tuple(dims[1:]), str(tensor.dtype))).encode())
    meta = torch.tensor([key, dims[0]], dtype=torch.int64)
    if info.backend == "nccl":
        meta = meta.to(tensor.device)
    everyone = torch.empty(2 * info.size, dtype=torch.int64, device=meta.device)
    _compat.all_gather_single(everyone, meta, group=info.group)
    rows = everyone.view(info.size, 2).tolist()  # (group size, [trailing shape+dtype key, dim0])
    if len({row[0] for row in rows}) > 1:
        described: List = [None] * info.size
        dist.all_gather_object(described, (tuple(tensor.shape), str(tensor.dtype)), group=info.group)
        lines = "\n".join(f"  rank {info.ranks[i]}: shape={s}, dtype={d}" for i, (s, d) in enumerate(described))
        raise CollectiveMismatchError(
            f"{collective}: ranks may differ in the first dimension only, but their tensors differ in the "
            f"trailing dimensions or dtype:\n{lines}"
        )
    return [row[1] for row in rows]


def _padded(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """`tensor` (1-d at least) grown along dim 0 to `length` rows, contiguous."""
    tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor
    if tensor.shape[0] == length:
        return tensor.contiguous()
    out = tensor.new_zeros((length,) + tuple(tensor.shape[1:]))
    out[: tensor.shape[0]] = tensor
    return out


def all_gather(tensor: torch.Tensor, group: Group = None, async_op: bool = False):
    """Every rank's tensor concatenated on dim 0, in group-rank order. Dim 0 may differ between
    ranks (trailing dims and dtype may not); a 0-d tensor counts as one row.

    Gloo and NCCL gather equal sizes only, so uneven inputs are padded to the longest and cut.
    """
    info, _ = _begin("all_gather", group, tensor)
    dim0 = _exchange_dim0(info, tensor, "all_gather")
    longest = max(dim0)
    staged = _padded(_staged(info, tensor), longest)
    out = staged.new_empty((info.size * longest,) + tuple(staged.shape[1:]))
    work = _compat.all_gather_single(out, staged, group=group, async_op=async_op)

    def result():
        if all(d == longest for d in dim0):
            joined = out
        else:
            rows = out.view((info.size, longest) + tuple(staged.shape[1:]))  # (group size, longest, ...)
            joined = torch.cat([rows[i, :d] for i, d in enumerate(dim0)])
        return joined.to(tensor.device)

    return _finish(work, result, async_op)


def gather(tensor: torch.Tensor, dst: int = 0, group: Group = None, async_op: bool = False):
    """On `dst`, every rank's tensor concatenated on dim 0 in group-rank order (dim 0 may differ);
    None on the other ranks."""
    info, _ = _begin("gather", group, tensor, root=dst, root_kind="dst")
    dim0 = _exchange_dim0(info, tensor, "gather")
    longest = max(dim0)
    staged = _padded(_staged(info, tensor), longest)
    parts = [torch.empty_like(staged) for _ in range(info.size)] if info.global_rank == dst else None
    work = dist.gather(staged, parts, dst, group=group, async_op=async_op)

    def result():
        if parts is None:
            return None
        return torch.cat([p[:d] for p, d in zip(parts, dim0)]).to(tensor.device)

    return _finish(work, result, async_op)


def reduce_scatter(tensor: torch.Tensor, op="sum", group: Group = None, async_op: bool = False):
    """Reduce `tensor` over the group and return this rank's chunk of dim 0 (dim 0 / group size rows).

    Note: Gloo implements this as a whole all_reduce, so it moves n times the bytes NCCL does.
    """
    info, name = _begin("reduce_scatter", group, tensor, op=op, divisible=True)
    chunk = tensor.shape[0] // info.size
    if not reduce_ops.backend_supports(info.backend, name):
        stacked = _gather_equal(info, tensor)
        mine = reduce_ops.fold(name, list(stacked.unbind(0)))[info.group_rank * chunk : (info.group_rank + 1) * chunk]
        return _finish(None, lambda: mine.clone(), async_op)
    staged = _staged(info, tensor).contiguous()
    out = staged.new_empty((chunk,) + tuple(staged.shape[1:]))
    work = _compat.reduce_scatter_single(out, staged, op=reduce_ops.TORCH_OPS[name], group=group, async_op=async_op)
    return _finish(work, lambda: out.to(tensor.device), async_op)


def scatter(tensor: torch.Tensor, src: int = 0, group: Group = None, async_op: bool = False):
    """Split `src`'s tensor into group-size chunks along dim 0; return this rank's chunk.

    Every rank passes a tensor of the same shape (as in broadcast); only src's contents are used.
    """
    info, _ = _begin("scatter", group, tensor, root=src, divisible=True)
    staged = _staged(info, tensor).contiguous()
    out = staged.new_empty((staged.shape[0] // info.size,) + tuple(staged.shape[1:]))
    chunks = list(staged.chunk(info.size)) if info.global_rank == src else None
    work = dist.scatter(out, chunks, src, group=group, async_op=async_op)
    return _finish(work, lambda: out.to(tensor.device), async_op)


def all_to_all(tensor: torch.Tensor, group: Group = None, async_op: bool = False):
    """Chunk j of dim 0 goes to group rank j; the result's chunk i came from group rank i."""
    info, _ = _begin("all_to_all", group, tensor, divisible=True)
    staged = _staged(info, tensor).contiguous()
    out = torch.empty_like(staged)
    work = dist.all_to_all_single(out, staged, group=group, async_op=async_op)
    return _finish(work, lambda: out.to(tensor.device), async_op)


def barrier(group: Group = None, async_op: bool = False):
    """Wait until every rank of the group has reached this call."""
    _begin("barrier", group)
    work = dist.barrier(group=group, async_op=async_op)
    return _finish(work, lambda: None, async_op)
