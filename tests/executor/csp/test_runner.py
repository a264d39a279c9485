"""NASPipe's claim, executed through ``python -m executor.naspipe``: CSP on 1, 2 and 4 CPU stages gives bitwise the
parameters (SHA-256 of every parameter) and the per-subnet losses of training the same subnet sequence one by one
in a single process."""


import pytest

from executor.naspipe import main as naspipe_main

# choices=4 includes the identity candidate, so some stages of some subnets have nothing trainable upstream.
SPEC = "supernet:blocks=6,choices=4,hidden=32,heads=4,seq=8,vocab=50"


def test_csp_is_bitwise_reproducible_across_stage_counts(tmp_path, naspipe_run):
    sequential = naspipe_run(tmp_path / "sequential", "--sequential")
    assert len(sequential["losses"]) == 12
    for stages in (1, 2, 4):
        run = naspipe_run(tmp_path / f"csp{stages}", "--stages", str(stages))
        assert run["final_params_sha256"] == sequential["final_params_sha256"], stages
        assert run["losses"] == sequential["losses"], stages  # floats from JSON: equal means bitwise equal
        assert all(sorted(order) == list(range(12)) for order in run["forward_order_per_stage"])
    # A different subnet sequence trains to different parameters: the hash can tell runs apart.
    other = naspipe_run(tmp_path / "other", "--sequential", "--seed", "4")
    assert other["final_params_sha256"] != sequential["final_params_sha256"]


@pytest.mark.parametrize("argv,message", [
    (["--subnets", "0", "--space", "c3"], "--subnets must be >= 1"),
    (["--space", "c3", "--model", SPEC], "exactly one of --space and --model"),
    (["--model", "gpt:layers=2"], "trains subnets of a supernet"),
    (["--space", "c3", "--model-overrides", "hidden=abc"], "key=integer"),
])
def test_bad_input_exits_2(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        naspipe_main([*argv, "--out", str(tmp_path / "o")])
    assert info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
