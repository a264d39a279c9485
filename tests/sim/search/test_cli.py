"""``python -m sim.search``: a full run's files, byte-identical twice, its plan.json being the best candidate's plan as
``sim.run`` writes it; bad input as one ``error:`` line and exit 2 with nothing written; no feasible plan as exit 1."""

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sim.ir.plan import Plan
from sim.models import build_model
from sim.run import main as sim_run
from sim.search.cli import main
from sim.search.space import Candidate, SearchProblem

ROOT = Path(__file__).resolve().parents[3]
MODEL = "gpt:layers=4,hidden=128,heads=4,seq=64,vocab=500"
ARGS = ["--topology", "4xA100", "--model", MODEL, "--global-batch", "8", "--no-progress",
        "--schedules", "1f1b,interleaved", "--chunks", "2", "--recompute", "none,full", "--microbatch-sizes", "1,2",
        "--sequence-parallel", "off"]
FILES = ("plan.json", "candidates.csv", "search.json", "pareto.png")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs of the same search into two directories (the first with --top 2), and what the first printed."""
    base = tmp_path_factory.mktemp("search")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main([*ARGS, "--top", "2", "--out", str(base / "a")]) == 0
    assert main([*ARGS, "--out", str(base / "b")]) == 0
    return base / "a", base / "b", printed.getvalue()


def test_a_run_writes_every_file_and_twice_the_same_bytes(runs):
    a, b, _ = runs
    assert sorted(p.name for p in a.iterdir()) == sorted(FILES)
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plan_is_the_best_candidates_as_sim_run_writes_it(runs, tmp_path, capsys):
    a, _, _ = runs
    data = json.loads((a / "search.json").read_text())
    feasible = [c for c in data["candidates"] if c["feasible"]]
    fastest = min(c["iteration_time_s"] for c in feasible)
    assert data["best"]["iteration_time_s"] == fastest
    best = Candidate(**data["best"]["candidate"])
    problem = SearchProblem(model=MODEL, topology="4xA100", global_batch=8)
    assert sim_run([*best.run_flags(problem), "--no-gantt", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    assert (a / "plan.json").read_text() == (tmp_path / "plan.json").read_text()
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["iteration_time_s"] == fastest
    plan = Plan.loads((a / "plan.json").read_text(), source=str(a / "plan.json"))
    assert plan.level == "L1" and plan.model == build_model(MODEL).spec and plan.microbatch_size == best.microbatch_size


def test_the_printed_table_has_the_top_rows(runs):
    a, _, out = runs
    data = json.loads((a / "search.json").read_text())
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rank", "TP"])
    rows = lines[header + 1: header + 3]
    assert [row.split()[0] for row in rows] == ["1", "2"] and not lines[header + 3].split()[0].isdigit()
    assert f"{data['best']['iteration_time_s']:.4f}" in rows[0]
    assert f"{data['evaluated']} of {data['space_size']} plans costed" in out


BAD = [
    (["--topology", "3xNOPE"], "NOPE"),
    (["--global-batch", "0"], "got 0"),
    (["--workers", "0"], "got 0"),
    (["--top", "0"], "got 0"),
    (["--schedules", "1f1b,bogus"], "'bogus'"),
    (["--time-budget", "0"], "got 0"),
    (["--time-budget", "-3"], "got -3"),
    (["--time-budget", "inf"], "got inf"),
    (["--memory-limit", "junk"], "'junk'"),
    (["--memory-limit", "0"], "got 0"),
    (["--model", "gpt:layers=x"], "layers"),
    (["--chunks", "1"], "chunks cannot include 1"),
    (["--routing", "zipf"], "zipf"),
    (["--capacity-factor", "-1"], "--capacity-factor"),
    (["--recompute-modules", "core_attn"], "argument --recompute-modules: recompute module 'core_attn'"),
    (["--recompute-modules", "moe_act"], "--recompute-modules names Megatron-Core's modules of the moe family"),
]


def _with(*change: str) -> list[str]:
    """:data:`ARGS` with each ``flag value`` pair of ``change`` replacing the flag's value or added."""
    args = list(ARGS)
    for flag, value in zip(change[::2], change[1::2]):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    return args


@pytest.mark.parametrize("change,needle", BAD, ids=[" ".join(c) for c, _ in BAD])
def test_bad_input_is_one_error_line_and_nothing_written(tmp_path, capsys, change, needle):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as info:
        main([*_with(*change), "--out", str(out)])
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err
    assert not out.exists()


def test_the_module_entry_point_exits_2_without_a_traceback(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "sim.search", *ARGS, "--workers", "0", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr == "error: --workers must be an integer >= 1, got 0\n"
    assert proc.stdout == "" and not out.exists()


def test_no_feasible_plan_exits_1_with_the_reasons_and_no_plan(tmp_path, capsys):
    # a 1-byte cap without headroom (with it, what a plan may use rounds down to 0 bytes)
    args = _with("--memory-limit", "1", "--memory-headroom", "0", "--schedules", "1f1b", "--recompute", "none")
    assert main([*args, "--out", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "no feasible plan" in captured.out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["candidates.csv", "pareto.png", "search.json"]
    data = json.loads((tmp_path / "search.json").read_text())
    assert data["best"] is None and data["feasible"] == 0 and data["candidates"]
    assert all(not c["feasible"] and c["reason"] for c in data["candidates"])
    assert any(c["reason"].startswith("out of memory: ") for c in data["candidates"])
    # stderr says why in one line: the plan nearest to fitting (smallest peak / capacity) and how far it is.
    ratio, label = min((max(p / c for p, c in zip(e["peak_memory_bytes"], e["memory_capacity_bytes"])), e["label"])
                       for e in data["candidates"] if e.get("peak_memory_bytes"))
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith(f"error: none of the {len(data['candidates'])} plans costed is feasible ("), \
        captured.err
    assert f"the closest to fitting is {label}: pipeline rank " in captured.err
    assert f"({ratio:.2f} times its memory)" in captured.err


def test_each_list_works_alone_as_in_sim_run(capsys):
    from sim.hw.topology import format_topology_list
    from sim.models import format_model_list

    assert main(["--model", "list"]) == 0
    assert capsys.readouterr().out == format_model_list() + "\n"
    assert main(["--topology", "list"]) == 0
    assert capsys.readouterr().out == format_topology_list() + "\n"
    assert main(["--model", "list", "--topology", "list"]) == 0
    assert capsys.readouterr().out == format_model_list() + "\n\n" + format_topology_list() + "\n"


def test_missing_flags_are_named_in_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--model", MODEL, "--global-batch", "8"])
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith("error: --topology and --out are required (e.g. --topology 8xA100 ")


def test_a_routed_search_records_its_routing_and_its_plan_is_the_one_sim_run_builds(tmp_path, capsys):
    """``--routing`` and ``--capacity-factor`` apply to every plan: the best plan's file is the one ``sim.run`` writes
    from the printed flags (which carry them), and ``search.json`` records them."""
    moe = ("moe:layers=4,experts=8,hidden=256,expert_ffn=256,ffn=512,heads=4,kv_heads=2,head_dim=64,seq=64,topk=2,"
           "vocab=500")
    args = ["--topology", "4xA100", "--model", moe, "--global-batch", "8", "--no-progress", "--schedules", "1f1b",
            "--ep", "2", "--zero", "0", "--routing", "skew:1.2:4", "--capacity-factor", "1.5"]
    assert main([*args, "--out", str(tmp_path / "search")]) == 0
    printed = capsys.readouterr().out
    assert "every plan routed skew:1.2:4, capacity factor 1.5" in printed
    record = json.loads((tmp_path / "search" / "search.json").read_text())
    assert (record["problem"]["routing"], record["problem"]["capacity_factor"]) == ("skew:1.2:4", 1.5)
    again = printed.split("the best plan again: python -m sim.run ")[1].split(" --out DIR")[0].split()
    assert again[again.index("--routing") + 1] == "skew:1.2:4" and again[again.index("--capacity-factor") + 1] == "1.5"
    assert sim_run([*again, "--no-gantt", "--out", str(tmp_path / "run")]) == 0
    assert (tmp_path / "search" / "plan.json").read_text() == (tmp_path / "run" / "plan.json").read_text()


def test_a_megatron_style_search_records_how_its_plans_run_and_its_plan_is_the_one_sim_run_builds(tmp_path, capsys):
    """``--blocks``, ``--deallocate-pipeline-outputs`` and ``--recompute-modules`` apply to every plan where they have
    a meaning: ``search.json`` records them, and the printed flags rebuild the best plan byte for byte."""
    moe = ("moe:layers=4,experts=8,hidden=256,expert_ffn=256,ffn=512,heads=4,kv_heads=2,head_dim=64,seq=64,topk=2,"
           "vocab=500")
    args = ["--topology", "4xA100", "--model", moe, "--global-batch", "8", "--no-progress", "--schedules", "1f1b",
            "--recompute", "selective", "--zero", "0", "--ep", "1", "--blocks", "transformer-engine",
            "--deallocate-pipeline-outputs", "--recompute-modules", "layernorm,moe_act"]
    assert main([*args, "--out", str(tmp_path / "search")]) == 0
    printed = capsys.readouterr().out
    problem = json.loads((tmp_path / "search" / "search.json").read_text())["problem"]
    assert (problem["blocks"], problem["deallocate_pipeline_outputs"], problem["recompute_modules"]) == (
        "transformer-engine", True, ["layernorm", "moe_act"])
    again = printed.split("the best plan again: python -m sim.run ")[1].split(" --out DIR")[0].split()
    assert again[again.index("--recompute-modules") + 1] == "layernorm,moe_act"
    assert sim_run([*again, "--no-gantt", "--out", str(tmp_path / "run")]) == 0
    assert (tmp_path / "search" / "plan.json").read_text() == (tmp_path / "run" / "plan.json").read_text()


def test_a_budget_counts_from_the_commands_start_and_keeps_back_the_outputs_share():
    import time

    from sim.search.cli import OUTPUT_RESERVE_S, OUTPUT_RESERVE_SHARE, _search_budget

    now = time.monotonic()
    # 40 s asked, 4 s already gone (imports, listing the space): the search gets the rest less the outputs' share.
    assert _search_budget(40.0, now - 4.0) == pytest.approx(36.0 * (1 - OUTPUT_RESERVE_SHARE) - OUTPUT_RESERVE_S,
                                                            abs=0.05)
    assert _search_budget(None, now) is None
    assert _search_budget(1.0, now - 5.0) == 0.05  # spent before the search: it still gets a moment, then the grace
