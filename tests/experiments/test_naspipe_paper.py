"""``experiments.naspipe_paper``: the artifact's own formula on its sample output gives the published ratios, the
tokens-per-step factor is its closed form, the quick run's ratio is the product of its factors, its equal-conditions
column is ``experiments.naspipe``'s, its files hold its rows, and bad input is refused."""

from __future__ import annotations

import csv
from argparse import Namespace

import pytest

from experiments import naspipe, naspipe_paper
from experiments.naspipe_paper import ARTIFACT, artifact_ratio, tokens_per_step_ratio
from sim.core.errors import SpecError


@pytest.fixture(scope="module")
def quick() -> naspipe_paper.Result:
    return naspipe_paper.run(quick=True)


@pytest.mark.parametrize("space", ["c1", "c2", "c3"])
def test_gen_figure_s_formula_on_the_sample_gives_the_published_ratio(space):
    # The oracle is the published figure (hardware.md §4.1: 8.0, 4.3, 2.8 from the 4-GPU sample), to its one decimal.
    assert round(artifact_ratio(ARTIFACT[space]), 1) == naspipe.PAPER_OVER_GPIPE[space][0]


def test_tokens_per_step_is_192_x_64_over_b_x_8():
    assert [tokens_per_step_ratio(b) for b in (32, 64, 128)] == [48.0, 24.0, 12.0]


def test_quick_run_has_one_row_per_space_and_its_ratio_is_the_product_of_its_factors(quick):
    assert [(r.space, r.topology) for r in quick.rows] == [("c1", "4xV100"), ("c2", "4xV100"), ("c3", "4xV100")]
    assert (quick.subnets, quick.seed) == (8, 0)
    for row in quick.rows:
        ratio = row.paper_conditions
        assert row.token_ratio == tokens_per_step_ratio(row.gpipe_batch)
        # tokens/s over tokens/s = (tokens per step) x (step rates), and = (same step) x (GPipe's step-size factor)
        assert ratio == pytest.approx(row.token_ratio * row.naspipe_steps_per_s / row.gpipe_steps_per_s, rel=1e-12)
        assert ratio == pytest.approx(row.same_step * row.step_size, rel=1e-12)
        assert row.budget_bytes < row.supernet_bytes


def test_equal_conditions_column_is_experiments_naspipe_s(quick):
    row = quick.rows[0]
    args = Namespace(topology="4xV100", subnets=8, seed=0, lookahead=30, minibatch=32, microbatches=8,
                     budget_factor=1.25)
    equal = naspipe._space(args, "c1")["over_gpipe"]
    assert (row.equal_predict, row.equal_resident) == (equal["csp+predict"], equal["csp"])


def test_the_file_holds_each_row_with_its_verdict_beside_the_paper(quick, tmp_path):
    files = naspipe_paper.write(quick, tmp_path)
    assert files == [tmp_path / "naspipe_paper.csv", tmp_path / "naspipe_paper.png"]
    assert files[1].read_bytes().startswith(b"\x89PNG")
    with open(files[0], newline="") as handle:
        written = list(csv.DictReader(handle))
    assert [r["space"] for r in written] == [r.space for r in quick.rows]
    for line, row in zip(written, quick.rows):
        assert float(line["paper"]) == naspipe.PAPER_OVER_GPIPE[row.space][0]
        assert float(line["sim_paper_conditions"]) == pytest.approx(row.paper_conditions, abs=5e-4)
        assert line["within_25pct"] == str(abs(row.paper_conditions / float(line["paper"]) - 1) <= 0.25)


@pytest.mark.parametrize("options, needle", [({"spaces": "c0"}, "c0"), ({"gpus": "5"}, "5"),
                                             ({"gpus": "four"}, "four"), ({"subnets": 0}, "--subnets"),
                                             ({"seed": -1}, "--seed")])
def test_bad_input_is_refused(options, needle):
    with pytest.raises(SpecError, match=needle):
        naspipe_paper.run(**options)


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
    from sim.cost.cost_view import CostView
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
        costs = CostView(graph, setup.topology, placement, batch)
        for kind in (OpKind.F, OpKind.B):
            times = [costs.compute_time(kind, v) for v in range(p)]
            total += sum(times) + (p - 1) * max(times)
    assert row.gpipe_steps_per_s == pytest.approx(subnets * p / total, rel=1e-9)
