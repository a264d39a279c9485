"""Activation offloading (sim.models.offload): the blocks marked, what the ledger stops keeping (exactly the offloaded
blocks' saved bytes), the copies' time against the host link's, and the plans Megatron-Core refuses."""

import pytest

from sim.core.errors import SpecError
from sim.hw.topology import Topology
from sim.ir.plan import Plan
from sim.models import build_model
from sim.models.offload import block_indices
from sim.models.sharding import Sharding
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict, predict_built

LLAMA = "llama:layers=6,hidden=1024,heads=8,kv_heads=4,ffn=3072,vocab=4096,seq=4096"


def test_the_first_blocks_are_marked_and_nothing_else_changes():
    whole = build_model(LLAMA)
    graph = build_model(LLAMA, Sharding(offloaded_blocks=4))
    blocks = block_indices(graph)
    assert blocks == (1, 2, 3, 4, 5, 6)  # after the embedding
    assert [layer.activations_offloaded for layer in graph.layers] == [False, True, True, True, True, False, False,
                                                                      False]
    assert [layer.saved_bytes for layer in graph.layers] == [layer.saved_bytes for layer in whole.layers]


def test_at_least_one_block_stays_and_only_the_decoders_offload():
    with pytest.raises(SpecError, match="must be below the model's 6 blocks"):
        build_model(LLAMA, Sharding(offloaded_blocks=6))
    with pytest.raises(SpecError, match="llama and moe families only"):
        build_model("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=512", Sharding(offloaded_blocks=1))


def _run(topology="1xH100", **extra):
    inputs = PlanInputs(model=LLAMA, topology=topology, microbatches=2, microbatch_size=2, **extra)
    built = build_plan(inputs)
    return built, predict_built(built, check_memory=False).metrics


def test_the_peak_drops_by_the_offloaded_blocks_activations():
    block = build_model(LLAMA).layers[1].saved_bytes  # every block keeps the same
    _, kept = _run()
    for count in (1, 3, 5):
        built, offloaded = _run(offload_activations=count)
        assert built.plan.option("offload_activations") == count
        drop = kept["devices"][0]["peak_memory_bytes"] - offloaded["devices"][0]["peak_memory_bytes"]
        assert drop == count * 2 * block  # two samples per microbatch


@pytest.mark.parametrize("topology", ["1xH100", "1xGB200"])
def test_an_offloaded_block_takes_the_longer_of_its_compute_and_its_copy(topology):
    built, _ = _run(topology, offload_activations=2)
    oracle = build_plan(PlanInputs(model=LLAMA, topology=topology, microbatches=2, microbatch_size=2)).costs.oracle
    costs = built.costs.oracle
    device = Topology.parse(topology).devices[0]
    plain, offloaded = oracle.layer_costs(device), costs.layer_costs(device)
    nbytes = 2 * build_model(LLAMA).layers[1].saved_bytes
    for i in (1, 2):
        assert offloaded.fwd[i] == max(plain.fwd[i], costs.device_to_host_s(0, nbytes))
        assert offloaded.bwd[i] == max(plain.bwd[i], costs.host_to_device_s(0, nbytes))
    assert offloaded.fwd[3:] == plain.fwd[3:] and offloaded.bwd[3:] == plain.bwd[3:]


def test_over_pcie_the_copy_shows_and_over_nvlink_c2c_it_hides():
    # PCIe 5 x16 (64 GB/s) against NVLink-C2C to Grace: the same block's copy outlasts its compute on the first
    for topology, slower in (("1xH100", True), ("1xGB200", False)):
        _, plain = _run(topology)
        _, offloaded = _run(topology, offload_activations=5)
        assert (offloaded["iteration_time_s"] > plain["iteration_time_s"]) is slower, topology


def test_a_written_plan_predicts_the_same():
    built, metrics = _run(offload_activations=3)
    again = predict(Plan.loads(built.plan.dumps()), check_memory=False).metrics
    assert again["devices"][0]["peak_memory_bytes"] == metrics["devices"][0]["peak_memory_bytes"]
    assert again["iteration_time_s"] == metrics["iteration_time_s"]


@pytest.mark.parametrize("extra,needle", [
    (dict(topology="2xH100", pp=2), "pipeline parallelism"),
    (dict(topology="1xH100", recompute="full"), "recomputation"),
    (dict(topology="1xH100", offload_activations=-1), "integer >= 0"),
])
def test_what_megatron_refuses_is_refused(extra, needle):
    extra.setdefault("offload_activations", 2)
    with pytest.raises(SpecError, match=needle):
        build_plan(PlanInputs(model=LLAMA, microbatches=2, **extra))


def test_sim_run_names_the_flags_in_one_line(tmp_path, capsys):
    from sim.run import main

    with pytest.raises(SystemExit) as info:
        main(["--topology", "2xH100", "--model", LLAMA, "--pp", "2", "--offload-activations", "2",
              "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: --offload-activations is not modelled beside pipeline parallelism"), err
    assert "--pp 2" in err
    assert not (tmp_path / "out").exists()
