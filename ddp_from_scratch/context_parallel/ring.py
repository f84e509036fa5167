"""Ring attention from send and recv: each rank keeps its queries and passes its keys and values
around the ring; each step attends to the block it holds and merges the result into its running
output by the online softmax (merge.py). The backward passes the keys and values around again,
and their gradients with them, one step behind.

    out = ring_attention(q, k, v, group, causal=True, balanced=True)   # (batch, heads, seq / N, head_dim)
    out.backward(dout)                                                  # q, k, v get this rank's gradients

q, k and v are this rank's tokens (layout.py: contiguous, or head-tail with balanced=True). At
step i rank r holds the keys and values of rank (r - i) mod N, and sends them on to rank r + 1
while it computes (a batched isend/irecv; overlap=False sends after computing instead, to measure
what the overlap hides). What each step computes (`plan`):

    not causal                    every query against every key of the block
    causal, step 0                its own block, with the causal mask
    causal, contiguous            a block from an earlier rank: all of it; from a later one: nothing
    causal, head-tail, step <= r  every query against the block's head piece (the block's tail
                                  piece comes after all of this rank's queries)
    causal, head-tail, step > r   the tail query piece against the whole block

Each block is one call of the CPU flash-attention kernel (aten._scaled_dot_product_flash_attention_for_cpu,
the kernel F.scaled_dot_product_attention runs on CPU), which returns the log-sum-exp the merge
needs. The backward calls its backward kernel per block with the merged output and log-sum-exp.
The query gradient accumulates on its rank in float32; each key and value gradient travels with
its block and collects every rank's contribution, in ring order from its owner, and arrives home
after the last step. These are torch's ring's steps, kernel calls and additions, in its order
(torch.distributed.tensor.experimental._context_parallel._attention._templated_ring_attention
and its backward), so the two agree bit for bit (tests/context_parallel).
"""

from __future__ import annotations

import dataclasses
import time
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .merge import merge

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
SEQ = 2  # the sequence dimension of (batch, heads, seq, head_dim)


@dataclasses.dataclass(frozen=True)
class Block:
    """What one step computes: which queries, which of the block's keys, with the causal mask or not."""

    queries: str  # "all" or "tail" (the second of this rank's two pieces)
    keys: str  # "all" or "head" (the first of the block's two pieces)
    causal: bool


def plan(rank: int, size: int, step: int, causal: bool, balanced: bool) -> Optional[Block]:
    """The block rank `rank` computes at `step` (holding rank (rank - step) mod size's keys), or None."""
    if not causal:
        return Block("all", "all", False)
    if step == 0:
        return Block("all", "all", True)
    if not balanced:
        return Block("all", "all", False) if (rank - step) % size < rank else None
    return Block("all", "head", False) if step <= rank else Block("tail", "all", False)


class Ring:
    """Sends to the next rank and receives from the previous one, a batched isend/irecv a step."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        whole = group if group is not None else dist.group.WORLD
        self.next = dist.get_global_rank(whole, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(whole, (self.rank - 1) % self.size)
        self.waited = 0.0  # seconds spent waiting for messages

    def start(self, buffer: torch.Tensor):
        """Post the send of `buffer` to the next rank and the receive of the previous rank's."""
        if self.size == 1:
            return buffer, []
        incoming = torch.empty_like(buffer)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, buffer, self.next, group=self.group),
                                        dist.P2POp(dist.irecv, incoming, self.prev, group=self.group)])
        return incoming, works

    def finish(self, posted) -> torch.Tensor:
        incoming, works = posted
        begin = time.perf_counter()
        for work in works:
            work.wait()
        self.waited += time.perf_counter() - begin
        return incoming


def _pieces(t: torch.Tensor, which: str) -> torch.Tensor:
    return t if which == "all" else t.chunk(2, dim=SEQ)[0 if which == "head" else 1]


def _add_into(whole: torch.Tensor, part: torch.Tensor, index: int) -> torch.Tensor:
    """whole with `part` added to its piece `index` (of 2 along the sequence)."""
    pieces = list(whole.chunk(2, dim=SEQ))
    pieces[index] += part
    return torch.cat(pieces, dim=SEQ)


def ring_forward(q, k, v, group, causal: bool, balanced: bool, overlap: bool = True,
                 steps: Optional[List[dict]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of this rank's queries over every rank's keys. `steps`: a list to which each step's
    compute and wait seconds are appended (the benchmark's)."""
    if balanced and not causal:
        raise ValueError("ring attention: the head-tail layout balances a causal mask; without one, use balanced=False")
    ring = Ring(group)
    k, v = k.contiguous(), v.contiguous()
    out = lse = None
    posted = None
    for i in range(ring.size):
        waited, wait_start = ring.waited, time.perf_counter()
        if i > 0:
            kv = ring.finish(posted)
            k, v = kv[:k.numel()].view(k.shape), kv[k.numel():].view(v.shape)
        if i < ring.size - 1 and overlap:
            posted = ring.start(torch.cat([k.flatten(), v.flatten()]))
        begin = time.perf_counter()
        block = plan(ring.rank, ring.size, i, causal, balanced)
        if block is not None:
            block_out, block_lse = FLASH(_pieces(q, block.queries), _pieces(k, block.keys), _pieces(v, block.keys),
                                         dropout_p=0.0, is_causal=block.causal)[:2]
            block_lse = block_lse.unsqueeze(-1)
            if out is None:
                out, lse = block_out, block_lse
            elif block.queries == "tail":  # only the tail piece's running result changes
                tail_out, tail_lse = merge(out.chunk(2, dim=SEQ)[1], lse.chunk(2, dim=SEQ)[1], block_out, block_lse)
                out = torch.cat([out.chunk(2, dim=SEQ)[0], tail_out], dim=SEQ)
                lse = torch.cat([lse.chunk(2, dim=SEQ)[0], tail_lse], dim=SEQ)
            else:
                out, lse = merge(out, lse, block_out, block_lse)
        computed = time.perf_counter() - begin
        if i < ring.size - 1 and not overlap:
            posted = ring.start(torch.cat([k.flatten(), v.flatten()]))
        if steps is not None:  # times on the machine's monotonic clock, the same in every process
            steps.append({"step": i, "compute_s": computed, "wait_s": ring.waited - waited,
                          "wait_start": wait_start, "compute_start": begin, "computed": block is not None})
    return out, lse.squeeze(-1)


def ring_backward(dout, q, k, v, out, lse, group, causal: bool, balanced: bool):
    """(dq, dk, dv) of this rank's q, k, v."""
    ring = Ring(group)
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk = torch.zeros_like(k, dtype=torch.float32)
    dv = torch.zeros_like(v, dtype=torch.float32)
    k, v = k.contiguous(), v.contiguous()
    posted_kv = posted_grads = None
    for i in range(ring.size):
        if i > 0:
            kv = ring.finish(posted_kv)
            k, v = kv[:k.numel()].view(k.shape), kv[k.numel():].view(v.shape)
        if i != ring.size - 1:
            posted_kv = ring.start(torch.cat([k.flatten(), v.flatten()]))
        block = plan(ring.rank, ring.size, i, causal, balanced)
        if block is not None:
            tail = block.queries == "tail"
            gq, gk, gv = FLASH_BACKWARD(
                _pieces(dout, block.queries), _pieces(q, block.queries), _pieces(k, block.keys), _pieces(v, block.keys),
                _pieces(out, block.queries), lse.chunk(2, dim=SEQ)[1].contiguous() if tail else lse, 0.0, block.causal)
        else:
            gq, gk, gv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
        if i == 0:
            dk += gk
            dv += gv
        else:  # the block's gradients so far, from the ranks before this one, plus this rank's
            grads = ring.finish(posted_grads)
            dk, dv = grads[:dk.numel()].view(dk.shape), grads[dk.numel():].view(dv.shape)
            if balanced and i <= ring.rank:
                dk, dv = _add_into(dk, gk, 0), _add_into(dv, gv, 0)
            else:
                dk += gk
                dv += gv
        posted_grads = ring.start(torch.cat([dk.flatten(), dv.flatten()]))
        if i <= ring.rank or not balanced:
            dq += gq
        else:
            dq = _add_into(dq, gq, 1)
    grads = ring.finish(posted_grads).to(k.dtype)  # this rank's own block's, home after the last step
    return dq.to(q.dtype), grads[:dk.numel()].view(dk.shape), grads[dk.numel():].view(dv.shape)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, balanced, overlap):
        out, lse = ring_forward(q, k, v, group, causal, balanced, overlap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.balanced = group, causal, balanced
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.group, ctx.causal, ctx.balanced)
        return dq, dk, dv, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, causal: bool = True,
                   balanced: bool = False, overlap: bool = True) -> torch.Tensor:
    """Attention of this rank's queries over every rank's keys and values, with gradients.

    Args:
        q, k, v: (batch, heads, this rank's tokens, head_dim), float32, laid out by layout.shard.
        group: the context-parallel group (default: the world).
        causal: each token attends to the tokens before it in the whole sequence.
        balanced: the tokens are in the head-tail layout (causal only).
        overlap: send the next block while computing this one.
    """
    return _RingAttention.apply(q, k, v, group, causal, balanced, overlap)
