"""Thin, checked wrappers over torch.distributed's collectives, same answer on Gloo and NCCL.

Names and argument order follow torch.distributed. In-place collectives (broadcast, all_reduce,
reduce) return the tensor; the others return a new tensor. With async_op=True each returns a
`Work` whose wait() gives that result.

    t = torch.full((4,), env.rank + 1.0)
    collectives.all_reduce(t, op="sum")                 # every rank: n(n+1)/2
    chunk = collectives.reduce_scatter(torch.ones(8))   # this rank's (8 / n,) chunk of the sum
    everyone = collectives.all_gather(torch.ones(env.rank + 1))  # uneven dim 0 is fine

`src`/`dst` are global ranks, as in torch.distributed. Run with `collectives.run(fn, n)`.

Any view works, not only contiguous tensors: a backend reads and writes `numel` elements from
the tensor's first address (a strided view such as `b[:, ::2]` would be read wrong and memory
outside it overwritten), so the wrappers hand it a contiguous copy and copy the result back.
"""

from __future__ import annotations

import functools
import math
import inspect
import weakref
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from . import checked_mode
from . import compat, reduce_ops
from .checks import CPU_BACKENDS, GroupInfo, check_divisible, check_root, check_tensor, check_writable, resolve_group
from .errors import CollectiveError, CollectiveMismatchError, backend_failure
from .dtypes import arithmetic_widening, as_bytes, from_bytes, moves_as_bytes, reduction_widening
from . import splits
from .exchange import check_same_root, describe_rows, exchange, raise_if_any_failed

Group = Optional[dist.ProcessGroup]


class Work:
    """The handle of an async collective. wait() blocks until it is done and returns its result."""

    def __init__(self, works: List, finish: Callable[[], object]):
        self._works, self._finish, self._done, self._result = works, finish, False, None
        self.collective, self.group = "collective", None  # set by _names_failures

    def wait(self):
        if not self._done:
            try:
                for work in self._works:
                    work.wait()
            except RuntimeError as exc:
                named = backend_failure(self.collective, exc, self.group)
                if named is None:
                    raise
                raise named from exc
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


def _names_failures(fn):
    """A backend failure inside `fn` (or its Work's wait) becomes a BackendFailure naming this
    rank, its host and the collective; our own checks' errors pass as they are."""
    collective = fn.__name__
    at = list(inspect.signature(fn).parameters).index("group")  # group given by position too

    def group_of(args, kwargs):
        return kwargs["group"] if "group" in kwargs else (args[at] if len(args) > at else None)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            result = fn(*args, **kwargs)
        except RuntimeError as exc:
            named = backend_failure(collective, exc, group_of(args, kwargs))
            if named is None:
                raise
            raise named from exc
        if type(result) is Work:
            result.collective, result.group = collective, group_of(args, kwargs)
        return result

    return wrapped


_NO_TENSOR = object()  # barrier has no tensor; None is a tensor argument that is missing
_NO_OP = object()  # not a reduction; op=None is an op argument that is missing


def _begin(collective: str, group: Group, tensor=_NO_TENSOR, op=_NO_OP, root=None, root_kind="src",
           divisible=False, writes=False, spread=False, compare_tensor=True):
    """Resolve the group, run the local checks, and in checked mode compare with the other ranks.

    Returns (group info, op name or None, this rank's local check failure or None). A failure
    raises here, except with spread=True in plain mode: then it is returned, for the caller's
    metadata exchange to tell every rank (see exchange.py). compare_tensor=False leaves the
    tensor out of checked mode's fingerprint (scatter: the ranks other than src may pass None).
    Kept lean: it runs before every collective.
    """
    info = resolve_group(group, collective)
    sequence = info.count_call()
    name = error = None
    try:
        if tensor is not _NO_TENSOR:
            check_tensor(tensor, collective, info)
            if writes:
                check_writable(tensor, collective, info)
        if op is not _NO_OP:  # a reduction: op=None is an error, not "no op"
            name = reduce_ops.op_name(op, collective)
            reduce_ops.check_op_dtype(name, tensor.dtype, collective)
        if root is not None:
            check_root(root, root_kind, collective, info)
        if divisible:
            check_divisible(tensor, collective, info)
    except CollectiveError as exc:
        if not checked_mode.is_checked() and not spread:
            raise
        error = str(exc)
    if checked_mode.is_checked():  # raises on every rank if any rank differs or failed
        shown = tensor if compare_tensor and tensor is not _NO_TENSOR else None
        checked_mode.verify(checked_mode.Call(collective, info, sequence, shown, name, root, error))
    return info, name, error


def _staged(info: GroupInfo, tensor: torch.Tensor, host: bool = True) -> torch.Tensor:
    """What the backend is handed: contiguous, and in host memory where Gloo needs it.

    Gloo runs broadcast and all_reduce on CUDA tensors (host=False); for the rest we go through
    host memory.
    """
    if host and info.backend == "gloo" and tensor.is_cuda:
        return tensor.cpu()
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _carried(info: GroupInfo, staged: torch.Tensor, collective: str) -> torch.Tensor:
    """`staged`, or its bytes where the backend cannot move its dtype (dtypes.py)."""
    return as_bytes(staged) if moves_as_bytes(info.backend, staged.dtype, collective) else staged


def _reduction_input(info: GroupInfo, tensor: torch.Tensor, name: str, host: bool = True):
    """(what the backend reduces, how to turn it back into the tensor's dtype, or None)."""
    staged = _staged(info, tensor, host)
    widening = reduction_widening(info.backend, tensor.dtype, name)
    return (staged, None) if widening is None else (widening.widen(staged), widening.narrow)


def _copy_back(tensor: torch.Tensor, sent: torch.Tensor, back=None) -> torch.Tensor:
    """Write the result into the caller's tensor, unless the backend already wrote it there."""
    if back is not None:
        tensor.copy_(back(sent))
    elif sent is not tensor:
        tensor.copy_(sent)
    return tensor


@_names_failures
def broadcast(tensor: torch.Tensor, src: int = 0, group: Group = None, async_op: bool = False):
    """Copy `src`'s tensor into every rank's tensor (in place). Returns the tensor.

    Args:
        tensor: same shape and dtype on every rank; src's contents are sent.
        src: global rank that sends.
        group: process group (default: the world).
        async_op: return a Work instead of waiting.
    """
    info, _, _ = _begin("broadcast", group, tensor, root=src, writes=True)
    staged = _staged(info, tensor, host=False)
    work = dist.broadcast(_carried(info, staged, "broadcast"), src, group=group, async_op=async_op)
    return _finish(work, lambda: _copy_back(tensor, staged), async_op)


# id(group) -> {(op, dtype): (GroupInfo, torch op)} for CPU all_reduces on Gloo that passed every
# check: what those checks decide cannot change for the same key, so later calls skip straight to
# torch. Keyed by id so that it holds no group (see checks.GroupInfo); a group's entry leaves when
# the group is collected, before its id can be reused. Measured with dist.all_reduce stubbed, as
# benchmarks.wrapper_overhead times the wrapper's own work: 1.13 us a call against 1.05 us when
# the dictionary held the group itself; a WeakKeyDictionary took 1.19 us.
_all_reduce_ready: dict = {}
_NOTHING_READY: dict = {}


def _remember_ready(group: dist.ProcessGroup, key, ready) -> None:
    entry = _all_reduce_ready.get(id(group))
    if entry is None:
        entry = _all_reduce_ready[id(group)] = {}
        weakref.finalize(group, _all_reduce_ready.pop, id(group), None).atexit = False
    entry[key] = ready


def _all_reduce_fast(tensor, op, group, async_op):
    """The hot path: a contiguous dense CPU tensor whose (group, op, dtype) already passed every
    check in plain mode. Returns None when the call must take the checked path.

    Measured on Gloo: any Python work right before the call costs several times its own
    duration, so this does a type check, a few attribute reads and two dictionary lookups.
    """
    if checked_mode.is_checked() or type(tensor) is not torch.Tensor or not tensor.is_cpu or not tensor.is_contiguous():
        return None
    try:  # group None means WORLD at the time of the call
        ready = _all_reduce_ready.get(id(dist.group.WORLD if group is None else group), _NOTHING_READY)
        ready = ready.get((op, tensor.dtype))
    except TypeError:  # an unhashable ReduceOp instance
        return None
    if ready is None:
        return None
    ready[0].count_call()
    work = dist.all_reduce(tensor, op=ready[1], group=group, async_op=async_op)
    return Work([work], lambda: tensor) if async_op else tensor


@_names_failures
def all_reduce(tensor: torch.Tensor, op="sum", group: Group = None, async_op: bool = False):
    """Reduce `tensor` over the group with `op`; every rank gets the result in place.

    Args:
        tensor: same shape and dtype on every rank.
        op: "sum", "avg", "min", "max", "product", "band", "bor", "bxor" or a ReduceOp.
        group: process group (default: the world).
        async_op: return a Work instead of waiting.
    """
    fast = _all_reduce_fast(tensor, op, group, async_op)
    if fast is not None:
        return fast
    info, name, _ = _begin("all_reduce", group, tensor, op=op, writes=True)
    if not reduce_ops.backend_supports(info.backend, name):
        tensor.copy_(_gather_and_fold(info, tensor, name))
        return _finish(None, lambda: tensor, async_op)
    sent, back = _reduction_input(info, tensor, name, host=False)
    if info.backend in CPU_BACKENDS and sent is tensor and tensor.is_cpu and not checked_mode.is_checked():
        try:
            _remember_ready(info.group, (op, tensor.dtype), (info, reduce_ops.TORCH_OPS[name]))
        except TypeError:
            pass
    work = dist.all_reduce(sent, op=reduce_ops.TORCH_OPS[name], group=group, async_op=async_op)
    return _finish(work, lambda: _copy_back(tensor, sent, back), async_op)


@_names_failures
def reduce(tensor: torch.Tensor, dst: int = 0, op="sum", group: Group = None, async_op: bool = False):
    """Reduce `tensor` over the group into `dst`'s tensor. Returns the tensor on every rank;
    only dst's holds the result (the backend may use the others' as scratch space).

    Args:
        tensor: same shape and dtype on every rank.
        dst: global rank that receives the result.
        op: as for all_reduce.
        group: process group (default: the world).
        async_op: return a Work instead of waiting.
    """
    info, name, _ = _begin("reduce", group, tensor, op=op, root=dst, root_kind="dst", writes=True)
    if not reduce_ops.backend_supports(info.backend, name):
        folded = _gather_and_fold(info, tensor, name)
        if info.global_rank == dst:
            tensor.copy_(folded)
        return _finish(None, lambda: tensor, async_op)
    sent, back = _reduction_input(info, tensor, name)
    work = dist.reduce(sent, dst, op=reduce_ops.TORCH_OPS[name], group=group, async_op=async_op)
    return _finish(work, lambda: _copy_back(tensor, sent, back), async_op)


def _gather_equal(info: GroupInfo, tensor: torch.Tensor) -> torch.Tensor:
    """All ranks' equal-shaped tensors stacked: (group size, *shape). Used to fill op gaps."""
    # Gloo takes only the concatenated form of the output (not the stacked one), so gather flat.
    flat = tensor.reshape(-1).contiguous()
    sent = _carried(info, flat, "all_gather")
    out = sent.new_empty(info.size * sent.numel())
    compat.all_gather_single(out, sent, group=info.group)
    return out.view(tensor.dtype).view((info.size,) + tuple(tensor.shape))


def _gather_and_fold(info: GroupInfo, tensor: torch.Tensor, name: str) -> torch.Tensor:
    """The reduction done here: every rank's tensor gathered, then folded in group-rank order."""
    parts = list(_gather_equal(info, tensor).unbind(0))
    widening = arithmetic_widening(tensor.dtype, name)
    if widening is None:
        return reduce_ops.fold(name, parts)
    return widening.narrow(reduce_ops.fold(name, [widening.widen(p) for p in parts]))


def _exchange_dim0(info: GroupInfo, tensor, collective: str, error: Optional[str], root: Optional[int] = None) -> List[int]:
    """Every rank's first dimension; refuses (on every rank) a local check failure on any rank,
    trailing shapes or dtypes that differ, and (gather) dst that differs.

    One small all_gather of a fixed size, so ranks that passed mismatched tensors learn it
    before the data collective, which Gloo would abort on.
    """
    rows = exchange(info, tensor, root, error)
    raise_if_any_failed(info, rows, error, collective)
    if root is not None:
        check_same_root(info, rows, collective, "dst")
    kinds = {(row.shape[1:] if len(row.shape) > 1 else (), row.dtype, row.tail_checksum) for row in rows}
    if len(kinds) > 1:
        raise CollectiveMismatchError(
            f"{collective}: ranks may differ in the first dimension only, but their tensors differ in the "
            f"trailing dimensions or dtype:\n{describe_rows(info, rows)}"
        )
    return [row.shape[0] if row.shape else 1 for row in rows]


def _padded(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """`tensor` (1-d at least) grown along dim 0 to `length` rows, contiguous."""
    tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor
    if tensor.shape[0] == length:
        return tensor.contiguous()
    out = tensor.new_zeros((length,) + tuple(tensor.shape[1:]))
    out[: tensor.shape[0]] = tensor
    return out


@_names_failures
def all_gather(tensor: torch.Tensor, group: Group = None, async_op: bool = False):
    """Every rank's tensor concatenated on dim 0, in group-rank order. Dim 0 may differ between
    ranks (trailing dims and dtype may not); a 0-d tensor counts as one row.

    Gloo and NCCL gather equal sizes only, so uneven inputs are padded to the longest and cut.

    Args:
        tensor: this rank's rows.
        group: process group (default: the world).
        async_op: return a Work instead of waiting.
    """
    info, _, error = _begin("all_gather", group, tensor, spread=True)
    dim0 = _exchange_dim0(info, tensor, "all_gather", error)
    longest = max(dim0)
    staged = _padded(_staged(info, tensor), longest)
    sent = _carried(info, staged, "all_gather")
    out = sent.new_empty((info.size * sent.shape[0],) + tuple(sent.shape[1:]))
    work = compat.all_gather_single(out, sent, group=group, async_op=async_op)

    def result():
        gathered = out if sent is staged else from_bytes(out, staged.dtype, (info.size * longest,) + tuple(staged.shape[1:]))
        if all(d == longest for d in dim0):
            joined = gathered
        else:
            rows = gathered.view((info.size, longest) + tuple(staged.shape[1:]))  # (group size, longest, ...)
            joined = torch.cat([rows[i, :d] for i, d in enumerate(dim0)])
        return joined.to(tensor.device)

    return _finish(work, result, async_op)


@_names_failures
def gather(tensor: torch.Tensor, dst: int = 0, group: Group = None, async_op: bool = False):
    """On `dst`, every rank's tensor concatenated on dim 0 in group-rank order (dim 0 may differ);
    None on the other ranks.

    Args:
        tensor: this rank's rows.
        dst: global rank that receives.
        group: process group (default: the world).
        async_op: return a Work instead of waiting.
    """
    info, _, error = _begin("gather", group, tensor, root=dst, root_kind="dst", spread=True)
    dim0 = _exchange_dim0(info, tensor, "gather", error, root=dst)
    longest = max(dim0)
    staged = _padded(_staged(info, tensor), longest)
    sent = _carried(info, staged, "gather")
    parts = [torch.empty_like(sent) for _ in range(info.size)] if info.global_rank == dst else None
    work = dist.gather(sent, parts, dst, group=group, async_op=async_op)

    def result():
        if parts is None:
            return None
        rows = parts if sent is staged else [from_bytes(p, staged.dtype, staged.shape) for p in parts]
        return torch.cat([p[:d] for p, d in zip(rows, dim0)]).to(tensor.device)

    return _finish(work, result, async_op)


@_names_failures
def reduce_scatter(tensor: torch.Tensor, op="sum", group: Group = None, async_op: bool = False):
    """Reduce `tensor` over the group and return this rank's chunk of dim 0 (dim 0 / group size rows).

    Note: Gloo implements this as a whole all_reduce, so it moves n times the bytes NCCL does.

    Args:
        tensor: same shape and dtype on every rank; dim 0 divisible by the group size.
        op: as for all_reduce.
        group: process group (default: the world).
        async_op: return a Work instead of waiting.
    """
    info, name, _ = _begin("reduce_scatter", group, tensor, op=op, divisible=True)
    chunk = tensor.shape[0] // info.size
    if not reduce_ops.backend_supports(info.backend, name):
        mine = _gather_and_fold(info, tensor, name)[info.group_rank * chunk : (info.group_rank + 1) * chunk]
        return _finish(None, lambda: mine.clone(), async_op)
    sent, back = _reduction_input(info, tensor, name)
    out = sent.new_empty((chunk,) + tuple(sent.shape[1:]))
    work = compat.reduce_scatter_single(out, sent, op=reduce_ops.TORCH_OPS[name], group=group, async_op=async_op)
    return _finish(work, lambda: (out if back is None else back(out)).to(tensor.device), async_op)


@_names_failures
def scatter(tensor: Optional[torch.Tensor], src: int = 0, group: Group = None, async_op: bool = False):
    """Split `src`'s tensor into group-size chunks along dim 0; return this rank's chunk.

    The other ranks pass None (as with torch.distributed.scatter's scatter_list), or a tensor
    shaped like src's whose contents are ignored. A small exchange of shapes comes first, so a
    rank whose tensor does not match src's is refused on every rank.

    Args:
        tensor: on src, the tensor to split (dim 0 divisible by the group size); elsewhere None.
        src: global rank that sends.
        group: process group (default: the world).
        async_op: return a Work instead of waiting.
    """
    me = dist.get_rank() if dist.is_initialized() else -1
    checked_tensor = _NO_TENSOR if tensor is None and me != src else tensor
    info, _, error = _begin("scatter", group, checked_tensor, root=src, spread=True, compare_tensor=False)
    rows = exchange(info, tensor, src, error)
    raise_if_any_failed(info, rows, error, "scatter")
    check_same_root(info, rows, "scatter", "src")
    source = rows[info.ranks.index(src)]
    if not source.has_tensor:
        raise CollectiveError(f"scatter: src rank {src} passed None; src must pass the tensor to split")
    wrong = [info.ranks[i] for i, row in enumerate(rows)
             if row.has_tensor and (row.shape, row.dtype, row.tail_checksum) != (source.shape, source.dtype, source.tail_checksum)]
    if wrong:
        raise CollectiveMismatchError(
            f"scatter: rank(s) {wrong} passed a tensor not shaped like src rank {src}'s (pass None or the same "
            f"shape and dtype):\n{describe_rows(info, rows)}")
    if not source.shape or source.shape[0] % info.size:
        dim0 = "a 0-d tensor" if not source.shape else f"first dimension {source.shape[0]}"
        raise CollectiveError(f"scatter: src rank {src}'s tensor has {dim0} (shape {source.shape}), which does not "
                              f"divide by the group size {info.size}")
    if "..." in source.shape and tensor is None:
        raise CollectiveError("scatter: src's tensor has more than 10 dimensions; pass a tensor of its shape instead of None")
    if tensor is None:
        device = torch.device("cuda", torch.cuda.current_device()) if info.backend == "nccl" else torch.device("cpu")
        result_device = device
    else:
        device = _staged(info, tensor).device
        result_device = tensor.device
    out = torch.empty((source.shape[0] // info.size,) + tuple(source.shape[1:]), dtype=source.dtype, device=device)
    received = _carried(info, out, "scatter")  # a view of out, or out itself
    chunks = list(_carried(info, _staged(info, tensor), "scatter").chunk(info.size)) if info.global_rank == src else None
    work = dist.scatter(received, chunks, src, group=group, async_op=async_op)
    return _finish(work, lambda: out.to(result_device), async_op)


@_names_failures
def all_to_all(tensor: torch.Tensor, group: Group = None, async_op: bool = False,
               input_split_sizes: Optional[List[int]] = None, output_split_sizes: Optional[List[int]] = None):
    """Chunk j of dim 0 goes to group rank j; the result's chunk i came from group rank i.

    With input_split_sizes the chunks may be uneven (torch's all_to_all_single with splits): this
    rank sends input_split_sizes[j] rows to group rank j, and the result holds, in group-rank
    order, the rows each rank sent this one. output_split_sizes (the rows this rank receives from
    each) may be given, or left for the wrapper to learn. Either way one small all_gather of every
    rank's splits, dtype and trailing shape comes first, so a rank that sends 3 rows to a rank
    expecting 2, or rows of another shape, is named on every rank before the data moves (Gloo
    aborts the process on it).

        mine = collectives.all_to_all(rows, input_split_sizes=[2, 0, 5])   # 7 rows, uneven

    Args:
        tensor: same shape and dtype on every rank; dim 0 divisible by the group size (even
            form), or the rows to send, in destination order (uneven form).
        group: process group (default: the world).
        async_op: return a Work instead of waiting.
        input_split_sizes: rows for each group rank, summing to dim 0 (uneven form).
        output_split_sizes: rows from each group rank (uneven form; learned when not given).
    """
    if input_split_sizes is not None or output_split_sizes is not None:
        return _all_to_all_uneven(tensor, group, async_op, input_split_sizes, output_split_sizes)
    info, _, _ = _begin("all_to_all", group, tensor, divisible=True)
    staged = _staged(info, tensor)
    out = torch.empty_like(staged)
    work = dist.all_to_all_single(_carried(info, out, "all_to_all"), _carried(info, staged, "all_to_all"), group=group,
                                  async_op=async_op)
    return _finish(work, lambda: out.to(tensor.device), async_op)


def _all_to_all_uneven(tensor, group, async_op, input_split_sizes, output_split_sizes):
    """all_to_all's uneven form: the splits checked on every rank (splits.py), then the rows moved."""
    info, _, error = _begin("all_to_all", group, tensor, spread=True, compare_tensor=False)
    if error is None:
        error = splits.local_error(tensor, info, input_split_sizes, output_split_sizes)
    received = splits.agree(info, tensor, input_split_sizes, output_split_sizes, error)
    sending = list(input_split_sizes) if input_split_sizes is not None else [0] * info.size
    staged = _staged(info, tensor)
    out = staged.new_empty((sum(received),) + tuple(staged.shape[1:]))
    scale = 1  # rows; bytes where the backend moves the dtype as bytes
    if moves_as_bytes(info.backend, staged.dtype, "all_to_all"):
        scale = math.prod(staged.shape[1:]) * staged.element_size()
    work = dist.all_to_all_single(_carried(info, out, "all_to_all"), _carried(info, staged, "all_to_all"),
                                  output_split_sizes=[n * scale for n in received],
                                  input_split_sizes=[n * scale for n in sending], group=group, async_op=async_op)
    return _finish(work, lambda: out.to(tensor.device), async_op)


@_names_failures
def barrier(group: Group = None, async_op: bool = False):
    """Wait until every rank of the group has reached this call.

    Args:
        group: process group (default: the world).
        async_op: return a Work instead of waiting.
    """
    _begin("barrier", group)
    work = dist.barrier(group=group, async_op=async_op)
    return _finish(work, lambda: None, async_op)
