"""A real SLURM cluster on the test hosts of collectives.cluster: `up --slurm`.

    python -m collectives.cluster up --nodes 2 --slurm
    python -m collectives.cluster run node0 -- sbatch -N2 --ntasks-per-node=2 examples/slurm/train.sbatch
    python -m collectives.cluster run node0 -- sinfo

munged runs on the machine (as the munge user; its socket is shared by every host), slurmctld
in node0 (its hostname there is node0, which SlurmctldHost names) and one slurmd per host, each in
the foreground under this module's control, so `down` stops them by pid. The configuration is
written under the cluster's state folder and found through SLURM_CONF, which every command run
on a host gets; nothing is written to /etc/slurm. Settings this machine kind needs (found by
trying): proctrack/linuxproc, task/none, and a cgroup.conf with cgroup/v1.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import time
from typing import Dict, List

BINARIES = ("munged", "slurmctld", "slurmd", "sinfo", "sbatch", "srun", "scancel")
APT = "apt-get install -y slurm-wlm munge"


class SlurmError(RuntimeError):
    """What stops the SLURM part, in one line."""


def missing() -> List[str]:
    return [b for b in BINARIES if shutil.which(b) is None and not os.path.exists(f"/usr/sbin/{b}")]


def config_dir(state_dir: str) -> str:
    return os.path.join(state_dir, "slurm")


def write_config(state_dir: str, nodes: List[Dict], cpus: int) -> str:
    """slurm.conf and cgroup.conf for these hosts; the path of slurm.conf."""
    d = config_dir(state_dir)
    os.makedirs(os.path.join(d, "state"), exist_ok=True)
    lines = [
        "ClusterName=collectives", f"SlurmctldHost={nodes[0]['name']}({nodes[0]['address']})",
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none", "ReturnToService=2",
        "SchedulerType=sched/backfill", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool-%n",
        f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd-%n.pid",
        f"SlurmctldLogFile={d}/slurmctld.log", f"SlurmdLogFile={d}/slurmd-%n.log",
        "SlurmctldTimeout=30", "SlurmdTimeout=30", "KillWait=5",
    ]
    lines += [f"NodeName={n['name']} NodeAddr={n['address']} CPUs={cpus} State=UNKNOWN" for n in nodes]
    lines.append("PartitionName=hosts Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4")
    with open(os.path.join(d, "slurm.conf"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(d, "cgroup.conf"), "w") as f:
        f.write("CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n")
    return os.path.join(d, "slurm.conf")


def start_munged() -> int:
    """munged as the munge user, with its key and folders owned by it; its pid."""
    try:
        munge = pwd.getpwnam("munge")
    except KeyError:
        raise SlurmError(f"no munge user: {APT}") from None
    for path in ("/etc/munge", "/var/lib/munge", "/var/log/munge", "/run/munge"):
        os.makedirs(path, exist_ok=True)
        os.chown(path, munge.pw_uid, munge.pw_gid)
    key = "/etc/munge/munge.key"
    if not os.path.exists(key):
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
    os.chown(key, munge.pw_uid, munge.pw_gid)
    os.chmod(key, 0o400)
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0:
        return int(subprocess.run(["pgrep", "-x", "munged"], capture_output=True, text=True).stdout.split()[0])
    out = subprocess.run(["runuser", "-u", "munge", "--", "munged"], capture_output=True, text=True)
    if out.returncode:
        raise SlurmError(f"munged did not start: {out.stderr.strip()}")
    with open("/run/munge/munged.pid") as f:
        return int(f.read())


def wait_idle(run_on_first, hosts: List[str], timeout: float = 60) -> str:
    """Until sinfo (run on the first host) shows every host idle; its last output."""
    deadline, said = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        out = run_on_first(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True)
        said = out.stdout.strip() or out.stderr.strip()
        states = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
        if all(states.get(h) == "idle" for h in hosts):
            return said
        time.sleep(1)
    raise SlurmError(f"the hosts were not all idle in sinfo within {timeout:g} s: {said or 'no answer'}")
