"""The SimPy engine against closed forms: bubble formulas, exact timelines, transfer times, memory."""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.cost.cost_view import CostView
from sim.engine.simpy_engine import OutOfMemoryError, simulate
from sim.hw.topology import Topology
from sim.ir.plan import RECV_KINDS, SEND_KINDS, Op, OpKind, Placement, Plan
from sim.models import build_model
from sim.models.graph import Layer, LayerGraph
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.plan.lower import add_recompute, lower
from sim.plan.partition import counts_to_ranges
from sim.plan.validate import PlanError, validate
from sim.schedules import SCHEDULES
from tests.sim.cost.nccl_closed_form import nccl_call_s, route_class


def _simulate(inputs):
    built = build_plan(inputs)
    return built, simulate(built.plan, built.costs, built.topology)


def _bubble(result):
    trace = result.trace
    busy = sum(s.duration for s in trace.spans if s.stream == "compute")
    return 1 - busy / (trace.num_ranks * trace.makespan)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bubble_fraction_formula_over_grid(schedule):
    # DESIGN §4 / GPipe §2.3: with uniform stage costs and free links, bubble = (p-1)/(m+p-1) and the iteration
    # takes (m+p-1)(t_f+t_b).
    for p in range(1, 9):
        for m in range(1, 33):
            inputs = PlanInputs(f"uniform:layers={p},fwd_ms=1,bwd_ms=2", f"{p}xideal", schedule, m, partition="uniform")
            _, result = _simulate(inputs)
            assert _bubble(result) == pytest.approx((p - 1) / (m + p - 1), rel=1e-12, abs=1e-12), (p, m)
            assert result.trace.makespan == pytest.approx((m + p - 1) * 3e-3, rel=1e-12), (p, m)


def test_1f1b_exact_timeline_p3_m4():
    # The diagram in sim/schedules/one_f_one_b.py, slot = 1 ms (t_f = t_b = 1 ms).
    _, result = _simulate(PlanInputs("uniform:layers=3,fwd_ms=1,bwd_ms=1", "3xideal", "1f1b", 4, partition="uniform"))
    expected = {
        0: "F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3",
        1: ".  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .",
        2: ".  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .",
    }
    for rank, row in expected.items():
        slots = row.split()
        got = ["."] * 12
        for span in result.trace.on_rank(rank, "compute"):
            if span.kind in ("F", "B"):
                assert span.duration == pytest.approx(1e-3)
                got[round(span.start * 1e3)] = f"{span.kind}{span.mb}"
        assert got == slots, rank


def _hand_plan(programs, layers, vstage_to_rank, topology, act_mb=1.0):
    graph = build_model(f"uniform:layers={layers},fwd_ms=1,bwd_ms=2,act_mb={act_mb},param_mb=0")
    placement = Placement(counts_to_ranges((1,) * layers), vstage_to_rank)
    plan = Plan("file", "L1", graph.spec, topology, 1, 1, "flush", placement, programs)
    topo = Topology.parse(topology)
    return plan, CostView(graph, topo, placement, 1), topo


def _transfer_program(src_vstage, src_rank, dst_rank, pair):
    send = Op(OpKind.SEND_F, src_vstage, 0, peer=dst_rank, pair=pair, deps=(f"{src_vstage}F0",))
    recv = Op(OpKind.RECV_F, src_vstage + 1, 0, peer=src_rank, pair=pair, deps=(send.id,))
    return (Op(OpKind.F, src_vstage, 0), send), (recv, Op(OpKind.F, src_vstage + 1, 0, deps=(recv.id,)))


def test_single_transfer_over_multi_hop_path_matches_closed_form():
    # 8xV100 ranks 0 and 5 have no NVLink: the message crosses two PCIe hops through the host.
    sender, receiver = _transfer_program(0, 0, 5, pair=0)
    programs = (sender, (), (), (), (), receiver)
    plan, costs, topo = _hand_plan(programs, 2, (0, 5), "8xV100")
    path = topo.path(0, 5)
    assert len(path) == 2
    nbytes = 1e6  # act_mb=1 → 1e6 bytes per sample
    # α + S/B over the path, as one NCCL message (one step) at its cheapest protocol, with PCIe's per-step latency:
    # this pair's route crosses PCIe although the server has NVLink elsewhere.
    link = sum(link.spec.latency for link in path) + nbytes / min(link.spec.bandwidth for link in path)
    expected = nccl_call_s(link, 1, "pcie")
    trace = simulate(plan, costs, topo).trace
    send = next(s for s in trace.spans if s.kind == "SEND_F")
    recv = next(s for s in trace.spans if s.kind == "RECV_F")
    # The message leaves when its forward ends: 1 ms of layer time (the kernel model's per-microbatch framework time
    # applies to GPT layers only, not to this synthetic model: sim.cost.gpu_time).
    producer = next(s for s in trace.spans if s.op == "0F0")
    assert costs.oracle.microbatch_overhead_s(topo.devices[0]) == 0.0
    assert producer.duration == pytest.approx(1e-3, rel=1e-12)
    assert send.start == producer.end and send.duration == pytest.approx(expected, rel=1e-12)
    assert (recv.start, recv.end, recv.rank) == (send.start, send.end, 5)
    consumer = next(s for s in trace.spans if s.op == "1F0")
    assert consumer.start == send.end


def test_two_transfers_sharing_links_take_longer_than_one():
    # Rank 0 → 2 and rank 1 → 3 of 2x2xV100 both cross the inter-node network in the same direction.
    topology = "2x2xV100"
    topo = Topology.parse(topology)
    shared = {(hop.src, hop.dst) for hop in topo.path(0, 2)} & {(hop.src, hop.dst) for hop in topo.path(1, 3)}
    assert shared, "the two paths were expected to share a link"
    s0, r0 = _transfer_program(0, 0, 2, pair=0)
    s1, r1 = _transfer_program(2, 1, 3, pair=1)
    plan, costs, topo = _hand_plan((s0, s1, r0, r1), 4, (0, 2, 1, 3), topology)
    trace = simulate(plan, costs, topo).trace
    ends = sorted(s.end for s in trace.spans if s.kind == "SEND_F")
    # Both forwards (1 ms of layer time; no framework time for a synthetic model) end together, when the sends start.
    ready = 1e-3
    assert [s.end for s in trace.spans if s.kind == "F" and s.vstage in (0, 2)] == pytest.approx([ready] * 2,
                                                                                                rel=1e-12)
    # One message on its own: the link model as one NCCL message (one step) over the network.
    alone = nccl_call_s(topo.transfer_time(1e6, 0, 2), 1, "net")
    assert alone == pytest.approx(nccl_call_s(topo.transfer_time(1e6, 1, 3), 1, "net"))
    assert ends[0] == pytest.approx(ready + alone, rel=1e-12)
    assert ends[1] == pytest.approx(ready + 2 * alone, rel=1e-12)  # waits for the shared links, then runs alone
    single_plan, single_costs, _ = _hand_plan((s0, (), r0), 2, (0, 2), topology)
    single = simulate(single_plan, single_costs, topo).trace
    assert max(s.end for s in single.spans if s.kind == "SEND_F") == pytest.approx(ready + alone, rel=1e-12)


@pytest.mark.parametrize("schedule, held", [("gpipe", lambda p, m, r: m), ("1f1b", lambda p, m, r: min(p - r, m))])
@pytest.mark.parametrize("p, m", [(4, 8), (4, 2), (6, 6)])
def test_peak_activation_memory(schedule, held, p, m):
    # Stage r of 1F1B keeps p - r microbatches in flight, GPipe all m (Megatron §2.2.1). Each in-flight microbatch of
    # a one-layer uniform stage keeps its received input and its output: 2 × act_mb.
    inputs = PlanInputs(f"uniform:layers={p},act_mb=1,param_mb=0", f"{p}xideal", schedule, m, partition="uniform")
    _, result = _simulate(inputs)
    assert result.peak_memory_bytes == tuple(2e6 * held(p, m, r) for r in range(p))


def test_training_state_is_resident_memory():
    _, result = _simulate(PlanInputs("uniform:layers=2,act_mb=0,param_mb=10", "2xideal", "1f1b", 4,
                                     partition="uniform"))
    # 10 MB of fp16 weights = 5e6 parameters × 16 bytes of mixed-precision Adam state (ZeRO §3.1).
    assert result.peak_memory_bytes == (80e6, 80e6)


def test_out_of_memory_names_device_time_and_op():
    built = build_plan(PlanInputs("uniform:layers=2,act_mb=12000,param_mb=0", "2xV100", "gpipe", 2,
                                  partition="uniform"))
    with pytest.raises(OutOfMemoryError, match=r"rank 0 \(v100-sxm2-32gb\) at t=\d+\.\d+ ms during 0F1"):
        simulate(built.plan, built.costs, built.topology)
    relaxed = simulate(built.plan, built.costs, built.topology, check_memory=False)
    assert relaxed.peak_memory_bytes[0] > built.topology.devices[0].memory_bytes


def _uncontended_times(plan, costs, topo):
    """Independent oracle: every op's end time when no two transfers ever share a link (pure Python). A message
    between two GPUs is one NCCL call of one step (tests/sim/cost/nccl_closed_form.py)."""
    end, issue = {}, {}
    pointer, last_compute = [0] * plan.num_ranks, [0.0] * plan.num_ranks
    sends, recvs = {}, {}
    remaining = sum(len(p) for p in plan.programs)
    while remaining:
        progressed = False
        for rank, program in enumerate(plan.programs):
            while pointer[rank] < len(program):
                op = program[pointer[rank]]
                if op.kind in SEND_KINDS or op.kind in RECV_KINDS:
                    issue[op.id] = last_compute[rank]
                    (sends if op.kind in SEND_KINDS else recvs)[op.pair] = (rank, op)
                elif all(d in end for d in op.deps):
                    start = max([last_compute[rank]] + [end[d] for d in op.deps])
                    end[op.id] = last_compute[rank] = start + costs.compute_time(op.kind, op.vstage)
                    remaining -= 1
                else:
                    break
                pointer[rank] += 1
                progressed = True
        for pair, (src, send) in list(sends.items()):
            if pair in recvs and send.id not in end and all(d in end for d in send.deps):
                dst, recv = recvs[pair]
                start = max([issue[send.id], issue[recv.id]] + [end[d] for d in send.deps])
                link = topo.transfer_time(costs.message_bytes(send.kind, send.vstage), src, dst)
                if src != dst and topo.devices[src].is_gpu and topo.devices[dst].is_gpu:
                    link = nccl_call_s(link, 1, route_class(topo, src, dst))
                end[send.id] = end[recv.id] = start + link
                remaining -= 2
                progressed = True
        assert progressed, "oracle found a deadlock"
    return end


TOPOLOGIES = ["{p}xideal", "{p}xV100", "{p}xA100", "1x{p}xT4", "{p}xH100"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    p=st.integers(1, 6),
    m=st.integers(1, 10),
    schedule=st.sampled_from(sorted(SCHEDULES)),
    topology=st.sampled_from(TOPOLOGIES),
    data=st.data(),
)
def test_random_plans_simulate_and_respect_lower_bounds(p, m, schedule, topology, data):
    entry = SCHEDULES[schedule]
    chunks = data.draw(st.integers(2, 3), label="chunks") if entry.chunked else 1
    if entry.chunked:
        m = p * (1 + m % 3)  # interleaving needs a multiple of p (Megatron)
    elif entry.fixed_chunks > 1:
        m = 2 * p + m % 3  # DualPipeV needs m >= 2p
    recompute = data.draw(st.booleans(), label="recompute")
    num_vstages = p * entry.chunks_per_rank(chunks)
    n = data.draw(st.integers(num_vstages, 3 * num_vstages), label="layers")
    times = data.draw(st.lists(st.tuples(st.floats(1e-4, 1e-2), st.floats(1e-4, 2e-2)), min_size=n, max_size=n))
    acts = data.draw(st.lists(st.integers(0, 50_000_000), min_size=n, max_size=n), label="activation bytes")
    layers = [Layer(f"l{i}", "uniform", 0.0, 0.0, 1000, a, a, 0, f, b)
              for i, ((f, b), a) in enumerate(zip(times, acts))]
    graph = LayerGraph("custom", layers, dtype_bytes=2, input_bytes=1000)
    topo = Topology.parse(topology.format(p=p))
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, n - 1)), min_size=num_vstages - 1,
                                    max_size=num_vstages - 1), label="cuts"))
    bounds = [0, *cuts, n]
    placement = Placement(tuple(zip(bounds, bounds[1:])), entry.vstage_to_rank(p, chunks))
    l0 = Plan(schedule, "L0", "custom", str(topo), m, 1, "flush", placement, entry.build(p, m, chunks))
    plan = lower(add_recompute(l0) if recompute else l0)
    validate(plan)
    costs = CostView(graph, topo, placement, 1)
    trace = simulate(plan, costs, topo, check_memory=False).trace
    makespan = trace.makespan
    for rank in range(p):
        busy = sum(s.duration for s in trace.on_rank(rank, "compute"))
        assert makespan >= busy * (1 - 1e-12)
    oracle = _uncontended_times(plan, costs, topo)
    critical_path = max(oracle.values())
    assert makespan >= critical_path * (1 - 1e-12)
    if topo.is_ideal or p <= 2:
        # Nothing can contend: links are free, or with two ranks each direction carries one message at a time (the
        # receiver posts one receive at a time, right before the op that needs it). The engine must then reproduce
        # the uncontended schedule exactly.
        assert makespan == pytest.approx(critical_path, rel=1e-12)
    assert math.isfinite(makespan) and len(trace.spans) == sum(len(prog) for prog in plan.programs)


def test_prefetch_and_evict_use_the_pcie_copy_engines():
    # A stage kept in host memory: its 100 MB of weights are copied in before F and written back after B.
    prefetch = Op(OpKind.PREFETCH, 0)
    program = (
        prefetch,
        Op(OpKind.F, 0, 0, deps=(prefetch.id,)),
        Op(OpKind.B, 0, 0),
        Op(OpKind.EVICT, 0, deps=("0B0",)),
    )
    graph = build_model("uniform:layers=1,fwd_ms=1,bwd_ms=2,act_mb=1,param_mb=100")
    placement = Placement(((0, 1),), (0,))
    topo = Topology.parse("1xV100")
    plan = Plan("file", "L1", graph.spec, "1xV100", 1, 1, "flush", placement, (program,))
    validate(plan)
    result = simulate(plan, CostView(graph, topo, placement, 1), topo)
    spans = {s.op: s for s in result.trace.spans}

    def closed_form(path):
        return sum(hop.spec.latency for hop in path) + 1e8 / min(hop.spec.bandwidth for hop in path)

    h2d, d2h = closed_form(topo.host_to_device_path(0)), closed_form(topo.device_to_host_path(0))
    assert spans["0PREFETCH"].stream == "h2d" and spans["0PREFETCH"].duration == pytest.approx(h2d, rel=1e-12)
    assert spans["0F0"].start == spans["0PREFETCH"].end
    assert spans["0EVICT"].stream == "d2h" and spans["0EVICT"].start == spans["0B0"].end
    assert spans["0EVICT"].duration == pytest.approx(d2h, rel=1e-12)
    # Offloaded weights are not resident at the start: peak = weights + one microbatch (its input and output).
    assert result.peak_memory_bytes == (1e8 + 2e6,)


def test_copy_waiting_on_a_later_op_of_its_own_rank_is_a_deadlock():
    program = (Op(OpKind.PREFETCH, 0, deps=("0B0",)), Op(OpKind.F, 0, 0, deps=("0PREFETCH",)), Op(OpKind.B, 0, 0))
    plan = Plan("file", "L1", "m", "1xideal", 1, 1, "flush", Placement(((0, 1),), (0,)), (program,))
    with pytest.raises(PlanError, match=r">>0F0<<.*waits for 0PREFETCH"):
        validate(plan)
