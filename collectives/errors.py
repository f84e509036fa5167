"""The errors this package raises, each naming the rank and the collective involved."""

from __future__ import annotations

from typing import Dict


class CollectiveError(RuntimeError):
    """A collective was called wrongly: bad src/dst, op for the dtype, device, shape, group.

    Raised before anything is sent, so the process group stays usable.
    """


class CollectiveMismatchError(CollectiveError):
    """Checked mode found that the ranks of a group called different collectives or arguments.

    Raised on every rank of the group, before the collective itself, so none of them hangs or
    aborts and the group stays usable.
    """


class RankFailure(RuntimeError):
    """One or more ranks raised, died or hung. `failures` maps rank -> what happened there.

    The message carries every failing rank's traceback (or its signal or exit code, or for a
    hang its Python stack).
    """

    def __init__(self, message: str, failures: Dict[int, str]):
        super().__init__(message)
        self.failures = failures

    @property
    def ranks(self):
        return sorted(self.failures)
