"""The format pages name every field the product writes: a plan, its metrics and a measured profile, as written
by the commands, checked against docs/formats/ (so a new field cannot go undocumented)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sim.run import main as sim_run

ROOT = Path(__file__).resolve().parents[2]
FORMATS = ROOT / "docs" / "formats"


def keys(value: object, *, depth: int) -> set[str]:
    """Every object key in ``value`` down to ``depth`` levels of objects (lists are walked through)."""
    found: set[str] = set()
    if depth == 0:
        return found
    if isinstance(value, dict):
        for key, inner in value.items():
            found.add(key)
            found |= keys(inner, depth=depth - 1)
    elif isinstance(value, list):
        for inner in value:
            found |= keys(inner, depth=depth)
    return found


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """A 3D plan with recomputation and a straggler: most optional fields present."""
    out = tmp_path_factory.mktemp("run")
    assert sim_run(["--topology", "8xA100", "--model", "gpt:layers=4,hidden=512,heads=8,seq=256", "--tp", "2",
                    "--dp", "2", "--pp", "2", "--zero", "1", "--recompute", "--microbatches", "4",
                    "--straggler", "0:1.5", "--no-gantt", "--out", str(out)]) == 0
    return out


def test_plan_json_fields_are_on_its_page(written, capsys):
    capsys.readouterr()
    page = (FORMATS / "plan-json.md").read_text()
    plan = json.loads((written / "plan.json").read_text())
    groups = plan["parallel"].pop("groups")
    for key in keys(plan, depth=3) - set(groups):
        assert f"`{key}`" in page or f"`placement.{key}`" in page, f"plan.json's {key!r} is not on plan-json.md"


def test_metrics_json_fields_are_on_its_page(written):
    page = (FORMATS / "metrics-and-trace.md").read_text()
    metrics = json.loads((written / "metrics.json").read_text())
    per_kind = set(metrics["ops"])  # op kinds, listed on the plan IR's page
    for key in keys(metrics, depth=2) - per_kind:
        assert f"`{key}`" in page, f"metrics.json's {key!r} is not on metrics-and-trace.md"


def test_profile_fields_are_in_the_schema_the_page_includes():
    schema = (ROOT / "profiles" / "README.md").read_text()
    assert "{include} ../../profiles/README.md" in (FORMATS / "profile-json.md").read_text()
    profile = json.loads((ROOT / "profiles" / "measured" / "cpu-gpt8.json").read_text())
    for key in keys(profile, depth=2):
        # named alone or as a dotted path (`p2p.sizes_bytes`), or in the JSON example ("microbatch_size": 1)
        assert re.search(rf"[`.\"]{key}[`\"]", schema), f"a profile's {key!r} is not in profiles/README.md"
