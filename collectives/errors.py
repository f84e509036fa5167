"""The errors this package raises, each naming the rank and the collective involved."""

from __future__ import annotations

from typing import Dict, Iterable, Optional


class CollectiveError(RuntimeError):
    """A collective was called wrongly: bad src/dst, op for the dtype, device, shape, group.

    Raised before anything is sent, so the process group stays usable.
    """


class CollectiveMismatchError(CollectiveError):
    """The ranks of a group called different collectives or passed arguments that disagree.

    Raised on every rank of the group, before the collective itself, so none of them hangs or
    aborts and the group stays usable.
    """


class RankFailure(RuntimeError):
    """One or more ranks raised, died or hung; every rank has been stopped.

    The message leads with the root cause (the rank that failed first and why), then the ranks
    stopped because of it, then each rank's traceback, exit code, signal or Python stack.

    Attributes:
        failures: rank -> what happened there (every rank named in the message).
        first: the rank that failed first (for a timeout: the first rank that was not waiting
            in a collective, else the lowest hung rank).
        failed: the ranks that raised, died or hung on their own, in rank order.
        stopped: the ranks that were still running, most often waiting in a collective for a
            failed rank, and were killed because of it.
    """

    def __init__(self, message: str, failures: Dict[int, str], first: Optional[int] = None,
                 failed: Optional[Iterable[int]] = None, stopped: Iterable[int] = ()):
        super().__init__(message)
        self.failures = failures
        self.failed = sorted(failures if failed is None else failed)
        self.stopped = sorted(stopped)
        self.first = first if first is not None else (self.failed[0] if self.failed else None)

    @property
    def ranks(self):
        """Every rank named: the failed ones and the stopped ones."""
        return sorted(self.failures)
