"""Text as bytes, the transformer runs' data: any file read as bytes, so the vocabulary is the 256
byte values and there is no tokenizer to install.

    data = Text.load("book.txt")              # or Text.load(None): the Python documentation's text
    tokens, targets = data.batch(step=12, rows=16, seq=32, seed=0)    # (16, 32) each, targets one byte on
    tokens, targets = data.validation(rows=16, seq=32)                # the held-out tail's windows

The last tenth of the bytes is held out for validation and never trained on. A step's global
batch is `rows` windows of the first nine tenths at offsets drawn from (seed, step) alone, so every
layout (whatever its ranks, each taking its own rows of the batch) sees the same batch at the same
step. The validation windows are fixed: `rows` of them, evenly spaced through the tail.

With no file, the text is the Python documentation's topics (`pydoc_data.topics`, the help() text
for the language's statements and types, about 460 KB, in every CPython installation), so a run
needs nothing to download.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Tuple

import torch

HELD_OUT = 10  # the last 1/HELD_OUT of the bytes
DEFAULT_NAME = "Python's documentation (pydoc_data.topics)"


class TextError(ValueError):
    """A text that cannot be trained on; the message is one line naming the file."""


def _default_bytes() -> bytes:
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics)).encode()


@dataclasses.dataclass
class Text:
    data: torch.Tensor  # (n,) uint8, the whole text
    name: str

    @classmethod
    def load(cls, path: Optional[str], seq: int = 0) -> "Text":
        """The file at `path` as bytes (None: the Python documentation's text); refused in one line
        when missing, unreadable or too short to hold a window of seq + 1 bytes in both parts."""
        if path is None:
            raw, name = _default_bytes(), DEFAULT_NAME
        else:
            try:
                with open(path, "rb") as f:
                    raw = f.read()
            except OSError as exc:
                raise TextError(f"--text {path}: cannot read it ({exc.strerror or exc})") from None
            name = os.path.basename(path)
        text = cls(torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8),
                   name)
        need = HELD_OUT * (seq + 1)
        if len(raw) < need:
            raise TextError(f"--text {path}: {len(raw)} bytes, too short: a window is {seq + 1} bytes and the last "
                            f"1/{HELD_OUT} is held out for validation, so it needs at least {need}")
        return text

    @property
    def split(self) -> int:
        """Where the held-out tail starts."""
        return len(self.data) - len(self.data) // HELD_OUT

    def _windows(self, offsets: torch.Tensor, seq: int) -> Tuple[torch.Tensor, torch.Tensor]:
        rows = self.data[offsets.unsqueeze(1) + torch.arange(seq + 1)].long()  # (rows, seq + 1)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def batch(self, step: int, rows: int, seq: int, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
        """The global batch of `step`: `rows` windows of the training part, from (seed, step) alone."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        offsets = torch.randint(0, self.split - seq, (rows,), generator=g)  # a window ends before the tail
        return self._windows(offsets, seq)

    def validation(self, rows: int, seq: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """`rows` fixed windows evenly spaced through the held-out tail."""
        room = len(self.data) - self.split - seq - 1
        offsets = self.split + torch.linspace(0, max(room, 0), rows).long()
        return self._windows(offsets, seq)
