"""Topology specs and files: the rank limit checked before anything is built, duplicate YAML keys, the size cap,
and the link names ``--topology list`` offers for ``network:``."""

import pytest

from sim.core.errors import SpecError
from sim.core.fileio import INPUT_LIMITS
from sim.hw.catalog import list_links, load_yaml
from sim.hw.description import MAX_RANKS
from sim.hw.grammar import load_topology_yaml
from sim.hw.topology import Topology, format_topology_list


def _yaml(tmp_path, text):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("repeat,count", [(10**10, 8), (10**100, 1), (MAX_RANKS // 8 + 1, 8)])
def test_repeat_times_count_is_checked_before_the_servers_are_listed(tmp_path, repeat, count):
    path = _yaml(tmp_path, f"nodes:\n  - {{device: V100, count: {count}, repeat: {repeat}}}\n")
    with pytest.raises(SpecError) as info:  # not a MemoryError from a list of 10**10 servers
        Topology.parse(path)
    assert (f"nodes[0]: repeat {repeat} x count {count} would bring the topology to {repeat * count} ranks; at most "
            f"{MAX_RANKS} are supported (over 5x the largest published pipeline-parallel run, 3072 GPUs"
            ) in str(info.value)


def test_the_entries_add_up_to_the_limit(tmp_path):
    half = MAX_RANKS // 16
    ok = _yaml(tmp_path, f"nodes:\n  - {{device: ideal, count: 1, repeat: {MAX_RANKS - 1}}}\n"
               "  - {device: ideal, count: 1}\n")
    assert load_topology_yaml(ok).ranks == MAX_RANKS
    over = _yaml(tmp_path, f"nodes:\n  - {{device: V100, count: 8, repeat: {half}}}\n"
                 f"  - {{device: V100, count: 8, repeat: {half}}}\n  - {{device: V100, count: 1}}\n")
    with pytest.raises(SpecError, match=rf"nodes\[2\]: repeat 1 x count 1 would bring the topology to {MAX_RANKS + 1}"):
        Topology.parse(over)


@pytest.mark.parametrize("spec,message", [
    ("1" + "0" * 5000 + "xV100", "a count over 5 digits"),  # int() of it would raise ValueError (4300-digit cap)
    ("2x" + "9" * 40 + "xV100", "a count over 5 digits"),
    ("2049x8xA100", "would make 16392 ranks"),
    ("+".join(["8xV100"] * 2049), "the terms would make 16392 ranks"),
])
def test_huge_counts_in_a_spec_are_refused_with_the_limit_and_why(spec, message):
    with pytest.raises(SpecError) as info:
        Topology.parse(spec)
    assert message in str(info.value) and f"at most {MAX_RANKS}" in str(info.value)
    assert "3072 GPUs" in str(info.value)


def test_leading_zeros_are_not_digits_of_the_count():
    assert Topology.parse("0002x0004xV100").num_ranks == 8


@pytest.mark.parametrize("text,key,line,first", [
    ("nodes:\n  - device: V100\n    count: 8\n    count: 4\n", "count", 4, 3),
    ("nodes:\n  - {device: V100, count: 4}\nnetwork: ib-edr\nnetwork: eth-10g\n", "network", 4, 3),
    ("nodes:\n  - {device: V100, count: 4, device: A100}\n", "device", 2, 2),
    ("nodes: []\nnodes:\n  - {device: V100, count: 4}\n", "nodes", 2, 1),
])
def test_a_duplicate_key_is_refused_with_the_key_and_its_lines(tmp_path, text, key, line, first):
    path = _yaml(tmp_path, text)
    with pytest.raises(SpecError) as info:
        Topology.parse(path)
    assert str(info.value) == (f"topology file {path!r}: malformed YAML (duplicate key {key!r} at line {line}, "
                               f"first at line {first}: a key may appear once in a mapping)")


def test_a_merge_key_may_be_overridden_and_the_loader_is_otherwise_safe_load():
    import yaml

    text = "base: &b {count: 8, device: V100}\nnode:\n  <<: *b\n  count: 4\nlist: [1, 2.5, null, yes]\n"
    assert load_yaml(text) == yaml.safe_load(text)
    assert load_yaml(text)["node"] == {"count": 4, "device": "V100"}
    with pytest.raises(yaml.YAMLError):
        load_yaml("!!python/object:os.system {}\n")


def test_an_oversized_topology_file_is_refused_before_parsing(tmp_path):
    limit = INPUT_LIMITS["topology file"][0]
    entry = "  - {device: V100, count: 1}\n"
    text = "nodes:\n" + entry * (limit // len(entry) + 1)
    path = _yaml(tmp_path, text)
    with pytest.raises(SpecError) as info:
        Topology.parse(path)
    assert str(info.value).startswith(f"topology file {path} is {len(text)} bytes; the limit is {limit} bytes "
                                      "(256 KiB): a topology lists groups of servers")


def test_topology_list_names_every_link_a_network_entry_takes():
    text = format_topology_list()
    assert "Links (what a YAML file's 'network:' names" in text
    listed = text.split("Links (")[1].splitlines()[1:]
    assert [line.split()[0] for line in listed] == [link.name for link in list_links()]
    assert any(line.split()[:5] == ["ib-edr", "11", "GB/s", "/", "12.5"] for line in listed)  # links.yaml's EDR


def test_every_listed_link_is_accepted_as_a_network(tmp_path):
    for link in list_links():
        path = _yaml(tmp_path, f"nodes:\n  - {{device: V100, count: 8, repeat: 2}}\nnetwork: {link.name}\n")
        assert Topology.parse(path).nodes[0].network.name == link.name
