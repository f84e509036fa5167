"""The suite's own order (tests/conftest.py): the modules it runs before the shm bridge is built
are files that exist, each named once, so a renamed or misspelt one cannot silently go back to
waiting for the build.

    pytest tests/test_suite_order.py -q
"""

import os

from .conftest import WITHOUT_BRIDGE, WITHOUT_BRIDGE_WHEN_NO_HOSTS


def test_the_modules_run_before_the_bridge_exist_and_are_named_once():
    named = WITHOUT_BRIDGE + WITHOUT_BRIDGE_WHEN_NO_HOSTS
    assert [path for path in named if not os.path.isfile(path)] == []
    assert len(set(named)) == len(named)
