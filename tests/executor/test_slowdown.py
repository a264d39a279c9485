"""``executor.run --slowdown RANK:FACTOR``: the flag's checks, the stretch itself (in this process, against the
handlers' own time), and one pair of real 2-rank runs, without and with ``--slowdown 1:2``."""

import json
import math
import time
from types import SimpleNamespace

import pytest

from executor.interpreter import RankInterpreter
from executor.nn.optim import make_optimizer
from executor.nn.stages import boundary_specs, build_stage, loss_fn, synthetic_batch
from executor.options import RunOptions
from executor.slowdown import STRETCHED_KINDS, describe_slowdown, parse_slowdown, slowdown_record, stretch
from sim.core.errors import SpecError
from sim.ir.plan import OpKind
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.report.chrome_trace import read_chrome_trace
from sim.run import main as sim_main
from tests.executor.conftest import CSP_SPEC
from tests.executor.runs import SPEC, built_plan, execute, refused, sim_plan

# --- the flag ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("values,world_size,expected", [
    ([], 2, ()),
    (["1:2"], 2, ((1, 2.0),)),
    (["0:1.5,3:2"], 4, ((0, 1.5), (3, 2.0))),
    (["3:2", "0:1.5"], 4, ((0, 1.5), (3, 2.0))),  # repeated, and sorted by rank
    ([" 1 : 1 "], 2, ((1, 1.0),)),  # factor 1 is allowed (no stretch); spaces around the parts are
    (["0:1000"], 1, ((0, 1000.0),)),
])
def test_slowdown_values_parse_to_rank_factor_pairs(values, world_size, expected):
    assert parse_slowdown(values, world_size) == expected


@pytest.mark.parametrize("value,message", [
    ("2:2", "slowdown '2:2': the rank must be 0..1"),
    ("-1:2", "slowdown '-1:2': expected RANK:FACTOR"),
    ("1", "slowdown '1': expected RANK:FACTOR"),
    ("a:2", "slowdown 'a:2': expected RANK:FACTOR"),
    ("1:", "the factor '' is not a number"),
    ("1:x", "slowdown '1:x': the factor 'x' is not a number"),
    ("1:0.5", "slowdown '1:0.5': the factor must be a finite number from 1 (no slowdown; a device cannot be "
              "made faster) to 1000, got '0.5'"),
    ("1:nan", "got 'nan'"),
    ("1:inf", "got 'inf'"),
    ("1:1000.5", "got '1000.5'"),
    ("1:2,1:3", "slowdown '1:3': rank 1 is given twice"),
    ("1:2,", "slowdown '': expected RANK:FACTOR"),
])
def test_a_bad_slowdown_is_refused_naming_the_value(value, message):
    with pytest.raises(SpecError) as info:
        parse_slowdown([value], 2)
    assert message in str(info.value) and str(info.value).startswith("slowdown ")  # its argument, not the flag


@pytest.mark.parametrize("extra,message", [
    (["--slowdown", "2:2"], "--slowdown '2:2': the rank must be 0..1 (the plan has 2 processes)"),
    (["--slowdown", "1:0.9"], "--slowdown '1:0.9': the factor must be a finite number"),
    (["--slowdown", "0:2", "--slowdown", "0:3"], "rank 0 is given twice"),
    (["--slowdown", "1:2", "--calibrate-out", "{tmp}/cal.json"],
     "--calibrate-out with --slowdown 1:2: the profile would record the emulated op times"),
])
def test_a_bad_slowdown_is_one_error_line_and_status_2_before_launch(tmp_path, capsys, extra, message):
    plan = sim_plan(tmp_path / "sim", 2, 2, "--schedule", "1f1b")
    err = refused(capsys, plan, tmp_path / "out", *[arg.format(tmp=tmp_path) for arg in extra])
    assert message in err, err


def test_slowdown_is_refused_for_a_csp_plan(tmp_path, capsys):
    assert sim_main(["--topology", "2xcpu", "--schedule", "csp", "--model", CSP_SPEC, "--subnets", "2",
                     "--partition", "uniform", "--no-gantt", "--out", str(tmp_path / "sim")]) == 0
    err = refused(capsys, tmp_path / "sim" / "plan.json", tmp_path / "out", "--slowdown", "1:2")
    assert "--slowdown does not apply to a csp plan" in err, err


def test_options_give_each_rank_its_factor():
    options = RunOptions("plan.json", "out", slowdown=((0, 1.5), (3, 2.0)))
    assert [options.slowdown_of(rank) for rank in range(4)] == [1.5, 1.0, 1.0, 2.0]
    assert RunOptions("plan.json", "out").slowdown_of(0) == 1.0
    assert describe_slowdown(options.slowdown) == "rank 0 ×1.5, rank 3 ×2"
    assert slowdown_record(()) is None
    assert slowdown_record(options.slowdown)["by_rank"] == {"0": 1.5, "3": 2.0}


# --- the stretch ---------------------------------------------------------------------------------------------------


@pytest.fixture
def sleeps(monkeypatch):
    """The seconds each ``time.sleep`` was asked for, instead of sleeping."""
    asked: list[float] = []
    monkeypatch.setattr(time, "sleep", asked.append)
    return asked


def test_a_compute_op_sleeps_factor_minus_one_times_its_time_outside_collectives(sleeps):
    # 0.5 s op of which 0.1 s inside tensor-parallel collectives: 0.4 s of compute, stretched to 3 × 0.4 s.
    stretch(OpKind.F, 3.0, 10.0, 10.5, 0.1)
    assert sleeps == [pytest.approx(0.8, abs=1e-12)]
    stretch(OpKind.OPT_STEP, 1.5, 0.0, 2.0)
    assert sleeps[-1] == pytest.approx(1.0, abs=1e-12)
    stretch(OpKind.B, 2.0, 0.0, 1.0, 5.0)  # collectives longer than the op (a coarse clock): nothing to stretch
    assert sleeps[-1] == 0.0


@pytest.mark.parametrize("kind", sorted(set(OpKind) - STRETCHED_KINDS, key=lambda k: k.value))
def test_communication_and_bookkeeping_ops_are_never_stretched(sleeps, kind):
    assert stretch(kind, 2.0, 1.0, 3.0) == 3.0 and sleeps == []


def test_factor_one_stretches_nothing(sleeps):
    assert stretch(OpKind.F, 1.0, 1.0, 3.0) == 3.0 and sleeps == []


def test_a_stretched_op_ends_no_earlier_than_factor_times_its_duration():
    start = time.perf_counter()
    while time.perf_counter() - start < 0.005:  # a 5 ms op
        pass
    end = time.perf_counter()
    assert stretch(OpKind.B, 2.0, start, end) - start >= 2 * (end - start)  # a sleep wakes late, never early


def _one_rank(plan, factor, tp_clock=None):
    """An interpreter of a one-rank plan of SPEC in this process (no group needed: no sends), slowed by ``factor``,
    whose handlers record their own duration in s (``durations``: op id → s), measured here, not by the code under
    test."""
    stage = build_stage(SPEC, 0, 4, seed=0)
    boundary = {0: boundary_specs(SPEC, [0], plan.microbatch_size)[0]}
    interpreter = RankInterpreter(plan, 0, {0: stage}, {0: make_optimizer("sgd", stage.parameters())},
                                  loss_fn(SPEC), boundary, tp_comm=tp_clock, slowdown=factor)
    durations: dict[str, float] = {}

    def timed(handler):
        def run(op):
            start = time.perf_counter()
            handler(op)
            durations[op.id] = time.perf_counter() - start
        return run

    interpreter.handlers = {kind: timed(handler) for kind, handler in interpreter.handlers.items()}
    return SimpleNamespace(interpreter=interpreter, durations=durations, stage=stage)


def _iterate(run, steps, m):
    losses, records = [], []
    for step in range(steps):
        batches = [synthetic_batch(SPEC, 1, seed=0, index=step * m + j) for j in range(m)]
        records, step_losses = run.interpreter.run_iteration([x for x, _ in batches], [y for _, y in batches])
        losses.append(step_losses)
    return losses, records


def test_a_slowed_rank_spans_each_compute_op_over_factor_times_its_work_and_trains_the_same(one_thread):
    factor, m = 3.0, 3
    plan = built_plan(m=m)
    slowed, plain = _one_rank(plan, factor), _one_rank(plan, 1.0)
    slowed_losses, records = _iterate(slowed, 2, m)
    plain_losses, _ = _iterate(plain, 2, m)
    assert slowed_losses == plain_losses  # the stretch changes when, never what
    for key, value in plain.stage.state_dict().items():
        assert slowed.stage.state_dict()[key].equal(value), key
    assert {r.op.kind for r in records} == {OpKind.F, OpKind.B, OpKind.OPT_STEP}
    for record in records:
        work = slowed.durations[record.op.id]
        # At least factor × the handler's own time (a sleep never wakes early); at most that plus 50 ms, a
        # generous bound on the wake-up delay and the interpreter's own bookkeeping on a loaded 2-core machine.
        assert factor * work <= record.end - record.start <= factor * work + 0.05, record.op.id


class _Clock:
    """A tensor-parallel clock that reports ``seconds`` inside collectives for every op."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def take_seconds(self) -> float:
        return self.seconds


@pytest.mark.parametrize("collective_s", [0.0, 1e3])
def test_time_inside_tensor_parallel_collectives_is_not_stretched(sleeps, one_thread, collective_s):
    plan = build_plan(PlanInputs(model=SPEC, topology="2xcpu", tp=2, microbatches=2, partition="uniform")).plan
    run = _one_rank(plan, 1000.0, _Clock(collective_s))
    _iterate(run, 1, 2)
    computes = [op for op in plan.programs[0] if op.kind in STRETCHED_KINDS]
    assert len(sleeps) == len(computes)
    if collective_s:  # the whole op (and more) was in collectives: nothing left to stretch
        assert sleeps == [0.0] * len(computes)
    else:
        assert all(asked >= 999 * run.durations[op.id] for asked, op in zip(sleeps, computes, strict=True))


# --- real runs -----------------------------------------------------------------------------------------------------

# Two blocks with a 16-word vocabulary: the embedding and the head are small beside a block, so the two stages
# (embedding + block, block + head) cost about the same (measured: rank 1's compute time 0.92-1.06 × rank 0's),
# and on one thread each F takes about 8 ms or more and each B 16 ms or more, long beside a sleep's wake-up delay
# (the optimizer step, about 3 ms, is one op of thirteen per rank).
REAL_SPEC = "gpt:layers=2,hidden=256,heads=4,seq=192,vocab=16"


def _busy(trace, rank: int) -> float:
    """Seconds ``rank`` spent in stretched ops in the measured iteration."""
    kinds = {kind.value for kind in STRETCHED_KINDS}
    return math.fsum(span.duration for span in trace.spans if span.rank == rank and span.kind in kinds)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 2-rank 1F1B plan of :data:`REAL_SPEC` run without and with ``--slowdown 1:2``, one thread each."""
    tmp = tmp_path_factory.mktemp("slowdown")
    plan = sim_plan(tmp / "sim", 2, 6, "--schedule", "1f1b", model=REAL_SPEC)
    done = {}
    for name, extra in (("plain", ()), ("slowed", ("--slowdown", "1:2"))):
        result = execute(plan, tmp / name, "--warmup", "1", "--iterations", "3", "--threads", "1", "--no-gantt",
                         *extra)
        assert result.returncode == 0, result.stderr
        done[name] = SimpleNamespace(stdout=result.stdout, trace=read_chrome_trace(tmp / name / "trace.json"),
                                     compare=json.loads((tmp / name / "compare.json").read_text()),
                                     metrics=json.loads((tmp / name / "metrics.json").read_text()))
    return SimpleNamespace(**done)


def test_slowing_rank_1_by_2_doubles_its_measured_compute_time(runs):
    # Rank 1's compute time relative to rank 0's, which is not slowed and ran at the same moments on the same
    # machine: dividing by it cancels most of the load other programs put on the machine, which changes op times
    # by up to 2x from one run to the next here. Expected: 2 × the plain run's ratio. Over 11 pairs of these runs
    # on the shared 2-core machine (load average 1 to 5) it was 1.57-2.30, median 1.92; the plain ratio was
    # 0.92-1.06; a fresh clone's CI run on 2026-12-07 gave 2.77 (plain 0.84). So 1.35-3.2 passes that spread and
    # still fails no stretch (about 1) and a stretch of rank 0 as well (about 1); the exact amount of each stretch is
    # the in-process test's above.
    ratio = {name: _busy(run.trace, 1) / _busy(run.trace, 0) for name, run in vars(runs).items()}
    assert 0.6 < ratio["plain"] < 1.6, ratio  # the control: the two stages cost about the same
    assert 1.35 < ratio["slowed"] / ratio["plain"] < 3.2, ratio


def test_an_emulated_run_says_so_and_a_real_one_says_it_is_not(runs):
    assert runs.plain.compare["slowdown"] is None and runs.plain.metrics["measurement"]["slowdown"] is None
    assert "slowdown" not in runs.plain.trace.meta and "emulated" not in runs.plain.stdout
    record = runs.slowed.compare["slowdown"]
    assert record["emulated"] is True and record["by_rank"] == {"1": 2.0}
    assert record["stretched_kinds"] == ["B", "F", "I", "OPT_STEP", "R", "W"]
    assert runs.slowed.metrics["measurement"]["slowdown"] == record == runs.slowed.trace.meta["slowdown"]
    assert "emulated slowdown: rank 1 ×2" in runs.slowed.stdout
    # The prediction is the plan's own: the same in both runs.
    assert runs.slowed.compare["predicted_iteration_time_s"] == runs.plain.compare["predicted_iteration_time_s"]
