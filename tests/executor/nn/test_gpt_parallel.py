"""The gpt layers' tensor-parallel shards against the simulator's per-shard figures and the whole layers they split
(the numerics of the shards together are checked by the real runs in ``tests/executor/test_run_parallel.py``)."""

from __future__ import annotations

import pytest
import torch

from executor.nn.gpt_parallel import shard_layer, shard_state, unshard_state
from executor.nn.stages import build_layers
from executor.nn.tensor_parallel import TensorParallelComm
from sim.core.spec import parse_spec
from sim.models import build_model
from sim.models.sharding import Sharding

pytestmark = pytest.mark.usefixtures("one_thread")

# A vocabulary that is not a multiple of 2 or 4, so the vocabulary-parallel tables are padded.
SPECS = ["gpt:heads=4,hidden=32,layers=2,seq=8,vocab=51", "gpt:heads=8,hidden=64,layers=1,seq=4,vocab=100"]


def _values(spec: str) -> dict[str, int]:
    return {key: int(value) for key, value in parse_spec(build_model(spec).spec)[1].items()}


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_shard_has_the_simulators_per_shard_parameter_count(spec, tp):
    graph = build_model(spec, Sharding(tp=tp))
    layers = build_layers(spec)
    for t in range(tp):
        comm = TensorParallelComm(None, tp, t)  # no collective runs while building
        counts = [sum(p.numel() for p in shard_layer(layer, _values(spec), comm).parameters()) for layer in layers]
        assert counts == [graph.param_count(i) for i in range(len(graph))]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_shards_of_a_layer_put_back_together_are_the_layer_bitwise(tp):
    spec = SPECS[0]
    for layer in build_layers(spec, seed=3):
        whole = layer.state_dict()
        shards = [shard_state(whole, t, tp) for t in range(tp)]
        back = unshard_state(shards, vocab=51)
        assert sorted(back) == sorted(whole)
        for name, tensor in whole.items():
            assert torch.equal(back[name], tensor), name


def test_shards_split_heads_and_columns_as_megatron_does():
    # The closed form of each split, from the whole block's weights (h = 32, 4 heads of 8, T = 2).
    h, tp = 32, 2
    block = build_layers(SPECS[0], seed=1)[1].state_dict()
    for t in range(tp):
        shard = shard_state(block, t, tp)
        rows = slice(t * h // tp, (t + 1) * h // tp)  # heads 2t, 2t + 1
        q, k, v = block["qkv.weight"].split(h)
        assert torch.equal(shard["qkv.weight"], torch.cat([q[rows], k[rows], v[rows]]))
        assert torch.equal(shard["proj.weight"], block["proj.weight"][:, rows])
        assert torch.equal(shard["up.weight"], block["up.weight"][t * 4 * h // tp:(t + 1) * 4 * h // tp])
        assert torch.equal(shard["down.weight"], block["down.weight"][:, t * 4 * h // tp:(t + 1) * 4 * h // tp])
        assert torch.equal(shard["proj_bias"], block["proj.bias"]) and torch.equal(shard["ln1.weight"],
                                                                                   block["ln1.weight"])


def test_vocabulary_shards_are_padded_with_zero_rows():
    head = build_layers(SPECS[0])[-1].state_dict()  # vocab 51 -> 52 rows over 2 shards of 26
    last = shard_state(head, 1, 2)["out.weight"]
    assert last.shape == (26, 32)
    assert torch.equal(last[:25], head["out.weight"][26:]) and not last[25].any()


def test_building_a_shard_never_draws_from_the_global_rng():
    layers = build_layers(SPECS[0])
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    for layer in layers:
        shard_layer(layer, _values(SPECS[0]), TensorParallelComm(None, 2, 1))
    assert torch.equal(torch.random.get_rng_state(), before)
