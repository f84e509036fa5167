"""Always-on local checks, run before a wrapper calls into the backend.

Each failure is a `CollectiveError` that names the collective, this rank, and what is wrong.
They cost microseconds and need no communication; checks that need the other ranks' view live
in `checked_mode.py`.
"""

from __future__ import annotations

import dataclasses
import numbers
import weakref
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .dtypes import UNMOVABLE
from .errors import CollectiveError

CPU_BACKENDS = ("gloo", "shm")  # the common case the checks let straight through


class GroupInfo:
    """The group a collective runs on, seen from this rank.

    `ranks` are global ranks; `group_rank` is this rank's index in `ranks`; `calls` counts the
    collectives this rank has started on the group. The group itself is held weakly: this cache
    must not keep a group alive after destroy_process_group (a Gloo group kept alive keeps its
    worker threads running into interpreter shutdown, where they can abort the process).
    """

    __slots__ = ("_group", "ranks", "group_rank", "global_rank", "backend", "calls")

    def __init__(self, group: Optional[dist.ProcessGroup], ranks: Tuple[int, ...], group_rank: int, global_rank: int,
                 backend: str, calls: int = 0):
        self._group = None if group is None else weakref.ref(group)
        self.ranks, self.group_rank, self.global_rank, self.backend, self.calls = \
            ranks, group_rank, global_rank, backend, calls

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        """The process group (None once it has been destroyed and dropped)."""
        return None if self._group is None else self._group()

    @property
    def size(self) -> int:
        return len(self.ranks)

    def count_call(self) -> int:
        """The number of the collective starting now on this group (1, 2, ...). Every collective
        counts, checked or not, so that checked mode can compare the ranks' numbers."""
        self.calls += 1
        return self.calls

    def __repr__(self) -> str:
        return (f"GroupInfo(ranks={self.ranks}, group_rank={self.group_rank}, global_rank={self.global_rank}, "
                f"backend={self.backend!r}, calls={self.calls})")


# group -> its GroupInfo, for as long as the group lives (weak: see GroupInfo)
_group_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class NotInGroup:
    """What a rank outside a group holds in its place (from collectives.new_group or split).

    Not None, which every call reads as the world: a rank left out that went on to a collective
    would join the world's and hang. Every wrapper refuses it by name; it is falsy, so
    `if group:` reads as "this rank has no group here".
    """

    ranks: Tuple[int, ...]  # the group's members; () for a rank that split() left out of every part
    made_by: str  # "new_group([0, 1])", "split([[0, 1, 2]])"

    def __bool__(self) -> bool:
        return False

    def describe(self, rank: int) -> str:
        if self.ranks:
            return f"group ranks {list(self.ranks)}, from {self.made_by}; rank {rank} holds a NotInGroup placeholder"
        return f"rank {rank} was left out of {self.made_by}, so it has no group there"


def resolve_group(group: Optional[dist.ProcessGroup], collective: str) -> GroupInfo:
    """The group (WORLD when None), refusing a rank that is not in it.

    torch.distributed only warns and returns None in that case, leaving the tensor untouched:
    a silent wrong answer. A group's membership never changes, so it is looked up once; this
    runs before every collective, so it is kept to a dictionary lookup.
    """
    if group is None:
        group = dist.group.WORLD
        if group is None:
            raise CollectiveError(
                f"{collective}: the default process group is not initialised; call "
                "collectives.init_from_env() or run the function with collectives.run()"
            )
    info = _group_cache.get(group) if isinstance(group, dist.ProcessGroup) else None
    if info is None:
        if isinstance(group, NotInGroup):
            me = dist.get_rank()
            raise CollectiveError(f"{collective}: rank {me} called it on a group it is not in ({group.describe(me)})")
        if not isinstance(group, dist.ProcessGroup):
            raise CollectiveError(f"{collective}: group must be a process group (from collectives.new_group or "
                                  f"split) or None for the world, got {group!r}")
        global_rank = dist.get_rank()
        ranks = tuple(dist.get_process_group_ranks(group))
        group_rank = ranks.index(global_rank) if global_rank in ranks else -1
        backend = str(dist.get_backend(group)).lower() if group_rank >= 0 else ""
        info = GroupInfo(group, ranks, group_rank, global_rank, backend)
        _group_cache[group] = info
    if info.group_rank < 0:
        raise CollectiveError(
            f"{collective}: rank {info.global_rank} called it on a group it is not in (group ranks {list(info.ranks)})"
        )
    return info


def check_tensor(tensor, collective: str, info: GroupInfo, name: str = "tensor") -> None:
    """A dense tensor on a device the group's backend can use, contiguous where it must be."""
    if info.backend in CPU_BACKENDS and isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided \
            and tensor.is_cpu and tensor.dtype not in UNMOVABLE:
        return  # the common case, kept short: time spent here shows up in small-message latency
    where = f"{collective} on rank {info.global_rank}"
    if tensor is None:
        raise CollectiveError(f"{where}: {name} is None; pass a torch.Tensor")
    if not isinstance(tensor, torch.Tensor):
        raise CollectiveError(f"{where}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise CollectiveError(f"{where}: {name} must be dense (strided), got layout {tensor.layout}")
    if tensor.dtype in UNMOVABLE:
        raise CollectiveError(f"{where}: {name} has dtype {tensor.dtype}, which no backend here can move (a bit-packed "
                              "or sub-byte dtype, or float8_e8m0fnu); view or cast it to uint8 first")
    device = tensor.device.type
    if info.backend == "nccl":
        if device != "cuda":
            raise CollectiveError(
                f"{where}: the nccl backend needs CUDA tensors, but {name} is on {tensor.device}; "
                "move it with .cuda() or use a gloo group for CPU tensors"
            )
        if tensor.device.index != torch.cuda.current_device():
            raise CollectiveError(
                f"{where}: {name} is on {tensor.device} but this rank's current device is "
                f"cuda:{torch.cuda.current_device()}; NCCL needs them to match"
            )
    elif info.backend == "gloo":
        if device not in ("cpu", "cuda"):
            raise CollectiveError(f"{where}: the gloo backend takes CPU or CUDA tensors, but {name} is on {tensor.device}")
    elif info.backend == "shm" and device != "cpu":
        raise CollectiveError(f"{where}: the shm backend moves CPU tensors only, but {name} is on {tensor.device}")
    # Non-contiguous tensors are fine: the wrappers hand the backend a contiguous copy (see ops.py).


def overlaps_itself(tensor: torch.Tensor) -> bool:
    """True when two elements of `tensor` share memory (an expand, or an as_strided window).

    A collective that writes its result in place cannot write two different values into one
    memory location. Cheap for the common views (sorted strides each reaching past the extent of
    the smaller ones); exact, by listing every element's offset, only for exotic strides.
    """
    dims = sorted((st, n) for n, st in zip(tensor.shape, tensor.stride()) if n > 1)
    if any(st == 0 for st, _ in dims):
        return True
    extent = 0
    for st, n in dims:
        if st <= extent:
            break
        extent += st * (n - 1)
    else:
        return False
    offsets = torch.zeros((), dtype=torch.int64)
    for n, st in zip(tensor.shape, tensor.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st
    return offsets.unique().numel() < tensor.numel()


def check_writable(tensor: torch.Tensor, collective: str, info: GroupInfo) -> None:
    """An in-place collective's tensor must not overlap itself (see `overlaps_itself`)."""
    if not tensor.is_contiguous() and overlaps_itself(tensor):
        raise CollectiveError(
            f"{collective} on rank {info.global_rank}: the tensor (shape {tuple(tensor.shape)}, stride "
            f"{tensor.stride()}) has elements that share memory (an expand() or as_strided view), so the "
            "result cannot be written into it in place; pass .clone() of it"
        )

def check_root(root: int, kind: str, collective: str, info: GroupInfo) -> None:
    """`src`/`dst` is a global rank (torch.distributed's convention) that is in the group."""
    where = f"{collective} on rank {info.global_rank}"
    if not isinstance(root, numbers.Integral) or isinstance(root, bool):  # numpy integers too, as torch takes them
        raise CollectiveError(f"{where}: {kind} must be an int (a global rank), got {root!r}")
    world = dist.get_world_size()
    if not 0 <= root < world:
        raise CollectiveError(f"{where}: {kind}={root} is out of range for world_size {world}")
    if root not in info.ranks:
        raise CollectiveError(f"{where}: {kind}={root} is not in the group (group ranks {list(info.ranks)})")


def check_divisible(tensor: torch.Tensor, collective: str, info: GroupInfo) -> None:
    """The first dimension splits into one equal chunk per rank of the group."""
    if tensor.dim() == 0 or tensor.shape[0] % info.size != 0:
        dim0 = "a 0-d tensor" if tensor.dim() == 0 else f"first dimension {tensor.shape[0]}"
        raise CollectiveError(
            f"{collective} on rank {info.global_rank}: the input's {dim0} (shape {tuple(tensor.shape)}) "
            f"does not divide by the group size {info.size}"
        )
