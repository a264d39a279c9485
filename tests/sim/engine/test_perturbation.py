"""Stragglers and jitter (``sim.engine.perturbation``): a straggler costs what a topology file's slowed device costs
(an independent path to the same cost), its window bounds what it slows, a slow tensor shard slows its group, a slow
replica slows the iteration as replica 0 would, jitter is seeded, a device is named by its rank or its table name
(``gpu5``) and its links apart (``gpu5-links``), and bad flags are one error line."""

import json

import numpy as np
import pytest

from sim.core.errors import SpecError
from sim.engine.perturbation import STRAGGLER_FORMS, Perturbation, SlowLink, Straggler, parse_straggler
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict_built
from sim.run import main

MODEL = "gpt:layers=4,hidden=64,heads=4,seq=32,vocab=100"


def _time(tmp_path, topology, *flags, name="run"):
    out = tmp_path / name
    assert main(["--topology", topology, "--model", MODEL, "--partition", "uniform", "-m", "4", "--no-gantt",
                 "--out", str(out), *flags]) == 0
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb1p"])
def test_a_straggler_costs_what_a_slowed_device_of_a_topology_file_costs(tmp_path, schedule):
    # The topology file's slowdown divides the device's rates (sim.hw.catalog.slowed_device): every compute op's
    # roofline cost on it is factor times as long, as the straggler makes it.
    yaml = tmp_path / "slow.yaml"
    yaml.write_text("nodes:\n  - {device: cpu, count: 2}\nslowdown: {1: 2.5}\n")
    slowed = _time(tmp_path, str(yaml), "--schedule", schedule, name="file")
    straggled = _time(tmp_path, "2xcpu", "--schedule", schedule, "--straggler", "1:2.5", name="flag")
    assert straggled["iteration_time_s"] == pytest.approx(slowed["iteration_time_s"], rel=1e-12)
    plain = _time(tmp_path, "2xcpu", "--schedule", schedule, name="plain")
    assert straggled["perturbation"]["unslowed_iteration_time_s"] == plain["iteration_time_s"]
    assert straggled["perturbation"]["slowdown"] == straggled["iteration_time_s"] / plain["iteration_time_s"] > 1
    # every compute op of rank 1 was slowed, and the trace names them
    trace = json.loads((tmp_path / "flag" / "trace.json").read_text())
    compute = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["pid"] == 1 and e["tid"] == 0]
    assert sorted(trace["otherData"]["slowed_ops"]["1"]) == sorted(e["args"]["op"] for e in compute)
    assert straggled["perturbation"]["slowed_ops"] == len(compute)


def test_a_window_slows_only_the_ops_that_start_in_it():
    built = build_plan(PlanInputs(MODEL, "2xcpu", "1f1b", 4, partition="uniform"))
    plain = predict_built(built).metrics["iteration_time_s"]
    always = predict_built(built, perturbation=Perturbation((Straggler(0, 3.0),)))
    late = predict_built(built, perturbation=Perturbation((Straggler(0, 3.0, 10 * plain, 20 * plain),)))
    early = predict_built(built, perturbation=Perturbation((Straggler(0, 3.0, 0.0, plain / 3),)))
    assert late.metrics["iteration_time_s"] == plain and late.metrics["perturbation"]["slowed_ops"] == 0
    assert plain < early.metrics["iteration_time_s"] < always.metrics["iteration_time_s"]
    assert 0 < early.metrics["perturbation"]["slowed_ops"] < always.metrics["perturbation"]["slowed_ops"]


def test_a_slow_shard_slows_its_group_and_a_slow_replica_the_iteration_as_replica_0_would():
    built = build_plan(PlanInputs(MODEL, "8xcpu", "1f1b", 4, partition="uniform", tp=2, dp=2, pp=2))
    layout = built.plan.layout
    times = {device: predict_built(built, perturbation=Perturbation((Straggler(device, 2.0),))).metrics[
        "iteration_time_s"] for device in (layout.device(0, 0, 0), layout.device(0, 0, 1), layout.device(0, 1, 0))}
    assert len(set(times.values())) == 1  # either shard of the group, or the other replica's: the same time
    assert next(iter(times.values())) > predict_built(built).metrics["iteration_time_s"]


def test_jitter_is_seeded_with_mean_one(tmp_path):
    first = _time(tmp_path, "2xcpu", "--jitter", "0.2", "--seed", "4", name="a")
    _time(tmp_path, "2xcpu", "--jitter", "0.2", "--seed", "4", name="b")
    other = _time(tmp_path, "2xcpu", "--jitter", "0.2", "--seed", "5", name="c")
    assert (tmp_path / "a" / "trace.json").read_bytes() == (tmp_path / "b" / "trace.json").read_bytes()
    assert first["iteration_time_s"] != other["iteration_time_s"]
    noise = Perturbation(jitter=0.2, seed=1).noise(0, 200_000)
    assert noise.mean() == pytest.approx(1.0, abs=0.005) and np.log(noise).std() == pytest.approx(0.2, rel=0.02)


@pytest.mark.parametrize("text, message", [
    ("3", "is none of its forms"), ("9:2", "device 9 outside 0..1"), ("gpu9:2", "device 9 outside 0..1"),
    ("gpu9-links:2", "device 9 outside 0..1"), ("1:0", "the factor must be a number in"),
    ("1:2@0.5-0.1", "0 <= START < END"), ("1:2@x", "is none of its forms"),
    ("gpu1-links:2@0-1", "a slow link has no window"), ("gpu1-links:0.5", "a link's factor must be a number in")])
def test_bad_stragglers_are_refused_by_value(text, message):
    with pytest.raises(SpecError, match=message):
        parse_straggler(text, 2)


@pytest.mark.parametrize("text, expected", [
    ("5:1.5", Straggler(5, 1.5)), ("gpu5:1.5", Straggler(5, 1.5)), ("GPU5:1.5", Straggler(5, 1.5)),
    (" gpu5 : 2@0.1-0.4", Straggler(5, 2.0, 0.1, 0.4)), ("gpu5-links:2", SlowLink("gpu5", 2.0)),
    ("ib-ndr-x8:2", SlowLink("ib-ndr-x8", 2.0))])
def test_a_device_is_named_by_its_rank_or_its_table_name_and_its_links_apart(text, expected):
    # gpu5 is what the device table calls device 5, so it means the device (its compute), as 5 does; its links are
    # spelt gpu5-links, never by the bare name.
    assert parse_straggler(text, 16) == expected


@pytest.mark.parametrize("text", ["gpu5link:2", "gpu-5:2", "gpu5-link:2", "gpus:2", "gpu:2", "gpu5-links-x:2"])
def test_a_name_between_a_device_and_its_links_is_refused_naming_the_forms(text):
    with pytest.raises(SpecError) as info:
        parse_straggler(text, 16)
    assert str(info.value) == f"--straggler {text!r} is none of its forms: {STRAGGLER_FORMS}"
    for form in ("gpu5:1.5", "5:1.5", "gpu5-links:2", "LINK:FACTOR"):
        assert form in str(info.value)


def test_gpu5_slows_device_5s_compute_and_gpu5_links_its_links(tmp_path):
    # The two spellings of device 1 give byte-identical outputs, and that is the compute straggler (its links
    # untouched: no link is named in the metrics); gpuN-links slows the links instead (compute untouched: no op
    # slowed), and it is the topology's own slowing of that device's links.
    _time(tmp_path, "2xcpu", "--straggler", "1:2.5", name="rank")
    by_name = _time(tmp_path, "2xcpu", "--straggler", "gpu1:2.5", name="name")
    for file in ("metrics.json", "trace.json", "plan.json"):
        assert (tmp_path / "rank" / file).read_bytes() == (tmp_path / "name" / file).read_bytes()
    assert by_name["perturbation"]["slowed_ops"] > 0 and by_name["perturbation"]["links"] == []
    links = _time(tmp_path, "2xcpu", "--straggler", "gpu1-links:4", name="links")
    assert links["perturbation"]["slowed_ops"] == 0
    assert links["perturbation"]["links"] == [{"links": "gpu1", "factor": 4.0}]
    from dataclasses import replace

    from sim.hw.topology import Topology

    topology = Topology.parse("8xA100")
    slowed = Perturbation(links=(parse_straggler("gpu5-links:4", 8),)).topology(topology)
    touched = 0
    for src, dst, link in topology.graph.edges(data="link"):
        ours = "gpu5" in (src, dst)
        touched += ours
        assert slowed.graph[src][dst]["link"].spec == (replace(link.spec, bandwidth=link.spec.bandwidth / 4) if ours
                                                       else link.spec)
    assert touched > 0


@pytest.mark.parametrize("flags, needle", [(["--straggler", "5:2"], "device 5 outside 0..1"),
                                           (["--straggler", "gpu1link:2"], "is none of its forms"),
                                           (["--straggler", "nvlink:2"], "gpu0-links..gpu1-links"),
                                           (["--jitter", "2"], "--jitter must be a number from 0 to 1")])
def test_bad_straggler_flags_are_one_error_line(tmp_path, capsys, flags, needle):
    with pytest.raises(SystemExit) as info:
        main(["--topology", "2xcpu", "--model", MODEL, "--out", str(tmp_path / "o"), *flags])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("error: ") and needle in err and err.count("\n") == 1


def test_a_slow_link_divides_its_bandwidth_and_slows_what_crosses_it():
    from sim.hw.topology import Topology, message_time

    topology = Topology.parse("2x8xH100")
    slowed = topology.with_slowed_links("ib-ndr-x8", 4.0)
    across = topology.path(0, 8)  # from server 0 to server 1: over the network
    assert [link.spec.name for link in slowed.path(0, 8)] == [link.spec.name for link in across]
    nbytes = 1 << 26
    bottleneck = min(link.spec.bandwidth for link in across)
    network = min(link.spec.bandwidth for link in across if link.spec.name == "ib-ndr-x8")
    # the path's bottleneck is the slower of its other links and the network at a quarter
    others = min((link.spec.bandwidth for link in across if link.spec.name != "ib-ndr-x8"), default=float("inf"))
    expected = sum(link.spec.latency for link in across) + nbytes / min(others, network / 4)
    assert message_time(slowed.path(0, 8), nbytes) == pytest.approx(expected, rel=1e-12)
    assert message_time(across, nbytes) == pytest.approx(sum(link.spec.latency for link in across) + nbytes /
                                                          bottleneck, rel=1e-12)
    assert slowed.path(0, 1) == topology.path(0, 1)  # inside a server: untouched
    one = topology.with_slowed_links("gpu5", 2.0)
    assert all(link.spec.bandwidth == topology_link.spec.bandwidth / 2 for link, topology_link in
               zip(one.path(5, 6), topology.path(5, 6), strict=True) if "gpu5" in (link.src, link.dst))
    with pytest.raises(SpecError, match="no link of 2x8xH100 is 'ib-hdr'"):
        topology.with_slowed_links("ib-hdr", 2.0)


def test_slow_links_slow_the_iteration_and_are_refused_with_a_window(tmp_path):
    built = build_plan(PlanInputs("gpt:layers=8,hidden=512,heads=8,seq=256,vocab=1000", "2x8xH100", "1f1b", 8,
                                  partition="uniform", tp=8, pp=2))
    plain = predict_built(built).metrics["iteration_time_s"]
    slow = predict_built(built, perturbation=Perturbation(links=(parse_straggler("ib-ndr-x8:8", 16),)))
    assert slow.metrics["iteration_time_s"] > plain and slow.metrics["perturbation"]["links"] == [
        {"links": "ib-ndr-x8", "factor": 8.0}]
    with pytest.raises(SpecError, match="a slow link has no window"):
        parse_straggler("ib-ndr-x8:2@0-1", 16)
