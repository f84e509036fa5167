"""Proof, run on every rank: the split blocks beside torch's parallelize_module on the same weights
and data, and the split transformer trained beside the one-rank model. The tests assert on what
these return; `python -m ddp_from_scratch.compare --impl tp` prints them as a table.

    pairs = mlp_against_torch(group)                        # {name: (ours, torch's)}: equal bit for bit
    pairs = attention_against_torch(group)                  # all but "dx" bit for bit (see below)
    pairs = sequence_parallel_against_torch(group)          # LayerNorm + MLP, split along the sequence
    pairs = tp_by_dp_against_torch()                        # 4 ranks: TP x DP 2 x 2 against a 2-D DeviceMesh
    run = transformer_against_one_rank(rank, tp, dp, steps=4)   # losses and final logits of both

torch's layout for each: ColwiseParallel then RowwiseParallel on the MLP's two Linears;
ColwiseParallel on q, k and v and RowwiseParallel on the output projection; SequenceParallel on
the LayerNorm with ColwiseParallel(input_layouts=Shard(1)) and RowwiseParallel(output_layouts=
Shard(1)). Ours takes torch's bias order (bias_in_partial_sums=True: b / p inside each partial
sum) so that the sums are the same. The one exception is attention's input gradient: torch's
three ColwiseParallel layers each all-reduce their share of it and add the three sums, ours adds
the shares and all-reduces once, so it is the same numbers added in another order.

One group per process for the torch side: a second DeviceMesh over the same ranks is equal to the
first, and torch's DTensors made on it ran their collectives on the first mesh's group (torch 2.13).
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .attention import TensorParallelAttention, one_rank_attention
from .mesh import Mesh2D
from .mlp import TensorParallelMLP, one_rank_mlp
from .model import TensorParallelTransformer
from .vocab import vocab_parallel_cross_entropy
from ..workload.transformer import TinyTransformer, token_batch

B, S, H, HEADS = 3, 8, 16, 4  # the blocks' input: (batch, seq, hidden); attention's heads
Pairs = Dict[str, Tuple[torch.Tensor, torch.Tensor]]


def block_data(seed: int = 1) -> tuple:
    """(x, dy): a block's input and the gradient that flows into its output, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's: this rank's shard when sharded, the whole (reduced) tensor when replicated or partial."""
    if not hasattr(t, "placements"):
        return t
    return t.to_local() if t.placements[0].is_shard() else t.full_tensor()


def _mesh(group):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, "cpu")


def _run(label_to_module, x: torch.Tensor, dy: torch.Tensor) -> Dict[str, dict]:
    """Forward and backward of each module on copies of x; y (awaited: torch's may be an
    AsyncCollectiveTensor) and x's gradient."""
    out = {}
    for label, module in label_to_module.items():
        xi = x.clone().requires_grad_(True)
        y = module(xi)
        y = y.full_tensor() if hasattr(y, "full_tensor") else y
        y.backward(dy)
        out[label] = {"y": y.detach().clone(), "dx": xi.grad}
    return out


def mlp_against_torch(group, bias_in_partial_sums: bool = True) -> Pairs:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    theirs = parallelize_module(one_rank_mlp(H), _mesh(group), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    ours = TensorParallelMLP(one_rank_mlp(H), group, bias_in_partial_sums=bias_in_partial_sums)
    out = _run({"ours": ours, "torch": theirs}, *block_data())
    for label, (up, down) in (("ours", (ours.up, ours.down)), ("torch", (theirs[0], theirs[2]))):
        out[label].update({f"{n}.{w}.grad": _local(getattr(lin, w).grad)
                           for n, lin in (("up", up), ("down", down)) for w in ("weight", "bias")})
    return {k: (out["ours"][k], out["torch"][k]) for k in out["ours"]}


def attention_against_torch(group) -> Pairs:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    theirs = one_rank_attention(H, HEADS)
    theirs.heads = HEADS // dist.get_world_size(group)  # torch's tutorial does the same: local heads after the split
    parallelize_module(theirs, _mesh(group), {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                                              "out": RowwiseParallel()})
    ours = TensorParallelAttention(one_rank_attention(H, HEADS), group, bias_in_partial_sums=True)
    out = _run({"ours": ours, "torch": theirs}, *block_data())
    for label, attn in (("ours", ours), ("torch", theirs)):
        out[label].update({f"{n}.{w}.grad": _local(getattr(getattr(attn, n), w).grad)
                           for n in ("q", "k", "v", "out") for w in ("weight", "bias")})
    return {k: (out["ours"][k], out["torch"][k]) for k in out["ours"]}


def tp_by_dp_against_torch(backend=None) -> Pairs:
    """4 ranks as 2 x 2. Ours: the MLP block split over the mesh's TP group, the bucketed DDP over
    its DP group (on `backend`). torch's: the block parallelized over the "tp" dimension of a
    2-D DeviceMesh (Gloo), and DDP's arithmetic on each local gradient over the "dp" dimension
    (divided by the DP size, then all-reduced). Each DP index trains its own batch."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from ..steps.ddp import DistributedDataParallel

    world = dist.get_world_size()
    if world != 4:
        raise ValueError(f"the TP x DP comparison runs on 4 ranks (2 x 2), not {world}")
    mesh = Mesh2D(tp=2, backend=backend)
    grid = DeviceMesh("cpu", torch.arange(world).reshape(2, 2), mesh_dim_names=("dp", "tp"))  # rank = d x 2 + t
    theirs = parallelize_module(one_rank_mlp(H), grid["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    ours = DistributedDataParallel(TensorParallelMLP(one_rank_mlp(H), mesh.tp, bias_in_partial_sums=True),
                                   group=mesh.dp)
    out = _run({"ours": ours, "torch": theirs}, *block_data(seed=1 + mesh.dp_index))
    dp_group = grid.get_group("dp")
    for label, (up, down) in (("ours", (ours.module.up, ours.module.down)), ("torch", (theirs[0], theirs[2]))):
        for n, lin in (("up", up), ("down", down)):
            for w in ("weight", "bias"):
                grad = getattr(lin, w).grad
                if label == "torch":  # DDP's arithmetic: each gradient / DP size, summed over the DP group
                    grad = grad.to_local() / grid["dp"].size()
                    dist.all_reduce(grad, group=dp_group)
                out[label][f"{n}.{w}.grad"] = grad
    return {k: (out["ours"][k], out["torch"][k]) for k in out["ours"]}


def sp_region(seed: int = 0) -> nn.Sequential:
    """A LayerNorm and the MLP block after it: the region sequence parallelism splits along the sequence."""
    torch.manual_seed(seed)
    ln = nn.LayerNorm(H)
    with torch.no_grad():  # not the ones and zeros LayerNorm starts from: a wrong gradient shows
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-0.5, 0.5)
    return nn.Sequential(ln, nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H))


def sequence_parallel_against_torch(group) -> Pairs:
    """This rank's slice of the sequence through the LayerNorm, the all_gather, the MLP and the
    reduce_scatter; the LayerNorm's gradients all-reduced (torch keeps them Partial until asked)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    from .operators import all_reduced

    p, r = dist.get_world_size(group), dist.get_rank(group)
    theirs = parallelize_module(sp_region(), _mesh(group),
                                {"0": SequenceParallel(), "1": ColwiseParallel(input_layouts=Shard(1)),
                                 "3": RowwiseParallel(output_layouts=Shard(1))})
    full = sp_region()
    ln, mlp = full[0], TensorParallelMLP(full[1:], group, sequence_parallel=True, bias_in_partial_sums=True)
    x, dy = block_data()
    k = S // p
    x, dy = x[:, r * k:(r + 1) * k].contiguous(), dy[:, r * k:(r + 1) * k].contiguous()
    out = _run({"ours": lambda t: mlp(ln(t)), "torch": theirs}, x, dy)
    out["ours"].update({"ln.weight.grad": all_reduced(ln.weight.grad, group),
                        "ln.bias.grad": all_reduced(ln.bias.grad, group),
                        **{f"{n}.{w}.grad": getattr(getattr(mlp, n), w).grad
                           for n in ("up", "down") for w in ("weight", "bias")}})
    out["torch"].update({"ln.weight.grad": _local(theirs[0].weight.grad), "ln.bias.grad": _local(theirs[0].bias.grad),
                         **{f"{n}.{w}.grad": _local(getattr(theirs[i], w).grad)
                            for n, i in (("up", 1), ("down", 3)) for w in ("weight", "bias")}})
    return {k: (out["ours"][k], out["torch"][k]) for k in out["ours"]}


def transformer_against_one_rank(rank: int, tp: int, steps: int = 4, sequence_parallel: bool = False,
                                 vocab: int = 32, hidden: int = 16, heads: int = 4, layers: int = 2,
                                 batch: int = 4, seq: int = 8, lr: float = 0.05, backend=None) -> dict:
    """Train the split transformer (TP over `tp` ranks, the bucketed DDP over the rest, on one
    global batch of `batch` sequences a step) and, on this rank alone, the one-rank model on the
    same batches, with SGD (momentum 0.9). Returns both runs' losses (the global batch's mean) and
    the logits of a probe batch after the last step, the split model's gathered over the TP group."""
    from ..steps.ddp import DistributedDataParallel

    mesh = Mesh2D(tp=tp, backend=backend)
    dp, rows = mesh.dp_size, batch // mesh.dp_size
    mine = slice(mesh.dp_index * rows, (mesh.dp_index + 1) * rows)
    torch.manual_seed(0)
    full = TinyTransformer(vocab, hidden, heads, layers)
    torch.manual_seed(0)
    split = TensorParallelTransformer(TinyTransformer(vocab, hidden, heads, layers), mesh.tp, sequence_parallel)
    model = DistributedDataParallel(split, group=mesh.dp) if dp > 1 else split
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m in (full, model)]
    losses = {"ours": [], "one rank": []}
    for step in range(steps):
        tokens, targets = token_batch(step, 0, batch, seq, vocab)
        one = full.loss(tokens, targets)
        one.backward()
        loss = vocab_parallel_cross_entropy(model(tokens[mine]), targets[mine], mesh.tp)
        loss.backward()
        split.sequence_parallel_grads()  # nothing without sequence parallelism
        for opt in opts:
            opt.step()
            opt.zero_grad()
        mean = loss.detach().clone()
        if dp > 1:
            dist.all_reduce(mean, group=mesh.dp)
            mean /= dp
        losses["ours"].append(mean.item())
        losses["one rank"].append(one.item())
    probe = token_batch(steps, 0, 2, seq, vocab)[0]
    with torch.no_grad():
        shard = split(probe)  # (2, seq, vocab / tp)
        shards = [torch.empty_like(shard) for _ in range(tp)]
        dist.all_gather(shards, shard.contiguous(), group=mesh.tp)
        logits = {"ours": torch.cat(shards, dim=-1), "one rank": full(probe)}
    return {"losses": losses, "logits": logits, "tp": tp, "dp": dp, "rank": rank}


def relative_difference(ours: torch.Tensor, want: torch.Tensor) -> float:
    """max |ours - want| / max |want|."""
    scale = want.abs().max().item() or 1.0
    return (ours - want).abs().max().item() / scale


def agrees(pairs: Pairs, inexact=()) -> tuple:
    """(every pair but `inexact` equal bit for bit, the largest relative difference of any pair)."""
    exact = all(torch.equal(a, b) for name, (a, b) in pairs.items() if name not in inexact)
    return exact, max((relative_difference(a, b) for a, b in pairs.values()), default=0.0)

