"""Step 4 of the teaching path: ZeRO-1, the optimizer's state sharded.

Plain data parallelism keeps on every rank a full copy of the parameters, their gradients and
the optimizer's state (SGD's momentum: one more tensor per parameter; Adam's: two). Every rank
then runs the same update on the same numbers. ZeRO-1 (Rajbhandari et al. 2020) splits the
update instead: after the gradients are averaged as in step 2 (one flat all_reduce), rank r
updates only its shard of each parameter (shard.py: rows r of every parameter) with optimizer
state for that shard alone, and an all_gather puts the updated shards back together on every
rank. The optimizer state per rank shrinks p times; the bytes sent grow by one all_gather.

    model = ZeroOneDataParallel(net)
    opt = model.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)   # state for this rank's shard
    loss.backward(); opt.step(); opt.zero_grad()

The update is elementwise, so updating each shard and gathering gives exactly the full update:
bitwise equal to torch's DDP at 2, 3 and 4 ranks (the same buckets, so the same sums;
tests/ddp/test_zero.py). Against torch's fully_shard it is bitwise at 2 ranks only: with more,
Gloo's all_reduce and its reduce_scatter add the ranks' values in different orders.
"""

from __future__ import annotations

import time
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

import collectives

from .ddp import DistributedDataParallel
from .shard import ShardLayout


class ShardedOptimizer:
    """An optimizer over one rank's shards; step() updates them and brings the parameters up to date.

    The wrapper says where the shards' gradients come from (`grad_shards`) and how the full
    parameters are rebuilt afterwards (`after_step`).
    """

    def __init__(self, model: "ZeroOneDataParallel", optimizer_cls=torch.optim.SGD, **kwargs):
        self.model = model
        self.shards: List[nn.Parameter] = model.own_shards()
        self.inner = optimizer_cls(self.shards, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)
        for s in self.shards:
            s.grad = None

    def step(self) -> None:
        for s, g in zip(self.shards, self.model.grad_shards()):
            s.grad = g
        self.inner.step()
        self.model.after_step(self.shards)

    def state_dict(self) -> dict:
        """This rank's shard of the state (a sharded checkpoint would save one per rank)."""
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def full_state_dict(self) -> dict:
        """The state gathered from every rank into whole tensors, by parameter name: what train.py
        saves (a checkpoint that does not depend on how the ranks cut the parameters). Every rank
        must call it (one all_gather per state entry)."""
        model, layout = self.model, self.model.layout
        state = self.inner.state_dict()
        per_shard = [state["state"].get(i, {}) for i in range(len(self.shards))]
        keys = sorted({k for st in per_shard for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0})
        whole = {}
        for key in keys:
            mine = layout.pack_row([st[key] if key in st else torch.zeros_like(s) for st, s in zip(per_shard, self.shards)],
                                   model.rank)
            everyone = collectives.all_gather(mine.view(1, -1), group=model.group)
            whole[key] = dict(zip(model.names, layout.gather_whole(everyone)))
        scalars = {k: v for k, v in per_shard[0].items() if k not in keys} if per_shard else {}
        return {"whole": whole, "scalars": scalars, "param_groups": state["param_groups"]}

    def load_full_state_dict(self, saved: dict) -> None:
        """The inverse of full_state_dict: each rank takes its rows of every whole tensor."""
        model, layout = self.model, self.model.layout
        state = {}
        for i, name in enumerate(model.names):
            entry = {key: layout.shard(tensors[name], i, model.rank).clone() for key, tensors in saved["whole"].items()}
            if entry:
                state[i] = {**saved["scalars"], **entry}
        self.inner.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


class ZeroOneDataParallel(DistributedDataParallel):
    def __init__(self, module: nn.Module, group: Optional[dist.ProcessGroup] = None, broadcast_buffers: bool = True,
                 gather_cap_mb: float = 25, **ddp_options):
        """gather_cap_mb: the after-step all_gather goes in groups of parameters of at most this
        many MiB (one group if a parameter is larger), so its landing buffer stays that small
        instead of a whole model's worth (benchmarks/sharded.py measured 1.25x DDP's memory with
        one all_gather of everything). Other options are DDP's (ddp.py)."""
        super().__init__(module, group=group, broadcast_buffers=broadcast_buffers, **ddp_options)
        self.rank = dist.get_rank(group)
        self.layout = ShardLayout(self.params, self.world_size)
        # Consecutive parameters, a group closed *before* it would pass the cap. (bucket.assign_buckets,
        # which closes a bucket once it reaches its cap, measured 1.003x DDP's peak here against 0.976x.)
        self.gather_groups, group_now, size = [], [], 0
        for i, p in enumerate(self.params):
            nbytes = p.numel() * p.element_size()
            if group_now and size + nbytes > gather_cap_mb * (1 << 20):
                self.gather_groups.append(group_now)
                group_now, size = [], 0
            group_now.append(i)
            size += nbytes
        if group_now:
            self.gather_groups.append(group_now)
        self.gather_layouts = [ShardLayout([self.params[i] for i in g], self.world_size) for g in self.gather_groups]

    def optimizer(self, optimizer_cls=torch.optim.SGD, **kwargs) -> ShardedOptimizer:
        return ShardedOptimizer(self, optimizer_cls, **kwargs)

    def own_shards(self) -> List[nn.Parameter]:
        """This rank's rows of every parameter, as leaf tensors the optimizer updates in place:
        views of the full parameters (no copy), so the step writes straight into them."""
        return [nn.Parameter(self.layout.shard(p.detach(), i, self.rank)) for i, p in enumerate(self.params)]

    def grad_shards(self) -> List[Optional[torch.Tensor]]:
        """After DDP's all_reduce every rank has the whole averaged gradient: take its rows."""
        return [None if p.grad is None else self.layout.shard(p.grad, i, self.rank) for i, p in enumerate(self.params)]

    def after_step(self, shards: List[nn.Parameter]) -> None:
        """All-gather the updated shards into every rank's full parameters, group by group."""
        start = time.perf_counter()
        for members, layout in zip(self.gather_groups, self.gather_layouts):
            mine = layout.pack_row([shards[i].detach() for i in members], self.rank)  # (per_rank,)
            everyone = collectives.all_gather(mine.view(1, -1), group=self.group)  # (world_size, per_rank)
            # this rank's rows were updated in place (the shards are views of the parameters)
            layout.unpack_into(everyone, [self.params[i].data for i in members], skip_rank=self.rank)
            del mine, everyone
        self._recorder.span("all_gather (after the step)", "parameters", start, time.perf_counter())

    def full_model_state(self) -> dict:
        """The module's state_dict with every parameter whole (here they are; FSDP gathers them)."""
        return self.module.state_dict()

    def load_full_model_state(self, state: dict) -> None:
        self.module.load_state_dict(state)

    def layout_text(self, rank: Optional[int] = None) -> str:
        return self.layout.describe(self.names, rank)
