"""The shared-memory segment the ranks of one machine meet in, and how it never outlives them.

Layout (one file in /dev/shm, mapped by every rank):

    control  int32 words: per rank its step counter (the barrier), its pid, what collective it
             is in (two banks, by call parity), and for cross-memory attach (cma.py) its
             tensor's address, whether it is writing into the others, whether the calls work;
             the abort word
    data     world_size slots of slot_bytes each: rank r writes only slot r
    mail     world_size x world_size mailboxes of MAILBOX_BYTES for point-to-point messages
             (transport.py), up to MAX_MAIL_RANKS ranks

Lifetime: rank 0 creates the file under a name carrying its pid, the others open it, every rank
says so through the store, and rank 0 unlinks the name at once. The mapping lives on in every
rank, but nothing is left in /dev/shm however the ranks end, SIGKILL included. The only window
is between creation and unlink (milliseconds at start-up); a rank that finds a leftover from a
dead pid there removes it (`sweep`).

    segment = Segment.create_or_attach(store, rank, world_size, slot_bytes)
    segment.slot(r)          # rank r's data slot as a uint8 tensor
    segment.steps[r]         # rank r's barrier counter (numpy int32, shared)
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
from datetime import timedelta

import numpy as np
import torch

from ..cli import format_bytes
from .config import ALIGN, ShmConfig

SHM_DIR = "/dev/shm"
PREFIX = "collectives-shm"
CONTROL_BYTES = 512 << 10  # int32 words: the per-rank and per-pair counters below, with room to spare
ABORT = 0  # control word: nonzero once the group is broken: 1 + the rank that failed or died
ABORT_SEEN_BY = 1  # 1 + the rank that noticed it
ABORT_WHY = 2  # why: DIED, FAILED or LATE (wait.py)
STEP0, PID0 = 16, 16 + 4096  # per-rank words start here (steps, then pids)
MAIL_SENT0 = PID0 + 4096  # per (src, dst) pair: messages put in that mailbox so far (by src)
MAIL_TAKEN0 = MAIL_SENT0 + 4096  # and taken out of it (by dst)
SLEEP0 = MAIL_TAKEN0 + 4096  # per rank: 1 while it sleeps on a futex (so others wake it only then)
CALL0 = SLEEP0 + 4096  # per rank, two banks of CALL_WORDS: which collective it is in, on what (python_path.py)
CALL_WORDS = 4
ADDR0 = CALL0 + 2 * 4096 * CALL_WORDS  # per rank, two words (one int64): its tensor's address (cma.py)
WRITING0 = ADDR0 + 2 * 4096  # per rank: 1 while it writes into the other ranks' memory (cma.py)
CMA_OK0 = WRITING0 + 4096  # per rank: 1 if it could read and write every other rank's memory (cma.py)
MAX_MAIL_RANKS = 64  # mailboxes (point-to-point) for up to 64 x 64 pairs
MAILBOX_BYTES = ShmConfig().mailbox_bytes  # the default; a segment takes its own (config.py)


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def sweep() -> int:
    """Remove segments left by processes that no longer exist (a crash between create and unlink)."""
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        match = re.fullmatch(rf"{PREFIX}-(\d+)-[0-9a-f]+", name)
        if not match:
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            try:
                os.unlink(_path(name))
                removed += 1
            except FileNotFoundError:
                pass
        except PermissionError:
            pass
    return removed


def leftovers(pids=None) -> list:
    """This package's entries in /dev/shm (the tests count them); with `pids`, only those that
    these processes created (a segment's name carries its creator's pid), so that a test is not
    confused by segments of other runs on the machine."""
    try:
        names = sorted(n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX))
    except OSError:
        return []
    if pids is None:
        return names
    made_by = {f"{PREFIX}-{pid}-" for pid in pids}
    return [n for n in names if n[: n.rindex("-") + 1] in made_by]


def too_large(size: int, free: int, world_size: int, slot_bytes: int, mail: int) -> str:
    """What a segment that does not fit in SHM_DIR is made of, the larger part named first with the
    setting that sizes it (a huge mailbox once read "set COLLECTIVES_SHM_SLOT_MB lower")."""
    parts = [(world_size * slot_bytes, f"the data slots ({world_size} x {format_bytes(slot_bytes)})",
              "COLLECTIVES_SHM_SLOT_MB"),
             (mail, f"the mailboxes ({world_size} x {world_size} x {format_bytes(mail / max(1, world_size ** 2))})",
              "COLLECTIVES_SHM_MAILBOX_KB")]
    parts.sort(key=lambda p: -p[0])
    (big, what, setting), (small, other, _) = parts
    return (f"the shm backend needs {size >> 20} MiB in {SHM_DIR} for {world_size} ranks, and only {free >> 20} MiB "
            f"is free there: {what} take {format_bytes(big)} of it, so set {setting} lower, or give {SHM_DIR} more "
            f"room (docker run --shm-size); {other} take {format_bytes(small)}")


class Segment:
    """One mapped segment: the control words (numpy views, shared) and the data slots (tensors)."""

    def __init__(self, mapping: mmap.mmap, world_size: int, slot_bytes: int, mailbox_bytes: int = MAILBOX_BYTES):
        self.mapping, self.world_size, self.slot_bytes = mapping, world_size, slot_bytes
        self.control = np.frombuffer(mapping, dtype=np.int32, count=CONTROL_BYTES // 4)
        self.steps = self.control[STEP0:STEP0 + world_size]
        self.pids = self.control[PID0:PID0 + world_size]
        self.sleeping = self.control[SLEEP0:SLEEP0 + world_size]
        self.calls = self.control[CALL0:CALL0 + 2 * world_size * CALL_WORDS].reshape(2, world_size, CALL_WORDS)
        self.addresses = np.frombuffer(mapping, dtype=np.int64, count=world_size, offset=ADDR0 * 4)
        self.writing = self.control[WRITING0:WRITING0 + world_size]
        self.cma_ok = self.control[CMA_OK0:CMA_OK0 + world_size]
        self.data = torch.frombuffer(mapping, dtype=torch.uint8, offset=CONTROL_BYTES,
                                     count=world_size * slot_bytes)
        pairs = world_size * world_size if world_size <= MAX_MAIL_RANKS else 0
        self.mail_sent = self.control[MAIL_SENT0:MAIL_SENT0 + pairs]
        self.mail_taken = self.control[MAIL_TAKEN0:MAIL_TAKEN0 + pairs]
        self.mail = torch.frombuffer(mapping, dtype=torch.uint8, offset=CONTROL_BYTES + world_size * slot_bytes,
                                     count=pairs * mailbox_bytes) if pairs else None
        self.mailbox_bytes = mailbox_bytes

    def mailbox(self, src: int, dst: int) -> torch.Tensor:
        """The mailbox for messages from src to dst, mailbox_bytes of uint8."""
        k = src * self.world_size + dst
        return self.mail[k * self.mailbox_bytes:(k + 1) * self.mailbox_bytes]

    def slot(self, rank: int) -> torch.Tensor:
        """Rank `rank`'s data slot, slot_bytes of uint8."""
        return self.data[rank * self.slot_bytes:(rank + 1) * self.slot_bytes]

    def address(self, word: int) -> int:
        """The memory address of control word `word` (for futex)."""
        return self.control.ctypes.data + 4 * word

    @classmethod
    def create_or_attach(cls, store, rank: int, world_size: int, slot_bytes: int, prefix: str = "",
                         timeout: timedelta = timedelta(minutes=5), mailbox_bytes: int = MAILBOX_BYTES) -> "Segment":
        """Every rank of the group calls this; returns the mapped segment, its name already unlinked."""
        if world_size > 4096:
            raise ValueError(f"the shm backend takes at most 4096 ranks, got {world_size}")
        # every slot and half-slot starts 64-byte aligned: a tensor view of any dtype needs its
        # element size to divide its offset (torch rounds a misaligned offset down, silently)
        slot_bytes = max(ALIGN * 2, -(-slot_bytes // (ALIGN * 2)) * ALIGN * 2)
        mail = world_size * world_size * mailbox_bytes if world_size <= MAX_MAIL_RANKS else 0
        size = CONTROL_BYTES + world_size * slot_bytes + mail
        key = f"{prefix}shm-segment"
        if rank == 0:
            sweep()
            free = os.statvfs(SHM_DIR)
            if free.f_bavail * free.f_frsize < size:  # else a rank dies of SIGBUS when it touches a page
                raise MemoryError(too_large(size, free.f_bavail * free.f_frsize, world_size, slot_bytes, mail))
            name = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(6)}"
            fd = os.open(_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, size)
                mapping = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            store.set(key, name)
        else:
            store.wait([key], timeout)
            name = store.get(key).decode()
            fd = os.open(_path(name), os.O_RDWR)
            try:
                mapping = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        segment = cls(mapping, world_size, slot_bytes, mailbox_bytes)
        segment.pids[rank] = os.getpid()
        store.set(f"{key}/attached/{rank}", "1")
        if rank == 0:  # everyone has it mapped: the name can go
            store.wait([f"{key}/attached/{r}" for r in range(world_size)], timeout)
            os.unlink(_path(name))
        return segment
