"""benchmarks.tensor_parallel: a short run times the four variants, and the bytes it reports are
the closed forms: TP's activations, (1 + 2L) b s h + 3 b s forward and (2L + 1) b s h backward
elements, for the batch each TP rank holds; DP's, the parameters a rank holds; PP's, a
microbatch's activation a stage sends on and its gradient back, b s h / m each.

    pytest tests/benchmarks/test_tensor_parallel_benchmark.py -q
"""

import json

import pytest

from benchmarks import tensor_parallel
from ddp_from_scratch.tensor_parallel.messages import pipeline_messages, step_messages


def test_a_short_run_reports_the_closed_form_bytes(tmp_path, capsys):
    out = tmp_path / "tp.json"
    args = ["--world-size", "2", "--tp", "2", "--rounds", "1", "--batch-size", "2", "--seq", "4", "--vocab", "8",
            "--hidden", "8", "--heads", "2", "--layers", "1", "--json", str(out)]
    assert tensor_parallel.main(args) == 0
    saved = json.loads(out.read_text())
    h, s, layers, n = 8, 4, 1, 2
    b = n * 2  # TP: every rank the whole global batch
    tp = (1 + 2 * layers) * b * s * h + 3 * b * s + (2 * layers + 1) * b * s * h
    whole = 8 * 8 + layers * (2 * 2 * h + 4 * (h * h + h) + (h * 4 * h + 4 * h) + (4 * h * h + h)) + 2 * h + h * 8
    assert saved["elements"]["TP"] == {"tp": tp, "dp": 0, "pp": 0}, saved["elements"]
    assert saved["elements"]["DP"] == {"tp": 0, "dp": whole, "pp": 0}, saved["elements"]
    assert saved["elements"]["PP x DP"] == {"tp": 0, "dp": 0, "pp": b * s * h}, saved["elements"]  # stage 0: forward
    assert saved["elements"]["TP x DP"]["tp"] == tp  # a mesh of 2 x 1: the same TP, a DP group of one
    assert all(len(t) == 1 for t in saved["times_s"].values())
    printed = capsys.readouterr().out
    assert "TP x DP" in printed and "TP sends fewer bytes than DP below" in printed
    assert "PP x DP" in printed and "a pipeline stage sends fewer bytes than a DP rank below" in printed
    # the closed forms of ddp_from_scratch/tensor_parallel/messages.py are what the run counted
    config = {"vocab": 8, "hidden": h, "heads": 2, "layers": layers, "batch_size": 2, "seq": s}
    shape = tensor_parallel.shape_of(config, n)
    assert step_messages(shape, n, tp=n).elements == saved["elements"]["TP"]
    assert step_messages(shape, n, tp=1).elements == saved["elements"]["DP"]
    pipe = pipeline_messages(shape, n, pp=2, microbatches=saved["microbatches"])
    assert pipe.elements == saved["elements"]["PP x DP"] and pipe.bubble == pytest.approx(1 / 5)


@pytest.mark.parametrize("argv, says", [
    (["--world-size", "4", "--tp", "3"], "--tp 3 must divide"),
    (["--world-size", "4", "--pp", "3"], "--pp 3 must divide --world-size 4"),
    (["--world-size", "4", "--pp", "4", "--layers", "1"], "--pp 4: the model has 3 pieces to cut"),
    (["--world-size", "4", "--pp", "4", "--microbatches", "2"], "1F1B needs at least as many as --pp 4"),
    (["--world-size", "4", "--pp", "2", "--microbatches", "3"], "--microbatches 3 must divide the 8 sequences"),
])
def test_sizes_the_ranks_do_not_divide_are_usage_errors(argv, says, capsys):
    with pytest.raises(SystemExit) as info:
        tensor_parallel.main(argv)
    assert info.value.code == 2 and says in capsys.readouterr().err
