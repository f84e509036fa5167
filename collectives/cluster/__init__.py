"""Test hosts on one machine: network namespaces on a bridge (hosts.py), an impaired link's wire
(wire.py), and a SLURM cluster on the hosts (slurm.py).

    python -m collectives.cluster up --nodes 2 [--link 1gbit] [--slurm]     # hosts.py says more
    from collectives import cluster; cluster.up(2); cluster.run_on("node0", ["hostname"])
"""

from .hosts import (BRIDGE, NETNS_ETC, PREFIX, ClusterError, address, busy, check_can_run, down, host_command, load_state,
                    main, namespace, processes, run_on, shape, status, up)

__all__ = ["BRIDGE", "NETNS_ETC", "PREFIX", "ClusterError", "address", "busy", "check_can_run", "down", "host_command",
           "load_state", "main", "namespace", "processes", "run_on", "shape", "status", "up"]
