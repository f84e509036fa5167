"""benchmarks/studies/race_ablation.py re-predicts a saved race across hosts four ways (the link's rate
alone or through its bucket, own cores or shared): on a made-up run whose measured time is 10%
over the full model's prediction, the full model scores it within 20% at +10% and the others
give other predictions; a run whose saved prediction is not the model's is refused, as is a
run from one host.

    pytest tests/benchmarks/test_race_ablation.py -q
"""

import json

import pytest
import torch

import collectives.algorithms as A
from benchmarks.studies import race_ablation
from collectives.algorithms.cost import CostModel
from collectives.algorithms.topology import Topology, link_beta, link_burst

MODEL = CostModel(alpha=1e-4, beta=5e-10, gamma=4e-11)
SIZE = 1 << 20


def _predicted(bucket: bool, share: float) -> float:
    intra = MODEL.sharing(share)
    topo = Topology.of_hosts([0, 0, 1, 1], intra, CostModel(intra.alpha, link_beta("1gbit"), intra.gamma),
                             link_burst("1gbit") if bucket else 0.0)
    return A.simulate("all_reduce", "ring", [torch.zeros(SIZE // 4) for _ in range(4)], model=topo)[1].time


def _run(saved_prediction):
    full = _predicted(True, 2.0)
    return {"world_size": 4, "hosts": [0, 0, 1, 1], "link": "1gbit", "burst": link_burst("1gbit"), "cpu_share": 2.0,
            "model": {"alpha": MODEL.alpha, "beta": MODEL.beta, "gamma": MODEL.gamma, "source": "test"},
            "rows": [{"collective": "all_reduce", "size": SIZE, "backend_s": 1.0, "backend_wrong": 0, "auto": "ring",
                      "algorithms": {"ring": {"s": 1.1 * full, "wrong": 0, "predicted_s": saved_prediction(full)}}},
                     {"collective": "all_reduce", "size": SIZE // 2, "backend_s": 1.0, "backend_wrong": 0,
                      "auto": "ring", "algorithms": {"ring": {"s": 99.0, "wrong": 0, "predicted_s": 1.0}}}]}


def test_each_variant_predicts_the_saved_run_its_own_way():
    run = _run(lambda full: full)
    within, total, worst = race_ablation.score(run, bucket=True, shared=True)
    assert (within, total) == (1, 1) and worst == pytest.approx(0.1)  # below 1 MiB is not counted
    measured = 1.1 * _predicted(True, 2.0)
    for bucket, shared in ((False, False), (True, False), (False, True)):
        _, _, worst = race_ablation.score(run, bucket, shared)
        assert worst == pytest.approx(measured / _predicted(bucket, 2.0 if shared else 1.0) - 1)
        assert worst != pytest.approx(0.1, abs=0.01)


def test_the_table_and_refusals(tmp_path, capsys):
    good, moved, one_host = tmp_path / "good.json", tmp_path / "moved.json", tmp_path / "one.json"
    good.write_text(json.dumps(_run(lambda full: full)))
    moved.write_text(json.dumps(_run(lambda full: 2 * full)))
    one_host.write_text(json.dumps({**_run(lambda full: full), "link": None}))
    assert race_ablation.main([str(good)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].split()[0] == "1gbit" and out.splitlines()[-1].endswith("1 of 1 (+10%)")
    for path, why in ((moved, "the run saved the prediction"), (one_host, "not a race across hosts")):
        with pytest.raises(SystemExit):
            race_ablation.main([str(path)])
        assert why in capsys.readouterr().err


@pytest.mark.parametrize("content, says", [
    ("[1, 2]", "a JSON list where an object with 'rows', 'world_size', 'hosts', 'model', 'link' is expected"),
    ('["rows", "world_size", "hosts", "model", "link"]', "a JSON list where an object"),    # the key names, as a list
    (json.dumps({k: v for k, v in _run(lambda f: f).items() if k != "rows"}), "no 'rows'"),  # a race without rows
    (json.dumps({**_run(lambda f: f), "rows": {"size": 1}}), "'rows' is not a list"),
    (json.dumps({**_run(lambda f: f), "rows": [{"size": SIZE}]}), "KeyError"),              # a row without a race's keys
    ("{not json", "not a JSON race across hosts"),
])
def test_a_file_that_is_not_a_race_is_one_line(content, says, tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text(content)
    with pytest.raises(SystemExit) as info:
        race_ablation.main([str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and f"RUN.json {path}" in err[0] and says in err[0], err
