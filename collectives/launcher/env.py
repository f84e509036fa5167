"""The distributed environment, read once into one small dataclass.

Every program in this project learns who it is from `init_from_env()` (started by torchrun,
srun, or plainly) or from `collectives.run` (which hands each rank its `DistEnv`), and passes
that `DistEnv` on. No other module reads RANK from os.environ.

    torchrun --nproc_per_node=4 my_prog.py      # RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT
    srun -N2 --ntasks-per-node=4 python my_prog.py   # SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
    python my_prog.py                            # one process: rank 0 of a world of 1

In `my_prog.py`:

    env = collectives.init_from_env()
    print(env.rank, env.world_size, env.device, env.backend)
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import os
import re
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from collectives import settings

from .agent_watch import watch_agent

DEFAULT_PG_TIMEOUT = datetime.timedelta(minutes=10)


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """Who this process is. Both branches (distributed or not) fill the same fields.

    Attributes:
        rank: global rank, 0 <= rank < world_size.
        world_size: number of processes in the default group.
        local_rank: rank among the processes on this machine (picks the GPU).
        device: the device this rank computes on (cuda:local_rank with NCCL, else cpu).
        backend: "nccl", "gloo" or "shm".
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that prints and writes files."""
        return self.rank == 0


def pick_backend(local_world_size: int, backend: Optional[str] = None) -> str:
    """NCCL only when every local rank can have a GPU of its own, else Gloo.

    One GPU cannot host two NCCL ranks ("Duplicate GPU detected"), so two ranks on one GPU
    use Gloo (with CUDA tensors where the caller asks for them). backend None: the variable
    COLLECTIVES_BACKEND if set (this project's test suite sets it to gloo, since its tensors are
    CPU ones, so that a world of one on a GPU machine does not become NCCL), else that choice.
    """
    origin = "backend"
    if backend is None and os.environ.get("COLLECTIVES_BACKEND"):
        backend, origin = os.environ["COLLECTIVES_BACKEND"], "COLLECTIVES_BACKEND"
    if backend is not None:
        backend = backend.lower()
        if backend not in ("gloo", "nccl", "shm"):
            raise ValueError(f"{origin} must be 'gloo', 'nccl' or 'shm', got {backend!r}")
        if backend == "shm":
            import collectives.shm  # noqa: F401 - registers the backend with torch.distributed
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA, and torch.cuda.is_available() is False")
        if backend == "nccl" and torch.cuda.device_count() < local_world_size:
            raise ValueError(
                f"backend 'nccl' needs one GPU per local rank: {local_world_size} local ranks, "
                f"{torch.cuda.device_count()} GPU(s) (NCCL refuses two ranks on one GPU)"
            )
        return backend
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"


def device_id_for(backend: str, device: torch.device) -> dict:
    """init_process_group's device_id for NCCL (binds the rank to its GPU up front; without it
    torch warns at the first barrier that it guesses the device), where this torch takes it."""
    if backend != "nccl" or "device_id" not in inspect.signature(dist.init_process_group).parameters:
        return {}
    return {"device_id": device}


def device_for(backend: str, local_rank: int) -> torch.device:
    """cuda:local_rank for NCCL, cpu for Gloo."""
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: "gpu[03-05,9],cpu1" -> "gpu03".

    Zero padding inside the brackets is kept, as SLURM does.
    """
    nodelist = nodelist.strip()
    if not nodelist:
        raise ValueError("empty SLURM node list")
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if match is None:
        raise ValueError(f"cannot read SLURM node list {nodelist!r}")
    prefix, _, ranges = match.groups()
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _slurm_port(job_id: str) -> int:
    # Every task of a job must agree on the port without talking first; derive it from the job
    # id so two jobs on one node rarely collide (MASTER_PORT in the environment wins).
    return 15000 + int(re.sub(r"\D", "", job_id) or "0") % 20000


def check_settings(backend: str, environ: Optional[Mapping[str, str]] = None) -> None:
    """Every setting a run on `backend` reads, read now, before any rank starts (the launcher's
    environment is its ranks'): a bad value is a ValueError naming the variable."""
    settings.fr_buffer_size(environ)
    if backend == "shm":
        from collectives.shm.config import ShmConfig

        ShmConfig.from_env(environ)


def read_env(environ: Mapping[str, str]) -> dict:
    """Parse torchrun's or SLURM's variables into rank/world_size/local_rank/master address.

    Returns a dict with keys rank, world_size, local_rank, local_world_size, master_addr,
    master_port (the last two None when not launched). Pure function, so it is testable.
    """
    def whole(name: str, default: Optional[int] = None, least: int = 0) -> int:
        """The variable as a whole number of at least `least`, or a RuntimeError naming it."""
        try:
            return settings.whole(name, default, least, environ)
        except ValueError as exc:
            raise RuntimeError(f"{exc} (as torchrun and srun set it)") from None

    if "RANK" in environ and "WORLD_SIZE" in environ:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in environ]
        if missing:
            raise RuntimeError(f"RANK and WORLD_SIZE are set but {', '.join(missing)} is not")
        world_size = whole("WORLD_SIZE", least=1)
        rank = whole("RANK")
        if rank >= world_size:
            raise RuntimeError(f"RANK={rank} is not a rank of a world of WORLD_SIZE={world_size} (0 to {world_size - 1})")
        return dict(
            rank=rank,
            world_size=world_size,
            local_rank=whole("LOCAL_RANK", 0),
            local_world_size=whole("LOCAL_WORLD_SIZE", world_size, least=1),
            master_addr=environ["MASTER_ADDR"],
            master_port=whole("MASTER_PORT", least=1),
        )
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise RuntimeError("SLURM_PROCID is set but SLURM_JOB_NODELIST is not")
        world_size = whole("SLURM_NTASKS", least=1)
        nnodes = whole("SLURM_NNODES", 1, least=1)
        return dict(
            rank=whole("SLURM_PROCID"),
            world_size=world_size,
            local_rank=whole("SLURM_LOCALID", 0),
            local_world_size=max(1, world_size // max(1, nnodes)),
            master_addr=environ.get("MASTER_ADDR") or first_slurm_host(nodelist),
            master_port=whole("MASTER_PORT", least=1) if environ.get("MASTER_PORT")
            else _slurm_port(environ.get("SLURM_JOB_ID", "0")),
        )
    return dict(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr=None, master_port=None)


def init_from_env(
    backend: Optional[str] = None,
    timeout: datetime.timedelta = DEFAULT_PG_TIMEOUT,
    environ: Optional[Mapping[str, str]] = None,
) -> DistEnv:
    """Initialise the default process group from torchrun's, SLURM's or no environment.

    Without either, this is rank 0 of a world of 1 (an in-memory store, no file or port),
    so collectives still work and later code never branches on "distributed or not".

    Args:
        backend: "gloo", "nccl" or "shm" (one machine); None picks NCCL when each local rank can
            have a GPU.
        timeout: how long a collective may wait for its peers before the backend gives up.
        environ: the variables to read (os.environ by default).

    Returns:
        The DistEnv of this process. Call `collectives.shutdown()` at the end.
    """
    info = read_env(os.environ if environ is None else environ)
    backend = pick_backend(info["local_world_size"], backend)
    device = device_for(backend, info["local_rank"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if info["master_addr"] is None:  # a world of one: an in-memory store, nothing left on disk
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout,
                                    **device_id_for(backend, device))
        else:
            try:
                dist.init_process_group(
                    backend, init_method=f"tcp://{info['master_addr']}:{info['master_port']}", rank=info["rank"],
                    world_size=info["world_size"], timeout=timeout, **device_id_for(backend, device),
                )
            except RuntimeError as exc:
                why = shared_store_restart(os.environ if environ is None else environ)
                if why:
                    raise RuntimeError(f"rank {info['rank']}: init_process_group failed ({str(exc).splitlines()[0]}); "
                                       f"{why}") from exc
                raise
            watch_agent(info["rank"], os.environ if environ is None else environ)  # under torchrun only
    return DistEnv(info["rank"], info["world_size"], info["local_rank"], device, backend)


def shared_store_restart(environ: Mapping[str, str]) -> str:
    """Why a rank restarted by torchrun's elastic agent could not connect, or "" when it was not.

    torch 2.13's c10d rendezvous shares the agent's TCPStore with the workers
    (TORCHELASTIC_USE_AGENT_STORE=True); after a restart the new ranks can read the keys of the
    attempt before, so Gloo connects to ports of dead ranks ("Connection refused"; NCCL likewise:
    pytorch/pytorch#135712). Measured on two namespace hosts: the restarted group failed in 2 runs
    of 3 with the shared store (and once more with a PrefixStore per restart count: the agents count
    restarts apart) and resumed bitwise with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        return ""
    return ("this is restart " + environ["TORCHELASTIC_RESTART_COUNT"] + " under torchrun, whose shared rendezvous "
            "store still holds the previous attempt's addresses: start torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment")


def shutdown() -> None:
    """Leave the process group cleanly: a barrier, then destroy_process_group().

    The barrier makes every rank leave together: with a tcp:// rendezvous (SLURM, or
    MASTER_ADDR/PORT by hand) rank 0 hosts the store, and a rank still tearing down when it exits
    would lose it. After this no group of this process is left alive by this library (its caches
    hold groups weakly; tests/collectives/test_env.py checks it): a Gloo group still referenced at
    exit keeps its worker threads running into interpreter shutdown, where one that drops a tensor
    with a Python object can abort the process after the program's last line ("terminate called
    without an active exception"). A program that keeps a group in its own globals should drop it
    before it exits.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
