"""experiments.deepseek_v3: the report's run as the simulator's inputs, its throughput from the report's GPU-hours,
and a prediction consistent with its own iteration time."""

import pytest

from experiments import deepseek_v3
from sim.hw.topology import Topology


def test_the_published_figure_is_the_reports_gpu_hours_per_trillion_tokens():
    # 180 K H800 GPU-hours per trillion tokens (arXiv 2412.19437 Table 1): 10^12 tokens / (1.8e5 h x 3600 s/h)
    assert deepseek_v3.PUBLISHED_TOKENS_PER_S_PER_GPU == pytest.approx(1543.2, abs=0.05)


def test_the_inputs_are_the_reports_run():
    inputs = deepseek_v3.plan_inputs()
    topology = Topology.parse(inputs.topology)
    assert len(topology.devices) == 2048 and topology.devices[0].name == "h800-sxm5-80gb"  # §3.1
    assert (inputs.pp, inputs.ep, inputs.dp, inputs.zero, inputs.tp) == (16, 64, 128, 1, 1)  # §3.2: no TP
    assert inputs.pp * inputs.dp == 2048
    assert inputs.global_batch == 15_360 and inputs.model == "deepseek-v3,seq=4096"  # §4.2
    assert inputs.precision == "fp8" and inputs.ep_overlap  # DualPipe overlaps the all-to-alls (§3.2.1)
    assert inputs.ep_dispatcher == "deduplicated"  # once per server over IB, then NVLink (§3.2.2)


def test_the_prediction_is_its_own_iteration_time_and_says_what_it_leaves_out():
    result = deepseek_v3.run()
    tokens = 15_360 * 4_096
    assert result.predicted == pytest.approx(tokens / result.iteration_time_s / 2048, rel=1e-9)
    assert result.error == pytest.approx(result.predicted / 1543.2098765 - 1, rel=1e-6)
    assert any("DualPipe" in item for item in result.unmodelled)
    assert 0 < result.bubble_fraction < result.idle_fraction < 1 and result.exposed_ep_fraction > 0
