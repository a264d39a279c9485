"""The measured profiles shipped in ``profiles/measured/`` load, cover their model layer by layer, and drive the
simulator (a shipped file that drifts from the zoo or the schema fails here, not on a user's machine)."""

from pathlib import Path

import pytest

from sim.cost.profile import load_profile
from sim.models import build_model
from sim.run import main as sim_main

SHIPPED = sorted((Path(__file__).resolve().parents[2] / "profiles" / "measured").glob("*.json"))


def test_there_is_a_shipped_profile():
    assert SHIPPED, "profiles/measured/ has no profile"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda path: path.name)
def test_shipped_profile_matches_its_model_and_simulates(path, tmp_path, capsys):
    profile = load_profile(path)
    graph = build_model(profile.model)
    assert [timing.name for timing in profile.layers] == [layer.name for layer in graph.layers]
    assert all(timing.fwd_s > 0 and timing.bwd_s > 0 for timing in profile.layers)
    assert sim_main(["--topology", f"2x{profile.device}", "--model", profile.model, "--profile", str(path), "-m", "2",
                     "--no-gantt", "--out", str(tmp_path)]) == 0
    assert f"costs measured profile {path}" in capsys.readouterr().out
