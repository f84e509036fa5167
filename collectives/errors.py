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


class BackendFailure(RuntimeError):
    """A collective that passed every check failed inside the backend: a peer died, the network
    went away, or the peers did not come within the process group's timeout.

    The message leads with this rank, its host and the collective, then torch's own words (Gloo
    says only "Timed out waiting 10000ms for recv operation", naming none of them).

    Attributes: rank, host, collective.
    """

    def __init__(self, message: str, rank: Optional[int], host: str, collective: str):
        super().__init__(message)
        self.rank, self.host, self.collective = rank, host, collective


def backend_failure(collective: str, exc: BaseException, group=None) -> Optional[BackendFailure]:
    """`exc` named with this rank, host and `collective` when it came from the backend (torch's
    DistError, or Gloo's and NCCL's RuntimeErrors); None for anything else (our own checks)."""
    import socket

    import torch.distributed as dist

    if isinstance(exc, (CollectiveError, BackendFailure)) or not isinstance(exc, RuntimeError):
        return None
    text = str(exc)
    if not (isinstance(exc, dist.DistError) or "gloo" in text.lower() or "nccl" in text.lower()):
        return None
    rank = size = backend = None
    try:
        rank, size, backend = dist.get_rank(), dist.get_world_size(group), dist.get_backend(group)
    except (RuntimeError, ValueError):  # the group is gone: name what is known
        pass
    host = socket.gethostname()
    over = f" over {size} ranks ({backend})" if size is not None else ""
    return BackendFailure(f"rank {rank} on host {host}: {collective}{over} failed in the backend: {text}",
                          rank, host, collective)


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
