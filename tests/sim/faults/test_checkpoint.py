"""A checkpoint's bytes (weights and optimizer state of the whole model, 14 bytes a bf16 parameter), its copy to the
hosts over the host links and its write to storage, synchronous and asynchronous."""

import pytest

from sim.faults.checkpoint import STORAGE_BANDWIDTH_PER_DEVICE, checkpoint_bytes, checkpoint_cost
from sim.hw.topology import Topology, message_time
from sim.models import build_model


def test_a_checkpoint_holds_fourteen_bytes_a_parameter_in_bf16():
    graph = build_model("llama3.1-8b")
    assert checkpoint_bytes(graph) == pytest.approx(graph.total_params * (2 + 4 + 8), abs=1)
    fp32 = build_model("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=100")  # fp16 weights with an fp32 master
    assert checkpoint_bytes(fp32) == pytest.approx(fp32.total_params * 14, abs=1)


def test_sync_stalls_for_the_copy_and_the_write_async_for_the_copy_only():
    graph, topology = build_model("llama3.1-8b"), Topology.parse("2x8xH100")
    nbytes = checkpoint_bytes(graph)
    copy = message_time(topology.device_to_host_path(0), nbytes / 16)
    write = nbytes / (16 * STORAGE_BANDWIDTH_PER_DEVICE)
    sync = checkpoint_cost(graph, topology)
    assert (sync.blocking_s, sync.persist_s, sync.load_s) == pytest.approx((copy + write, 0.0, copy + write))
    background = checkpoint_cost(graph, topology, asynchronous=True, storage_bandwidth=1e11)
    assert (background.blocking_s, background.persist_s) == pytest.approx((copy, nbytes / 1e11))
    with pytest.raises(ValueError, match="storage bandwidth must be"):
        checkpoint_cost(graph, topology, storage_bandwidth=0.0)
