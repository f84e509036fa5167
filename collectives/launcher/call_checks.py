"""What the launcher checks in a call before any rank starts: the function and its arguments
pickle, the world size is a positive int, a timeout is a positive, finite number of seconds.

    check_call(fn, args, timeout)               # TypeError or ValueError naming what is wrong
"""

from __future__ import annotations

import math
import pickle
from typing import Optional


def pickled(fn, args, name: Optional[str] = None) -> bytes:
    """(fn, args) as the ranks receive them; a TypeError naming what does not pickle, before any rank starts."""
    try:
        return pickle.dumps((fn, tuple(args)))
    except Exception as exc:
        raise TypeError(
            f"cannot send {name or getattr(fn, '__qualname__', repr(fn))} to the ranks: {exc}. Define the function "
            "at module level (not a lambda or a nested function) and pass picklable args."
        ) from exc


def check_call(fn, args, timeout) -> None:
    """What submit() and run() take: a function, a tuple or list of arguments, a timeout."""
    if not callable(fn):
        raise TypeError(f"fn must be a function, got {type(fn).__name__} {fn!r}")
    if isinstance(args, (str, bytes)) or not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple or list of positional arguments, got {type(args).__name__} {args!r}")
    check_timeout(timeout, "timeout")


def check_world_size(world_size) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__} {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")


def check_timeout(timeout, name: str) -> None:
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool):
        raise TypeError(f"{name} must be a number of seconds, got {type(timeout).__name__} {timeout!r}")
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {timeout!r}")
