"""One name for each data-parallel wrapper, and one `wrap` that builds any of them.

    model = wrap(net, "bucketed", bucket_cap_mb=25)    # or "torch", "naive", "flat"

"torch" is torch.nn.parallel.DistributedDataParallel; the others are the teaching path's three
steps. The sharded steps (SHARDED_WRAPPERS: zero1, zero2, fsdp) take an optimizer of their own
(`model.optimizer(...)`) and are built directly; torch_fully_shard is torch's FSDP2 cut into the
same units as our fsdp. Options that only some wrappers have (bucket_cap_mb, find_unused_parameters, ...) are
refused by name for the others, so a comparison never silently drops one.
"""

from __future__ import annotations

from typing import Union

from torch import nn

from .ddp import DistributedDataParallel
from .flat import FlatDataParallel
from .fsdp import FullyShardedDataParallel, unit_plan
from .naive import NaiveDataParallel
from .zero1 import ZeroOneDataParallel
from .zero2 import ZeroTwoDataParallel

WRAPPERS = {"naive": NaiveDataParallel, "flat": FlatDataParallel, "bucketed": DistributedDataParallel}
IMPLS = ["torch"] + list(WRAPPERS)
SHARDED_WRAPPERS = {"zero1": ZeroOneDataParallel, "zero2": ZeroTwoDataParallel, "fsdp": FullyShardedDataParallel}


def torch_fully_shard(module: nn.Module, units="children") -> nn.Module:
    """torch's FSDP2 on the same units as ours (fsdp.unit_plan): fully_shard on each unit's module,
    innermost first, then on the root."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    # The mesh on the module's own device: left to itself, fully_shard builds a CUDA mesh whenever a
    # GPU is visible and moves a CPU module there (seen on an H100 machine, Gloo ranks on the CPU).
    device = next(module.parameters()).device
    mesh = DeviceMesh.from_group(dist.group.WORLD, device_type=device.type)
    for name, _ in reversed(unit_plan(module, units)):
        if name:
            fully_shard(module.get_submodule(name), mesh=mesh)
    return fully_shard(module, mesh=mesh)


def wrap(model: nn.Module, impl: Union[str, type], **kwargs) -> nn.Module:
    """`model` wrapped by `impl`: a name in IMPLS, or a wrapper class (tests pass broken ones).

    Args:
        model: the module to replicate (on this rank's device).
        impl: "torch", "naive", "flat", "bucketed", or a class taking (module, **kwargs).
        kwargs: the wrapper's options, with torch's names (bucket_cap_mb, find_unused_parameters,
            gradient_as_bucket_view, device_ids for torch's; compress, timeline for ours).
            A None value means the wrapper's default and is not passed on.
    """
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if impl == "torch":
        return nn.parallel.DistributedDataParallel(model, **kwargs)
    cls = WRAPPERS[impl] if isinstance(impl, str) else impl
    if cls in (NaiveDataParallel, FlatDataParallel) and kwargs.keys() - {"group", "broadcast_buffers"}:
        raise ValueError(f"{cls.__name__} takes no {', '.join(sorted(kwargs))}: only the bucketed wrapper and torch's do")
    return cls(model, **kwargs)
