"""What the launcher says about a rank that failed: how it ended (exit code or signal), where it
was (from the stack faulthandler wrote), and whether its error only says that a peer went first.

    describe_exit(-6)      -> "died from SIGABRT (Gloo aborts like this on a size or dtype mismatch)"
    where_it_was(clean_stack(dump)) -> "waiting in all_reduce (called from prog.py:6 in boom)"

RankPool (pool.py) builds its RankFailure from these.
"""

from __future__ import annotations

import os
import re
import signal
from typing import Optional

from .rank_main import HIDDEN_FILES, PACKAGE_DIR


def describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (Gloo aborts like this on a size or dtype mismatch)" if name == "SIGABRT" else ""
        return f"died from {name}{hint}"
    return f"exited with code {code} without reporting a result"


# What a rank's error says when the peer it was talking to died or failed first.
PEER_LOST = re.compile(r"Connection (reset|closed) by peer|Socket closed|Broken pipe|peer.*(closed|died)"
                        r"|PeerFailure: .* rank \d+ (\(pid \d+\) )?(died|failed)", re.IGNORECASE)


def short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def _direct_call(frame: dict) -> bool:
    """A frame of the shm backend's direct calls (collectives.shm.all_reduce: a collective without
    torch.distributed in the stack), which a rank waits in as it would in dist.all_reduce."""
    return frame["file"] == os.path.join(PACKAGE_DIR, "shm", "direct.py") and not frame["func"].startswith("_")


def where_it_was(stack: str) -> str:
    """Where a rank was, from its main thread's stack (the first block of `clean_stack`'s
    output, innermost frame first): "waiting in all_reduce (called from prog.py:6 in boom)" or
    "in sleep_forever (prog.py:12)"."""
    frames = [m.groupdict() for m in _FRAME.finditer(stack.split("\n\n")[0])]
    if not frames:
        return ""
    user = next((f for f in frames if "/torch/" not in f["file"] and not f["file"].startswith(PACKAGE_DIR)), None)
    called = f" (called from {os.path.basename(user['file'])}:{user['line']} in {user['func']})" if user else ""
    c10d = next((f for f in frames if "torch/distributed/" in f["file"] or _direct_call(f)), None)
    if c10d is not None:
        return f"waiting in {c10d['func']}{called}"
    first = frames[0]
    return f"in {first['func']} ({os.path.basename(first['file'])}:{first['line']})"


def clean_stack(text: str) -> str:
    """faulthandler's all-thread dump, minus the parent-watch thread, the spawn bootstrap frames and
    the trailer a fatal signal adds (the signal is in the summary already)."""
    blocks = re.split(r"\n\s*\n|\n(?=(?:Current thread|Thread) 0x)", text.strip())
    blocks = [b for b in blocks if b.strip() and "in _watch_parent" not in b and "<no Python frame>" not in b]
    # first the thread a fatal signal hit (faulthandler calls it the current one), else the main
    # thread (the one running fn)
    blocks.sort(key=lambda b: (not b.lstrip().startswith("Current thread"), "in run_rank" not in b))
    kept = []
    for block in blocks:
        lines = [ln for ln in block.splitlines()
                 if "multiprocessing/" not in ln and '"<string>"' not in ln and not any(h in ln for h in HIDDEN_FILES)
                 and not ln.startswith(("Fatal Python error:", "Extension modules:"))]  # a crash's trailer
        kept.append("\n".join(lines))
    return "\n\n".join(k for k in kept if k.strip())
