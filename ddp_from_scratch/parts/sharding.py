"""What every sharded stage (ZeRO-1, ZeRO-2, FSDP) shares: how parameters are cut into per-rank
shards, the optimizer that updates a rank's shards, and the all-gather that puts the updated
shards back together after the step.

Words used in the sharded stages:
- shard: rank r's rows of one parameter (dim 0 cut into world_size chunks of ceil(rows /
  world_size) rows, as torch's FSDP2 cuts it; the last chunks may be shorter, or empty).
- shard layout (ShardLayout): where each rank's shard of each parameter sits in a flat buffer.
- unit: the parameters reduce-scattered together (ZeRO-2: the whole model, or runs of at most
  bucket_cap_mb; FSDP: a module's parameters, also all-gathered together before its forward).
- gather group: the parameters all-gathered together after the step (ZeRO-1 and ZeRO-2: runs
  of at most gather_cap_mb). FSDP gathers by unit before each forward instead.

A parameter of 10 rows on 4 ranks:

    rank 0: rows 0-2   rank 1: rows 3-5   rank 2: rows 6-8   rank 3: row 9 (and 2 rows of padding)

Gradients are reduce-scattered as one flat buffer laid out as FSDP2's chunk_cat lays it out:
row r of the buffer (the part that ends on rank r) is chunk r of every parameter, each padded to
its full chunk size, one after another. The layout matters beyond 2 ranks: Gloo reduces an
element in an order that depends on where it sits in the buffer, so only FSDP2's own layout
gives FSDP2's bits.

    layout = ShardLayout(params, world_size)
    flat = layout.pack([p.grad for p in params])       # (world_size, per_rank) in chunk_cat order
    mine = layout.unpack(flat[rank], rank)             # this rank's shard of each parameter
    print(layout.describe(names))

A sharded stage is a data-parallel wrapper that also inherits ShardedStage, which gives it
`optimizer()` (a ShardedOptimizer over this rank's shards), the all-gather after the step, and
the whole-model checkpoint methods; the stage says where the shards' gradients come from
(`grad_shards`). docs/extending.md shows a new stage step by step.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

import collectives

from .bucket import runs_of_at_most

# Options of the bucketed DDP (ddp.py) that mean nothing to a stage that reduce-scatters: refused by name.
DDP_ONLY_OPTIONS = ("compress", "gradient_as_bucket_view", "find_unused_parameters", "first_bucket_mb")


def refuse_ddp_options(stage: str, options: Dict) -> None:
    """A ValueError naming the DDP-only options passed to a stage that has no use for them (they
    would otherwise be dropped silently), or a TypeError for a name no wrapper knows."""
    ddp_only = sorted(k for k in options if k in DDP_ONLY_OPTIONS)
    if ddp_only:
        raise ValueError(f"{stage} takes no {', '.join(ddp_only)}: {'it is an option' if len(ddp_only) == 1 else 'they are options'} "
                         "of the bucketed all_reduce (DistributedDataParallel, ZeroOneDataParallel); "
                         f"{stage} reduce-scatters its gradients instead")
    if options:
        raise TypeError(f"{stage} got unexpected options {sorted(options)}")


class ShardLayout:
    """Where each parameter's shard of each rank sits, and the flat reduce-scatter layout."""

    def __init__(self, params: Sequence[torch.Tensor], world_size: int):
        dtypes = sorted({str(p.dtype) for p in params})
        if len(dtypes) > 1:  # one flat buffer per layout: a second dtype would be cast silently
            raise ValueError(f"ShardLayout: the parameters mix dtypes {dtypes}; one flat buffer holds one dtype "
                             "(cast the model to one dtype first)")
        self.world_size = world_size
        self.shapes = [tuple(p.shape) for p in params]
        self.rows = [s[0] if s else 1 for s in self.shapes]
        self.row_numel = [max(1, p.numel() // r) if r else 0 for p, r in zip(params, self.rows)]
        self.chunk_rows = [-(-r // world_size) for r in self.rows]  # ceil
        self.chunk_numel = [c * n for c, n in zip(self.chunk_rows, self.row_numel)]
        self.offsets, total = [], 0  # where each parameter's chunk starts within a rank's row
        for numel in self.chunk_numel:
            self.offsets.append(total)
            total += numel
        self.per_rank = total  # elements of one rank's row of the flat buffer

    def rows_of(self, i: int, rank: int) -> slice:
        """The rows of parameter i that rank owns (possibly empty)."""
        start = min(rank * self.chunk_rows[i], self.rows[i])
        return slice(start, min(start + self.chunk_rows[i], self.rows[i]))

    def shard(self, param: torch.Tensor, i: int, rank: int) -> torch.Tensor:
        """Rank's rows of parameter i (a view; 0-d parameters count as one row)."""
        return param.reshape(self.rows[i], -1)[self.rows_of(i, rank)]

    def pack(self, tensors: Sequence[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(world_size, per_rank) in chunk_cat order: row r = chunk r of every tensor, padded."""
        out = tensors[0].new_empty(self.world_size, self.per_rank) if out is None else out
        for i, t in enumerate(tensors):
            self.pack_one(t, i, out)
        return out

    def pack_one(self, tensor: torch.Tensor, i: int, out: torch.Tensor) -> None:
        """Put parameter i's tensor in its place in a (world_size, per_rank) buffer (pack, one at a
        time), padding zeroed: `out` may come from new_empty (zeroing all of it costs page faults)."""
        rows = tensor.reshape(self.rows[i], -1)
        start, end = self.offsets[i], self.offsets[i] + self.chunk_numel[i]
        for r in range(self.world_size):
            part = rows[self.rows_of(i, r)].reshape(-1)
            out[r, start:start + part.numel()] = part
            out[r, start + part.numel():end] = 0

    def pack_row(self, shards: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
        """One rank's row (per_rank,) from its own shards: what it contributes to an all_gather."""
        row = shards[0].new_zeros(self.per_rank)
        for i, s in enumerate(shards):
            row[self.offsets[i]:self.offsets[i] + s.numel()] = s.reshape(-1)
        return row

    def unpack(self, row: torch.Tensor, rank: int) -> List[torch.Tensor]:
        """Rank's shard of every parameter out of its row of the flat buffer (views, padding dropped)."""
        out = []
        for i in range(len(self.shapes)):
            n = (self.rows_of(i, rank).stop - self.rows_of(i, rank).start) * self.row_numel[i]
            out.append(row[self.offsets[i]:self.offsets[i] + n].view(-1, self.row_numel[i]))
        return out

    def unpack_into(self, everyone: torch.Tensor, fulls: Sequence[torch.Tensor], skip_rank: Optional[int] = None) -> None:
        """Every rank's rows, from an all_gather's (world_size, per_rank) output, into the whole
        tensors `fulls` (one per parameter); skip_rank's rows are left as they are."""
        for r in range(self.world_size):
            if r != skip_rank:
                for i, piece in enumerate(self.unpack(everyone[r], r)):
                    self.shard(fulls[i], i, r).copy_(piece)

    def gather_whole(self, everyone: torch.Tensor) -> List[torch.Tensor]:
        """New whole tensors, one per parameter, from an all_gather's (world_size, per_rank) output."""
        fulls = [everyone.new_empty(shape) for shape in self.shapes]
        self.unpack_into(everyone, fulls)
        return fulls

    def describe(self, names: Sequence[str], rank: Optional[int] = None) -> str:
        """One line per parameter: its shape and the rows each rank owns (or only `rank`'s)."""
        lines = [f"{self.world_size} ranks, {self.per_rank} elements per rank in the flat reduce-scatter buffer "
                 f"({self.per_rank * self.world_size - sum(r * n for r, n in zip(self.rows, self.row_numel))} of "
                 "them padding)"]
        for i, name in enumerate(names):
            ranks = range(self.world_size) if rank is None else [rank]
            owned = ", ".join(f"r{r}: {self.rows_of(i, r).start}-{self.rows_of(i, r).stop - 1}"
                              if self.rows_of(i, r).stop > self.rows_of(i, r).start else f"r{r}: -" for r in ranks)
            lines.append(f"  {name:<40s} {str(self.shapes[i]):<18s} rows {owned}")
        return "\n".join(lines)


class ShardedOptimizer:
    """An optimizer over one rank's shards; step() updates them and brings the parameters up to date.

    The stage says where the shards' gradients come from (`grad_shards`) and how the full
    parameters are rebuilt afterwards (`after_step`).
    """

    def __init__(self, model: "ShardedStage", optimizer_cls=torch.optim.SGD, **kwargs):
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
        model, layout = self.model, self.model.shard_layout
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
        model, layout = self.model, self.model.shard_layout
        state = {}
        for i, name in enumerate(model.names):
            entry = {key: layout.shard(tensors[name], i, model.rank).clone() for key, tensors in saved["whole"].items()}
            if entry:
                state[i] = {**saved["scalars"], **entry}
        self.inner.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


class ShardedStage:
    """What a sharded stage adds to the data-parallel wrapper it is built on (a mixin: list it
    first among the bases). The stage's __init__ calls `_shard(gather_cap_mb)` once the wrapper
    is built, and defines `grad_shards()`; the rest is here:

    - optimizer(cls, **kwargs): a ShardedOptimizer over this rank's shards;
    - own_shards(): the shards, as views of the full parameters (FSDP keeps copies instead);
    - after_step(shards): all-gather the updated shards into every rank's full parameters, in
      gather groups of at most gather_cap_mb, built at the first step (FSDP never needs them);
    - full_model_state() / load_full_model_state(): the whole model for checkpoints;
    - shard_layout_text(rank): which rows of which parameter each rank owns.
    """

    def _shard(self, gather_cap_mb: float = 25) -> None:
        """gather_cap_mb: the after-step all_gather goes in groups of parameters of at most this
        many MiB (one group if a parameter is larger), so its landing buffer stays that small
        instead of a whole model's worth (benchmarks/sharded.py measured 1.25x DDP's memory with
        one all_gather of everything)."""
        self.rank = dist.get_rank(self.group)
        self.shard_layout = ShardLayout(self.params, self.world_size)
        self.gather_cap_mb = gather_cap_mb
        self._gather_plan: Optional[list] = None  # [(parameter indices, their ShardLayout)], built at the first step

    def optimizer(self, optimizer_cls=torch.optim.SGD, **kwargs) -> ShardedOptimizer:
        return ShardedOptimizer(self, optimizer_cls, **kwargs)

    def own_shards(self) -> List[nn.Parameter]:
        """This rank's rows of every parameter, as leaf tensors the optimizer updates in place:
        views of the full parameters (no copy), so the step writes straight into them."""
        return [nn.Parameter(self.shard_layout.shard(p.detach(), i, self.rank)) for i, p in enumerate(self.params)]

    def grad_shards(self) -> List[Optional[torch.Tensor]]:  # pragma: no cover - each stage says
        """This rank's shard of each parameter's averaged gradient (None: no gradient)."""
        raise NotImplementedError

    def after_step(self, shards: List[nn.Parameter]) -> None:
        """All-gather the updated shards into every rank's full parameters, group by group.
        (Consecutive parameters, a group closed *before* it would pass the cap: closing once it
        reaches the cap, as DDP's buckets do, measured 1.003x DDP's peak memory against 0.976x.)"""
        if self._gather_plan is None:
            runs = runs_of_at_most([p.numel() * p.element_size() for p in self.params], self.gather_cap_mb * (1 << 20))
            self._gather_plan = [(run, ShardLayout([self.params[i] for i in run], self.world_size)) for run in runs]
        start = time.perf_counter()
        for members, layout in self._gather_plan:
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

    def shard_layout_text(self, rank: Optional[int] = None) -> str:
        """Which rows of which parameter each rank owns (or only `rank`)."""
        return self.shard_layout.describe(self.names, rank)
