"""The transformer runs' batches: synthetic tokens (--synthetic), or text as bytes (--text FILE, or
with neither the Python documentation's text: workload/text.py).

    batches = Batches(config)
    tokens, targets = batches(step, rows)     # the global batch of `step`: the same on every layout
    batches.label                             # "[synthetic tokens]" or "[text: book.txt]", for the progress line
    tokens, targets = batches.validation(rows)  # the held-out windows every layout evaluates on

Every --eval-every steps and at the end a run evaluates: its forward alone (no gradient) on the
validation batch, as many windows as a training step's global batch and laid out over the ranks
the same way, the cross-entropy averaged as the training loss is. The value is the one-rank
model's within float32 rounding on every layout.
"""

from __future__ import annotations

from ..workload.text import Text
from ..workload.transformer import token_batch
from .transformer_args import VOCAB, sizes


def validation_summary(validation: list) -> dict:
    """The summary's validation entries: every evaluation, and the last one's loss."""
    return {"validation": validation, "validation_loss": validation[-1]["loss"] if validation else None}


def evaluation_due(config, done: int, end: int) -> bool:
    """After `done` steps of a run that ends at `end`: evaluate now?"""
    every = getattr(config, "eval_every", None)
    return done == end or bool(every and done % every == 0)


class Batches:
    def __init__(self, config):
        self.seed, self.seq = config.seed, sizes(config)[4]
        self.text = None if config.synthetic else Text.load(getattr(config, "text", None), self.seq)
        self.label = "[synthetic tokens]" if self.text is None else f"[text: {self.text.name}]"

    def __call__(self, step: int, rows: int):
        if self.text is None:
            return token_batch(step, 0, rows, self.seq, VOCAB)
        return self.text.batch(step, rows, self.seq, self.seed)

    def validation(self, rows: int):
        """The validation batch: `rows` fixed windows of the held-out tail (synthetic: a fixed batch
        no training step draws)."""
        if self.text is None:
            return token_batch(10 ** 9, 0, rows, self.seq, VOCAB)
        return self.text.validation(rows, self.seq)

    def prompt(self) -> bytes:
        """The start of the first validation window: text the model never trained on."""
        tokens, _ = self.validation(1)
        return bytes(tokens[0, :self.seq // 2].tolist())

    def summary(self) -> dict:
        return {"synthetic_data": self.text is None, "text": None if self.text is None else self.text.name}
