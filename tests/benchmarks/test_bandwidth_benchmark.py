"""benchmarks.bandwidth: the table round-trips through its parser, busbw factors are nccl-tests',
#wrong counts a planted wrong element, every collective's check data is exact, flags refuse
nonsense, and a small end-to-end run writes its table, JSON, CSV and plot.

    pytest tests/benchmarks -q
"""

import csv
import json
import math
import pathlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import bandwidth as bench
from benchmarks.parts import cases
from benchmarks.parts.bandwidth_report import add_limits, faster_by_size, over_limit
from benchmarks.parts.nccl_format import bandwidths, bus_factor, format_row, header, parse_table
from benchmarks.plot import plot_results
from benchmarks.parts.sweep import size_list
from collectives.testing import run_on_ranks

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _side(t, wrong=0, limit=None):
    algbw, busbw = bandwidths(1 << 20, t, "all_reduce", 4)
    return {"time_us": t, "algbw": round(algbw, 2), "busbw": round(busbw, 2), "wrong": wrong, "limit_pct": limit}


@pytest.mark.parametrize("with_limit", [False, True])
def test_table_round_trips_through_the_parser(with_limit):
    rows = [
        {"size": 8, "count": 2, "type": "float", "redop": "sum", "root": -1, "oop": None, "ip": _side(35.66, 0, 1.5)},
        {"size": 1 << 20, "count": 1 << 18, "type": "half", "redop": "none", "root": 0,
         "oop": _side(1234.5, 3, 50.0), "ip": _side(999.99, None, None)},
    ]
    text = header(with_limit) + "\n" + "\n".join(format_row(r, with_limit) for r in rows)
    parsed = parse_table(text)
    assert len(parsed) == 2
    for got, want in zip(parsed, rows):
        for key in ("size", "count", "type", "redop", "root"):
            assert got[key] == want[key]
        assert got["oop"] is None if want["oop"] is None else got["oop"]["time_us"] == pytest.approx(want["oop"]["time_us"], abs=0.005)
        assert got["ip"]["wrong"] == want["ip"]["wrong"]
        if with_limit:
            assert got["ip"]["limit_pct"] == (None if want["ip"]["limit_pct"] is None else pytest.approx(want["ip"]["limit_pct"], abs=0.05))
    assert "\n".join(format_row(r, with_limit) for r in parsed) == "\n".join(format_row(r, with_limit) for r in rows)


def test_cells_never_run_together_at_any_size():
    """Times past 99,999 us once ran into the previous column ("N/A132366.16"), and the parser
    dropped those rows. Every cell keeps a space before it, and time switches format as it grows."""
    big = {"time_us": 132366.16, "algbw": 0.5, "busbw": 0.75, "limit_pct": 27.0, "wrong": 0}
    huge = {"time_us": 123456789.0, "algbw": 12345.67, "busbw": 0.0, "limit_pct": 1000.0, "wrong": 16777216}
    rows = [{"size": 64 << 20, "count": 16 << 20, "type": "float", "redop": "sum", "root": -1, "oop": None, "ip": big},
            {"size": 1 << 40, "count": 1 << 38, "type": "bfloat16", "redop": "none", "root": 0, "oop": huge, "ip": big}]
    for with_limit in (False, True):
        text = header(with_limit) + "\n" + "\n".join(format_row(r, with_limit) for r in rows)
        assert "N/A1" not in text and "%1" not in text
        parsed = parse_table(text)
        assert [r["size"] for r in parsed] == [64 << 20, 1 << 40]
        assert parsed[0]["ip"]["time_us"] == pytest.approx(132366.2) and parsed[1]["oop"]["time_us"] == 123456789.0
        assert parsed[1]["oop"]["wrong"] == 16777216


@pytest.mark.parametrize("ranks", [2, 4])
def test_committed_results_parse_in_full(ranks):
    """Every row of the committed JSON is in the committed table, with the same numbers."""
    stem = RESULTS / f"bandwidth_gloo-cpu-2core_{ranks}ranks_2026-11-22"
    saved = json.loads(stem.with_suffix(".json").read_text())["rows"]
    text = stem.with_suffix(".txt").read_text()
    by_collective = text.split("#\n# ")[1:]  # one table per collective
    parsed = [row for part in by_collective for row in parse_table(part)]
    assert len(parsed) == len(saved) > 0
    for got, want in zip(parsed, saved):
        assert (got["size"], got["count"]) == (want["size"], want["count"])
        for side in ("oop", "ip"):
            if want[side] is None:
                assert got[side] is None
            else:
                assert got[side]["time_us"] == pytest.approx(want[side]["time_us"], rel=1e-3, abs=0.006)
                assert got[side]["wrong"] == want[side]["wrong"] == 0


def test_committed_side_by_side_results_parse_in_full():
    """The main job's committed table: a block per collective and backend, every row of the JSON
    in it with the same numbers, spread included, and no %limit over 100 left unexplained."""
    stem = RESULTS / "bandwidth_gloo-vs-shm-cpu-2core_2ranks_2026-11-26"
    saved = json.loads(stem.with_suffix(".json").read_text())
    text = stem.with_suffix(".txt").read_text()
    blocks = text.split("#\n# ")[1:]
    assert len(blocks) == 12 and blocks[0].startswith("all_reduce on gloo") and blocks[6].startswith("all_reduce on shm")
    parsed = [row for block in blocks for row in parse_table(block)]
    assert len(parsed) == len(saved["rows"]) == 2 * 6 * 24
    for got, want in zip(parsed, saved["rows"]):
        assert (got["size"], got["count"]) == (want["size"], want["count"])
        for side in ("oop", "ip"):
            if want[side] is None:
                assert got[side] is None
                continue
            assert got[side]["time_us"] == pytest.approx(want[side]["time_us"], rel=1e-3, abs=0.006)
            assert got[side]["wrong"] == want[side]["wrong"] == 0
            spread = 50 * (want[side]["time_us_max"] - want[side]["time_us_min"]) / want[side]["time_us"]
            assert got[side]["spread_pct"] == pytest.approx(spread, abs=0.051)
            if got[side]["limit_pct"] > 100:
                assert f"# over the limit: {want['backend']} {want['collective']} at " in text


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_bus_bandwidth_factors_are_nccl_tests(n):
    assert bus_factor("all_reduce", n) == 2 * (n - 1) / n
    for name in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bus_factor(name, n) == (n - 1) / n
    assert bus_factor("broadcast", n) == bus_factor("reduce", n) == bus_factor("sendrecv", n) == 1.0
    algbw, busbw = bandwidths(10**9, 10**6, "all_reduce", n)  # 1e9 bytes in one second
    assert algbw == pytest.approx(1.0) and busbw == pytest.approx(2 * (n - 1) / n)


def test_sizes():
    assert [bench.parse_size(s) for s in ("8", "64K", "16M", "1G", "2kb")] == [8, 65536, 16 << 20, 1 << 30, 2048]
    assert size_list(8, 64, 2) == [8, 16, 32, 64]
    assert size_list(8, 100, 4) == [8, 32]


@pytest.mark.parametrize("argv, message", [
    (["-b", "1M", "-e", "1K"], "-b 1048576 must be at least 1 and at most -e 1024"),
    (["-o", "mean"], "invalid choice: 'mean'"),
    (["-f", "1"], "step factor must be at least 2"),
    (["-o", "avg", "-d", "int32"], "-o avg needs a floating -d"),
    (["-b", "12X"], "not a number with an optional K, M or G suffix"),
    (["-c", "allreduce"], "invalid choice: 'allreduce'"),
    (["--rounds", "0"], "--rounds must be at least 1, got 0"),
    (["--budget-ms", "0"], "--budget-ms must be a positive number of milliseconds"),
    (["--budget-ms", "nan"], "--budget-ms must be a positive number of milliseconds"),
    (["--backend", "gloo", "gloo"], "--backend names a backend twice: gloo gloo"),
    (["--backend", "gloo", "tcp"], "invalid choice: 'tcp'"),
    (["--backend", "gloo", "shm", "--algorithm", "ring"], "--algorithm times one backend's point-to-point messages"),
])
def test_flags_refuse_nonsense(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when there is no GPU")
def test_nccl_without_a_gpu_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--backend", "nccl"])
    assert "need a CUDA device" in capsys.readouterr().err


def _check_all(env, op, dtype_name):
    """Every collective and side, odd and even counts: #wrong is 0 and a planted error counts 1."""
    dtype, out = bench.DTYPES[dtype_name], []
    for collective in bench.COLLECTIVES:
        for side in ("oop", "ip"):
            count = 6 * env.world_size
            case = cases.make_case(collective, side, count, env.world_size, env.rank, op, dtype, torch.device("cpu"))
            if case is None:
                continue
            clean = cases.count_wrong(case, "cpu")
            run, refill, expected = case

            def corrupted():  # the collective, then every rank's output gets one wrong element
                run()
                got, want = expected()
                if want is not None:
                    got.view(-1)[1] += 1

            planted = cases.count_wrong((corrupted, refill, expected), "cpu")
            out.append((collective, side, clean, planted))
    return out


@pytest.mark.parametrize("world_size, op, dtype", [(2, "sum", "float32"), (3, "prod", "bfloat16"), (4, "avg", "float16"),
                                                    (3, "max", "int32"), (4, "min", "int64")])
def test_check_data_is_exact_and_wrong_elements_are_counted_on_every_rank(world_size, op, dtype):
    """One wrong element planted on every rank whose output is defined: #wrong is the sum over
    ranks (world_size, or 1 for reduce, whose output only the root defines)."""
    results = run_on_ranks(_check_all, world_size, args=(op, dtype))
    for rank_results in results:  # every rank reports the same total
        assert rank_results == results[0]
    assert len(results[0]) == 9  # sendrecv out of place too
    for collective, side, clean, planted in results[0]:
        assert clean == 0, f"{collective} {side}: {clean} wrong on clean data"
        want = 1 if collective == "reduce" else world_size
        assert planted == want, f"{collective} {side}: planted {want} wrong elements (one per rank), counted {planted}"


def _buffers(env, nbytes, dtype_name):
    """Per collective and side: (the size column's bytes, the bytes of the buffer nccl-tests sizes)."""
    dtype, n, out = bench.DTYPES[dtype_name], env.world_size, []
    for collective in bench.COLLECTIVES:
        count = cases.buffer_count(collective, nbytes, n, dtype.itemsize)
        for side in ("oop", "ip"):
            case = cases.make_case(collective, side, count, n, env.rank, "sum", dtype, torch.device("cpu"))
            if case is None:
                continue
            case[0]()
            got, _ = case[2]()  # the output buffer
            per_rank_output = {"all_gather": got.numel(), "reduce_scatter": got.numel() * n}.get(collective, got.numel())
            out.append((collective, side, count * dtype.itemsize, per_rank_output * dtype.itemsize))
    return out


@pytest.mark.parametrize("world_size, nbytes, dtype", [(3, 1000, "float32"), (4, 64, "float16"), (2, 8, "int64")])
def test_size_column_is_the_bytes_of_the_buffer_moved(world_size, nbytes, dtype):
    for collective, side, size, moved in run_on_ranks(_buffers, world_size, args=(nbytes, dtype))[0]:
        assert size == moved, f"{collective} {side}: size column {size} B, buffer {moved} B"
        assert size <= max(nbytes, world_size * bench.DTYPES[dtype].itemsize)
        if collective in ("all_gather", "reduce_scatter", "all_to_all"):
            assert (size // bench.DTYPES[dtype].itemsize) % world_size == 0


@pytest.mark.slow
def test_end_to_end_small_run(tmp_path, capfd):  # capfd: the progress comes from the spawned ranks
    files = {k: tmp_path / f"run.{k}" for k in ("json", "csv", "png")}
    # -b 6: the sizes asked for (6, 24, 96, 384 B) are not what moves at the smallest: 1 float of
    # all_reduce (4 B), all_gather's count rounded up to one per rank (8 B); the size column says so
    rc = bench.main(["--world-size", "2", "-c", "all_reduce", "all_gather", "-b", "6", "-e", "1K", "-f", "4",
                     "-n", "2", "-w", "1", "--rounds", "2", "--backend", "gloo", "shm", "--limits",
                     "--json", str(files["json"]), "--csv", str(files["csv"]), "--plot", str(files["png"])])
    captured = capfd.readouterr()
    assert rc == 0
    blocks = captured.out.split("#\n# ")[1:]  # one table per collective and backend
    assert [b.splitlines()[0] for b in blocks] == ["all_reduce on gloo", "all_gather on gloo", "all_reduce on shm",
                                                  "all_gather on shm"]
    for block in blocks:
        assert "# limit: busbw counts" in block and " spread " in block
    rows = parse_table(captured.out)
    assert [r["size"] for r in rows] == [4, 24, 96, 384, 8, 24, 96, 384] * 2
    assert [r["count"] for r in rows] == [1, 6, 24, 96, 2, 6, 24, 96] * 2
    assert all(r["ip"]["wrong"] == 0 for r in rows) and rows[0]["oop"] is None and rows[4]["oop"]["wrong"] == 0
    assert "# Out of bounds values : 0 OK" in captured.out and "point-to-point" in captured.out
    summary = captured.out.split("# faster backend, by size")[1].splitlines()[1:3]
    assert [line.split(":")[0] for line in summary] == ["#   all_reduce", "#   all_gather"], summary
    assert all(" gloo at " in line or " shm at " in line for line in summary), summary
    assert "[round 2/2] done" in captured.err and "[round" not in captured.out
    saved = json.loads(files["json"].read_text())
    assert saved["environment"]["backends"] == ["gloo", "shm"] and len(saved["rows"]) == 16
    for row in saved["rows"]:  # every round kept
        side = row["ip"]
        assert len(side["rounds_us"]) == 2 and side["time_us_min"] <= side["time_us"] <= side["time_us_max"]
    assert sorted((r["backend"], r["size"]) for r in saved["reference"]) == sorted(
        (b, s) for b in ("gloo", "shm") for s in (6, 24, 96, 384))
    assert all(len(r["rounds_us"]) == 2 and r["gbps"] > 0 for r in saved["reference"])
    assert len(list(csv.reader(files["csv"].open()))) == 17
    assert files["png"].stat().st_size > 10_000
    plot_results([saved, saved], str(tmp_path / "two.png"))  # several runs on one plot
    assert (tmp_path / "two.png").stat().st_size > 10_000


def _result(backends=("gloo", "shm"), collectives=("all_reduce", "broadcast"), sizes=(8, 1024, 1 << 20)):
    """A result as benchmarks.bandwidth --json writes it, with made-up times: shm 10x faster
    below 1 MiB and 2x slower at 1 MiB."""
    rows, reference = [], []
    for b in backends:
        for c in collectives:
            for size in sizes:
                t = 100.0 * (1 + size / 1e4) * ((0.1 if size < 1 << 20 else 2.0) if b == "shm" else 1.0)
                rounds = [t * 0.9, t, t * 1.2]
                algbw, busbw = bandwidths(size, t, c, 2)
                side = {"time_us": t, "rounds_us": rounds, "time_us_min": min(rounds), "time_us_max": max(rounds),
                        "algbw": algbw, "busbw": busbw, "wrong": 0}
                rows.append({"backend": b, "collective": c, "requested": size, "size": size, "count": size // 4,
                             "type": "float", "redop": "sum", "root": -1, "oop": None, "ip": side})
        for size in sizes:
            t = 50.0 * (1 + size / 1e4)
            reference.append({"backend": b, "size": size, "rounds_us": [t, t, t], "time_us": t, "gbps": size / t / 1e3})
    env = {"backend": " ".join(backends), "backends": list(backends), "world_size": 2, "device": "cpu",
           "date": "2026-11-26"}
    return {"environment": env, "limits": {"copy_gbps": 10.0}, "reference": reference, "rows": rows}


def test_the_figure_has_time_and_busbw_panels_on_log_axes_with_a_line_per_backend():
    from benchmarks.parts.busbw_plot import figure

    fig = figure([_result()])
    axes = fig.axes
    assert len(axes) == 4  # two collectives, two panels each
    for k, ax in enumerate(axes):
        assert ax.get_xscale() == "log"
        assert ax.get_yscale() == ("log" if k % 2 == 0 else "linear")
        labels = [line.get_label() for line in ax.get_lines()]
        assert sum(label.startswith(("gloo x2", "shm x2")) for label in labels) == 2, labels
        ticks = [t.get_text() for t in ax.get_xticklabels()]
        assert "8 B" in ticks and "1 KiB" in ticks and "1 MiB" in ticks, ticks
    assert axes[0].get_ylabel() == "time (us)" and axes[1].get_ylabel() == "busbw (GB/s)"
    assert any("limit" in line.get_label() for line in axes[1].get_lines())  # the limit curve


def test_limit_is_the_reference_at_the_same_size_and_the_faster_backend_is_named_with_its_ratio():
    result = _result()
    add_limits(result["rows"], result["reference"])
    for row in result["rows"]:
        ref = next(r for r in result["reference"] if (r["backend"], r["size"]) == (row["backend"], row["size"]))
        assert row["ip"]["limit_pct"] == pytest.approx(100 * row["ip"]["busbw"] / ref["gbps"])
    lines = faster_by_size(result["rows"], ["gloo", "shm"])
    assert lines[1] == "#   all_reduce: shm at 8 B-1 KiB (0.10x-0.10x gloo's time); gloo at 1 MiB (0.50x shm's time)"
    assert faster_by_size(result["rows"], ["gloo"]) == []


def test_a_busbw_past_its_limit_is_named_with_why():
    result = _result(sizes=(8, 1 << 20))
    add_limits(result["rows"], result["reference"])
    lines = over_limit(result["rows"], result["reference"])
    # shm at 8 B takes a fifth of the reference's time (busbw = algbw on 2 ranks); its rounds 0.9x-1.2x
    assert lines == [
        "# over the limit: shm all_reduce at 8 B (up to 500%): every rank sends and receives at once, both "
        "directions of each link, where the reference sends one way",
        "# over the limit: shm broadcast at 8 B (up to 500%): the collective's data takes another path than the "
        "reference's on this backend"], lines
    for row in result["rows"]:  # now within the spread: the reference's fastest round is 12x its median
        if row["backend"] == "shm" and row["size"] == 8:
            row["ip"]["limit_pct"] = 101.0
    for ref in result["reference"]:
        ref["rounds_us"] = [ref["time_us"] / 12] * 3
    assert all("all within the rounds' spread" in line for line in over_limit(result["rows"], result["reference"]))


def test_the_table_with_its_spread_column_round_trips():
    rows = _result()["rows"][:3]
    text = header(True, True) + "\n" + "\n".join(format_row(r, True, True) for r in rows)
    parsed = parse_table(text)
    assert [r["ip"]["spread_pct"] for r in parsed] == [15.0] * 3  # (1.2 - 0.9) / 2 of the median


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 7), st.integers(1, 9), st.integers(0, 40), st.integers(0, 11),
       st.sampled_from(["sum", "prod", "max", "min", "avg"]), st.sampled_from(["float32", "bfloat16", "int64"]))
def test_check_data_is_its_closed_form(rank, world, count, offset, op, dtype_name):
    """Rank r's element i is ((offset + i + r) mod m) + 1 and the reduction is op over the ranks'
    values at that element, whatever the count (the tile repeats and is cut) and offset."""
    if op == "avg" and dtype_name == "int64":
        return
    dtype, m = bench.DTYPES[dtype_name], 2 if op == "prod" else 3
    got = cases.pattern(rank, count, offset, op, dtype, "cpu")
    assert got.tolist() == [float((offset + i + rank) % m + 1) for i in range(count)]
    combine = {"sum": sum, "prod": math.prod, "max": max, "min": min, "avg": lambda v: sum(v) / len(v)}[op]
    want = [combine([(offset + i + r) % m + 1 for r in range(world)]) for i in range(count)]
    assert torch.equal(cases.reduced(world, count, offset, op, dtype, "cpu"), torch.tensor(want, dtype=torch.float64).to(dtype))


def test_agreement_counts_the_medians_inside_the_other_runs_range(tmp_path, capsys):
    from benchmarks import bandwidth_agreement

    a, b = _result(), _result()
    for row in b["rows"]:  # b's medians: 5% slower (inside a's 0.9x-1.2x), and one 50% slower (outside by 30%)
        row["ip"]["time_us"] *= 1.05
    b["rows"][0]["ip"]["time_us"] = a["rows"][0]["ip"]["time_us"] * 1.5
    paths = []
    for name, result in (("a", a), ("b", b)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(result))
    assert bandwidth_agreement.main([str(p) for p in paths]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("b.json's medians inside " + str(paths[0]) + "'s range: 11/12 (92%)")
    assert out[1] == "  gloo all_reduce 8 B ip: 30.0% of the median outside"


def _agreement_refuses(tmp_path, capsys, a, b) -> str:
    from benchmarks import bandwidth_agreement

    paths = []
    for name, result in (("a", a), ("b", b)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(result))
    with pytest.raises(SystemExit) as info:
        bandwidth_agreement.main([str(p) for p in paths])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1, err
    return err[0]


def test_agreement_refuses_two_runs_that_share_no_cell(tmp_path, capsys):
    """-b 8 -e 64 against -b 1K -e 1K: nothing to compare is a usage error naming what each has,
    not a division by zero."""
    a, b = _result(), _result()
    for row in b["rows"]:
        row["size"] *= 3  # 24 B, 3 KiB, 3 MiB: none of a's sizes
    line = _agreement_refuses(tmp_path, capsys, a, b)
    assert "the two runs share no cell (backend, collective, size, side)" in line, line
    assert "gloo all_reduce" in line and " to " in line, line


@pytest.mark.parametrize("which", [0, 1])
def test_agreement_refuses_a_one_round_run(tmp_path, capsys, which):
    """A --rounds 1 run has min = max = its median: every other median falls 'outside' it."""
    runs = [_result(), _result()]
    runs[which]["environment"]["rounds"] = 1
    line = _agreement_refuses(tmp_path, capsys, *runs)
    assert f"{'ab'[which]}.json: its run had --rounds 1" in line and "--rounds 2 or more" in line, line


# -- the report's arithmetic over its whole input space -----------------------------------------------

@settings(max_examples=150, deadline=None)
@given(st.sampled_from(bench.COLLECTIVES), st.integers(1, 1 << 20), st.integers(1, 9),
       st.sampled_from(["float32", "bfloat16", "int64", "float64"]))
def test_every_row_whose_size_rounding_moved_keeps_its_limit(collective, requested, n, dtype_name):
    """%limit holds a row against the reference at the size asked for (-b 6 moves all_reduce's
    row to 4 B, all_gather's to 8 B on 2 ranks; the reference is timed at 6 B): a row moved by the
    rounding must keep its %limit, at exactly busbw over the reference's bandwidth."""
    from benchmarks.parts.bandwidth_rounds import _summarised

    itemsize = bench.DTYPES[dtype_name].itemsize
    count = cases.buffer_count(collective, requested, n, itemsize)
    row = {"backend": "gloo", "collective": collective, "requested": requested, "size": count * itemsize,
           "count": count, "oop": None, "ip": {"rounds_us": [10.0, 12.0, 11.0], "iters": [5, 5, 5], "wrong": 0}}
    _summarised(row, n)
    reference = [{"backend": "gloo", "size": requested, "rounds_us": [5.0] * 3, "time_us": 5.0,
                  "gbps": requested / 5.0 / 1e3}]
    add_limits([row], reference)
    assert row["ip"]["limit_pct"] == pytest.approx(100 * row["ip"]["busbw"] / reference[0]["gbps"])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.floats(0.5, 1e6, allow_nan=False), min_size=1, max_size=12))
def test_a_cells_time_is_the_median_of_its_rounds_for_odd_and_even_counts(rounds):
    """An even --rounds has two middle rounds: the cell is their mean (statistics.median), not the
    lower one, and its range is every round's."""
    import statistics

    from benchmarks.parts.bandwidth_rounds import _summarised

    row = {"collective": "all_reduce", "size": 1024, "oop": None,
           "ip": {"rounds_us": list(rounds), "iters": [1] * len(rounds), "wrong": 0}}
    _summarised(row, 2)
    ordered = sorted(rounds)
    middle = (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) / 2
    assert row["ip"]["time_us"] == pytest.approx(middle) == pytest.approx(statistics.median(rounds))
    assert (row["ip"]["time_us_min"], row["ip"]["time_us_max"]) == (min(rounds), max(rounds))


def _two_backends(a_rounds, b_rounds, size=1024):
    import statistics

    rows = []
    for backend, rounds in (("gloo", a_rounds), ("shm", b_rounds)):
        rows.append({"backend": backend, "collective": "all_reduce", "size": size, "oop": None,
                     "ip": {"rounds_us": list(rounds), "time_us": statistics.median(rounds)}})
    return rows


def test_the_faster_backend_is_the_one_the_paired_rounds_say_when_the_medians_disagree():
    """gloo's median (3) is below shm's (9), yet shm was faster in 3 of the 5 rounds, the backends
    timed back to back: the summary names shm, with a ratio below 1."""
    rows = _two_backends([1, 2, 10, 3, 4], [0.5, 1.5, 9, 20, 20])
    lines = faster_by_size(rows, ["gloo", "shm"])
    assert lines[1] == "#   all_reduce: shm at 1 KiB (0.90x gloo's time)", lines


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9).flatmap(lambda k: st.tuples(st.lists(st.floats(0.1, 1e4), min_size=k, max_size=k),
                                                     st.lists(st.floats(0.1, 1e4), min_size=k, max_size=k))))
def test_the_backend_named_faster_never_takes_more_time_than_the_other(pair):
    """Whatever the rounds: the ratio printed is the named backend's time over the other's, paired
    by round (the median of the ratios' logarithms, so that the two directions are reciprocal: the
    plain median of [0.5, 2] is 1.25, and so is that of [2, 0.5]), and it is at most 1."""
    import re
    import statistics

    a, b = pair
    line = faster_by_size(_two_backends(a, b), ["gloo", "shm"])[1]
    m = re.fullmatch(r"#   all_reduce: (gloo|shm) at 1 KiB \((\d+\.\d\d)x (gloo|shm)'s time\)", line)
    assert m and m.group(1) != m.group(3), line
    named, other = (a, b) if m.group(1) == "gloo" else (b, a)
    ratio = math.exp(statistics.median(math.log(x / y) for x, y in zip(named, other)))
    assert ratio <= 1 + 1e-12 and m.group(2) == f"{ratio:.2f}", (line, ratio)
