"""Tests across namespace hosts (collectives.cluster): they run where this process is root and can
make network namespaces, and are skipped with the reason elsewhere."""

import pytest

from collectives import cluster

try:
    cluster.check_can_run()
    WHY_NOT = ""
except (cluster.ClusterError, FileNotFoundError) as exc:
    WHY_NOT = str(exc)
needs_hosts = pytest.mark.skipif(bool(WHY_NOT), reason=f"no test hosts here: {WHY_NOT}")
