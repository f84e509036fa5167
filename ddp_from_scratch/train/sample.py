"""--sample N: bytes the trained model writes, so one reads what it learned. The model is put
together whole on every rank first (a --tp, --pp or --cp rank gathers every rank's parameters
into the one-rank model: places.py; an expert-parallel rank gathers every expert), then each rank
samples the same bytes from the same generator.

    text = sample(one_rank_model, prompt=b"The ", n=200, seq=32, seed=0)    # the bytes after the prompt

Each step feeds the last `seq` bytes, takes the last position's logits, and draws the next byte
from softmax(logits / TEMPERATURE). The prompt is the start of the first validation window: the
held-out text the model never trained on.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from ..expert_parallel.model import MoETransformer, expert_state

TEMPERATURE = 0.8


@torch.no_grad()
def sample(model, prompt: bytes, n: int, seq: int, seed: int = 0) -> bytes:
    context = list(prompt)
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.tensor(context[-seq:]).unsqueeze(0)
        logits = model(x)[0, -1]
        context.append(int(torch.multinomial((logits / TEMPERATURE).softmax(-1), 1, generator=g)))
    return bytes(context[len(prompt):])


def write_sample(whole, batches, config, rank: int):
    """`--sample`: the bytes `whole` (the one-rank model) writes after the held-out prompt, printed
    on rank 0's stderr; the summary's text, or None without --sample."""
    if not config.sample:
        return None
    prompt = batches.prompt()
    written = sample(whole, prompt, config.sample, batches.seq, config.seed).decode(errors="replace")
    if rank == 0:
        print(f"sample: {prompt.decode(errors='replace')}|{written}", file=sys.stderr)
    return written


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
