"""A script that calls collectives.run() without the __main__ guard gets a hint, not a riddle.

    pytest tests/collectives/test_launch_guard.py -q
"""

import subprocess
import sys


def test_missing_main_guard_is_explained(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text("import collectives\n\ndef f(env):\n    return env.rank\n\nprint(collectives.run(f, world_size=2))\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert out.returncode != 0
    assert "in start-up" in out.stderr and '`if __name__ == "__main__":`' in out.stderr
