"""``experiments.hetero_search``: the stand-in cluster against the real one, the three plans against brute force
over the searches' own evaluations, the ``--quick`` files, and bad input."""

from __future__ import annotations

import csv
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from experiments import hetero_search
from experiments.hetero_search import (
    CLUSTERS,
    QUICK_CLUSTERS,
    QUICK_SPACE,
    Cluster,
    Comparison,
    compare,
    fixed_partition,
    stand_in,
)
from sim.core.errors import SpecError
from sim.core.fileio import write_text_atomic
from sim.hw.topology import Topology
from sim.search.alpa import honours_alpa_assumption
from sim.search.evaluate import evaluate


def _real(cluster: Cluster, folder: Path) -> Topology:
    if not cluster.yaml:
        return Topology.parse(cluster.topology)
    path = folder / f"{cluster.name}.yaml"
    write_text_atomic(cluster.yaml, path)
    return Topology.parse(str(path))


def _parsed_stand_in(real: Topology, folder: Path) -> tuple[Topology, str]:
    text, device = stand_in(real)
    path = folder / "stand-in.yaml"
    write_text_atomic(text, path)
    return Topology.parse(str(path)), device


@pytest.mark.parametrize("cluster", CLUSTERS, ids=[c.name for c in CLUSTERS])
def test_the_stand_in_has_the_same_servers_wiring_and_network_and_one_device_model(tmp_path, cluster):
    real = _real(cluster, tmp_path)
    homogeneous, device = _parsed_stand_in(real, tmp_path)
    assert homogeneous.num_ranks == real.num_ranks == 8
    assert homogeneous.node_of_rank == real.node_of_rank  # the same servers, each with the same GPU count
    assert [(s.count, s.intra, s.network, s.nics) for s in homogeneous.nodes] == \
        [(s.count, s.intra, s.network, s.nics) for s in real.nodes]
    assert {d.name for d in homogeneous.devices} == {device}
    # every cluster here has two device models in equal numbers: the stand-in takes the first rank's
    assert sorted(Counter(d.name for d in real.devices).values()) == [4, 4]
    assert device == real.devices[0].name
    # only the devices of the other model change
    assert [a.name != b.name for a, b in zip(real.devices, homogeneous.devices)] == \
        [d.name != device for d in real.devices]


def test_the_stand_in_takes_the_most_common_device_and_its_own_wiring_where_it_must(tmp_path):
    # 2 V100 (cube-mesh, 4 EDR ports) + 4 A100 (NVSwitch, 8 ports): the A100 is the most common although not first
    real = Topology.parse("2xV100+4xA100")
    homogeneous, device = _parsed_stand_in(real, tmp_path)
    assert device == "a100-sxm4-80gb" and {d.name for d in homogeneous.devices} == {device}
    assert homogeneous.node_of_rank == real.node_of_rank
    # an A100 server cannot be a cube-mesh: the A100's own wiring for 2 GPUs (NVSwitch); the ports disagree, so each
    # server takes the A100's default count (8)
    assert [s.intra for s in real.nodes] == ["cube-mesh", "nvswitch"]
    assert [s.intra for s in homogeneous.nodes] == ["nvswitch", "nvswitch"]
    assert [s.nics for s in real.nodes] == [4, 8] and [s.nics for s in homogeneous.nodes] == [8, 8]
    assert {s.network.name for s in homogeneous.nodes} == {s.network.name for s in real.nodes} == {"ib-edr"}


#: A100 and V100 16 GB servers of 2, a 24-layer GPT: the A100 stand-in's pick overflows the V100s, its second fits.
_SMALL = Cluster("small", "2 x A100 + 2 x V100 16 GB", model="gpt:layers=24,hidden=2048,heads=16,seq=2048",
                 global_batch=8, yaml="nodes:\n  - {device: A100, count: 2}\n  - {device: v100-sxm2-16gb, count: 2}\n"
                                      "network: ib-edr\nnics_per_node: 1\n")
_SMALL_SPACE = replace(QUICK_SPACE, microbatch_sizes=(2,), zero=(0,))


def _check(c: Comparison) -> None:
    """The three plans against brute force over the evaluations the searches made."""
    searched = c.searched.best
    feasible = [e for e in c.searched.evaluations if e.feasible]
    assert searched.iteration_time_s == min(e.iteration_time_s for e in feasible)
    # Alpa: the fastest feasible plan that honours the assumption, over the same space
    topology = Topology.parse(c.problem.topology)
    honouring = [e for e in c.alpa.evaluations if e.feasible]
    assert all(honours_alpa_assumption(e.candidate, topology) for e in c.alpa.evaluations)
    assert c.alpa.best.iteration_time_s == min(e.iteration_time_s for e in honouring)
    # homogeneous: the stand-in's fastest, with its layer counts, costed on the real cluster
    stand_in_best = min((e for e in c.homogeneous.evaluations if e.feasible), key=lambda e: e.iteration_time_s)
    assert c.pick == evaluate(c.problem, fixed_partition(stand_in_best))
    assert c.pick.layer_counts == stand_in_best.layer_counts
    # the searched space holds the other plans (the same evaluation), so it is never slower than either
    listed = {e.candidate: e for e in c.searched.evaluations}
    for plan in {c.alpa.best, c.pick, c.fits} - {None}:
        assert listed[plan.candidate] == plan
        assert searched.iteration_time_s <= plan.iteration_time_s or not plan.feasible
    assert searched.iteration_time_s <= c.alpa.best.iteration_time_s
    if c.fits is not None:
        assert searched.iteration_time_s <= c.fits.iteration_time_s


def test_a_pick_that_overflows_the_real_devices_gives_way_to_the_first_that_fits(tmp_path):
    c = compare(_SMALL, tmp_path, _SMALL_SPACE)
    _check(c)
    assert not c.pick.feasible and "out of memory" in c.pick.reason and "v100-sxm2-16gb" in c.pick.reason
    assert c.fits.feasible and c.fits is not c.pick
    # every plan the stand-in ranks above the one that fits overflows the real devices
    ranked = [fixed_partition(e) for e in c.homogeneous.ranked]
    before = ranked[:ranked.index(c.fits.candidate)]
    assert before and not any(evaluate(c.problem, k).feasible for k in before)
    assert [name for name, _ in c.plans()] == ["searched", "alpa", "homogeneous", "homogeneous-fits"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One ``--quick`` run, its files written, and the folder both wrote into."""
    out = tmp_path_factory.mktemp("quick") / "out"
    out.mkdir()
    result = hetero_search.run(out=out, quick=True, workers=1)
    assert hetero_search.write(result, out) == [out / "hetero_search.csv", out / "hetero_search.png"]
    return result, out


def test_quick_writes_its_files_and_its_plans_hold_against_brute_force(quick):
    result, out = quick
    names = [c.name for c in QUICK_CLUSTERS]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["hetero_search.csv", "hetero_search.png"] + [f"{n}.standin.yaml" for n in names]
        + [f"{c.name}.yaml" for c in QUICK_CLUSTERS if c.yaml])
    assert (out / "hetero_search.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    made = list(result.comparisons)
    assert [c.cluster for c in made] == list(QUICK_CLUSTERS)
    for c in made:
        _check(c)
    rows = list(csv.DictReader((out / "hetero_search.csv").open()))
    expected = [(c.cluster.name, plan, e.iteration_time_s) for c in made for plan, e in c.plans()]
    assert [(r["cluster"], r["plan"], float(r["iteration_time_s"])) for r in rows] == expected
    for r in rows:
        best = next(float(s["iteration_time_s"]) for s in rows if s["cluster"] == r["cluster"] and
                    s["plan"] == "searched")
        assert float(r["relative_to_searched"]) == pytest.approx(float(r["iteration_time_s"]) / best, rel=1e-12)


def test_no_workers_is_refused_naming_the_flag(tmp_path):
    with pytest.raises(SpecError, match="--workers must be an integer >= 1, got 0"):
        hetero_search.run(out=tmp_path, workers=0)
    assert list(tmp_path.iterdir()) == []
