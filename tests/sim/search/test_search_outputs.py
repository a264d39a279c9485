"""sim.search.search_outputs: the Pareto front against a brute-force dominance check, candidates.csv and search.json
read back against the evaluations, the PNG, the table."""

import csv
import io
import json
import random
from collections import Counter
from dataclasses import asdict, fields

import pytest

from sim.search.evaluate import Evaluation
from sim.search.search import SearchResult, run_search
from sim.search.search_outputs import (
    candidates_csv,
    format_table,
    pareto_front,
    pareto_png,
    search_json,
    why_no_plan,
    write_search_outputs,
)
from sim.search.space import Candidate, SearchProblem, SearchSpace

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def result():
    """A small search with every kind of row: feasible, over the memory limit (simulated) and breaking a rule
    (heads=2 with tp=4, a microbatch of 3 in a batch of 8: not simulated)."""
    space = SearchSpace(schedules=("1f1b", "gpipe"), recompute=("none",), microbatch_sizes=(1, 3, 4),
                        sequence_parallel=(False,), zero=(0,))
    p = SearchProblem(model="gpt:layers=4,hidden=128,heads=2,seq=64,vocab=500", topology="4xA100", global_batch=8,
                      memory_limit_bytes=int(12e6), space=space)
    r = run_search(p)
    kinds = {(e.feasible, e.iteration_time_s is not None) for e in r.evaluations}
    assert kinds == {(True, True), (False, True), (False, False)}, kinds
    return r


def _evaluation(i: int, time_s: float, peak: int, feasible: bool = True) -> Evaluation:
    return Evaluation(Candidate(1, 1, 1, i + 1, "1f1b"), feasible, "" if feasible else "out of memory: made up",
                      time_s, 1.0 / time_s, 1, (4,), (peak,), (10 ** 9,))


def _non_dominated(points: list[tuple[int, float]]) -> set[tuple[int, float]]:
    """Points (memory, time) no other point beats in both, one at least strictly: the definition, pair by pair."""
    return {p for p in points
            if not any(q[0] <= p[0] and q[1] <= p[1] and (q[0] < p[0] or q[1] < p[1]) for q in points)}


def test_the_pareto_front_is_the_set_no_point_dominates():
    rng = random.Random(14)
    for trial in range(300):
        n = rng.randint(0, 12)
        # Few distinct values, so that ties in memory, in time and in both occur often.
        evaluations = tuple(_evaluation(i, rng.randint(1, 6) / 10, rng.randint(1, 6), rng.random() < 0.8)
                            for i in range(n))
        front = pareto_front(evaluations)
        feasible = [(e.max_peak_memory_bytes, e.iteration_time_s) for e in evaluations if e.feasible]
        points = [(e.max_peak_memory_bytes, e.iteration_time_s) for e in front]
        assert all(e.feasible for e in front), trial
        assert set(points) == _non_dominated(feasible), trial
        assert len(points) == len(set(points)), trial  # an exact duplicate point listed once
        assert [m for m, _ in points] == sorted(m for m, _ in points), trial  # by increasing memory
        assert [t for _, t in points] == sorted((t for _, t in points), reverse=True), trial


def test_candidates_csv_has_one_row_per_evaluation_and_reads_back(result):
    rows = list(csv.DictReader(io.StringIO(candidates_csv(result))))
    assert len(rows) == len(result.evaluations)
    for row, e in zip(rows, result.evaluations, strict=True):
        c = e.candidate
        for f in fields(Candidate):
            value = getattr(c, f.name)
            text = ";".join(map(str, value)) if isinstance(value, tuple) else str(value)  # the device order
            assert row[f.name] == text, f.name
        assert row["feasible"] == str(e.feasible) and row["reason"] == e.reason
        if e.iteration_time_s is None:
            assert row["iteration_time_s"] == row["throughput_samples_per_s"] == row["max_peak_memory_bytes"] == ""
            assert row["microbatches"] == "" and row["layer_counts"] == ""
        else:
            assert float(row["iteration_time_s"]) == e.iteration_time_s  # written exactly (repr)
            assert float(row["throughput_samples_per_s"]) == e.throughput_samples_per_s
            assert int(row["max_peak_memory_bytes"]) == max(e.peak_memory_bytes)
            assert [int(x) for x in row["peak_memory_bytes"].split(";")] == list(e.peak_memory_bytes)
            assert [int(x) for x in row["layer_counts"].split(";")] == list(e.layer_counts)
            assert sum(int(x) for x in row["layer_counts"].split(";")) == 6  # embed, 4 blocks, head
            assert int(row["microbatches"]) == result.problem.global_batch // (c.microbatch_size * c.dp)


def test_search_json_round_trips_and_lists_every_evaluation(result, tmp_path):
    names = write_search_outputs(tmp_path, result)
    assert sorted(names) == sorted(p.name for p in tmp_path.iterdir())
    data = json.loads((tmp_path / "search.json").read_text())
    assert data == search_json(result)  # every value survives JSON, floats included
    assert data["evaluated"] == len(data["candidates"]) == len(result.evaluations)
    assert data["space_size"] == result.space_size and data["coverage"] == 1.0
    assert data["feasible"] == sum(c["feasible"] for c in data["candidates"])
    for record, e in zip(data["candidates"], result.evaluations, strict=True):
        fields_ = {**record["candidate"], "devices": tuple(record["candidate"]["devices"])}  # JSON has lists
        assert Candidate(**fields_) == e.candidate and record["label"] == e.candidate.label()
        assert record["feasible"] == e.feasible
        assert ("reason" in record) == (not e.feasible) and record.get("reason", "") == e.reason
        assert record.get("iteration_time_s") == e.iteration_time_s
    fastest = min((c for c in data["candidates"] if c["feasible"]), key=lambda c: c["iteration_time_s"])
    assert data["best"]["iteration_time_s"] == fastest["iteration_time_s"]
    best = result.best.candidate
    assert data["best"]["candidate"] == {**asdict(best), "devices": list(best.devices)}
    assert data["problem"]["memory_limit_bytes"] == int(12e6) and data["problem"]["space"]["microbatch_sizes"] == [
        1, 3, 4]
    assert (tmp_path / "pareto.png").read_bytes()[:8] == PNG
    assert (tmp_path / "candidates.csv").read_text() == candidates_csv(result)


def test_the_png_is_drawn_even_with_nothing_simulated(result):
    empty = SearchResult(result.problem, "exhaustive", 10, (), True, 0.0, 0)
    assert pareto_png(empty)[:8] == PNG
    assert search_json(empty)["best"] is None and search_json(empty)["coverage"] == 0.0
    assert candidates_csv(empty).count("\n") == 1  # the header alone


@pytest.mark.parametrize("top", [1, 3, 1000])
def test_the_table_has_the_top_k_rows_in_rank_order(result, top):
    lines = format_table(result, top).splitlines()
    header = lines[0].split()
    assert header[:4] == ["rank", "TP", "DP", "PP"]
    rows = lines[1:]
    assert len(rows) == min(top, len(result.ranked))
    column = header.index("iteration")  # "iteration (s)" splits in two words; the cells before it are one each
    for i, (line, e) in enumerate(zip(rows, result.ranked, strict=False)):
        cells = line.split()
        assert cells[0] == str(i + 1) and cells[1:4] == [str(e.candidate.tp), str(e.candidate.dp),
                                                           str(e.candidate.pp)]
        assert cells[column] == f"{e.iteration_time_s:.4f}"


def test_the_tables_partition_column_runs_repeated_counts_together(result):
    def ranked_alone(counts):
        e = Evaluation(Candidate(1, 1, len(counts), 1, "1f1b"), True, "", 0.5, 16.0, 8, counts, (10,), (100,))
        return SearchResult(result.problem, "exhaustive", 1, (e,), False, 0.0, 0)

    # 6,6,6,6 is 6×4; 5,7,7,5 keeps its order with the middle run joined: 5,7×2,5.
    assert " 6×4 " in format_table(ranked_alone((6, 6, 6, 6)), 1)
    assert " 5,7×2,5 " in format_table(ranked_alone((5, 7, 7, 5)), 1)


def test_why_no_plan_names_the_reasons_when_nothing_was_simulated(result):
    rule = [e for e in result.evaluations if e.iteration_time_s is None]
    assert rule and all(not e.reason.startswith("out of memory") for e in rule)
    only_rules = SearchResult(result.problem, "exhaustive", 30, tuple(rule), False, 0.0, 0)
    most = Counter(e.reason for e in rule).most_common(1)[0][0]  # ties: the first met, in the space's order
    assert why_no_plan(only_rules) == (f"none of the {len(rule)} plans costed is feasible ({len(rule)} breaking a "
                                       f"rule); the most common reason: {most}; search.json says why each failed")
    # The screen refuses plans by its memory bound alone, without peaks: the reason is given as it stands.
    bound = Evaluation(rule[0].candidate, False, reason="out of memory: the pipeline ranks hold 9.00 GB")
    assert why_no_plan(SearchResult(result.problem, "screen", 3, (bound,), False, 0.0, 0)) == (
        "none of the 1 plans costed is feasible (1 out of memory); the first: out of memory: the pipeline ranks hold "
        "9.00 GB; search.json says why each failed")
    assert why_no_plan(SearchResult(result.problem, "exhaustive", 10, (), True, 0.0, 0)) == (
        "the time budget ended the search before any plan was costed; give --time-budget more seconds")
    # After Ctrl-C the remedy is time, not a flag.
    interrupted = SearchResult(result.problem, "exhaustive", 30, tuple(rule), False, 0.0, 0, interrupted=True)
    assert why_no_plan(interrupted) == (f"Ctrl-C ended the search before a plan that fits was simulated ({len(rule)} "
                                        "of 30 plans costed); let it run longer")


def test_a_candidates_fields_are_read_as_asdict_would_in_field_order(result):
    # The writers copy a candidate's __dict__ (faster than reading its fields one by one): it must hold exactly the
    # dataclass's fields, in their order, with asdict's values.
    from dataclasses import asdict, fields

    from sim.search.search_outputs import _fields

    for evaluation in result.evaluations[:50]:
        copied = _fields(evaluation.candidate)
        assert list(copied) == [f.name for f in fields(evaluation.candidate)]
        assert copied == asdict(evaluation.candidate)
