"""``--cuda-graphs``: a captured step costs its kernels' own time plus one launch. Against closed forms: a stream
stage of k convolutions runs 3k ops per step (forward, backward, update of each layer), each paying the catalog's
per-op overhead eagerly; captured, it pays one launch, so its time per step drops by exactly (3k − 1) launches. A
transformer block under the kernel model (Megatron-Core's full-iteration graphs on a pipeline schedule) costs the sum
of its kernels' GPU times, no host issue between them, and never more than eagerly."""

import pytest

from sim.core.errors import SpecError
from sim.hw.catalog import get_device
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict, predict_built

MODEL = "cnn:layers=10,features=16,kernel=5,size=64"
LLAMA = "llama:layers=4,hidden=2048,heads=16,kv_heads=4,ffn=5632,vocab=32000,seq=2048"


def partime_metrics(cuda_graphs: bool, topology: str = "4xV100"):
    built = build_plan(PlanInputs(model=MODEL, topology=topology, schedule="stream", microbatches=24,
                                  partition="3,2,2,3", cuda_graphs=cuda_graphs))
    prediction = predict_built(built)
    return built, prediction.metrics["stream"]


def test_a_captured_step_saves_all_but_one_launch_per_stage():
    built, eager = partime_metrics(False)
    captured_built, captured = partime_metrics(True)
    assert built.plan.placement.layer_counts() == captured_built.plan.placement.layer_counts()
    launch = get_device("V100").launch_overhead_s
    assert launch > 0
    for k, slow, fast in zip(built.plan.placement.layer_counts(), eager["stage_step_time_s"],
                             captured["stage_step_time_s"]):
        assert slow - fast == pytest.approx((3 * k - 1) * launch, rel=1e-9)
    assert captured_built.plan.option("cuda_graphs") is True


def test_the_plan_records_it_and_the_prediction_path_costs_it_from_the_plan():
    built, captured = partime_metrics(True)
    again = predict(built.plan)  # the oracle rebuilt from plan.json alone (sim.cost.plan_costs.plan_oracle)
    assert again.metrics["stream"]["stage_step_time_s"] == captured["stage_step_time_s"]


def _block_oracle(cuda_graphs: bool):
    from sim.cost.plan_costs import plan_oracle, sharded_graph
    from sim.hw.topology import Topology
    from sim.ir.parallel import Parallelism

    topology = Topology.parse("2xH100")
    layout = Parallelism(tp=1, dp=1, pp=2)
    graph = sharded_graph(LLAMA, layout)
    return graph, plan_oracle(graph, 1, None, topology, layout, cuda_graphs=cuda_graphs)


def test_a_captured_transformer_block_costs_the_sum_of_its_kernels():
    from sim.cost.gpu_time import kernel_seconds
    from sim.cost.kernels.llama import LlamaBlockShape, llama_block_kernels

    graph, captured = _block_oracle(True)
    _, eager = _block_oracle(False)
    device = get_device("H100")
    block = next(i for i, layer in enumerate(graph.layers)
                 if layer.transformer is not None and layer.transformer.part == "block")
    part = graph.layers[block].transformer
    shape = LlamaBlockShape(1, part.seq, part.hidden, part.heads, part.kv_heads, part.head_dim, part.ffn, part.tp)
    model = captured.kernel_model
    for backward, costs in ((False, captured.layer_costs(device).fwd), (True, captured.layer_costs(device).bwd)):
        kernels = llama_block_kernels(shape, backward=backward)
        assert costs[block] == pytest.approx(sum(kernel_seconds(k, device, model) for k in kernels), rel=1e-12)
    # eagerly each kernel waits for its host issue where the GPU outruns the host: never faster than captured
    assert eager.layer_costs(device).fwd[block] >= captured.layer_costs(device).fwd[block]
    assert captured.microbatch_overhead_s(device) == 0 < eager.microbatch_overhead_s(device)
    assert captured.step_overhead_s(device) == device.launch_overhead_s


def test_a_pipeline_plan_with_captured_steps_is_predicted_faster():
    def iteration(cuda_graphs):
        built = build_plan(PlanInputs(model=LLAMA, topology="2xH100", schedule="1f1b",
                                      pp=2, microbatches=4, cuda_graphs=cuda_graphs))
        return built, predict_built(built).metrics["iteration_time_s"]

    captured_built, captured = iteration(True)
    _, eager = iteration(False)
    assert captured < eager and captured_built.plan.option("cuda_graphs") is True


def test_csp_refuses_it_on_the_command_line(capsys):
    from sim.run import main

    with pytest.raises(SystemExit) as ended:
        main(["--schedule", "csp", "--topology", "4xV100", "--cuda-graphs", "--out", "/nonexistent/x"])
    assert ended.value.code == 2
    assert "--cuda-graphs does not apply to --schedule csp" in capsys.readouterr().err


@pytest.mark.parametrize("change, needle", [
    ({"topology": "4xcpu"}, "cuda_graphs needs GPUs"),
    ({"topology": "4xideal"}, "cuda_graphs needs GPUs"),
])
def test_where_it_does_not_apply_is_one_error(change, needle):
    inputs = {"model": MODEL, "topology": "4xV100", "schedule": "stream", "microbatches": 8, "cuda_graphs": True,
              **change}
    with pytest.raises(SpecError, match=needle):
        build_plan(PlanInputs(**inputs))
