"""3D plans in one process: the interpreter's tensor-parallel spans, where a replica's data comes from, the
data-parallel reference, and what ``executor.run`` refuses before it launches anything (the real runs are
``test_run_parallel.py``)."""

import pytest
import torch

from executor.interpreter import RankInterpreter, check_supported
from executor.nn.optim import make_optimizer
from executor.nn.stages import boundary_specs, build_stage, loss_fn, synthetic_batch
from executor.parallel import Place, microbatch_index
from executor.reference import train_reference
from sim.ir.parallel import Parallelism
from sim.ir.plan import TP_KINDS, OpKind
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.plan.validate import PlanError
from sim.run import main as sim_main
from tests.executor.runs import SPEC, edited_plan, refused

pytestmark = pytest.mark.usefixtures("one_thread")


class _FixedClock:
    """A tensor-parallel clock that says every op spent ``seconds`` inside collectives."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def take_seconds(self) -> float:
        return self.seconds


def _tp_plan(m=2, **inputs):
    """A TP 2 plan of SPEC on one pipeline rank (program 0 runs on both shards)."""
    return build_plan(PlanInputs(model=SPEC, topology="2xcpu", tp=2, microbatches=m, partition="uniform",
                                 **inputs)).plan


def _run_program(plan, clock):
    """Program 0 of ``plan`` in this process on the whole model (one rank needs no group; the clock stands for the
    collectives); its op records."""
    stage = build_stage(SPEC, 0, 4, seed=0)
    boundary = {0: boundary_specs(SPEC, [0], 1)[0]}
    interpreter = RankInterpreter(plan, 0, {0: stage}, {0: make_optimizer("sgd", stage.parameters())},
                                  loss_fn(SPEC), boundary, tp_comm=clock)
    batches = [synthetic_batch(SPEC, 1, seed=0, index=j) for j in range(plan.num_microbatches)]
    records, _ = interpreter.run_iteration([x for x, _ in batches], [y for _, y in batches])
    return records


@pytest.mark.parametrize("seconds", [1e-7, 1e3])
def test_a_tp_span_is_the_collective_time_cut_from_the_end_of_its_compute_op(seconds):
    plan = _tp_plan()
    check_supported(plan)
    records = _run_program(plan, _FixedClock(seconds))
    assert {r.op.kind for r in records} >= {OpKind.TP_F, OpKind.TP_B}
    for before, record in zip(records, records[1:]):
        if record.op.kind in TP_KINDS:
            assert before.op.kind in (OpKind.F, OpKind.B) and (before.op.vstage, before.op.mb) == (record.op.vstage,
                                                                                                  record.op.mb)
            # The two spans tile the compute op: it ends where the TP span starts.
            assert before.end == record.start and before.start <= before.end
            if seconds < 1e-3:  # a real op lasts more than 0.1 µs: the TP span is exactly the time given
                assert record.end - record.start == pytest.approx(seconds, rel=1e-3)
            else:  # more than the op lasted: the compute span shrinks to nothing, never below its start
                assert before.end == before.start


def test_a_tp_op_away_from_its_compute_op_or_without_a_group_isrefused():
    plan = _tp_plan()
    program = list(plan.programs[0])
    index = next(i for i, op in enumerate(program) if op.kind is OpKind.TP_F)
    program[index - 1], program[index] = program[index], program[index - 1]
    stage = build_stage(SPEC, 0, 4, seed=0)
    args = (0, {0: stage}, {0: make_optimizer("sgd", stage.parameters())}, loss_fn(SPEC), {})
    with pytest.raises(PlanError, match="must follow the compute op it reports"):
        RankInterpreter(plan.with_programs((tuple(program),), level="L1"), *args, tp_comm=_FixedClock(0.0))
    with pytest.raises(PlanError, match="no tensor-parallel group"):
        RankInterpreter(plan, *args)


def test_replicas_run_consecutive_slices_of_the_global_batch():
    replicas, m = 3, 2
    for iteration in range(3):
        indices = [microbatch_index(iteration, j, m, d, replicas) for d in range(replicas) for j in range(m)]
        assert indices == list(range(iteration * replicas * m, (iteration + 1) * replicas * m))
    layout = Parallelism(tp=2, dp=2, pp=2)
    place = Place.of(layout, 5)  # tp-dp-pp: 5 = 1 + 2 * (0 + 2 * 1)
    assert (place.pp, place.dp, place.tp) == (1, 0, 1) and place.peer(0) == 1


def test_the_data_parallel_reference_is_training_on_the_global_batch():
    # D replicas of m microbatches = one process on D·m microbatches, up to the order of the gradient sums.
    replicated = train_reference(SPEC, steps=3, num_microbatches=2, microbatch_size=1, optimizer="sgd", replicas=2)
    single = train_reference(SPEC, steps=3, num_microbatches=4, microbatch_size=1, optimizer="sgd")
    assert replicated.losses[0] == single.losses[0]  # the same weights on the same batches
    for key, value in single.state.items():
        torch.testing.assert_close(replicated.state[key], value, rtol=0, atol=1e-8, msg=key)
    initial = train_reference(SPEC, steps=0, num_microbatches=1, microbatch_size=1).state
    assert max((single.state[k] - initial[k]).abs().max().item() for k in initial) > 1e-6  # training moved them


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """``sim.run`` plans: TP 2 × PP 2 on 4xcpu, DP 2 on 2xcpu, TP 2 with sequence parallelism."""
    tmp = tmp_path_factory.mktemp("plans")
    made = {}
    for name, topology, flags in (("tp2pp2", "4xcpu", ["--tp", "2", "--pp", "2", "-m", "2"]),
                                  ("dp2", "2xcpu", ["--dp", "2", "--global-batch", "4"]),
                                  ("sp", "2xcpu", ["--tp", "2", "--sequence-parallel", "-m", "2"])):
        assert sim_main(["--topology", topology, "--model", SPEC, "--partition", "uniform", "--no-gantt",
                         "--out", str(tmp / name), *flags]) == 0
        made[name] = tmp / name / "plan.json"
    return made


@pytest.mark.parametrize("name,edit,extra,message", [
    # 4 processes needed, 2 devices in the topology: refused, nothing launched.
    ("tp2pp2", lambda d: d.update(topology="2xcpu"), (),
     "plan has TP 2 × DP 1 × PP 2 = 4 devices but its topology '2xcpu' has 2 device(s)"),
    ("sp", None, (), "does not implement sequence parallelism"),
    ("tp2pp2", lambda d: d.update(model="cnn:features=4,kernel=3,layers=2,size=8"), (),
     "tensor parallelism (tp = 2) is implemented for gpt and llama only, not 'cnn'"),
    ("dp2", lambda d: d.update(weight_policy="stash"), (), "1f1b has 'stash' weights"),
    ("tp2pp2", None, ("--calibrate-out", "{tmp}/cal.json"), "--calibrate-out profiles whole layers"),
    ("tp2pp2", None, ("--inject-failure", "4:0F0"), "the rank must be 0..3"),
    ("tp2pp2", None, ("--inject-failure", "3:0F0"), "rank 3 has no op '0F0'"),  # global rank 3 runs pipeline rank 1
    ("tp2pp2", lambda d: d["parallel"].update(deallocate_pipeline_outputs=True), (),
     "the executor keeps each stage's output until its backward"),
], ids=["too-few-devices", "sequence-parallel", "tp-cnn", "dp-stash", "calibrate", "inject-range", "inject-op",
        "freed-outputs"])
def test_3d_plans_the_executor_cannot_run_are_refused_before_launch(tmp_path, capsys, plans, name, edit, extra,
                                                                    message):
    plan = plans[name] if edit is None else edited_plan(plans[name], tmp_path / "edited.json", edit)
    extra = [arg.format(tmp=tmp_path) for arg in extra]
    assert message in refused(capsys, plan, tmp_path / "out", *extra)


def test_expert_tensor_parallelism_is_refused_before_launch(tmp_path, capsys):
    moe = "moe:layers=2,hidden=32,heads=4,kv_heads=2,head_dim=8,ffn=48,vocab=50,seq=8,experts=4,topk=2,expert_ffn=16"
    assert sim_main(["--topology", "4xcpu", "--model", moe, "--dp", "4", "--ep", "2", "--etp", "2",
                     "--global-batch", "4", "--no-gantt", "--out", str(tmp_path / "sim")]) == 0
    message = refused(capsys, tmp_path / "sim" / "plan.json", tmp_path / "out")
    assert "the executor does not implement expert tensor parallelism (etp = 2)" in message
