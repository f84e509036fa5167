"""Step 6 of the teaching path: ZeRO-3, also called fully sharded data parallelism (FSDP).

ZeRO-2 still keeps every parameter whole on every rank. Here a rank keeps only its shard of each
parameter, and the model is cut into units (by default: each child module that has parameters,
and the rest as the root unit). A unit's parameters are all-gathered just before its forward
and freed just after; gathered again just before its backward, and freed again once its
gradients are reduce-scattered (ZeRO-2's step, now per unit, as each unit's backward
ends; the unit is freed as soon as its last gradient has arrived, before its reduce-scatter).
At any moment a rank holds its shards plus about one unit whole:

    forward:  gather u0, run u0, free u0 | gather u1, run u1, free u1 | ...
    backward: ... | gather u1, grads u1, reduce-scatter u1, free u1 | gather u0, grads u0, ...

    model = FullyShardedDataParallel(net)        # units="children", "blocks", "model" or module names
    opt = model.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)
    print(model.shard_layout_text())                       # which rows of which parameter each rank owns

Freeing is `param.data = <an empty tensor>`: autograd keeps the parameter object for backward,
and reads its .data only when the backward runs, by which time it has been gathered again (a
hook on the unit's output fires when the gradient reaches it, just before the unit's backward).
Bitwise equal to torch's fully_shard applied to the same units (tests/ddp/test_zero.py): the
same shards, the same reduce-scatter layout and op.

Built on ZeRO-2 (zero2.py), which reduce-scatters unit by unit: this file gives it the units
(by module, `unit_plan`), keeps only the shards between uses (copies, so freeing the whole
parameters frees their memory), and gathers each unit before its forward and its backward.
Nothing is gathered after the step: the next forward gathers each unit afresh.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

import collectives

from ..parts.sharding import refuse_ddp_options
from ..parts.unused import tensors_in
from .zero2 import ZeroTwoDataParallel


def unit_module_names(module: nn.Module, units="children") -> List[str]:
    """The modules that are units, by name: "children" (each direct child with parameters),
    "blocks" (one level deeper inside children that only hold other modules, as ResNet's
    layer1..layer4 hold their blocks), "model" (none: the root is the one unit), or a list of
    names. Parameters no listed module holds form the root's unit."""
    if isinstance(units, (list, tuple)):
        return list(units)
    if units == "model":
        return []
    if units not in ("children", "blocks"):
        raise ValueError(f"units must be 'children', 'blocks', 'model' or a list of module names, got {units!r}")
    out = []
    for name, child in module.named_children():
        if not any(p.requires_grad for p in child.parameters()):
            continue
        inner = [(n, m) for n, m in child.named_children() if any(p.requires_grad for p in m.parameters())]
        if units == "blocks" and inner and not any(True for _ in child.parameters(recurse=False)):
            out += [f"{name}.{n}" for n, _ in inner]
        else:
            out.append(name)
    return out


def unit_plan(module: nn.Module, units="children") -> List[Tuple[str, List[str]]]:
    """(module name, its parameter names) per unit, in the modules' order, the root's ("") last.
    A parameter belongs to the innermost listed module holding it, as with nested fully_shard."""
    listed = unit_module_names(module, units)
    known = dict(module.named_modules())
    missing = [m for m in listed if m not in known]
    if missing:
        raise ValueError(f"no module named {missing} in {type(module).__name__}")
    owner = {}
    for n, p in module.named_parameters():
        if p.requires_grad:
            holders = [m for m in listed if n.startswith(m + ".")]
            owner[n] = max(holders, key=len) if holders else ""
    order = [m for m in known if m in listed] + [""]
    plan = [(m, [n for n, o in owner.items() if o == m]) for m in order]
    return [(m, names) for m, names in plan if names]


def units_of(module: nn.Module, units="children") -> List[List[str]]:
    """Parameter names per unit (unit_plan without the module names)."""
    return [names for _, names in unit_plan(module, units)]


class FullyShardedDataParallel(ZeroTwoDataParallel):
    def __init__(self, module: nn.Module, group: Optional[dist.ProcessGroup] = None, units: str = "children",
                 broadcast_buffers: bool = False, timeline: bool = True, prefetch: bool = True, **ddp_options):
        """prefetch: in backward, start the next unit's all_gather while this one's backward runs
        (FSDP2's default too), for one more unit held. Measured on ResNet-50 here it changes
        little (0.96x against 0.98x fully_shard's step at 2 ranks, 1.02x against 1.01x at 4); the
        async reduce-scatter (zero2.py) is what took the step from 1.11x to about 1.0x
        (benchmarks/sharded.py measures both, with and without)."""
        refuse_ddp_options(type(self).__name__, ddp_options)
        plan = unit_plan(module, units)
        super().__init__(module, group=group, broadcast_buffers=broadcast_buffers, timeline=timeline,
                         unit_params=[names for _, names in plan])
        self.unit_names = [name for name, _ in plan]  # the units' modules; "" is the root's own parameters
        self.shards = [nn.Parameter(self.shard_layout.shard(p.detach(), i, self.rank).clone())
                       for i, p in enumerate(self.params)]  # this rank's rows: the only copy it keeps
        self._empty = [p.data.new_empty(0) for p in self.params]
        self._gathered = [False] * len(self.units)
        self._prefetching: Dict[int, tuple] = {}  # unit -> (all_gather work, start) started ahead
        self._forward_order: List[int] = []
        self.prefetch = prefetch
        for u in range(len(self.units)):
            self._free(u)
        for u, mod in self._unit_modules(module).items():
            mod.register_forward_pre_hook(lambda m, args, u=u: self._gather(u, "forward"))
            mod.register_forward_hook(lambda m, args, out, u=u: self._after_forward(u, m, out))

    def _after_forward(self, u: int, mod: nn.Module, output) -> None:
        """Free the unit, and have its parameters gathered again when the gradient of its output
        arrives, i.e. just before its backward. (A hook on the output tensor, not a module
        backward hook: those break on ResNet's in-place ReLU after a BatchNorm.)"""
        for t in tensors_in(output):
            if t.requires_grad:
                t.register_hook(lambda grad, u=u: (self._gather(u, "backward"), grad)[1])
        if mod is not self.module:  # the root stays gathered: its backward comes right after its forward
            self._free(u)

    def _unit_modules(self, module: nn.Module) -> Dict[int, nn.Module]:
        """The module whose forward and backward bracket each unit: its own, or the root."""
        return {u: module.get_submodule(name) if name else module for u, name in enumerate(self.unit_names)}

    # -- parameters: gathered for a unit's forward and backward, freed between ---------------
    def _gather(self, u: int, why: str = "") -> None:
        """Make unit u whole: land its prefetched all_gather, or all-gather it now. In forward,
        note the order; in backward, start the all_gather of the unit whose backward comes next
        (the one before u in forward order) so it travels while u's backward computes, as FSDP2's
        backward prefetch does."""
        if why == "forward":
            self._forward_order.append(u)
        if not self._gathered[u]:
            work, start = self._prefetching.pop(u, None) or self._start_gather(u)
            self._land(u, work.wait(), start, why)
        if why == "backward" and self.prefetch:
            order = self._forward_order
            k = len(order) - 1 - order[::-1].index(u) if u in order else 0
            nxt = order[k - 1] if k > 0 else None
            if nxt is not None and not self._gathered[nxt] and nxt not in self._prefetching:
                self._prefetching[nxt] = self._start_gather(nxt)

    def bytes_in_flight(self) -> int:
        """As ZeRO-2's, plus each prefetched all_gather's row and landing buffer (world_size rows)."""
        rows = sum(self.unit_layouts[u].per_rank * (self.world_size + 1) * self.shards[0].element_size()
                   for u in self._prefetching)
        return super().bytes_in_flight() + rows

    def _start_gather(self, u: int):
        unit, layout = self.units[u], self.unit_layouts[u]
        mine = layout.pack_row([self.shards[i].detach() for i in unit], self.rank)
        work = collectives.all_gather(mine.view(1, -1), group=self.group, async_op=True)  # (world_size, per_rank)
        return work, time.perf_counter()

    def _land(self, u: int, everyone: torch.Tensor, start: float, why: str) -> None:
        for i, full in zip(self.units[u], self.unit_layouts[u].gather_whole(everyone)):
            self.params[i].data = full
        self._gathered[u] = True
        self._recorder.span(f"all_gather unit {u} ({why})", f"unit {u}", start, time.perf_counter())

    def forward(self, *args, **kwargs):
        self._forward_order = []
        return super().forward(*args, **kwargs)

    def _check_every_unit_sent(self) -> None:
        for u in list(self._prefetching):  # prefetched for a backward that did not come: drop it
            work, _ = self._prefetching.pop(u)
            work.wait()
        super()._check_every_unit_sent()

    def _free(self, u: int) -> None:
        for i in self.units[u]:
            self.params[i].data = self._empty[i]
        self._gathered[u] = False

    # -- gradients: reduce-scattered per unit (zero2.py), then the unit is freed ---------------
    def _reduce_scatter(self, u: int) -> None:
        # Every gradient of the unit has arrived, so its whole parameters are no longer needed:
        # free them before the reduce-scatter, as FSDP2 does (freed after it, ResNet-50's peak on 2
        # ranks measured 232.5 MiB against 203.9, benchmarks/sharded.py).
        self._free(u)
        super()._reduce_scatter(u)

    # -- the optimizer updates the shards; the next forward gathers them ---------------------
    def own_shards(self) -> List[nn.Parameter]:
        """Copies, not views: the full parameters are freed, and a view would keep them alive."""
        return self.shards

    def after_step(self, shards) -> None:
        pass  # nothing to rebuild: every unit is gathered afresh before its next forward

    def full_model_state(self) -> Dict[str, torch.Tensor]:
        """The module's state_dict with every parameter gathered whole (buffers are not sharded)."""
        return {**self.module.state_dict(), **self.full_state()}

    def load_full_model_state(self, state: Dict[str, torch.Tensor]) -> None:
        """Each rank keeps its rows of each saved parameter; buffers are loaded as they are."""
        with torch.no_grad():
            for i, (name, shard) in enumerate(zip(self.names, self.shards)):
                shard.copy_(self.shard_layout.shard(state[name].to(shard.device), i, self.rank))
        buffers = {n for n, _ in self.module.named_buffers()}
        self.module.load_state_dict({k: v for k, v in state.items() if k in buffers}, strict=False)

    def full_state(self) -> Dict[str, torch.Tensor]:
        """Every parameter whole (an all_gather of every unit): for checkpoints and comparisons."""
        for u in range(len(self.units)):
            self._gather(u)
        state = {n: p.detach().clone() for n, p in zip(self.names, self.params)}
        for u in range(len(self.units)):
            self._free(u)
        return state
