"""The NASPipe supernet in the zoo and its search spaces: exact counts, costs, specs, sampler (sim/models/supernet.py,
sim/models/supernet_space.py)."""

from __future__ import annotations

import math
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.core.errors import SpecError
from sim.models import build_model, format_model_list
from sim.models.supernet import KIND_CYCLE, CandidateOp, Supernet, build_supernet, subnet_layer_costs
from sim.models.supernet_space import SPACES, parse_space, sample_subnets, space_spec
from sim.run import main

SMALL = "supernet:blocks=4,choices=4,hidden=32,seq=8,vocab=50"

# --- independent closed forms, one function per torch module -------------------------------------------------------


def linear(n_in: int, n_out: int, bias: bool = True) -> int:
    return n_in * n_out + (n_out if bias else 0)


def layernorm(h: int) -> int:
    return 2 * h


def conv1d(c_in: int, c_out: int, k: int, groups: int = 1) -> int:
    return c_out * (c_in // groups) * k + c_out  # weight [c_out, c_in / groups, k] + bias


def expected_params(kind: str, h: int) -> int:
    """Parameters of each candidate, summed module by module (module docstring of sim/models/supernet.py)."""
    if kind == "identity":
        return 0
    if kind.startswith("conv"):
        return layernorm(h) + conv1d(h, h, int(kind[4:]))
    if kind.startswith("dwconv"):
        return layernorm(h) + conv1d(h, h, int(kind[6:]), groups=h) + linear(h, h)
    if kind.startswith("attn"):
        return layernorm(h) + linear(h, 3 * h) + linear(h, h)
    if kind.startswith("ffn"):
        m = int(kind[3:])
        return layernorm(h) + linear(h, m * h) + linear(m * h, h)
    assert kind.startswith("glu")
    m = int(kind[3:])
    return layernorm(h) + linear(h, 2 * m * h) + linear(m * h, h)


def expected_flops(kind: str, s: int, h: int) -> int:
    """Matmul / conv FLOPs per sample, 2 per multiply-add, written out op by op."""
    if kind == "identity":
        return 0
    if kind.startswith("conv"):
        k = int(kind[4:])
        return 2 * (s * h) * (k * h)  # s*h outputs, each a dot product over k taps x h channels
    if kind.startswith("dwconv"):
        k = int(kind[6:])
        return 2 * (s * h) * k + 2 * s * h * h
    if kind.startswith("attn"):
        return 2 * s * h * 3 * h + 2 * s * s * h + 2 * s * s * h + 2 * s * h * h
    m = int(kind[3:])
    up = 2 * m if kind.startswith("glu") else m
    return 2 * s * h * (up * h) + 2 * s * (m * h) * h


# --- candidates and the graph ---------------------------------------------------------------------------------------


def test_cycle_has_sixteen_distinct_kinds_and_k_choices_take_its_prefix():
    assert len(KIND_CYCLE) == len(set(KIND_CYCLE)) == 16
    assert KIND_CYCLE[:4] == ("conv3", "attn", "glu4", "identity")
    for k in (1, 4, 8, 16, 20):
        sn = build_supernet(f"supernet:blocks=3,choices={k},hidden=16,seq=4,vocab=10")
        assert sn.num_blocks == 3 and sn.num_choices == k
        for block in sn.candidates:
            assert [c.kind for c in block] == [KIND_CYCLE[i % 16] for i in range(k)]


@settings(max_examples=25, deadline=None)
@given(h_per_head=st.integers(1, 24), heads=st.sampled_from([1, 2, 3, 4, 6, 8]), s=st.integers(1, 70),
       v=st.integers(1, 500), blocks=st.integers(1, 5))
def test_candidate_params_and_flops_are_exact_and_blocks_sum_them(h_per_head, heads, s, v, blocks):
    h = h_per_head * heads
    sn = build_supernet(f"supernet:blocks={blocks},choices=16,hidden={h},heads={heads},seq={s},vocab={v}")
    graph = sn.graph
    assert [layer.name for layer in graph] == ["embed"] + [f"block{b}" for b in range(blocks)] + ["head"]
    assert graph.param_count(0) == v * h + s * h
    assert graph.param_count(len(graph) - 1) == layernorm(h) + linear(h, v, bias=False)
    for b, cands in enumerate(sn.candidates):
        for cand in cands:
            assert cand.params == expected_params(cand.kind, h), cand
            assert cand.flops_fwd == expected_flops(cand.kind, s, h) and cand.flops_bwd == 2 * cand.flops_fwd
            assert cand.activation_bytes == 2 * s * h
        layer = graph[Supernet.block_layer(b)]
        # The whole supernet block lives in host memory: its parameters are the sum over candidates.
        assert graph.param_count(b + 1) == sum(c.params for c in cands)
        assert layer.kind == "choice" and layer.activation_bytes == 2 * s * h
        assert layer.flops_fwd == pytest.approx(sum(c.flops_fwd for c in cands) / 16, rel=1e-12)
        assert layer.saved_bytes == math.ceil(sum(c.saved_bytes for c in cands) / 16)


def test_closed_forms_of_the_docstring_for_one_size():
    h, s, a = 64, 16, 4
    cands = {c.kind: c for c in build_supernet(f"supernet:blocks=1,choices=16,hidden={h},heads={a},seq={s}")
             .candidates[0]}
    assert cands["conv5"].params == 5 * h * h + 3 * h
    assert cands["dwconv11"].params == h * h + 15 * h
    assert cands["attn"].params == cands["attn_few"].params == 4 * h * h + 6 * h
    assert cands["ffn4"].params == 8 * h * h + 7 * h and cands["ffn2"].params == 4 * h * h + 5 * h
    assert cands["glu4"].params == 12 * h * h + 11 * h and cands["glu2"].params == 6 * h * h + 7 * h
    assert cands["identity"] == CandidateOp("identity", 0, 0.0, 0.0, 2 * s * h, 0)
    # Saved bytes: Korthikanti et al. 2022 §4.1 attention without dropout, 12sh + 2as^2; attn_few has a / 2 heads.
    assert cands["attn"].saved_bytes == 12 * s * h + 2 * a * s * s
    assert cands["attn_few"].saved_bytes == 12 * s * h + 2 * (a // 2) * s * s
    assert cands["ffn4"].saved_bytes == 20 * s * h  # Korthikanti's MLP 19sh minus the dropout mask, plus the output
    assert cands["conv3"].saved_bytes == 6 * s * h and cands["dwconv3"].saved_bytes == 8 * s * h


def test_spec_is_canonical_round_trips_and_matches_build_model():
    sn = build_supernet("supernet:vocab=50 , seq=8,blocks=4,hidden=32")
    assert sn.graph.spec == "supernet:blocks=4,choices=4,heads=4,hidden=32,seq=8,vocab=50" == build_model(SMALL).spec
    assert build_model(sn.graph.spec) == sn.graph == build_supernet(sn.graph.spec).graph
    assert build_supernet(sn.graph.spec) == sn
    assert sn.graph.input_bytes == 8 * 8 and sn.graph.dtype_bytes == 2


def test_subnet_layer_costs_swap_in_the_chosen_candidates():
    sn = build_supernet(SMALL)
    layers = subnet_layer_costs(sn, (0, 1, 2, 3))
    assert [layer.name for layer in layers] == [layer.name for layer in sn.graph]
    assert layers[0] == sn.graph[0] and layers[-1] == sn.graph[-1]
    for b, k in enumerate((0, 1, 2, 3)):
        cand = sn.candidates[b][k]
        layer = layers[b + 1]
        assert (layer.kind, layer.flops_fwd, layer.flops_bwd, layer.saved_bytes, layer.activation_bytes) == (
            cand.kind, cand.flops_fwd, cand.flops_bwd, cand.saved_bytes, cand.activation_bytes)
        assert layer.param_bytes == 2 * cand.params
    assert layers[4].kind == "identity" and layers[4].param_bytes == 0 and layers[4].flops_fwd == 0


@pytest.mark.parametrize("choice, fragment", [((0, 1, 2), "3 choices"), ((0, 1, 2, 4), "block 3 choice 4"),
                                              ((0, -1, 0, 0), "block 1 choice -1"), ((0, 1.0, 0, 0), "1.0")])
def test_bad_subnets_name_the_value(choice, fragment):
    with pytest.raises(ValueError, match=fragment.replace(".", r"\.")):
        subnet_layer_costs(build_supernet(SMALL), choice)


@pytest.mark.parametrize(
    ("spec", "shown"),
    [
        ("supernet:blocks=0", "got 0"),
        ("supernet:choices=0", "choices must be >= 1"),
        ("supernet:hidden=30,heads=4", "heads (4) must divide hidden (30)"),
        ("supernet:choice=4", "choice"),
        ("supernet:vocab=x", "'x'"),
    ],
)
def test_bad_specs_raise_spec_error_naming_the_value(spec, shown):
    for build in (build_model, build_supernet):
        with pytest.raises(SpecError) as info:
            build(spec)
        assert shown in str(info.value)


def test_build_supernet_rejects_other_models():
    with pytest.raises(SpecError, match="'gpt'"):
        build_supernet("gpt:layers=2")


# --- the command line -----------------------------------------------------------------------------------------------


def test_model_list_shows_the_supernet(capsys):
    assert "supernet:blocks=12,choices=4,heads=4,hidden=256,seq=64,vocab=1000" in format_model_list()
    assert main(["--model", "list", "--topology", "x"]) == 0
    assert "supernet:blocks=12" in capsys.readouterr().out


def test_bad_supernet_spec_is_one_error_line_and_status_2():
    proc = subprocess.run([sys.executable, "-m", "sim.run", "--topology", "2xV100", "--model", "supernet:blocks=0",
                           "--out", "/nonexistent/never-written"], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1 and "blocks" in proc.stderr


def test_the_supernet_graph_runs_through_the_simulator(tmp_path, capsys):
    code = main(["--topology", "2xideal", "--model", SMALL, "-m", "4", "--no-gantt", "--out", str(tmp_path)])
    assert code == 0 and (tmp_path / "plan.json").exists()
    assert "supernet:blocks=4" in capsys.readouterr().out


# --- search spaces --------------------------------------------------------------------------------------------------


def test_spaces_follow_naspipe_c0_largest_to_c3_smallest():
    assert sorted(SPACES) == ["c0", "c1", "c2", "c3"]
    choices = [parse_space(name).choices for name in ("c0", "c1", "c2", "c3")]
    assert choices == sorted(choices, reverse=True) == [48, 16, 8, 4]
    sizes = [build_model(space_spec(name)).total_param_bytes() for name in ("c0", "c1", "c2", "c3")]
    assert sizes == sorted(sizes, reverse=True)


def test_space_spec_is_canonical_and_takes_overrides():
    spec = space_spec("c3", blocks=4, hidden=32, heads=4, seq=8, vocab=50)
    assert spec == build_model(SMALL).spec
    assert space_spec("c1").startswith("supernet:blocks=32,choices=16,heads=8,hidden=512,")
    assert build_model(space_spec("c2", choices=5)).spec == space_spec("c2", choices=5)
    assert "choices=5" in space_spec("c2", choices=5)


@pytest.mark.parametrize("name", ["c9", "C1", "", "nlp.c1"])
def test_unknown_space_is_a_spec_error_naming_it(name):
    with pytest.raises(SpecError, match=f"unknown search space {name!r}.*known: c0, c1, c2, c3"):
        parse_space(name)
    with pytest.raises(SpecError, match=repr(name)):
        space_spec(name)


def test_bad_override_is_a_spec_error():
    with pytest.raises(SpecError, match="blcks"):
        space_spec("c1", blcks=3)
    with pytest.raises(SpecError, match="got 0"):
        space_spec("c1", hidden=0)


# --- the subnet sampler ---------------------------------------------------------------------------------------------

_PCG_MULT = 0x2360ED051FC65DA44385DF649FCCF645  # PCG64's 128-bit LCG multiplier (O'Neill 2014; numpy pcg64.h)


def _pcg64_reference(seed: int, count: int) -> list[int]:
    """A pure-Python PCG64 (XSL-RR 128/64): advance the 128-bit LCG, then xor-fold and rotate by the top 6 bits.

    Only the seeding (SeedSequence -> initial state and increment) is taken from numpy."""
    state = np.random.PCG64(seed).state["state"]
    s, inc = state["state"], state["inc"]
    out = []
    for _ in range(count):
        s = (s * _PCG_MULT + inc) % 2**128
        folded = ((s >> 64) ^ s) % 2**64
        rot = s >> 122
        out.append(((folded >> rot) | (folded << (64 - rot))) % 2**64)
    return out


@pytest.mark.parametrize("blocks, choices, n, seed", [(4, 4, 6, 0), (3, 48, 5, 123), (1, 7, 9, 2**40), (5, 1, 2, 1)])
def test_sampler_equals_an_independent_pcg64_and_multiply_shift(blocks, choices, n, seed):
    raw = _pcg64_reference(seed, blocks * n)
    expected = [(x * choices) >> 64 for x in raw]  # exact 128-bit floor(x * K / 2^64)
    got = sample_subnets(blocks, choices, n, seed)
    assert [c for subnet in got for c in subnet] == expected
    assert len(got) == n and all(len(subnet) == blocks for subnet in got)


def test_sampler_is_deterministic_prefix_stable_and_seed_dependent():
    a = sample_subnets(6, 8, 50, 7)
    assert a == sample_subnets(6, 8, 50, 7)
    assert sample_subnets(6, 8, 20, 7) == a[:20]  # subnet i does not depend on how many follow
    assert sample_subnets(6, 8, 50, 8) != a
    assert all(type(c) is int and 0 <= c < 8 for subnet in a for c in subnet)
    assert sample_subnets(6, 8, 0, 7) == ()
    assert sample_subnets(3, 1, 4, 0) == ((0, 0, 0),) * 4


def test_sampler_is_uniform_over_choices_and_blocks():
    k, blocks, n = 6, 4, 6000
    subnets = sample_subnets(blocks, k, n, 2024)
    for b in range(blocks):
        counts = Counter(subnet[b] for subnet in subnets)
        assert set(counts) == set(range(k))
        # Chi-square with k - 1 = 5 degrees of freedom: P(X > 25) < 2e-4 for a uniform sampler.
        chi2 = sum((counts[c] - n / k) ** 2 / (n / k) for c in range(k))
        assert chi2 < 25, (b, counts)
    # Blocks are independent: pairs (block 0, block 1) cover all k^2 cells.
    assert len({(subnet[0], subnet[1]) for subnet in subnets}) == k * k


@pytest.mark.parametrize("args, error, fragment", [
    ((0, 4, 1, 0), SpecError, "num_blocks must be >= 1, got 0"),
    ((4, 0, 1, 0), SpecError, "num_choices must be in [1, 4294967296], got 0"),
    ((4, 4, -1, 0), SpecError, "n must be >= 0, got -1"),
    ((4, 4, 1, -5), SpecError, "seed must be >= 0, got -5"),
    ((4, 4, 1.5, 0), TypeError, "n must be an int, got 1.5"),
    ((4, True, 1, 0), TypeError, "num_choices must be an int, got True"),
])
def test_sampler_rejects_bad_arguments_naming_them(args, error, fragment):
    with pytest.raises(error) as info:
        sample_subnets(*args)
    assert fragment in str(info.value)
