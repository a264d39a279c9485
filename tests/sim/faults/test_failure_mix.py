"""Failure mixes: the built-in one is Llama 3's Table 5 (419 interruptions, the per-device MTBF its exposure implies),
files are read and refused with the field named, and a job's MTBF shrinks with its devices."""

import pytest

from sim.core.errors import SpecError
from sim.faults.failure_mix import builtin_mix, job_mtbf_s, load_failure_mix


def test_the_builtin_mix_is_llama_3s_table_5():
    mix = builtin_mix()
    assert mix.total == 419 and len(mix.causes) == 18
    assert (mix.causes[0].name, mix.causes[0].count) == ("Faulty GPU", 148)
    assert sum(mix.shares()) == pytest.approx(1.0)
    # 16,384 GPUs for 54 days with 419 failures: a failure every 3.09 h, 50,676 h per GPU
    assert mix.device_mtbf_s() / 3600 == pytest.approx(16_384 * 54 * 24 / 419)
    assert job_mtbf_s(mix.device_mtbf_s(), 16_384) / 3600 == pytest.approx(54 * 24 / 419)


def test_a_mix_file_is_read(tmp_path):
    path = tmp_path / "mix.yaml"
    path.write_text("source: a test\ncauses:\n  - {name: GPU, category: GPU, count: 3, repair_minutes: 30}\n"
                    "  - {name: network, category: Network, count: 1}\n")
    mix = load_failure_mix(path)
    assert mix.shares() == (0.75, 0.25) and mix.causes[0].repair_s == 1800.0 and mix.causes[1].repair_s == 0.0
    assert mix.device_mtbf_s() is None  # no exposure given
    json_path = tmp_path / "mix.json"
    json_path.write_text('{"causes": [{"name": "GPU", "category": "GPU", "count": 2}], "devices": 8, "hours": 100}')
    assert load_failure_mix(json_path).device_mtbf_s() == 400 * 3600


@pytest.mark.parametrize("text, message", [
    ("causes: []", "a non-empty list 'causes'"),
    ("causes:\n  - {name: a, category: b, count: -1}", "cause 1: count must be a finite number >= 0"),
    ("causes:\n  - {name: a, category: b, count: 1.5}", "cause 1: count must be an integer"),
    ("causes:\n  - {name: a, category: b, count: 1, repair: 3}", "unknown key.s. repair; valid: name"),
    ("causes:\n  - {name: a, category: b, count: 0}", "every count is 0"),
    ("devices: 8\ncauses:\n  - {name: a, category: b, count: 1}", "give both devices and hours"),
    ("causes: [", "is not valid YAML"),
])
def test_bad_mix_files_are_refused_by_field(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SpecError, match=message):
        load_failure_mix(path)
    with pytest.raises(SpecError, match="does not exist"):
        load_failure_mix(tmp_path / "missing.yaml")
