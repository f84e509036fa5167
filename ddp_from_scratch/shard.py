"""How the sharded steps (ZeRO, FSDP) cut parameters into per-rank shards, as torch's FSDP2 does.

Each parameter is cut along dim 0 into world_size chunks of ceil(rows / world_size) rows; rank
r owns chunk r (the last ones may be shorter, or empty). A parameter of 10 rows on 4 ranks:

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
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch


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
