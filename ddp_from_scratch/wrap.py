"""The one registry of data-parallel stages by name, and one `wrap` that builds any of them.

    model = wrap(net, "bucketed", bucket_cap_mb=25)    # "torch", "naive", "flat", "bucketed"
    model = wrap(net, "zero2-bucketed")                 # a sharded stage: then model.optimizer(...)
    STAGES["fsdp"].summary                              # what it is, for --help texts

Everything that takes a stage by name reads STAGES: `wrap`, the parity program (compare.py,
compare/sharded.py), the training program (train.py), the timeline program (trace.py) and the
sharded benchmark (benchmarks/sharded.py). A new stage is its file plus one entry here
(docs/extending.md shows it).

"torch" is torch.nn.parallel.DistributedDataParallel and "torch-fsdp" torch's fully_shard (FSDP2)
cut into the same units as our fsdp; the others are the teaching path's steps. Options that only
some stages have (bucket_cap_mb, find_unused_parameters, ...) are refused by name for the others,
so a comparison never silently drops one.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Union

from torch import nn

from .steps.ddp import DistributedDataParallel
from .steps.flat import FlatDataParallel
from .steps.fsdp import FullyShardedDataParallel, unit_plan
from .steps.naive import NaiveDataParallel
from .steps.zero1 import ZeroOneDataParallel
from .steps.zero2 import ZeroTwoDataParallel


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


def quarter_of_the_model_mb(module: nn.Module) -> float:
    """A quarter of the module's parameter bytes, in MiB: buckets that make at least 4 units, whatever the model."""
    return sum(p.numel() * p.element_size() for p in module.parameters()) / 4 / (1 << 20)


@dataclasses.dataclass(frozen=True)
class Stage:
    """One data-parallel stage, by name.

    build(module, **options) wraps the module; `defaults(module)` adds options the name implies
    (zero2-bucketed: its bucket size); `takes` lists the options beyond group and broadcast_buffers
    that it accepts. For the sharded stages (which have `model.optimizer(...)`): `bitwise_twin` is
    torch's wrapper it matches bit for bit at every world size ("torch" for DDP, "torch-fsdp" for
    fully_shard, None: only at 2 ranks; compare/sharded.py's SHARDED_NOTE says why). A stage that takes
    fsdp's `units` is compared with a fully_shard cut the same way; the others with the whole
    model as one unit.
    """

    name: str
    build: Callable[..., nn.Module]
    summary: str
    sharded: bool = False
    ours: bool = True
    takes: frozenset = frozenset()
    defaults: Callable[[nn.Module], Dict] = lambda module: {}
    bitwise_twin: Optional[str] = None


_BUCKETED = frozenset({"bucket_cap_mb", "first_bucket_mb", "find_unused_parameters", "gradient_as_bucket_view",
                       "compress", "timeline"})

STAGES: Dict[str, Stage] = {s.name: s for s in [
    Stage("torch", lambda module, **kw: nn.parallel.DistributedDataParallel(module, **kw),
          "torch.nn.parallel.DistributedDataParallel", ours=False),
    Stage("naive", NaiveDataParallel, "step 1: one all_reduce per parameter after backward"),
    Stage("flat", FlatDataParallel, "step 2: one all_reduce of every gradient, flattened, after backward"),
    Stage("bucketed", DistributedDataParallel, "step 3: buckets all-reduced while backward runs (torch's DDP)",
          takes=_BUCKETED),
    Stage("zero1", ZeroOneDataParallel, "step 4, ZeRO-1: DDP's buckets, the optimizer state sharded",
          sharded=True, takes=_BUCKETED | {"gather_cap_mb"}, bitwise_twin="torch"),
    Stage("zero2", ZeroTwoDataParallel, "step 5, ZeRO-2: one reduce_scatter after backward, gradients sharded too",
          sharded=True, takes=frozenset({"bucket_cap_mb", "gather_cap_mb", "timeline"}), bitwise_twin="torch-fsdp"),
    Stage("zero2-bucketed", ZeroTwoDataParallel,
          "step 5, ZeRO-2 in buckets reduce-scattered during backward (default: a quarter of the model each)",
          sharded=True, takes=frozenset({"bucket_cap_mb", "gather_cap_mb", "timeline"}),
          defaults=lambda module: {"bucket_cap_mb": quarter_of_the_model_mb(module)}),
    Stage("fsdp", FullyShardedDataParallel, "step 6, ZeRO-3/FSDP: parameters sharded too, gathered unit by unit",
          sharded=True, takes=frozenset({"units", "prefetch", "timeline"}), bitwise_twin="torch-fsdp"),
    Stage("torch-fsdp", lambda module, units="children", **kw: torch_fully_shard(module, units),
          "torch's fully_shard (FSDP2) on the same units as fsdp", sharded=True, ours=False,
          takes=frozenset({"units"})),
]}

# Derived views, for argparse choices
IMPLS: List[str] = [n for n, s in STAGES.items() if not s.sharded]  # torch, naive, flat, bucketed
WRAPPERS = {n: s.build for n, s in STAGES.items() if not s.sharded and s.ours}  # ours, replicated
SHARDED: List[str] = [n for n, s in STAGES.items() if s.sharded and s.ours]  # zero1, zero2, zero2-bucketed, fsdp
SHARDED_IMPLS: List[str] = [n for n, s in STAGES.items() if s.sharded]  # ours and torch-fsdp


def wrap(model: nn.Module, impl: Union[str, type], **kwargs) -> nn.Module:
    """`model` wrapped by `impl`: a name in STAGES, or a wrapper class (tests pass broken ones).

    Args:
        model: the module to replicate or shard (on this rank's device).
        impl: a name in STAGES, or a class taking (module, **kwargs).
        kwargs: the stage's options, with torch's names (bucket_cap_mb, find_unused_parameters,
            gradient_as_bucket_view, device_ids for torch's; compress, timeline for ours; units
            for fsdp). A None value means the stage's default and is not passed on. An option the
            stage does not take is refused by name.
    """
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if not isinstance(impl, str):
        return impl(model, **kwargs)
    if impl not in STAGES:
        raise ValueError(f"no stage named {impl!r}; the stages are {', '.join(STAGES)}")
    stage = STAGES[impl]
    if impl == "torch":  # torch's DDP checks its own options
        return stage.build(model, **kwargs)
    refused = sorted(kwargs.keys() - {"group", "broadcast_buffers"} - stage.takes)
    if refused:
        takers = [n for n, s in STAGES.items() if set(refused) <= s.takes]
        raise ValueError(f"{impl} takes no {', '.join(refused)}"
                         + (f": only {', '.join(takers)} {'does' if len(takers) == 1 else 'do'}" if takers else ""))
    return stage.build(model, **{**stage.defaults(model), **kwargs})
