"""Prove the sharded steps (ZeRO-1, ZeRO-2, FSDP) against torch's fully_shard and torch's DDP.

    python -m ddp_from_scratch.compare --impl zero1 zero2 fsdp --world-sizes 2 3 4 --no-options --show-layout

compare.py's program runs these; this module holds the side-by-side training, which pairs are
bitwise by construction (must_be_bitwise, SHARDED_NOTE says why) and the shard layout printout.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..parts.step_check import StepCheck, count_nonfinite, relative_diff, same_bits
from ..steps.fsdp import unit_plan
from ..workload.models import MODELS, batch
from ..parts.sharding import ShardLayout
from ..wrap import SHARDED, STAGES, torch_fully_shard, wrap


def _gather_dim0(p) -> torch.Tensor:
    """A fully_shard parameter (a DTensor sharded on dim 0, as torch.chunk cuts it) whole, gathered
    with one all_gather_into_tensor of padded rows. Not DTensor.full_tensor(): its functional
    all_gather dies from SIGSEGV on Gloo with CUDA tensors (torch 2.11, seen on an H100)."""
    local = p.to_local().detach()
    group = p.device_mesh.get_group()
    n = dist.get_world_size(group)
    rows = -(-p.shape[0] // n)  # the first ranks' chunk; later ones may be shorter or empty
    padded = local.new_zeros((rows, *p.shape[1:]))
    padded[: local.shape[0]] = local
    whole = local.new_empty((rows * n, *p.shape[1:]))
    dist.all_gather_into_tensor(whole, padded, group=group)
    return whole[: p.shape[0]]


def _full_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter whole: DTensors gathered (fully_shard), our FSDP's units gathered."""
    if hasattr(model, "full_state"):
        return model.full_state()
    inner = getattr(model, "module", model)
    return {n: (_gather_dim0(p) if hasattr(p, "to_local") else p.detach()) for n, p in inner.named_parameters()}


# The sharded stages the parity check knows by name: every sharded stage of ours in wrap.STAGES
PARITY_IMPLS = SHARDED


def _build_ours(impl, base: nn.Module, against: str, units: str) -> nn.Module:
    if not isinstance(impl, str):
        return impl(base)
    return wrap(base, impl, broadcast_buffers=against == "torch", units=units if "units" in STAGES[impl].takes else None)


def train_sharded_side_by_side(env, impl: str, steps: int, against: str = "torch-fsdp", model="small",
                               batch_size: int = 4, image: int = 12, units: str = "children",
                               lr: float = 0.05, device: Optional[torch.device] = None) -> List[StepCheck]:
    """A sharded step of ours (a name in PARITY_IMPLS, or a wrapper class) against torch's
    fully_shard or torch's DDP.

    Every rank starts from the same weights (fully_shard keeps each rank's own rows and does not
    broadcast them). Against fully_shard, buffers are not synchronised (FSDP2 leaves BatchNorm
    statistics per rank); against DDP they are broadcast from rank 0 before each forward, as
    DDP does. Compared after every step: every parameter (whole), buffer and the loss; the
    gradients are shards on both sharded sides and are not compared one by one. `device` is where
    the model and batches live (default: env.device).
    """
    device = env.device if device is None else torch.device(device)
    torch.manual_seed(100)
    base = (MODELS[model] if isinstance(model, str) else model)().to(device)
    copied = copy.deepcopy(base)
    # the units torch's side is cut into: ours for fsdp; ZeRO-1/2 reduce the whole model at once
    cut = units if isinstance(impl, str) and "units" in STAGES[impl].takes else "model"
    theirs = torch_fully_shard(copied, cut) if against == "torch-fsdp" else wrap(copied, "torch")
    ours = _build_ours(impl, base, against, units)
    opt_ours = ours.optimizer(torch.optim.SGD, lr=lr, momentum=0.9)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=lr, momentum=0.9)
    report = []
    for step in range(steps):
        x, y = (t.to(device) for t in batch(step, env.rank, batch_size, image))
        losses = []
        for m, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        p_ours, p_theirs = _full_params(ours), _full_params(theirs)
        b_ours = dict(ours.module.named_buffers())
        b_theirs = dict(getattr(theirs, "module", theirs).named_buffers())
        report.append(StepCheck(
            params=all(same_bits(p_ours[k], p_theirs[k]) for k in p_theirs),
            buffers=all(same_bits(b_ours[k], b_theirs[k]) for k in b_theirs),
            loss=same_bits(losses[0], losses[1]),
            largest_diff=max(relative_diff(p_ours[k], p_theirs[k]) for k in p_theirs),
            nonfinite_ours=count_nonfinite(p_ours.values()),
            nonfinite_theirs=count_nonfinite(p_theirs.values()),
        ))
    return report


SHARDED_HEADERS = ["stage", "against", "ranks", "steps", "bitwise equal", "must be", "largest relative param diff",
                   "first step differing", "values"]
SHARDED_NOTE = """Why some pairs are bitwise only on 2 ranks: Gloo's all_reduce and its reduce_scatter add the
ranks' values in different orders once there are more than 2 (a sum of two values has one order).
ZeRO-1 averages its gradients as DDP does (the same buckets, one all_reduce each), so it matches
torch's DDP at every world size and fully_shard only at 2. ZeRO-2 and FSDP reduce-scatter in
FSDP2's layout (each parameter's dim-0 shards, padded, concatenated as chunk_cat does; average
after the sum), so they match fully_shard cut into the same units (ZeRO-2: the whole model as
one unit; FSDP: each child with parameters, then the root) at every world size, and DDP only at 2.
ZeRO-2 in buckets (zero2-bucketed: a quarter of the model each) reduce-scatters bucket by bucket:
bitwise both at 2 ranks; beyond, it has no fully_shard twin (its buckets are not modules)."""


def must_be_bitwise(impl: str, against: str, world_size: int) -> bool:
    """Which sharded comparisons are bitwise by construction (wrap.STAGES' bitwise_twin; SHARDED_NOTE says why)."""
    return world_size <= 2 or STAGES[impl].bitwise_twin == against


def shard_layout_text(model: str, world_size: int, units: str = "children") -> str:
    """Which rows of which parameter each rank owns, unit by unit (no ranks needed: it is arithmetic)."""
    net = MODELS[model]()
    params = dict(net.named_parameters())
    parts = []
    for u, (module_name, names) in enumerate(unit_plan(net, units)):
        layout = ShardLayout([params[n] for n in names], world_size)
        parts.append(f"unit {u} ({module_name or 'the root'}): " + layout.describe(names))
    return "\n".join(parts)
