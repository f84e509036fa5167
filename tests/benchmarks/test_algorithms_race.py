"""The algorithms race (benchmarks/algorithms.py): a real run on 2 ranks, and its predictions
across hosts: one host keeps the closed forms, several need --link and get the simulator's times
on the two-level topology; the prediction errors and busbw it prints, on a made-up result.

    pytest tests/benchmarks/test_algorithms_race.py -q
"""

import json

import pytest
import torch

import collectives.algorithms as A
from benchmarks import algorithms
from collectives.algorithms.cost import CostModel
from collectives.algorithms.topology import PAYLOAD_PER_FRAME, Topology, link_beta, link_burst

MODEL = CostModel(alpha=1e-4, beta=5e-10, gamma=4e-11, source="test")


def test_a_race_on_two_ranks_checks_every_output_and_predicts_each(tmp_path, capsys):
    out = tmp_path / "race.json"
    assert algorithms.main(["-c", "all_reduce", "-b", "64K", "-e", "64K", "--world-size", "2", "--json", str(out)]) == 0
    run = json.loads(out.read_text())
    assert run["hosts"] == [0, 0] and run["link"] is None
    (row,) = run["rows"]
    model = CostModel(**{k: run["model"][k] for k in ("alpha", "beta", "gamma")})
    for name, m in row["algorithms"].items():
        assert m["wrong"] == 0 and m["s"] > 0
        assert m["predicted_s"] == pytest.approx(model.predict("all_reduce", name, row["size"], 2), rel=1e-12)
    assert "hierarchical" in row["algorithms"]
    text = capsys.readouterr().out
    assert "# wrong elements in all checks: 0" in text and "measured / predicted - 1 from 1 MiB" in text


def test_one_host_keeps_the_closed_forms_and_several_need_the_link():
    assert algorithms.topology_of([0, 0, 0], MODEL, None) is None
    with pytest.raises(SystemExit, match="--link 1gbit is the rate between hosts, but all 3 ranks are on one host"):
        algorithms.topology_of([0, 0, 0], MODEL, "1gbit")
    with pytest.raises(SystemExit, match="the ranks are on 2 hosts; give --link RATE"):
        algorithms.topology_of([0, 0, 1, 1], MODEL, None)
    topo = algorithms.topology_of([0, 0, 1, 1], MODEL, "1gbit")
    assert topo.hosts == (0, 0, 1, 1) and topo.intra == MODEL
    assert topo.inter.beta == link_beta("1gbit") and topo.inter.alpha == MODEL.alpha
    assert topo.burst == link_burst("1gbit")  # the cluster's bucket unless --burst says otherwise
    # each call waits for the bucket to fill: burst bytes at the link's rate, and 1 ms more
    assert algorithms.refill_seconds(topo) == pytest.approx(link_burst("1gbit") * link_beta("1gbit") + 0.001)
    assert algorithms.refill_seconds(None) == 0.0


def test_burst_and_shared_cores_in_the_topology():
    """--burst 0 is a link without a bucket (no wait before calls); 2 ranks per core double every
    CPU cost (alpha, beta and gamma within a host, alpha and gamma across) but not the link's rate."""
    bare = algorithms.topology_of([0, 0, 1, 1], MODEL, "1gbit", burst=0)
    assert bare.burst == 0 and algorithms.refill_seconds(bare) == 0.0
    assert algorithms.topology_of([0, 1], MODEL, "1gbit", burst=1000).burst == 1000
    shared = algorithms.topology_of([0, 0, 1, 1], MODEL, "1gbit", share=2)
    assert shared.intra == MODEL.sharing(2)
    assert (shared.inter.alpha, shared.inter.beta, shared.inter.gamma) == (2 * MODEL.alpha, link_beta("1gbit"),
                                                                           2 * MODEL.gamma)


def test_burst_is_given_in_frames_bytes_and_kept_in_payload_bytes(monkeypatch):
    """--burst is tc tbf's burst, which counts whole frames; the race models payload."""
    seen = {}
    monkeypatch.setattr(algorithms.collectives, "run_or_join", lambda fn, n, args, timeout: seen.update(args[0]))
    for name, value in dict(RANK="0", WORLD_SIZE="4", MASTER_ADDR="node0", MASTER_PORT="29500").items():
        monkeypatch.setenv(name, value)  # as torchrun starts a rank: --link is for ranks across hosts
    assert algorithms.main(["-c", "all_reduce", "--link", "1gbit", "--burst", "1000"]) == 0
    assert seen["burst"] == pytest.approx(1000 * PAYLOAD_PER_FRAME) and seen["link"] == "1gbit"
    algorithms.main(["-c", "all_reduce", "--link", "1gbit"])
    assert seen["burst"] is None  # topology_of then takes the cluster's bucket


def test_burst_needs_the_link(capsys):
    with pytest.raises(SystemExit):
        algorithms.main(["--burst", "64K"])
    assert "--burst is the bucket of the link that --link names; give --link too" in capsys.readouterr().err


def test_a_link_for_ranks_spawned_on_this_host_is_refused(monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as info:
        algorithms.main(["-c", "all_reduce", "--link", "1gbit"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--link 1gbit is the rate between hosts, but the ranks this spawns are all on " \
        "this host" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "reduce_scatter", "broadcast"])
def test_the_prediction_across_hosts_is_the_simulated_time(collective):
    topo = Topology.two_level(2, 2, MODEL, CostModel(MODEL.alpha, link_beta("1gbit"), MODEL.gamma))
    count = 4096  # the buffer's elements (all_gather: the gathered output)
    name = next(iter(A.ALGORITHMS[collective]))
    each = count // 4 if collective == "all_gather" else count
    want = A.simulate(collective, name, [torch.zeros(each) for _ in range(4)], model=topo)[1].time
    assert algorithms.predict(collective, name, count, 4, torch.float32, MODEL, topo) == want
    assert algorithms.predict(collective, name, count, 4, torch.float32, MODEL, None) == \
        MODEL.predict(collective, name, count * 4, 4)


def _row(size, backend_s, times):
    return {"collective": "all_reduce", "size": size, "backend_s": backend_s, "backend_wrong": 0,
            "algorithms": {a: {"s": s, "predicted_s": p, "wrong": 0} for a, (s, p) in times.items()}, "auto": "ring"}


def test_prediction_errors_and_busbw_are_counted_from_one_mib():
    result = {"world_size": 4, "backend": "gloo", "link": "1gbit", "hosts": [0, 0, 1, 1], "rows": [
        _row(1 << 19, 1.0, {"ring": (9.0, 1.0), "hierarchical": (1.0, 1.0)}),  # below 1 MiB: not counted
        _row(1 << 20, 0.02, {"ring": (0.0115, 0.010), "hierarchical": (0.009, 0.010)}),
        _row(1 << 22, 0.06, {"ring": (0.05, 0.04), "hierarchical": (0.03, 0.031)}),
    ]}
    text = algorithms.prediction_errors(result)
    assert text.splitlines()[0].endswith("3 of 4 within 20%")
    assert "all_reduce ring: +15%, +25%" in text and "all_reduce hierarchical: -10%, -3%" in text
    bw = algorithms.busbw(result)
    assert "the link: 1gbit" in bw
    assert f"gloo {1.5 * (1 << 20) / 0.02 / 1e9:.3f}  hierarchical {1.5 * (1 << 20) / 0.009 / 1e9:.3f}" in bw
