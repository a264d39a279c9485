"""``sim.search --straggler``: every candidate is costed under the straggler by the one prediction path (its time is
what ``sim.run --straggler`` predicts for it), the outputs say so, and a link the topology lacks is refused first."""

import csv

import pytest

from sim.engine.perturbation import Perturbation, Straggler
from sim.plan.build import build_plan
from sim.predict import predict_built
from sim.search.cli import main
from sim.search.space import Candidate, SearchProblem

MODEL = "gpt:layers=8,hidden=512,heads=8,seq=256,vocab=1000"
FLAGS = ["--model", MODEL, "--topology", "8xA100", "--global-batch", "16", "--schedules", "1f1b", "--zero", "0",
         "--sequence-parallel", "off", "--recompute", "none", "--no-progress"]


def test_every_candidate_is_costed_under_the_straggler(tmp_path, capsys):
    assert main([*FLAGS, "--straggler", "3:3", "--out", str(tmp_path / "slow")]) == 0
    assert "every plan simulated with device 3 × 3" in capsys.readouterr().out
    problem = SearchProblem(MODEL, "8xA100", 16, perturbation=Perturbation((Straggler(3, 3.0),)))
    plain_problem = SearchProblem(MODEL, "8xA100", 16)
    with open(tmp_path / "slow" / "candidates.csv") as handle:
        rows = [row for row in csv.DictReader(handle) if row["feasible"] == "True"]
    slowed_any = False
    for row in rows[::7]:  # a sample across the ranking
        candidate = Candidate(int(row["tp"]), int(row["dp"]), int(row["pp"]), int(row["microbatch_size"]),
                              row["schedule"])
        built = build_plan(candidate.plan_inputs(problem))
        alone = predict_built(built, check_memory=False, perturbation=problem.perturbation)
        assert float(row["iteration_time_s"]) == pytest.approx(alone.metrics["iteration_time_s"], rel=1e-12)
        plain = predict_built(build_plan(candidate.plan_inputs(plain_problem)), check_memory=False)
        assert alone.metrics["iteration_time_s"] >= plain.metrics["iteration_time_s"]
        slowed_any |= alone.metrics["iteration_time_s"] > plain.metrics["iteration_time_s"]
    assert slowed_any


def test_a_link_the_topology_lacks_is_refused_before_the_search(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main([*FLAGS, "--straggler", "ib-ndr-x8:2", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "no link of 8xA100 is 'ib-ndr-x8'" in err and err.count("\n") == 1
