"""The progress line of a transformer run (--tp, --pp, --ep, --cp), on rank 0's stderr:

    epoch 1/1 step 3/16 loss 5.6870 (balance 2.047, dropped 14 of 1024 slots) 7472 tokens/s, ~2 s left [synthetic tokens]
"""

from __future__ import annotations

import sys
import time

from collectives.cli import eta

from .transformer_args import sizes


def progress(config, done: int, first: int, steps: int, loss: float, per_step: int, start: float, note: str = "",
             label: str = "[synthetic tokens]", validation=None) -> None:
    """Rank 0's progress line of a transformer run (--tp, --pp, --ep, --cp) on stderr after global
    step `done` (counting from 0; a resumed run started at `first`): step, loss (and `note`),
    tokens/s, time left."""
    epoch, step = divmod(done, steps)
    done, ran = done + 1, done + 1 - first
    if validation:
        note += f", validation {validation[-1]['loss']:.4f} (step {validation[-1]['step']})"
    elapsed = time.perf_counter() - start
    print(f"\repoch {epoch + 1}/{config.epochs} step {step + 1}/{steps} loss {loss:.4f}{note} "
          f"{ran * per_step * sizes(config)[4] / elapsed:.0f} tokens/s, "
          f"{eta(ran, steps * config.epochs - first, elapsed)} "
          f"{label}", end="", flush=True, file=sys.stderr)
