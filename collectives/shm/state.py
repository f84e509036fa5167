"""One shm group on this rank, in one object: what its backend (process_group.py) builds as the
group is made, and what the parts around it receive, instead of reading the backend's own
fields: the native engine's setup (native_setup.py), the algorithms' transport (transport.py)
and the direct call (direct.py).

    state = backend_of(group).state
    state.segment, state.waiter, state.collectives     # the shared memory, the barrier, the Python path
    state.engine                                       # the native path's engine, or None
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional


@dataclasses.dataclass
class GroupState:
    rank: int
    size: int
    config: Any  # config.ShmConfig, as the group read it
    cores: int  # the CPUs the ranks may run on between them (layout.agree)
    segment: Any  # segment.Segment
    collectives: Any  # python_path.ShmCollectives: the Python path's calls on the segment
    waiter: Any  # wait.Waiter: the barrier
    recorder: Optional[Any]  # recorder.Recorder, or None when the group keeps no flight record
    drain: Callable[[], None]  # until every call issued so far on the group has finished
    engine: Optional[Any] = None  # the native path's engine (forward.cpp), once the creator made it
