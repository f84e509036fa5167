"""The transformer runs' text (ddp_from_scratch/workload/text.py): a file as bytes, the last tenth
held out, a step's batch drawn from (seed, step) alone and never from the held-out tail, each
target the byte after its token, the validation windows inside the tail; a missing or short file
refused in one line naming it; with no file, Python's own documentation text; and a TP run on
text that trains (its loss falls) with the one-rank model's losses, validation losses and sample.

    pytest tests/ddp/test_text.py -q
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collectives.testing import run_on_ranks
from ddp_from_scratch.train.args import TrainConfig, build_parser
from ddp_from_scratch.train.tp import train_tp
from ddp_from_scratch.workload.text import HELD_OUT, Text, TextError


def _counting(n: int, tmp_path) -> Text:
    """A text whose byte at i is i mod 251: where a window came from shows in its first byte."""
    path = tmp_path / "count.txt"
    path.write_bytes(bytes(i % 251 for i in range(n)))
    return Text.load(str(path), seq=8)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(90, 3000), step=st.integers(0, 10_000), seed=st.integers(0, 5), rows=st.integers(1, 9))
def test_a_batch_is_windows_of_the_training_part_and_each_target_is_the_next_byte(tmp_path_factory, n, step, seed,
                                                                                   rows):
    text = _counting(n, tmp_path_factory.mktemp("t"))
    tokens, targets = text.batch(step, rows, seq=8, seed=seed)
    assert tokens.shape == targets.shape == (rows, 8) and tokens.dtype == torch.long
    assert torch.equal(targets[:, :-1], tokens[:, 1:])  # the same window, one byte on
    assert torch.equal((tokens[:, 0] + 8) % 251, targets[:, -1])  # each window is 9 consecutive bytes
    split = n - n // HELD_OUT
    whole = text.data.long()
    for row in range(rows):  # find the window in the training part: it never reaches the tail
        starts = [o for o in range(split - 8) if torch.equal(whole[o:o + 9], torch.cat([tokens[row], targets[row, -1:]]))]
        assert starts, (n, step, seed, row)
    again = text.batch(step, rows, seq=8, seed=seed)
    assert torch.equal(again[0], tokens)  # from (seed, step) alone
    val_tokens, val_targets = text.validation(rows=3, seq=8)
    assert torch.equal(val_targets[:, :-1], val_tokens[:, 1:])


def test_the_validation_windows_lie_in_the_held_out_tail(tmp_path):
    text = _counting(2000, tmp_path)
    split = 2000 - 200
    tokens, _ = text.validation(rows=5, seq=8)
    firsts = tokens[:, 0].tolist()
    assert firsts[0] == split % 251 and firsts[-1] == (2000 - 9) % 251  # from the tail's start to its last window
    assert all(text.batch(s, 64, 8)[0].numel() for s in range(3))


def test_a_missing_or_short_text_is_refused_in_one_line_naming_it(tmp_path):
    with pytest.raises(TextError, match=r"--text .*nothing.txt: cannot read it \(No such file or directory\)"):
        Text.load(str(tmp_path / "nothing.txt"), seq=32)
    short = tmp_path / "short.txt"
    short.write_bytes(b"abc")
    with pytest.raises(TextError, match="3 bytes, too short: a window is 33 bytes and the last 1/10 is held out for "
                                        "validation, so it needs at least 330"):
        Text.load(str(short), seq=32)


def test_with_no_file_the_text_is_pythons_documentation():
    text = Text.load(None, seq=32)
    assert len(text.data) > 100_000 and "pydoc_data.topics" in text.name
    assert b"assert" in bytes(text.data[:2000].tolist())


def test_a_tp_run_on_text_learns_with_the_one_rank_models_losses():
    """The global batch is the text's, the same on every layout: TP over 2 ranks gives the one-rank
    model's losses within float32 rounding, and 6 steps on real text bring the loss down."""
    def run(tp):
        args = build_parser().parse_args(["--tp", str(tp), "--train-size", "48", "--batch-size", "8", "--lr", "0.05",
                                          "--eval-every", "3", "--sample", "40"])
        return run_on_ranks(train_tp, tp, args=(TrainConfig.from_args(args),), backend="gloo")[0]

    one, split = run(1), run(2)
    assert one["text"] == split["text"] and not one["synthetic_data"]
    torch.testing.assert_close(torch.tensor(split["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-6)
    assert one["losses"][-1] < one["losses"][0] - 0.5  # bytes of English and code: learnable fast
    # the held-out tail's loss after steps 3 and 6, the same on both layouts, and falling
    assert [v["step"] for v in one["validation"]] == [v["step"] for v in split["validation"]] == [3, 6]
    torch.testing.assert_close(torch.tensor([v["loss"] for v in split["validation"]]),
                               torch.tensor([v["loss"] for v in one["validation"]]), rtol=1e-5, atol=1e-6)
    assert one["validation"][1]["loss"] < one["validation"][0]["loss"] and one["validation_loss"] == one["validation"][1]["loss"]
    # 40 bytes written after the held-out prompt, the same by the TP shards gathered into one model
    assert len(one["sample"].encode()) >= 40 and split["sample"] == one["sample"]
