"""The small transformer (workload/transformer.py) with a mixture-of-experts MLP in every block,
and the same model with its experts over an expert-parallel group: the model `train --ep` trains.

    model = MoETransformer(vocab=256, hidden=64, heads=4, layers=2, experts=4, top_k=2)
    logits = model(tokens)                    # (batch, seq, vocab)
    aux = model.aux_loss()                    # the blocks' balance losses from that forward
    ep_model = expert_parallel(model, group)  # a copy whose blocks keep this rank's experts only

Each block is x + attention(LayerNorm(x)), then x + MoE(LayerNorm(x)); each sequence routes as
its own group (its own capacity and balance loss: routing.py), so a sequence is routed the same
way on any layout. aux_loss() is the sum over blocks of the mean over the sequences of this
forward's balance loss; a training loss adds it times a small weight (Switch: 0.01).

An expert-parallel model's parameters are of two kinds: the experts, each on one rank of the
expert-parallel group (and copied on the same position of every other group), and the rest,
on every rank. `expert_parameters` and `dense_parameters` tell them apart for the gradient
all-reduces (train/ep.py), and `expert_state` names each expert by its index in the whole layer,
so the ranks' experts put together are the one-rank model's.
"""

from __future__ import annotations

import copy
from typing import Dict, Iterator, Optional

import torch
from torch import nn

from ..workload.transformer import Attention, TinyTransformer
from .layer import ExpertParallelMoE
from .moe import MoE


class MoEBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, experts: int, top_k: int, capacity_factor: Optional[float]):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.moe = MoE(hidden, experts, top_k, capacity_factor=capacity_factor)
        self.aux: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        y, aux = self.moe(self.ln2(x))  # each sequence a group
        self.aux = aux.mean()
        return x + y


class MoETransformer(TinyTransformer):
    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4, layers: int = 2, experts: int = 4,
                 top_k: int = 1, capacity_factor: Optional[float] = None):
        nn.Module.__init__(self)
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(MoEBlock(hidden, heads, experts, top_k, capacity_factor) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.pos = None  # no position embedding (workload/transformer.py's default)

    def aux_loss(self) -> torch.Tensor:
        """The blocks' balance losses of the last forward, summed."""
        return torch.stack([b.aux for b in self.blocks]).sum()

    def moe_layers(self):
        return [b.moe for b in self.blocks]


def expert_parallel(model: MoETransformer, group) -> MoETransformer:
    """A copy of `model` whose MoE layers keep only this rank's experts (layer.py)."""
    ep = copy.deepcopy(model)
    for block in ep.blocks:
        block.moe = ExpertParallelMoE(block.moe, group)
    return ep


def expert_parameters(model: MoETransformer) -> Iterator[nn.Parameter]:
    for layer in model.moe_layers():
        yield from layer.experts.parameters()


def dense_parameters(model: MoETransformer) -> Iterator[nn.Parameter]:
    experts = {id(p) for p in expert_parameters(model)}
    return (p for p in model.parameters() if id(p) not in experts)


def expert_state(model: MoETransformer) -> Dict[str, torch.Tensor]:
    """This rank's experts by their index in the whole layer: blocks.{i}.moe.experts.{e}.{name}
    with e global, the names the one-rank model gives them."""
    state = {}
    for i, layer in enumerate(model.moe_layers()):
        first = getattr(layer, "first_expert", 0)
        for local, expert in enumerate(layer.experts):
            for name, t in expert.state_dict().items():
                state[f"blocks.{i}.moe.experts.{first + local}.{name}"] = t.detach().clone()
    return state
