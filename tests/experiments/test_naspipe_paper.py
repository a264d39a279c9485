"""``experiments.run naspipe_paper``: the artifact's own formula on its sample output gives the published ratios, the
tokens-per-step factor is its closed form, the quick run's ratio is the product of its factors, its equal-conditions
column is ``experiments.naspipe``'s, and bad input is one error line."""

from __future__ import annotations

import csv
from argparse import Namespace

import pytest

from experiments import naspipe
from experiments.naspipe_paper import ARTIFACT, artifact_ratio, tokens_per_step_ratio
from experiments.run import main as run_main
from tests.experiments.refusal import refused


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("naspipe_paper")
    assert run_main(["naspipe_paper", "--quick", "--out", str(out)]) == 0
    assert (out / "naspipe_paper.png").read_bytes().startswith(b"\x89PNG")
    with open(out / "naspipe_paper.csv", newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.parametrize("space", ["c1", "c2", "c3"])
def test_gen_figure_s_formula_on_the_sample_gives_the_published_ratio(space):
    # The oracle is the published figure (hardware.md §4.1: 8.0, 4.3, 2.8 from the 4-GPU sample), to its one decimal.
    assert round(artifact_ratio(ARTIFACT[space]), 1) == naspipe.PAPER_OVER_GPIPE[space][0]


def test_tokens_per_step_is_192_x_64_over_b_x_8():
    assert [tokens_per_step_ratio(b) for b in (32, 64, 128)] == [48.0, 24.0, 12.0]


def test_quick_run_has_one_row_per_space_and_its_ratio_is_the_product_of_its_factors(quick):
    assert [(r["space"], r["topology"]) for r in quick] == [("c1", "4xV100"), ("c2", "4xV100"), ("c3", "4xV100")]
    for row in quick:
        ratio = float(row["sim_paper_conditions"])
        assert float(row["tokens_per_step_ratio"]) == tokens_per_step_ratio(int(row["gpipe_batch"]))
        # tokens/s over tokens/s = (tokens per step) x (step rates), and = (same step) x (GPipe's step-size factor);
        # the CSV rounds each to 3-4 digits.
        by_rate = float(row["tokens_per_step_ratio"]) * float(row["naspipe_steps_per_s"]) / float(
            row["gpipe_steps_per_s"])
        assert ratio == pytest.approx(by_rate, abs=1e-3)
        assert ratio == pytest.approx(float(row["sim_same_step"]) * float(row["sim_step_size"]), rel=5e-3)
        assert row["within_25pct"] == str(abs(ratio / float(row["paper"]) - 1) <= 0.25)
        assert float(row["device_budget_bytes"]) < float(row["supernet_bytes"])


def test_equal_conditions_column_is_experiments_naspipe_s(quick):
    row = quick[0]
    args = Namespace(topology="4xV100", subnets=8, seed=0, lookahead=30, minibatch=32, microbatches=8,
                     budget_factor=1.25)
    equal = naspipe._space(args, "c1")["over_gpipe"]
    assert float(row["equal_conditions_predict"]) == pytest.approx(equal["csp+predict"], abs=5e-4)
    assert float(row["equal_conditions_resident"]) == pytest.approx(equal["csp"], abs=5e-4)


@pytest.mark.parametrize("args, needle", [(["--spaces", "c0"], "c0"), (["--gpus", "5"], "5"),
                                          (["--gpus", "four"], "four"), (["--subnets", "0"], "--subnets"),
                                          (["--seed", "-1"], "--seed"), (["--bogus"], "--bogus")])
def test_bad_input_is_one_error_line(tmp_path, capsys, args, needle):
    assert needle in refused(capsys, ["naspipe_paper", "--out", str(tmp_path / "o"), *args])
    assert not (tmp_path / "o" / "naspipe_paper.csv").exists()


@pytest.mark.parametrize("k, target, n, g", [(48.0, 8.0, 23.5, 1081.0), (12.0, 2.8, 20.0, 414.0),
                                             (24.0, 4.3, 2.0, 70.0)])
def test_closing_overhead_added_to_both_step_times_gives_the_target(k, target, n, g):
    from experiments.naspipe_paper import closing_overhead_s

    o = closing_overhead_s(k, target, n, g)
    assert o > 0 and k * (1 / g + o) / (1 / n + o) == pytest.approx(target, rel=1e-12)
    assert closing_overhead_s(k, k, n, g) == float("inf")


def test_gpipe_rate_on_free_links_is_the_flow_shop_closed_form():
    """On ``4xideal`` (free links) one GPipe iteration of p identical microbatches is a flow shop with identical
    jobs, forward then backward: sum_s f_s + (p - 1) max_s f_s + sum_s b_s + (p - 1) max_s b_s (the optimizer is
    free at infinite memory bandwidth). The experiment's GPipe rate is p microbatches per iteration over that sum."""
    from experiments.naspipe_paper import GPIPE_SEQ, simulate_space
    from sim.cost.model import CostModel
    from sim.csp.csp_plan import CspInputs, build_csp_problem
    from sim.ir.ops import OpKind
    from sim.ir.plan import Placement
    from sim.models.graph import LayerGraph
    from sim.models.supernet import subnet_layer_costs
    from sim.models.supernet_space import space_spec

    p, subnets, batch = 4, 3, ARTIFACT["c3"].gpipe_batch
    row = simulate_space("c3", p, subnets, seed=0, device="ideal")
    plan, setup, _ = build_csp_problem(CspInputs(space_spec("c3", seq=GPIPE_SEQ), None, f"{p}xideal", subnets, 0, 30,
                                                 batch * p))
    supernet, placement = setup.supernet, Placement(plan.placement.vstage_layers, tuple(range(p)))
    total = 0.0
    for choice in plan.subnets:
        graph = LayerGraph(supernet.graph.spec, subnet_layer_costs(supernet, choice),
                           dtype_bytes=supernet.graph.dtype_bytes, input_bytes=supernet.graph.input_bytes)
        costs = CostModel(graph, setup.topology, placement, batch)
        for kind in (OpKind.F, OpKind.B):
            times = [costs.compute_time(kind, v) for v in range(p)]
            total += sum(times) + (p - 1) * max(times)
    assert row.gpipe_steps_per_s == pytest.approx(subnets * p / total, rel=1e-9)
