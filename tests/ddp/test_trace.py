"""The bucket timeline: every gradient's ready time, every bucket's launch and completion, the
end of backward, exported as a Chrome trace and a PNG; and the layout before and after the rebuild.

    pytest tests/ddp/test_trace.py -q
"""

import json

import pytest

import torch.nn.functional as F

from ddp_from_scratch.workload.models import SmallNet, batch
from ddp_from_scratch.steps.ddp import DistributedDataParallel
from ddp_from_scratch.trace import plot_timeline, write_chrome_trace
from collectives.testing import run_on_ranks


def _traced(env, out_dir):
    model = DistributedDataParallel(SmallNet(), bucket_cap_mb=0.0005, first_bucket_mb=0.0001)
    for step in range(2):
        x, y = batch(step, env.rank, 4, 12)
        F.cross_entropy(model(x), y).backward()
    tl = model.timeline
    n_buckets = len(tl["buckets"])
    assert len(tl["ready"]) == sum(len(b) for b in tl["buckets"]) == 8
    assert sorted(tl["launch"]) == list(range(n_buckets)) and sorted(tl["done"]) == list(range(n_buckets))
    for bucket in range(n_buckets):
        last_ready = max(t for _, b, t in tl["ready"] if b == bucket)
        assert last_ready <= tl["launch"][bucket] <= tl["done"][bucket] <= tl["end"]
    launches = [tl["launch"][b] for b in range(n_buckets)]
    assert launches == sorted(launches)  # buckets go out in order
    if env.rank == 0:
        write_chrome_trace(tl, str(out_dir / "trace.json"), rank=0)
        plot_timeline(tl, str(out_dir / "timeline.png"))
    return n_buckets, model.layouts


def test_timeline_trace_and_layouts(tmp_path):
    n_buckets, layouts = run_on_ranks(_traced, 2, args=(tmp_path,))[0]
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == n_buckets == 3 and all(e["dur"] >= 0 for e in spans)
    assert sum(e["name"].startswith("grad ready") for e in events) == 8
    assert any(e["name"] == "end of backward" for e in events)
    assert (tmp_path / "timeline.png").stat().st_size > 5000
    assert set(layouts) == {"initial", "rebuilt"}
    assert layouts["initial"].count("bucket ") == 1  # first iteration: one bucket, as torch does
    assert "bucket 2:" in layouts["rebuilt"] and "bucket 3:" not in layouts["rebuilt"]


def test_trace_program_writes_every_rank_and_prints_the_layouts(tmp_path, capsys):
    from ddp_from_scratch import trace

    out = tmp_path / "tl"
    assert trace.main(["--model", "small", "--world-size", "2", "--batch-size", "4", "--out", str(out)]) == 0
    events = json.loads((tmp_path / "tl.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    assert (tmp_path / "tl.png").stat().st_size > 5000
    text = capsys.readouterr().out
    assert "bucket layout, initial:\nbucket 0:   8 params" in text and "bucket layout, rebuilt:" in text
    assert "rank 0, bucket 0: last gradient ready at" in text and "end of backward at" in text


def test_sharded_spans_are_drawn_and_traced(tmp_path):
    from ddp_from_scratch.parts.timeline import Timeline
    from ddp_from_scratch.trace import chrome_trace_events, plot_timeline

    t = Timeline([["a.weight"], ["b.weight", "b.bias"]], [1024, 4 << 20])
    t0 = t.events["start"]
    t.span("all_gather unit 0 (forward)", "unit 0", t0 + 0.001, t0 + 0.002)
    t.span("all_gather unit 1 (backward)", "unit 1", t0 + 0.003, t0 + 0.005)
    t.span("reduce_scatter unit 1", "unit 1", t0 + 0.006, t0 + 0.008)
    t.span("all_gather (after the step)", "parameters", t0 + 0.009, t0 + 0.010)
    t.ready("b.weight", 1)
    t.finished()
    events = chrome_trace_events(t.events)
    spans = [(e["name"], e["tid"], round(e["dur"])) for e in events if e.get("ph") == "X"]
    assert ("reduce_scatter unit 1", "unit 1", 2000) in spans and ("all_gather unit 0 (forward)", "unit 0", 1000) in spans
    plot_timeline(t.events, str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_trace_program_traces_the_bucketed_zero2_one_reduce_scatter_per_bucket(tmp_path, capsys):
    from ddp_from_scratch import trace

    out = tmp_path / "z2"
    assert trace.main(["--impl", "zero2", "--bucket-cap-mb", "0.001", "--model", "small", "--world-size", "2",
                       "--batch-size", "4", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    units = [line for line in text.splitlines() if line.startswith("rank 0, reduce_scatter unit ")]
    assert len(units) > 1, text  # the cap was passed on: a bucket each, not the model in one
    assert text.count("\nunit ") == len(units), text


def test_trace_program_refuses_a_bucket_cap_for_other_impls(capsys):
    from ddp_from_scratch import trace

    with pytest.raises(SystemExit):
        trace.main(["--impl", "fsdp", "--bucket-cap-mb", "5"])
    assert "--bucket-cap-mb applies to --impl zero2 or zero2-bucketed here, not fsdp" in capsys.readouterr().err
