"""benchmarks.collectives: the table round-trips through its parser, busbw factors are nccl-tests',
#wrong counts a planted wrong element, every collective's check data is exact, flags refuse
nonsense, and a small end-to-end run writes its table, JSON, CSV and plot.

    pytest tests/benchmarks -q
"""

import csv
import json

import pytest
import torch

from benchmarks import collectives as bench
from benchmarks.nccl_format import bandwidths, bus_factor, format_row, header, parse_table
from benchmarks.plot import plot_results


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


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_bus_bandwidth_factors_are_nccl_tests(n):
    assert bus_factor("all_reduce", n) == 2 * (n - 1) / n
    for name in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bus_factor(name, n) == (n - 1) / n
    assert bus_factor("broadcast", n) == bus_factor("reduce", n) == 1.0
    algbw, busbw = bandwidths(10**9, 10**6, "all_reduce", n)  # 1e9 bytes in one second
    assert algbw == pytest.approx(1.0) and busbw == pytest.approx(2 * (n - 1) / n)


def test_sizes():
    assert [bench.parse_size(s) for s in ("8", "64K", "16M", "1G", "2kb")] == [8, 65536, 16 << 20, 1 << 30, 2048]
    assert bench.size_list(8, 64, 2) == [8, 16, 32, 64]
    assert bench.size_list(8, 100, 4) == [8, 32]


@pytest.mark.parametrize("argv, message", [
    (["-b", "1M", "-e", "1K"], "-b 1048576 must be at least 1 and at most -e 1024"),
    (["-o", "mean"], "invalid choice: 'mean'"),
    (["-f", "1"], "step factor must be at least 2"),
    (["-o", "avg", "-d", "int32"], "-o avg needs a floating -d"),
    (["-b", "12X"], "not a number with an optional K, M or G suffix"),
    (["-c", "allreduce"], "invalid choice: 'allreduce'"),
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
            case = bench.make_case(collective, side, count, env.world_size, env.rank, op, dtype, torch.device("cpu"))
            if case is None:
                continue
            clean = bench.count_wrong(case, "cpu")
            run, refill, expected = case

            def corrupted():  # the collective, then rank 0's output gets one wrong element
                run()
                got, want = expected()
                if env.rank == 0 and want is not None:
                    got.view(-1)[1] += 1

            planted = bench.count_wrong((corrupted, refill, expected), "cpu")
            out.append((collective, side, clean, planted))
    return out


@pytest.mark.parametrize("world_size, op, dtype", [(2, "sum", "float32"), (3, "prod", "bfloat16"), (4, "avg", "float16"),
                                                    (3, "max", "int32"), (4, "min", "int64")])
def test_check_data_is_exact_and_a_planted_error_is_counted(world_size, op, dtype, dist_run):
    results = dist_run(_check_all, world_size, args=(op, dtype))[0]
    assert len(results) == 8
    for collective, side, clean, planted in results:
        assert clean == 0, f"{collective} {side}: {clean} wrong on clean data"
        assert planted == 1, f"{collective} {side}: planted 1 wrong element, counted {planted}"


def test_end_to_end_small_run(tmp_path, capfd):  # capfd: the progress comes from the spawned ranks
    files = {k: tmp_path / f"run.{k}" for k in ("json", "csv", "png")}
    rc = bench.main(["--world-size", "2", "-c", "all_reduce", "all_gather", "-b", "8", "-e", "1K", "-f", "4",
                     "-n", "2", "-w", "1", "--limits", "--json", str(files["json"]), "--csv", str(files["csv"]),
                     "--plot", str(files["png"])])
    captured = capfd.readouterr()
    assert rc == 0
    rows = parse_table(captured.out)
    assert [r["size"] for r in rows] == [8, 32, 128, 512, 8, 32, 128, 512]
    assert all(r["ip"]["wrong"] == 0 for r in rows) and rows[0]["oop"] is None and rows[4]["oop"]["wrong"] == 0
    assert "# Out of bounds values : 0 OK" in captured.out and "point-to-point" in captured.out
    assert "[all_gather] 512 B done (4/4)" in captured.err and "[all_gather]" not in captured.out
    saved = json.loads(files["json"].read_text())
    assert saved["environment"]["world_size"] == 2 and len(saved["rows"]) == 8 and saved["limits"]["p2p_gbps"] > 0
    assert len(list(csv.reader(files["csv"].open()))) == 9
    assert files["png"].stat().st_size > 10_000
    plot_results([saved, saved], str(tmp_path / "two.png"))  # several runs on one plot
    assert (tmp_path / "two.png").stat().st_size > 10_000
