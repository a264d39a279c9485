"""What ``executor.run`` refuses before it launches anything: plans edited into something that cannot run, a
profile for another model, options that are not numbers it can use. Each case once started ranks (or ran every
iteration) before failing; each must now end with one ``error:`` line, status 2, and nothing written."""

import json

import pytest

from tests.executor.conftest import ROOT
from tests.executor.runs import edited_plan, refused, sim_plan

OTHER_PROFILE = ROOT / "profiles" / "measured" / "cpu-gpt8.json"


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return sim_plan(tmp_path_factory.mktemp("plan") / "sim", 2, 2, "--schedule", "1f1b")


@pytest.mark.parametrize("edit,message", [
    # The user's two edits: a placement past the model's last layer, and a model with fewer layers.
    (lambda d: d["placement"].__setitem__("vstage_layers", [[0, 3], [3, 9]]), "placement covers 9 layers"),
    # runs.SPEC has 2 blocks (4 graph layers); with 1 block the placement covers one layer too many.
    (lambda d: d.__setitem__("model", d["model"].replace("layers=2", "layers=1")), "but its model"),
    (lambda d: d.__setitem__("unknown_key", True), "unknown field(s) 'unknown_key'"),
    (lambda d: d["ranks"][0][0].__setitem__("stream", "compute"), "unknown field(s) 'stream'"),
    (lambda d: d["placement"].__setitem__("layers", [4, 4]), "placement has unknown field(s) 'layers'"),
])
def test_an_edited_plan_is_refused_before_launch(tmp_path, capsys, plan, edit, message):
    bad = edited_plan(plan, tmp_path / "bad.json", edit)
    assert message in refused(capsys, bad, tmp_path / "out")


def test_a_profile_for_another_model_is_refused_before_launch(tmp_path, capsys, plan):
    other = json.loads(OTHER_PROFILE.read_text())
    assert other["model"] != json.loads(plan.read_text())["model"] and other["device"] == "cpu"
    err = refused(capsys, plan, tmp_path / "out", "--profile", str(OTHER_PROFILE))
    assert "was measured for" in err


@pytest.mark.parametrize("flag,value", [("--lr", "inf"), ("--lr", "nan"), ("--lr", "-1"), ("--timeout", "inf"),
                                        ("--timeout", "0")])
def test_options_that_are_not_usable_numbers_arerefused(tmp_path, capsys, plan, flag, value):
    assert f"{flag} must be a finite number" in refused(capsys, plan, tmp_path / "out", flag, value)
