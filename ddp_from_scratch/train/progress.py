"""The progress line of a transformer run (--tp, --pp, --ep, --cp), on rank 0's stderr:

    epoch 1/1 step 3/16 loss 5.6870 (balance 2.047, dropped 14 of 1024 slots) 7472 tokens/s, ~2 s left [synthetic tokens]
"""

from __future__ import annotations

import sys
import time

from collectives.cli import eta

from .args import SEQ


def progress(config, epoch: int, step: int, steps: int, loss: float, per_step: int, start: float, note: str = "",
             label: str = "[synthetic tokens]", validation=None) -> None:
    """Rank 0's progress line of a transformer run (--tp, --pp, --ep) on stderr: step, loss (and
    `note`), tokens/s, time left."""
    done = epoch * steps + step + 1
    if validation:
        note += f", validation {validation[-1]['loss']:.4f} (step {validation[-1]['step']})"
    elapsed = time.perf_counter() - start
    print(f"\repoch {epoch + 1}/{config.epochs} step {step + 1}/{steps} loss {loss:.4f}{note} "
          f"{done * per_step * SEQ / elapsed:.0f} tokens/s, {eta(done, steps * config.epochs, elapsed)} "
          f"{label}", end="", flush=True, file=sys.stderr)
