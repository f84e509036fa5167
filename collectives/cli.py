"""What the project's command-line programs share: how they end, and how they show progress.

    @cli.command
    def main(argv=None) -> int: ...        # Ctrl-C, a failed rank: a clear message, no traceback

    print(f"\\rstep {k}/{n} {cli.eta(k, n, elapsed)}", end="", file=sys.stderr)

- Ctrl-C ends the progress line first, says "interrupted", and exits with 130 (the shell's
  code for SIGINT); the ranks are stopped by the pool on the way out.
- A `RankFailure` prints its message (which leads with the rank that failed first and why) and
  exits with 1, instead of the launcher's own traceback glued under it.
- Anything else is a bug in the program and keeps its traceback.
SIGTERM and SIGKILL need nothing here: the ranks watch their parent and end with it (pool.py).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable

from .errors import RankFailure


def format_seconds(seconds: float) -> str:
    """3725 -> "1 h 2 min", 83 -> "1 min 23 s", 4.2 -> "4 s"."""
    seconds = max(0, int(round(seconds)))
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60} min"
    if seconds >= 60:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds} s"


def eta(done: float, total: float, elapsed: float) -> str:
    """"~1 min 5 s left" from the work done so far and its time, assuming a steady rate."""
    if done <= 0 or total <= done:
        return "" if total <= done else "estimating time left"
    return f"~{format_seconds(elapsed / done * (total - done))} left"


def eta_by_size(done: list, left: list) -> str:
    """"~1 min 5 s left" for a sweep over sizes: each size is taken to cost a + b * bytes, with a
    (the latency) the fastest size so far and b from the largest size done. Counting the work in
    bytes alone is absurd at the start of a sweep (an 8-byte call that takes 40 us "predicts"
    days for 1 GiB); this is optimistic there instead and exact once the sizes are
    bandwidth-bound. `done`: (bytes, seconds) of every size measured; `left`: the bytes to come."""
    if not done:
        return "estimating time left" if left else ""
    if not left:
        return ""
    a = min(t for _, t in done)
    big_bytes, big_time = max(done)
    b = max(0.0, big_time - a) / big_bytes if big_bytes else 0.0
    return f"~{format_seconds(sum(a + b * n for n in left))} left"


def compile_cache_outside_tmp() -> None:
    """Keep torch's compile cache out of the temporary directory, unless the user placed it.

    Constructing any torch optimizer imports torch._dynamo, which creates
    /tmp/torchinductor_<user> (TORCHINDUCTOR_CACHE_DIR's default) although nothing here compiles.
    Every rank and every program of this project points it at ~/.cache/torchinductor instead
    (XDG_CACHE_HOME respected): one directory, reused, and nothing new in /tmp after a run.
    """
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache, "torchinductor"))


def command(main: Callable[..., int]) -> Callable[..., int]:
    """Decorate a program's main(argv=None) -> exit code (see the module docstring)."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs) -> int:
        compile_cache_outside_tmp()
        try:
            return main(*args, **kwargs)
        except KeyboardInterrupt:
            print("\ninterrupted (Ctrl-C); every rank was stopped", file=sys.stderr, flush=True)
            return 130
        except RankFailure as exc:
            print(f"\nerror: {exc}", file=sys.stderr, flush=True)
            return 1

    return wrapped
