"""A pipeline split written as Megatron-Core's ``pipeline_model_parallel_layout`` (sim.plan.megatron_layout): its
own documented example, the layer counts it gives against the other rules, and every layout that is not the model's
layers refused in one line."""

import pytest

from sim.core.errors import SpecError
from sim.models import build_model
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.plan.megatron_layout import MAX_LAYOUT_LAYERS, is_megatron_layout, layout_counts, layout_stages

LLAMA = "llama:layers=6,hidden=256,heads=4,kv_heads=2,ffn=512,vocab=1000,seq=128"
MTP = ("moe:layers=5,hidden=128,heads=4,head_dim=32,ffn=256,vocab=500,seq=64,experts=4,topk=2,expert_ffn=64,"
       "qk_norm=0,q_lora=64,kv_lora=32,rope_dim=16,v_dim=32,mtp=1")


def test_megatrons_documented_example_unrolls_as_its_docstring_says():
    # parse_str_to_list: "Ettt|(tt|)*29,m|L" -> [["E","t","t","t"]] + [["t","t"]]*29 + [["m"],["L"]]
    assert layout_stages("Ettt|(tt|)*29,m|L") == ("Ettt",) + ("tt",) * 29 + ("m", "L")
    assert layout_stages("E|t*3|tL") == ("E", "ttt", "tL")


def test_a_layout_is_told_from_the_rules_and_the_counts():
    assert is_megatron_layout("Et*4|(t*4|)*14tmL") and is_megatron_layout("(Et|)*1tL")
    for other in ("uniform", "balanced", "blocks", "4,4,8", "Et x"):
        assert not is_megatron_layout(other), other


def test_the_embedding_and_loss_counted_in_the_split_is_the_uniform_rule():
    # Llama 3.1 405B's recipes count the embedding and the loss as a layer each (the megatron_bridge experiment):
    # written as a layout, 6 decoders + 2 on 4 stages is E t | t t | t t | t L, the uniform split of the 8 layers
    inputs = PlanInputs(LLAMA, "4xH100", "1f1b", microbatches=4, pp=4)
    layout = build_plan(PlanInputs(**{**inputs.__dict__, "partition": "Et|tt|tt|tL"}))
    uniform = build_plan(PlanInputs(**{**inputs.__dict__, "partition": "uniform"}))
    assert layout.plan.placement.layer_counts() == uniform.plan.placement.layer_counts() == (2, 2, 2, 2)
    assert layout.plan.placement == uniform.plan.placement


def test_an_mtp_models_layout_counts_its_stages_by_hand():
    graph = build_model(MTP)  # embed, 5 blocks, mtp, head
    assert layout_counts("Et*2|t*3|mL", graph, 3) == (3, 3, 2)
    assert layout_counts("E|(t|)*5mL", graph, 7) == (1, 1, 1, 1, 1, 1, 2)
    # interleaved: stage k on rank k mod PP, the split in the order of the stages' first layers
    built = build_plan(PlanInputs(MTP, "2xH100", "interleaved", microbatches=4, pp=2, chunks=2,
                                  partition="Et|tt|tt|mL"))
    assert built.plan.placement.layer_counts() == (2, 2, 2, 2)
    assert built.plan.placement.vstage_to_rank == (0, 1, 0, 1)


@pytest.mark.parametrize("layout, stages, needle", [
    ("Et*2|t*3|L", 3, "a multi-token-prediction layer: 0 written, 1 in the model"),
    ("Et*2|t*4|mL", 3, "a decoder layer: 6 written, 5 in the model"),
    ("Et*2|mt*3|L", 3, "the same layers in another order"),
    ("EEt*2|t*3|mL", 3, "the embedding: 2 written, 1 in the model"),
    ("Et*2|t*3||mL", 4, "leaves stage 2 without a layer"),
    ("Et*2|t*3|mL", 4, "has 3 stages, the plan has 4 (PP × chunks)"),
    ("Et*2|(t*3|mL", 3, "'(' is not a layer of a Megatron layout"),
    (f"Et*{MAX_LAYOUT_LAYERS + 1}|mL", 2, "repeats 't*1000001' past 1,000,000 layers"),
])
def test_a_layout_that_is_not_the_models_layers_is_refused_saying_why(layout, stages, needle):
    with pytest.raises(SpecError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")
                       .replace("|", r"\|")):
        layout_counts(layout, build_model(MTP), stages)


def test_a_model_without_transformer_layers_has_no_layout():
    with pytest.raises(SpecError, match="uniform has layers a layout does not name"):
        layout_counts("Et|tL", build_model("uniform:layers=4"), 2)


def test_sim_run_takes_a_layout_and_says_what_is_wrong_in_one_line(tmp_path, capsys):
    from sim.run import main

    base = ["--topology", "2xH100", "--model", MTP, "--pp", "2", "--microbatches", "4", "--no-gantt"]
    assert main([*base, "--partition", "Et*3|t*2mL", "--out", str(tmp_path / "ok")]) == 0
    assert "layers per stage 4,4" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main([*base, "--partition", "Et*3|t*3mL", "--out", str(tmp_path / "bad")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: --partition 'Et*3|t*3mL' does not lay out the model's layers"), err
    assert not (tmp_path / "bad").exists()
