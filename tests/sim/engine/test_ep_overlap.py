"""``--ep-overlap``: expert all-to-alls beside the rank's next compute op. Oracles: the exact spans of a small
schedule (which op waits for which), the blocking plan as the baseline, and refusals."""

import pytest

from sim.core.errors import SpecError
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.plan.lower_collectives import EP_OVERLAP_OPTION
from sim.predict import predict_built

SMALL = "moe:layers=4,hidden=256,heads=8,kv_heads=2,head_dim=32,ffn=512,vocab=1024,seq=512,experts=8,topk=2," \
        "expert_ffn=128,qk_norm=0"


def _spans(overlap: bool, pp: int = 1, schedule: str = "1f1b"):
    inputs = PlanInputs(SMALL, "8xH100", schedule, 4, dp=8 // pp, pp=pp, ep=8 // pp, zero=1, ep_overlap=overlap)
    built = build_plan(inputs)
    prediction = predict_built(built)
    spans = {(s.op, s.rank): s for s in prediction.trace.spans if s.rank < pp}
    return built, prediction, spans


def test_the_option_is_recorded_and_without_it_the_plan_is_as_before():
    plain, overlapped = (build_plan(PlanInputs(SMALL, "8xH100", "1f1b", 4, dp=8, ep=8, zero=1, ep_overlap=flag))
                         for flag in (False, True))
    assert overlapped.plan.option(EP_OVERLAP_OPTION) is True and plain.plan.option(EP_OVERLAP_OPTION) is None
    assert EP_OVERLAP_OPTION not in plain.plan.dumps()
    # The same ops in the same order; only the deps of later compute ops of a microbatch grow.
    assert [[op.id for op in p] for p in plain.plan.programs] == [[op.id for op in p] for p in overlapped.plan.programs]


def test_a_microbatch_waits_for_its_own_exchange_and_the_next_one_does_not():
    _, _, blocking = _spans(False)
    _, _, overlapped = _spans(True)
    for spans, overlap in ((blocking, False), (overlapped, True)):
        for i in range(4):
            forward_exchange = spans[(f"0EP_F{i}", 0)]
            # the backward of microbatch i needs the tokens its forward exchanged, either way
            assert spans[(f"0B{i}", 0)].start >= forward_exchange.end
            if i < 3:
                backward_exchange, next_forward = spans[(f"0EP_B{i}", 0)], spans[(f"0F{i + 1}", 0)]
                if overlap:  # the next microbatch's forward starts as its backward ends, beside the exchange
                    assert next_forward.start == pytest.approx(spans[(f"0B{i}", 0)].end)
                    assert next_forward.start < backward_exchange.end
                else:  # the compute stream waits for the exchange
                    assert next_forward.start >= backward_exchange.end


def test_on_one_stage_the_overlap_saves_every_backward_exchange():
    # pp 1, m = 4: blocking, each microbatch takes f + e + b + e and the gradient reduction (which needs B3's weight
    # gradients only) starts after the last exchange; overlapped, the backward exchange of microbatch i hides behind
    # the forward of i + 1 (its exchange is shorter than a forward here), and the last one behind the reduction
    # and the update (longer than an exchange here): all four backward exchanges leave the critical path, the
    # forward ones stay.
    _, blocking, spans = _spans(False)
    _, overlapped, overlapped_spans = _spans(True)
    exchange = spans[("0EP_B0", 0)].end - spans[("0EP_B0", 0)].start
    forward = spans[("0F1", 0)].end - spans[("0F1", 0)].start
    assert 0 < exchange < forward
    last_backward = overlapped_spans[("0B3", 0)].end
    assert overlapped_spans[("0REDUCE_GRAD", 0)].start == pytest.approx(last_backward)
    # the reduction, the step and the parameters' all-gather after it outlast the exchange
    assert overlapped_spans[("0GATHER_PARAMS", 0)].end - last_backward > exchange
    saved = blocking.metrics["iteration_time_s"] - overlapped.metrics["iteration_time_s"]
    assert saved == pytest.approx(4 * exchange, rel=1e-9)


def test_a_pipeline_with_the_overlap_is_never_slower():
    for schedule in ("1f1b", "zb1p", "gpipe"):
        _, blocking, _ = _spans(False, pp=2, schedule=schedule)
        _, overlapped, _ = _spans(True, pp=2, schedule=schedule)
        assert overlapped.metrics["iteration_time_s"] <= blocking.metrics["iteration_time_s"]


def test_without_expert_parallelism_it_is_refused():
    with pytest.raises(SpecError, match="needs --ep > 1"):
        build_plan(PlanInputs(SMALL, "8xH100", "1f1b", 4, dp=8, ep_overlap=True))


def test_the_executor_refuses_such_a_plan(tmp_path, capsys):
    from tests.executor.runs import refused

    built = build_plan(PlanInputs(SMALL, "2xcpu", "1f1b", 2, dp=2, ep=2, ep_overlap=True))
    plan = tmp_path / "plan.json"
    plan.write_text(built.plan.dumps())
    assert "--ep-overlap" in refused(capsys, plan, tmp_path / "out")
