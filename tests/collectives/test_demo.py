"""The demo (the README's main job) runs, checks its outputs and says so.

    pytest tests/collectives/test_demo.py -q
"""

from collectives import demo


def test_demo_shows_every_rank_and_finds_nothing_wrong(capsys):
    assert demo.main(["--world-size", "3", "-c", "all_to_all", "all_gather", "--checked"]) == 0
    out = capsys.readouterr().out
    assert "rank 2: in [20 21 22]" in out and "-> out [2 12 22]" in out
    assert "op differ" in out
    assert "6 outputs right, 0 wrong" in out
