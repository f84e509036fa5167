"""Reading torchrun's and SLURM's environments, and programs really started by torchrun and by
an srun-like launcher.

    pytest tests/collectives/test_env.py -q
"""

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from collectives.launcher.env import first_slurm_host, pick_backend, read_env, shared_store_restart


def test_torchrun_variables():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
    assert read_env(env) == dict(rank=3, world_size=8, local_rank=1, local_world_size=2,
                                 master_addr="10.0.0.1", master_port=29400)


def test_torchrun_variables_without_master_are_refused():
    with pytest.raises(RuntimeError, match="MASTER_ADDR, MASTER_PORT"):
        read_env({"RANK": "0", "WORLD_SIZE": "2"})


TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29400"}
SLURM = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"}


@pytest.mark.parametrize("env, says", [
    ({**TORCHRUN, "WORLD_SIZE": "two"}, "WORLD_SIZE='two': must be a whole number of at least 1"),
    ({**TORCHRUN, "WORLD_SIZE": "0"}, "WORLD_SIZE='0': must be a whole number of at least 1"),
    ({**TORCHRUN, "RANK": "-1"}, "RANK='-1': must be a whole number of at least 0"),
    ({**TORCHRUN, "RANK": "2"}, "RANK=2 is not a rank of a world of WORLD_SIZE=2 (0 to 1)"),
    ({**TORCHRUN, "LOCAL_RANK": "x"}, "LOCAL_RANK='x': must be a whole number"),
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": "1.5"}, "LOCAL_WORLD_SIZE='1.5': must be a whole number"),
    ({**TORCHRUN, "MASTER_PORT": "port"}, "MASTER_PORT='port': must be a whole number of at least 1"),
    ({**SLURM, "SLURM_NTASKS": "many"}, "SLURM_NTASKS='many': must be a whole number of at least 1"),
    ({**SLURM, "SLURM_PROCID": ""}, "SLURM_PROCID='': must be a whole number"),
    ({**SLURM, "SLURM_NNODES": "0"}, "SLURM_NNODES='0': must be a whole number of at least 1"),
])
def test_a_variable_that_is_not_a_whole_number_is_named(env, says):
    with pytest.raises(RuntimeError) as info:
        read_env(env)
    assert str(info.value).startswith(says), str(info.value)


def test_slurm_variables():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456"}
    got = read_env(env)
    assert (got["rank"], got["world_size"], got["local_rank"], got["local_world_size"]) == (5, 8, 1, 4)
    assert got["master_addr"] == "gpu07"
    assert got["master_port"] == 15000 + 123456 % 20000
    assert read_env({**env, "MASTER_PORT": "4000", "MASTER_ADDR": "x"})["master_port"] == 4000


@pytest.mark.parametrize("nodelist, first", [
    ("node1", "node1"), ("gpu[03-05,9],cpu1", "gpu03"), ("a[1,3]", "a1"), ("h-01,h-02", "h-01"), ("x[007]", "x007"),
])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_plain_process_is_rank_0_of_1():
    assert read_env({}) == dict(rank=0, world_size=1, local_rank=0, local_world_size=1,
                                master_addr=None, master_port=None)


def test_backend_choice(monkeypatch):
    monkeypatch.delenv("COLLECTIVES_BACKEND", raising=False)
    assert pick_backend(2, "GLOO") == "gloo"
    with pytest.raises(ValueError, match="'gloo', 'nccl' or 'shm'"):
        pick_backend(1, "mpi")
    import torch

    if not torch.cuda.is_available():
        assert pick_backend(1) == "gloo"
        with pytest.raises(ValueError, match="needs CUDA"):
            pick_backend(1, "nccl")


def test_backend_from_the_environment_variable(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_BACKEND", "shm")
    assert pick_backend(2) == "shm" and pick_backend(2, "gloo") == "gloo"  # an explicit one wins
    monkeypatch.setenv("COLLECTIVES_BACKEND", "mpi")
    with pytest.raises(ValueError, match="COLLECTIVES_BACKEND must be 'gloo', 'nccl' or 'shm', got 'mpi'"):
        pick_backend(1)


PROGRAM = textwrap.dedent("""
    import gc, weakref, torch, torch.distributed as dist, collectives
    env = collectives.init_from_env()
    t = torch.tensor([env.rank + 1.0])
    collectives.all_reduce(t)
    collectives.all_reduce(t)
    t /= env.world_size  # the sum again (the second call takes the wrappers' fast path)
    print(f"rank={env.rank} world={env.world_size} local={env.local_rank} backend={env.backend} sum={t.item():g}")
    world = weakref.ref(dist.group.WORLD)
    collectives.shutdown()
    gc.collect()
    print(f"world group kept after shutdown: {world() is not None}")
""")
# The last line: nothing may keep the world's group (and its Gloo threads) alive past shutdown(),
# or those threads run into interpreter shutdown, where they can abort the process.


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_plain_python_program_leaves_nothing_in_tmp(tmp_path):
    (tmp_path / "prog.py").write_text(PROGRAM)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = subprocess.run([sys.executable, str(tmp_path / "prog.py")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TMPDIR": str(tmp)})
    assert out.returncode == 0, out.stderr
    assert "rank=0 world=1 local=0 backend=gloo sum=1" in out.stdout
    assert "world group kept after shutdown: False" in out.stdout
    assert list(tmp.iterdir()) == []  # no rendezvous folder left behind (there used to be one per run)


@pytest.mark.slow
def test_torchrun_program(tmp_path):
    (tmp_path / "prog.py").write_text(PROGRAM)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(tmp_path / "prog.py")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    for r in range(2):
        assert f"rank={r} world=2 local={r} backend=gloo sum=3" in out.stdout
    assert out.stdout.count("world group kept after shutdown: False") == 2, out.stdout


def _launch_slurm_like(script):
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    base.update(SLURM_NTASKS="2", SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="1",
                MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}) for r in range(2)]
    return [(p.wait(timeout=180), *p.communicate()) for p in procs]


@pytest.mark.slow
def test_slurm_like_program(tmp_path):
    """Two processes given only SLURM's variables, as srun would, find each other, and leave
    nothing of their group to interpreter shutdown (where Gloo's threads aborted 1 run in 60)."""
    (tmp_path / "prog.py").write_text(PROGRAM)
    results = _launch_slurm_like(tmp_path / "prog.py")
    for r, (code, stdout, stderr) in enumerate(results):
        assert code == 0, f"rank {r} exited with {code}: {stderr}"
        assert f"rank={r} world=2 local={r} backend=gloo sum=3" in stdout
        assert "world group kept after shutdown: False" in stdout, stdout


@pytest.mark.parametrize("environ, says", [
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2"}, True),
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}, False),  # a first attempt
    ({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_RESTART_COUNT": "1"}, False),  # not shared
    ({}, False),  # not under torchrun
])
def test_a_failed_connect_after_a_restart_on_the_shared_store_names_the_setting(environ, says):
    why = shared_store_restart(environ)
    assert bool(why) == says
    if says:
        assert "restart 2" in why and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in why
