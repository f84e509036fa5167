"""benchmarks.studies.split_backward: a tiny run times every part, its split gives B's gradients
bit for bit (twice B's with the W later, the same microbatch run twice), it counts page faults, and
the stage it times is the pipeline benchmark's last stage.

    pytest tests/benchmarks/test_split_backward_study.py -q
"""

import json

import torch

from benchmarks.studies import split_backward


def test_a_short_run_times_each_part_and_its_split_is_bs_bits(tmp_path, capsys):
    out = tmp_path / "split.json"
    assert split_backward.main(["--rounds", "2", "--width", "16", "--depth", "2", "--json", str(out)]) == 0
    saved, printed = json.loads(out.read_text()), capsys.readouterr().out
    assert saved["same_bits"] is True and saved["config"]["rounds"] == 2
    for part in ("B", "I", "W", "I + W", "W later", "I + W, W later", "input's gradient alone",
                 "weights' gradients alone", "products, layer by layer (as B)",
                 "products, inputs' then weights' (as I, W)"):
        assert saved["ms"][part] > 0, part
        assert f"\n{part} " in printed, (part, printed)
    assert "the split's gradients are B's bit for bit: yes" in printed
    assert saved["ms"]["I + W"] >= saved["ms"]["I"] and saved["i_plus_w_over_b"] > 0
    assert saved["ms"]["I + W, W later"] >= saved["ms"]["W later"] and saved["i_plus_w_later_over_b"] > 0
    assert set(saved["page_faults"]) == {"B", "W", "W later"} and all(n >= 0 for n in saved["page_faults"].values())
    assert saved["finding_groups_ms"] == saved["ms"]["I"] - saved["ms"]["input's gradient alone"]


def test_the_stage_is_the_second_half_of_the_benchmarks_model():
    stage = split_backward.last_stage(16, 3)  # 3 Linear(16)+Tanh and a Linear to 10: 7 layers, cut in 2
    linears = [m for m in stage if isinstance(m, torch.nn.Linear)]
    assert linears[-1].out_features == 10 and all(m.in_features == 16 for m in linears)
    assert 0 < len(list(stage)) < 7
