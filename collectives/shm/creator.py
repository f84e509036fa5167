"""How shm groups are made and found: the creator torch calls for a group, a group made with
settings of its own, and the ShmBackend behind a group.

    import collectives.shm                       # registers "shm" with create() as its creator
    dist.init_process_group("shm", ...)          # torch calls create() on every rank
    g = collectives.shm.new_group_with({"COLLECTIVES_SHM_PATH": "python"})   # settings for one group
    collectives.shm.backend_of(g).path           # "python": the group's ShmBackend (process_group.py)
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from . import native, native_setup
from .process_group import ShmBackend


def create(store, rank: int, size: int, timeout: timedelta):
    """The creator torch calls for init_process_group("shm") and new_group(backend="shm"): a C++
    Backend (forward.cpp) that runs the native path's calls itself (COLLECTIVES_SHM_PATH=native,
    the default) and hands every other call to a ShmBackend."""
    impl = ShmBackend(store, rank, size, timeout)
    module = native.load()
    forward = module.ForwardBackend(impl, rank, size, "shm")
    if impl.config.path == "native":
        state = impl.state
        impl.use_engine(module.make_engine(native_setup.setup(state), native_setup.error_maker(state.rank, state.size)))
        forward.set_engine(state.engine)
        if state.recorder is not None:  # one record: the engine's calls and the Python path's
            state.recorder.native = state.engine
    return forward


def new_group_with(settings: dict, ranks=None, timeout=None):
    """dist.new_group(ranks, timeout, backend="shm") made with these environment settings
    (COLLECTIVES_SHM_*, TORCH_FR_BUFFER_SIZE: a group reads them as it is made), the environment
    restored after. Every rank calls it, as new_group.

        native = new_group_with({"COLLECTIVES_SHM_PATH": "native"})
        python = new_group_with({"COLLECTIVES_SHM_PATH": "python", "COLLECTIVES_SHM_WAIT": "spin"})
        quick = new_group_with({}, timeout=timedelta(seconds=5))   # gives up on a late rank after 5 s
    """
    saved = {k: os.environ.get(k) for k in settings}
    os.environ.update({k: str(v) for k, v in settings.items()})
    try:
        return dist.new_group(ranks, timeout=timeout, backend="shm")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def backend_of(group=None) -> ShmBackend:
    """The ShmBackend behind an shm group (default: the world), e.g. to read its cma_off_reason."""
    group = dist.group.WORLD if group is None else group
    forward = group._get_backend(torch.device("cpu"))
    if not hasattr(forward, "impl"):
        raise ValueError(f"{group} is a {dist.get_backend(group)} group, not an shm group")
    return forward.impl
