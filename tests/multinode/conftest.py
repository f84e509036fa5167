import pytest

from collectives import cluster


@pytest.fixture(scope="module")
def hosts():
    """Two test hosts, node0 and node1, for the tests of one module; removed after them."""
    cluster.up(2)
    yield ["node0", "node1"]
    cluster.down()
