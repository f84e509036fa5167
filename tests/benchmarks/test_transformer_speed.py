"""benchmarks/transformer_speed.py: its FLOPs a step are the model's, counted by torch's own
FlopCounterMode on a real training step (every product, forward and backward), plus causal
attention counted whole (the counter does not see the CPU's attention kernel); the refusals.

    pytest tests/benchmarks/test_transformer_speed.py -q
"""

from __future__ import annotations

import pytest
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import transformer_speed
from ddp_from_scratch.workload.transformer import TinyTransformer, token_batch


@pytest.mark.parametrize("hidden, heads, layers, seq, batch", [(64, 4, 2, 32, 16), (48, 3, 3, 16, 5), (32, 2, 1, 8, 1)])
def test_the_flops_of_a_step_are_the_models_products_and_its_attention(hidden, heads, layers, seq, batch):
    model = TinyTransformer(256, hidden, heads, layers, positions=seq)
    tokens, targets = token_batch(0, 0, batch, seq, 256)
    with FlopCounterMode(display=False) as counted:
        F.cross_entropy(model(tokens).reshape(-1, 256), targets.reshape(-1)).backward()
    attention = 3 * batch * seq * layers * 4 * seq * hidden  # QK^T and AV, forward and twice backward
    assert transformer_speed.step_flops(256, hidden, layers, seq, batch * seq) - attention == counted.get_total_flops()


def test_where_the_time_goes_times_each_part():
    args = transformer_speed.build_parser().parse_args(["--hidden", "32", "--layers", "1", "--seq", "8",
                                                        "--batch-size", "4"])
    parts = transformer_speed.where_the_time_goes(args, steps=3)
    assert set(parts) == {"forward", "backward", "optimizer", "forward_products", "forward_attention"}
    assert all(v > 0 for v in parts.values())
    assert parts["forward_products"] < parts["forward"]  # a part of the forward, timed alone


@pytest.mark.parametrize("argv, fragment", [
    (["--hidden", "30", "--heads", "4"], "--heads 4 does not divide --hidden 30"),
    (["--batch-size", "6"], "does not split over the layout"),  # 4 microbatches of the pipeline
    (["--steps", "2"], "--steps must be at least 3"),
])
def test_what_the_benchmark_cannot_run_is_refused(argv, fragment, capsys):
    with pytest.raises(SystemExit) as info:
        transformer_speed.main(argv)
    assert info.value.code == 2 and fragment in capsys.readouterr().err
