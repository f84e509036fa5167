"""The transformer runs' batches: synthetic tokens (--synthetic), or text as bytes (--text FILE, or
with neither the Python documentation's text: workload/text.py).

    batches = Batches(config)
    tokens, targets = batches(step, rows)     # the global batch of `step`: the same on every layout
    batches.label                             # "[synthetic tokens]" or "[text: book.txt]", for the progress line
"""

from __future__ import annotations

from ..workload.text import Text
from ..workload.transformer import token_batch
from .args import SEQ, VOCAB


class Batches:
    def __init__(self, config):
        self.seed = config.seed
        self.text = None if config.synthetic else Text.load(getattr(config, "text", None), SEQ)
        self.label = "[synthetic tokens]" if self.text is None else f"[text: {self.text.name}]"

    def __call__(self, step: int, rows: int):
        if self.text is None:
            return token_batch(step, 0, rows, SEQ, VOCAB)
        return self.text.batch(step, rows, SEQ, self.seed)

    def summary(self) -> dict:
        return {"synthetic_data": self.text is None, "text": None if self.text is None else self.text.name}
