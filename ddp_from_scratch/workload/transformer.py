"""A small decoder-only transformer (GPT-style, pre-LayerNorm) on tokens (synthetic, or bytes of text): the model the
tensor-parallel steps split (ddp_from_scratch/tensor_parallel/model.py).

    model = TinyTransformer(vocab=64, hidden=32, heads=4, layers=2)
    tokens, targets = token_batch(step=0, rank=0, batch_size=4, seq=16, vocab=64)
    loss = model.loss(tokens, targets)          # cross-entropy of the next tokens

Embedding, then per block x + attention(LayerNorm(x)) and x + MLP(LayerNorm(x)), a last
LayerNorm and an untied head to the vocabulary. `positions=N` adds a learned position embedding
for N places (GPT-2's kind; the training program's transformer runs all have one, so a
context-parallel rank's tokens from all over a sequence keep their places); without it (the
benchmarks' model) the causal attention alone tells positions apart.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn



class Attention(nn.Module):
    """The one-rank block: q, k, v and output projections, causal scaled dot-product attention."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"the hidden size {hidden} does not split into {heads} heads: choose a multiple of {heads}")
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(hidden, hidden) for _ in range(4))
        self.attend = attend  # context parallelism puts its ring here (context_parallel/model.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attend(self.q(x), self.k(x), self.v(x), self.heads))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Causal attention of (batch, seq, heads x head_dim) projections, head by head."""
    b, s, width = q.shape
    split = lambda t: t.view(b, s, heads, width // heads).transpose(1, 2)  # noqa: E731
    y = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
    return y.transpose(1, 2).reshape(b, s, width)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Positioned(nn.Module):
    """A pipeline's first piece for a model with positions: embed(tokens) + pos(places), the
    places fixed (every microbatch's tokens sit at the same places of their sequences)."""

    def __init__(self, embed: nn.Module, pos: nn.Embedding, places: Optional[torch.Tensor]):
        super().__init__()
        self.embed, self.pos = embed, pos
        self.places = places  # not a buffer: a DDP over the stage would broadcast it from its first rank

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        places = self.places if self.places is not None else torch.arange(tokens.shape[1])
        return self.embed(tokens) + self.pos(places)


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4, layers: int = 2, positions: int = 0):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        # learned positions, made last so the other weights are those of a model without them; small
        # at the start (GPT-2's 0.02), so they do not drown the tokens' embeddings (standard normal)
        self.pos = nn.Embedding(positions, hidden) if positions else None
        if self.pos is not None:
            nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits of (batch, seq) tokens. `positions`: each token's place in its whole sequence
        (default 0 ... seq - 1; a context-parallel rank holds other places), for a model made with
        positions > 0."""
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos(positions if positions is not None else torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

    def as_sequence(self, positions: Optional[torch.Tensor] = None) -> nn.Sequential:
        """The forward as a sequence of its own modules (shared, not copied), for a pipeline to cut:
        the embedding (with the positions, for a model that has them: `positions` are the places
        of the tokens every microbatch holds, default 0 ... seq - 1), each block, then the last
        LayerNorm with the head."""
        embed = self.embed if self.pos is None else Positioned(self.embed, self.pos, positions)
        return nn.Sequential(embed, *self.blocks, nn.Sequential(self.ln, self.head))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def token_batch(step: int, rank: int, batch_size: int, seq: int, vocab: int):
    """Synthetic tokens and their next-token targets, different per (step, rank)."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
