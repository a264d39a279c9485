"""Whether a plan fits, and the remedies that make it fit, held to the engine: every remedy offered simulates without
running out of memory, and every single remedy left out does run out."""

from dataclasses import replace

import pytest

from sim.engine.simpy_engine import OutOfMemoryError
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.plan.memory_fit import _candidates, memory_remedies, memory_report
from sim.predict import predict

#: A GPT whose plain 1F1B plan on 8 A100s with DP 2 × PP 4 does not fit (activations of a 6k-token sequence).
TIGHT = PlanInputs("gpt:layers=16,hidden=4096,seq=6144", "8xA100", "1f1b", microbatch_size=2, dp=2, pp=4,
                   global_batch=32)


def _engine_fits(inputs: PlanInputs) -> bool:
    built = build_plan(inputs)
    try:
        predict(built.plan, topology=built.topology, oracle=built.costs.oracle)
    except OutOfMemoryError:
        return False
    return True


def test_the_report_is_the_engines_peak_and_verdict():
    built = build_plan(TIGHT)
    report = memory_report(built)
    engine = predict(built.plan, topology=built.topology, oracle=built.costs.oracle, check_memory=False)
    assert report.peaks == engine.peak_memory_bytes
    assert not report.fits and not _engine_fits(TIGHT)
    assert report.over_bytes == max(p - c for p, c in zip(report.peaks, report.capacities)) > 0
    assert report.device == "a100-sxm4-80gb"


def test_every_remedy_offered_fits_and_every_single_one_left_out_does_not():
    built = build_plan(TIGHT)
    remedies = memory_remedies(TIGHT, built)
    assert remedies, "some remedy must fit this plan"
    offered = {remedy.changes for remedy in remedies}
    for changes in _candidates(TIGHT, built):
        changed = replace(replace(TIGHT, pp=built.plan.layout.pp), **dict(changes))
        assert _engine_fits(changed) == (changes in offered), changes
    assert [r.peak_bytes / r.capacity_bytes for r in remedies] == sorted(r.peak_bytes / r.capacity_bytes
                                                                          for r in remedies)


def test_remedies_keep_the_global_batch():
    built = build_plan(TIGHT)
    for remedy in memory_remedies(TIGHT, built):
        changed = build_plan(replace(replace(TIGHT, pp=built.plan.layout.pp), **dict(remedy.changes))).plan
        assert changed.num_microbatches * changed.microbatch_size * changed.layout.dp == 32


def test_a_plan_with_host_copies_is_left_to_the_engine():
    from sim.ir.ops import Op, OpKind

    built = build_plan(PlanInputs("uniform:layers=2", "1xideal", "1f1b", 1))
    program = (Op(OpKind.PREFETCH, 0), *built.plan.programs[0])
    with pytest.raises(ValueError, match="host copies"):
        memory_report(replace(built, plan=built.plan.with_programs((program,), level="L1")))
