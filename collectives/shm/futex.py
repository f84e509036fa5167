"""Sleeping on a word of the shared segment until another rank changes it: Linux's futex.

    if futex.AVAILABLE:
        futex.wait(address, expected, timeout_s=1e-3)   # returns at once if the word is not `expected`;
                                                         # True when a wake ended the sleep
        futex.wake(address)                             # every sleeper on the word

`address` is the word's address in this process (`Segment.address(word)`); a futex on a shared
mapping works across processes, so a rank sleeps on another rank's counter and that rank wakes it
after writing the counter. The kernel compares the word with `expected` before it sleeps, so a
write that lands between a rank's last read and its sleep is never missed. Known on x86-64 and
aarch64 (the syscall's number differs); elsewhere AVAILABLE is False and the callers poll instead.
"""

from __future__ import annotations

import ctypes
import platform

SYSCALL = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
AVAILABLE = SYSCALL is not None
_WAIT, _WAKE = 0, 1
_EVERYONE = 1 << 30

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def wait(address: int, expected: int, timeout_s: float) -> bool:
    """Sleep while the int32 at `address` is `expected`, at most timeout_s (a wake, a signal or a
    spurious wake-up also end it: callers read the word again). True when a wake ended it."""
    seconds = int(timeout_s)
    ts = _Timespec(seconds, int((timeout_s - seconds) * 1e9))
    return _libc.syscall(SYSCALL, ctypes.c_void_p(address), _WAIT, ctypes.c_int(expected), ctypes.byref(ts),
                         None, 0) == 0


def wake(address: int) -> None:
    """Wake every process sleeping on the int32 at `address`."""
    _libc.syscall(SYSCALL, ctypes.c_void_p(address), _WAKE, _EVERYONE, None, None, 0)
