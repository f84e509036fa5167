"""--sample N: bytes the trained model writes, so one reads what it learned. The model is put
together whole on every rank first (a context-parallel rank's copy attends alone; an
expert-parallel rank gathers every expert; a tensor-parallel one gathers its shards), then each rank samples the same bytes from the same
generator.

    text = sample(one_rank_model, prompt=b"The ", n=200, seed=0)    # the bytes after the prompt

Each step feeds the last SEQ bytes, takes the last position's logits, and draws the next byte
from softmax(logits / TEMPERATURE). The prompt is the start of the first validation window: the
held-out text the model never trained on.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist

from ..expert_parallel.model import MoETransformer, expert_state
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.vocab import VocabParallelEmbedding
from ..workload.transformer import TinyTransformer, attend
from .args import HEADS, HIDDEN, LAYERS, SEQ, VOCAB

TEMPERATURE = 0.8


@torch.no_grad()
def sample(model, prompt: bytes, n: int, seed: int = 0) -> bytes:
    context = list(prompt)
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.tensor(context[-SEQ:]).unsqueeze(0)
        logits = model(x)[0, -1]
        context.append(int(torch.multinomial((logits / TEMPERATURE).softmax(-1), 1, generator=g)))
    return bytes(context[len(prompt):])


def write_sample(whole, batches, config, rank: int):
    """`--sample`: the bytes `whole` (the one-rank model) writes after the held-out prompt, printed
    on rank 0's stderr; the summary's text, or None without --sample."""
    if not config.sample:
        return None
    prompt = batches.prompt()
    written = sample(whole, prompt, config.sample, config.seed).decode(errors="replace")
    if rank == 0:
        print(f"sample: {prompt.decode(errors='replace')}|{written}", file=sys.stderr)
    return written


def one_rank_copy(model):
    """A copy of a context-parallel model that attends alone (its parameters are whole on every rank)."""
    attention = [m for m in model.modules() if hasattr(m, "attend") and hasattr(m, "heads")]
    rings = [m.attend for m in attention]
    for m in attention:  # the ring holds its process group, which cannot be copied
        m.attend = attend
    try:
        return copy.deepcopy(model)
    finally:
        for m, ring in zip(attention, rings):
            m.attend = ring


def gathered_moe(model, full_args: tuple, group) -> MoETransformer:
    """The one-rank MoE transformer from an expert-parallel one: its dense parameters, and every
    rank's experts by their global index (all_gather_object over the expert-parallel group)."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, expert_state(model), group=group)
    state = {k: v for k, v in model.state_dict().items() if ".moe.experts." not in k}
    for experts in everyone:
        state.update(experts)
    whole = MoETransformer(*full_args)
    whole.load_state_dict(state)
    return whole


def _whole(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def gathered_tp(model, group, positions: int = 0) -> TinyTransformer:
    """The one-rank transformer from a tensor-parallel one (tensor_parallel/model.py): every
    column-parallel weight and bias gathered along its rows, every row-parallel weight along its
    columns, the embedding along the vocabulary; what every rank holds whole is taken as it is."""
    whole = TinyTransformer(VOCAB, HIDDEN, HEADS, LAYERS, positions=positions)
    split = dict(model.named_modules())
    state = {}
    for name, _ in whole.named_parameters():
        owner, _, kind = name.rpartition(".")
        tp_name = owner.replace(".mlp.0", ".mlp.up").replace(".mlp.2", ".mlp.down")
        module = split[tp_name]
        t = getattr(module, kind)
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            t = _whole(t, 0, group)
        elif isinstance(module, RowParallelLinear) and kind == "weight":
            t = _whole(t, 1, group)
        state[name] = t.detach()
    whole.load_state_dict(state)
    return whole
