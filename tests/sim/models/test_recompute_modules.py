"""Which modules selective recomputation drops (sim.models.recompute_modules, ``--recompute-modules``): the list
parsed into canonical order, a plan recording only a set other than the default, the costed plan matching the model
built with the same modules, and the combinations that mean nothing refused in one line."""


import pytest

from sim.core.errors import SpecError
from sim.cost.plan_settings import RECOMPUTE_MODULES_OPTION
from sim.models import build_model
from sim.models.recompute_modules import DEFAULT_RECOMPUTE_MODULES, RECOMPUTE_MODULES, parse_recompute_modules
from sim.models.sharding import Sharding
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict_built

MOE = ("moe:layers=3,hidden=256,heads=4,head_dim=64,ffn=512,experts=4,topk=2,expert_ffn=256,vocab=1000,seq=512,"
       "qk_norm=0,q_lora=128,kv_lora=64,rope_dim=32,v_dim=64")


def test_a_list_is_read_in_canonical_order_and_bad_lists_say_what_is_valid():
    assert parse_recompute_modules("mla_up_proj, layernorm") == ("layernorm", "mla_up_proj")
    assert parse_recompute_modules("moe_act") == ("moe_act",)
    assert DEFAULT_RECOMPUTE_MODULES == RECOMPUTE_MODULES == ("layernorm", "moe_act", "mla_up_proj")
    for text, needle in (("", "comma-separated list"), ("moe_act,", "comma-separated list"),
                         ("core_attn", "'core_attn' is not modelled; choose from layernorm, moe_act, mla_up_proj"),
                         ("moe_act,moe_act", "distinct")):
        with pytest.raises(ValueError, match=needle):
            parse_recompute_modules(text)


def _built(**extra):
    return build_plan(PlanInputs(model=MOE, topology="2xH100", pp=2, microbatches=2, **extra))


def test_a_plan_records_the_modules_only_when_they_are_not_the_default_and_costs_what_it_records():
    default = _built(recompute="selective")
    assert default.plan.option(RECOMPUTE_MODULES_OPTION) is None
    fewer = _built(recompute="selective", recompute_modules=("mla_up_proj",))
    assert fewer.plan.option(RECOMPUTE_MODULES_OPTION) == "mla_up_proj"
    # the costed graph is the model built with the same modules, block by block
    direct = build_model(MOE, Sharding(selective_recompute=True, recompute_modules=("mla_up_proj",)))
    assert [layer.saved_bytes for layer in fewer.graph.layers] == [layer.saved_bytes for layer in direct.layers]
    # dropping less keeps more: the prediction's peak is between the default's and no recomputation's
    peaks = [max(device["peak_memory_bytes"] for device in predict_built(built, check_memory=False).metrics["devices"])
             for built in (default, fewer, _built())]
    assert peaks[0] < peaks[1] < peaks[2]


def test_the_written_plan_predicts_the_same():
    from sim.ir.plan import Plan
    from sim.predict import predict

    fewer = _built(recompute="selective", recompute_modules=("layernorm", "moe_act"))
    written = Plan.loads(fewer.plan.dumps())  # as plan.json holds it
    again = predict(written, topology=fewer.topology, check_memory=False)
    assert again.metrics == predict_built(fewer, check_memory=False).metrics


def test_modules_given_as_anything_but_a_tuple_of_known_names_are_refused_before_building():
    for modules, needle in ((["moe_act"], "non-empty tuple"), (("mla_up_proj", "moe_act"), "in the order"),
                            (("core_attn",), "'core_attn' is not modelled")):
        with pytest.raises(SpecError, match=needle):
            _built(recompute="selective", recompute_modules=modules)


@pytest.mark.parametrize("extra, needle", [
    (dict(recompute_modules=("mla_up_proj",)), "needs --recompute selective, got none"),
    (dict(recompute="full", recompute_modules=("moe_act",)), "needs --recompute selective, got full"),
])
def test_modules_without_selective_recomputation_are_refused(extra, needle):
    with pytest.raises(SpecError, match=needle.replace("--recompute", "recompute")):
        _built(**extra)


def test_sim_run_refuses_modules_for_another_family_and_unknown_names_in_one_line(tmp_path, capsys):
    from sim.run import main

    llama = "llama:layers=2,hidden=256,heads=4,kv_heads=4,ffn=512,vocab=1000,seq=512"
    for argv, needle in (
            (["--model", llama, "--recompute", "selective", "--recompute-modules", "layernorm"],
             "error: --recompute-modules names Megatron-Core's modules of the moe family's blocks; llama's"),
            (["--model", MOE, "--recompute", "selective", "--recompute-modules", "core_attn"],
             "error: argument --recompute-modules: recompute module 'core_attn' is not modelled")):
        with pytest.raises(SystemExit) as info:
            main(["--topology", "2xH100", *argv, "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.count("\n") == 1 and err.startswith(needle), err
        assert not (tmp_path / "out").exists()
