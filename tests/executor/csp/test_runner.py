"""NASPipe's claim, executed as a user runs it: ``sim.run --schedule csp`` writes a plan, ``executor.run --plan``
runs it on 2 and 4 CPU stages (one stage: ``test_offload.py``, under a budget), and every run gives bitwise the
parameters (SHA-256 of every parameter) and the per-subnet losses of ``executor.run --reference``, which trains the
same subnet sequence one by one in one process."""

import json

import pytest


def test_csp_plans_are_bitwise_the_sequential_reference_on_2_and_4_stages(tmp_path, csp_run, csp_reference):
    reference = csp_reference
    assert reference["mode"] == "reference" and len(reference["losses"]) == 12
    for stages in (2, 4):
        run = csp_run(tmp_path / f"csp{stages}", stages)
        assert run["final_params_sha256"] == reference["final_params_sha256"], stages
        assert run["losses"] == reference["losses"], stages  # floats from JSON: equal means bitwise equal
        assert all(sorted(order) == list(range(12)) for order in run["forward_order_per_stage"])
        assert run["plan"]["schedule"] == "csp" and len(run["devices"]) == stages
        compare = json.loads((tmp_path / f"csp{stages}" / "compare.json").read_text())
        assert compare["measured_iteration_time_s"] == run["iteration_time_s"] > 0
        assert compare["predicted_iteration_time_s"] > 0  # sim.predict on the very plan that ran
    # A different subnet sequence trains to different parameters: the hash can tell runs apart.
    other = csp_run(tmp_path / "other", 1, "--seed", "4", reference=True)
    assert other["final_params_sha256"] != reference["final_params_sha256"]


def _executor(capsys, *argv: str) -> tuple[int, str]:
    """``executor.run`` in this process: what is tested here is refused before anything is launched."""
    from executor.run import main as executor_main

    with pytest.raises(SystemExit) as info:
        executor_main(list(argv))
    return info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--iterations", "3"], "--iterations does not apply to a csp plan"),
    (["--warmup", "1"], "--warmup does not apply to a csp plan"),
    (["--calibrate-out", "cal.json"], "--calibrate-out does not apply"),
    (["--inject-failure", "1:1F0"], "--inject-failure does not apply"),
])
def test_flags_a_csp_plan_cannot_honour_are_refused_before_launch(tmp_path, capsys, csp_plan, flags, message):
    code, err = _executor(capsys, "--plan", str(csp_plan), "--out", str(tmp_path / "o"), *flags)
    assert code == 2 and message in err, err
    assert err.count("\n") == 1 and not (tmp_path / "o").exists()


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["subnets"][1].__setitem__(0, 7), "subnet 1 is"),
    (lambda d: d["subnets"].pop(), "subnet table has 3 rows"),
    (lambda d: d["options"].__setitem__("lookahead", "many"), "option lookahead must be int"),
    (lambda d: d["options"].__setitem__("speed", 2), "unknown option(s) speed"),
    (lambda d: d.__setitem__("extra", 1), "unknown field(s) 'extra'"),
    (lambda d: d["placement"].__setitem__("vstage_to_rank", [1, 0]), "one stage per rank in order"),
])
def test_an_edited_csp_plan_is_refused_before_launch(tmp_path, capsys, csp_plan, edit, message):
    data = json.loads(csp_plan.read_text())
    edit(data)
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps(data))
    code, err = _executor(capsys, "--plan", str(bad), "--out", str(tmp_path / "o"))
    assert code == 2 and message in err, err
    assert not (tmp_path / "o").exists()


def test_reference_is_for_csp_plans(tmp_path, capsys):
    from sim.run import main as sim_main

    assert sim_main(["--topology", "2xcpu", "--model", "gpt:layers=2,hidden=64,heads=2,seq=16,vocab=100",
                     "--no-gantt", "--out", str(tmp_path / "p")]) == 0
    code, err = _executor(capsys, "--plan", str(tmp_path / "p" / "plan.json"), "--out", str(tmp_path / "o"),
                          "--reference")
    assert code == 2 and "--reference trains a csp plan" in err
