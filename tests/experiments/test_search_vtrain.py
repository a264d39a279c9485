"""``experiments.run search_vtrain``: the figures against hand-computed ones, the search's pick against the one
prediction path, the ``--candidates`` file form through the real command, and the command's files and errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from experiments import search_vtrain
from experiments.search_vtrain import group_runs, megatron_space, score, search_group, write_candidates
from experiments.vtrain import DATA, Run, load_runs, predict_run, split_runs
from sim.core.errors import SpecError
from sim.search.cli import main as search_main
from sim.search.search import run_search

A, B, C, D = (1, 1, 2, 4), (1, 2, 1, 4), (2, 1, 1, 4), (1, 1, 2, 2)


def _setting(run: Run) -> tuple[int, int, int, int]:
    return run.tp, run.dp, run.pp, run.microbatch


def _ranked(result) -> list[tuple[int, int, int, int]]:
    return [(e.candidate.tp, e.candidate.dp, e.candidate.pp, e.candidate.microbatch_size) for e in result.ranked]


def _group(layers: int, hidden: int, gpus: int, batch: int) -> list[Run]:
    runs = load_runs(DATA)
    return [r for r in runs if (r.layers, r.hidden, r.gpus, r.global_batch) == (layers, hidden, gpus, batch)]


def test_regret_and_spearman_of_a_tiny_group_by_hand():
    measured = {A: 1.10, B: 1.00, C: 1.30, D: 1.20}
    figures = score([A, B, C, D], measured)
    # pick A (1.10 s) against the best B (1.00 s): 10 % slower
    assert (figures.pick, figures.best, figures.configurations) == (A, B, 4)
    assert figures.regret == pytest.approx(0.10, abs=1e-12)
    # measured ranks in the search's order A, B, C, D are 1, 0, 3, 2: d = ±1, ρ = 1 − 6·4 / (4·15) = 0.6
    assert figures.spearman == pytest.approx(0.6, abs=1e-12)


def test_a_rejected_best_costs_regret_and_small_groups_have_no_rho():
    # The search rejected B (not in its ranking), the measured best: its pick D is 20 % slower.
    figures = score([D, A, C], {A: 1.10, B: 1.00, C: 1.30, D: 1.20})
    assert figures.ranked == (D, A, C) and figures.regret == pytest.approx(0.20, abs=1e-12)
    # order D, A, C measured 1.20, 1.10, 1.30: ranks 1, 0, 2; d = (1, −1, 0); ρ = 1 − 6·2 / (3·8) = 0.5
    assert figures.spearman == pytest.approx(0.5, abs=1e-12)
    two = score([B, A], {A: 1.10, B: 1.00})
    assert two.spearman is None and two.regret == 0.0
    one = score([A], {A: 1.10})
    assert (one.spearman, one.regret, one.pick, one.configurations) == (None, None, A, 1)
    # settings the search ranked but that are not among the runs scored (held-out restriction) are left out
    assert score([C, A, B], {A: 1.10, B: 1.00}).ranked == (A, B)


def test_the_shipped_runs_form_144_groups_of_two_or_more():
    runs = load_runs(DATA)
    groups = group_runs(runs)
    assert len(groups) == 144 and sum(map(len, groups.values())) == 1440
    assert min(map(len, groups.values())) == 2
    for key, members in groups.items():
        assert {(runs[i].model, runs[i].gpus, runs[i].global_batch) for i in members} == {key}


@pytest.mark.parametrize(("layers", "hidden", "gpus", "batch"), [(12, 2048, 4, 4), (24, 1024, 8, 64)])
def test_the_search_ranks_by_the_same_predictions_as_predict_run(tmp_path, layers, hidden, gpus, batch):
    group = _group(layers, hidden, gpus, batch)
    assert len(group) >= 8
    result = search_group(group, tmp_path)
    predicted = {_setting(run): predict_run(run) for run in group}
    assert {_setting(run) for run in group} == set(_ranked(result))  # every measured setting, all feasible
    for evaluation in result.evaluations:
        c = evaluation.candidate
        assert evaluation.iteration_time_s == predicted[(c.tp, c.dp, c.pp, c.microbatch_size)]
    assert _ranked(result)[0] == min(predicted, key=predicted.__getitem__)
    assert _ranked(result) == sorted(predicted, key=predicted.__getitem__)


def test_a_search_over_the_held_out_settings_alone_ranks_them_in_the_same_order(tmp_path):
    runs = load_runs(DATA)
    halves = split_runs(runs, 0)
    group = _group(24, 1024, 8, 64)
    held = [run for run in group if halves[runs.index(run)] == "held-out"]
    assert 3 <= len(held) < len(group)
    whole = _ranked(search_group(group, tmp_path))
    alone = _ranked(search_group(held, tmp_path))
    assert alone == [s for s in whole if s in set(alone)]


def test_the_candidates_file_through_sim_search_picks_what_the_experiment_picks(tmp_path):
    group = _group(12, 2048, 4, 4)
    settings = [_setting(run) for run in group]
    write_candidates(settings, tmp_path / "candidates.csv")
    space = megatron_space(tuple(settings))
    status = search_main([
        "--topology", "4xA100", "--model", group[0].model, "--global-batch", "4", "--candidates",
        str(tmp_path / "candidates.csv"), "--schedules", ",".join(space.schedules), "--recompute", "full",
        "--sequence-parallel", "off", "--zero", "0", "--partitions", "blocks", "--no-progress",
        "--out", str(tmp_path / "search")])
    assert status == 0
    found = json.loads((tmp_path / "search" / "search.json").read_text())
    assert found["evaluated"] == len(settings) == found["feasible"]
    best = found["best"]["candidate"]
    ours = search_group(group, tmp_path)
    assert (best["tp"], best["dp"], best["pp"], best["microbatch_size"]) == _ranked(ours)[0]
    assert found["best"]["iteration_time_s"] == ours.best.iteration_time_s
    # the same run_search in-process on the same space gives the same ranking
    assert _ranked(run_search(ours.problem)) == _ranked(ours)


def test_quick_searches_twelve_groups_and_writes_one_row_per_group(tmp_path):
    result = search_vtrain.run(quick=True)
    assert len(result.groups) == 12 and result.shipped and result.quick
    assert any(g.held_out is not None for g in result.groups)
    for group in result.groups:
        repeats: dict[tuple[int, int, int, int], list[float]] = {}
        for r in group.runs:
            repeats.setdefault(_setting(r), []).append(r.measured_s)
        measured = {s: sum(times) / len(times) for s, times in repeats.items()}
        if group.all.regret is not None:  # the pick's measured time over the best's, by brute force over the group
            assert group.all.best == min(measured, key=lambda s: (measured[s], s))
            assert group.all.regret == pytest.approx(measured[group.all.pick] / min(measured.values()) - 1,
                                                     abs=1e-12)
            assert group.all.regret >= 0
    files = search_vtrain.write(result, tmp_path)
    assert files == [tmp_path / "search_vtrain.csv", tmp_path / "search_vtrain.png"]
    rows = list(csv.DictReader(files[0].open()))
    assert len(rows) == 12
    for row in rows:
        regret = float(row["pick_measured_s"]) / float(row["best_measured_s"]) - 1
        assert float(row["regret"]) == pytest.approx(regret, abs=1e-12) and regret >= 0
    assert files[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _write_runs(path: Path, rows: list[str]) -> Path:
    path.write_text(DATA.read_text().splitlines()[0] + "\n" + "".join(row + "\n" for row in rows))
    return path


def test_another_file_is_all_held_out_with_repeats_averaged_and_single_groups_apart(tmp_path):
    rows = ["2,8,4,1024,16,12,1024,1,1,2,100", "2,8,4,1024,16,12,1024,1,2,1,90",
            "2,8,4,1024,16,12,1024,2,1,1,120", "2,8,4,1024,16,12,1024,1,2,1,100",  # tp1 dp2 pp1 again: mean 95
            "2,16,8,1024,16,12,1024,1,2,1,150"]  # a group of one
    data = _write_runs(tmp_path / "runs.csv", rows)
    result = search_vtrain.run(data=data)
    assert not result.shipped and len(result.groups) == 2
    first, single = result.groups
    assert (first.all.configurations, single.all.configurations) == (3, 1) and single.all.regret is None
    measured = {(1, 1, 2, 4): 0.100, (1, 2, 1, 4): 0.095, (2, 1, 1, 4): 0.120}
    runs = load_runs(data)[:3]
    pick = min((_setting(r) for r in runs), key=lambda s: predict_run(next(r for r in runs if _setting(r) == s)))
    assert first.all.pick == pick
    assert (first.all.best, first.all.regret) == ((1, 2, 1, 4), pytest.approx(measured[pick] / 0.095 - 1, abs=1e-12))
    assert first.held_out == first.all  # every run of another file is held out


@pytest.mark.parametrize(("options", "message"), [
    ({"workers": 0}, "--workers must be an integer >= 1, got 0"),
    ({"data": "{tmp}/bad.csv"}, "does not have vTrain's columns"),
    ({"data": "{tmp}/partial.csv"}, "a run with TP 1 × DP 1 × PP 2 on 4 GPUs: the search uses every device"),
])
def test_bad_input_is_refused(tmp_path, options, message):
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    _write_runs(tmp_path / "partial.csv", ["4,8,4,1024,16,12,1024,1,1,2,100", "4,8,4,1024,16,12,1024,1,4,1,90"])
    options = {k: Path(v.replace("{tmp}", str(tmp_path))) if k == "data" else v for k, v in options.items()}
    with pytest.raises(SpecError, match=message):
        search_vtrain.run(**options)
    with pytest.raises(FileNotFoundError):
        search_vtrain.run(data=tmp_path / "missing.csv")
