"""sim.search.placement: the distinct assignments of device blocks to pipeline stages on a mixed cluster, against a
brute force over every permutation of the blocks."""

from itertools import permutations

import pytest

from sim.hw.topology import Topology
from sim.ir.parallel import Parallelism
from sim.search.placement import MAX_PLACEMENTS, stage_placements, swapped_placements


def kinds_of(layout: Parallelism, topology: Topology) -> tuple:
    """The device models serving each pipeline rank, in order."""
    return tuple(tuple(sorted(topology.devices[layout.device(p, d, t)].name for d in range(layout.dp)
                              for t in range(layout.tp))) for p in range(layout.pp))


def brute_force_sequences(layout: Parallelism, topology: Topology) -> set:
    blocks = kinds_of(layout, topology)
    return {tuple(blocks[i] for i in order) for order in permutations(range(layout.pp))}


def test_one_device_model_has_one_placement():
    assert stage_placements(Parallelism(tp=2, pp=4), Topology.parse("8xA100")) == [()]


@pytest.mark.parametrize("topology, tp, dp, pp, order", [
    ("4xV100+4xA100", 4, 1, 2, "tp-dp-pp"),
    ("4xV100+4xA100", 2, 1, 4, "tp-dp-pp"),
    ("4xV100+4xA100", 1, 2, 4, "tp-dp-pp"),
    ("4xV100+4xA100", 1, 1, 8, "tp-dp-pp"),
    ("2xV100+2xA100+4xT4", 1, 2, 4, "pp-dp-tp"),
])
def test_every_distinct_sequence_of_block_kinds_once(topology, tp, dp, pp, order):
    topo = Topology.parse(topology)
    layout = Parallelism(tp=tp, dp=dp, pp=pp, order=order)
    placements = stage_placements(layout, topo)
    assert placements[0] == ()  # the layout's own order first
    sequences = [kinds_of(Parallelism(tp=tp, dp=dp, pp=pp, order=order, devices=d), topo) for d in placements]
    expected = brute_force_sequences(layout, topo)
    assert len(sequences) == len(set(sequences)) == min(len(expected), MAX_PLACEMENTS)
    assert set(sequences) <= expected


def test_many_stages_are_capped_and_start_with_the_fastest_first():
    topo = Topology.parse("8xV100+8xA100")
    placements = stage_placements(Parallelism(pp=16), topo)
    assert len(placements) == len(set(placements)) == MAX_PLACEMENTS  # of 16! / (8! 8!) = 12,870 distinct ones
    names = [kinds_of(Parallelism(pp=16, devices=d), topo) for d in placements[:2]]
    a100, v100 = ("a100-sxm4-80gb",), ("v100-sxm2-32gb",)
    # The layout's own order is already the fastest last here; the fastest first comes next.
    assert names[0] == (v100,) * 8 + (a100,) * 8 and names[1] == (a100,) * 8 + (v100,) * 8


@pytest.mark.parametrize("topology, tp, dp, pp, order", [
    ("4xV100+4xA100", 1, 2, 4, "tp-dp-pp"),
    ("2xV100+2xA100+4xT4", 1, 2, 4, "pp-dp-tp"),
    ("1xT4+3xA100", 1, 1, 4, "tp-dp-pp"),
])
def test_a_swap_exchanges_the_kinds_of_two_neighbouring_stages_and_nothing_else(topology, tp, dp, pp, order):
    topo = Topology.parse(topology)
    for start in stage_placements(Parallelism(tp=tp, dp=dp, pp=pp, order=order), topo):
        layout = Parallelism(tp=tp, dp=dp, pp=pp, order=order, devices=start)
        before = kinds_of(layout, topo)
        # The oracle: every neighbouring pair of different kinds, exchanged in the kind sequence.
        expected = []
        for p in range(pp - 1):
            if before[p] != before[p + 1]:
                swapped = list(before)
                swapped[p], swapped[p + 1] = swapped[p + 1], swapped[p]
                expected.append(tuple(swapped))
        moves = swapped_placements(layout, topo)
        assert [kinds_of(Parallelism(tp=tp, dp=dp, pp=pp, order=order, devices=d), topo) for d in moves] == expected
        for devices in moves:  # a device order the IR accepts: each device once
            assert sorted(Parallelism(tp=tp, dp=dp, pp=pp, order=order, devices=devices).device_ranks) \
                == list(range(layout.world_size))
