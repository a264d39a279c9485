"""The Megatron-Bridge experiment: every pre-training row read, the expressible ones mapped to the inputs their
columns mean, the others refused with a reason, each configuration's newest row judged, and a row's prediction the
one prediction path's (``sim.run`` on the same flags gives the same tokens per device)."""

import json
import subprocess
import sys

import pytest

from experiments import megatron_bridge as mb
from experiments.published_rows import RowResult


def _row(line):
    return next(r for r in mb.load_rows() if r.line == line)


def test_every_pre_training_row_is_read_and_each_is_expressed_or_refused_with_a_reason():
    rows = mb.load_rows()
    assert len(rows) == 210 and {r.system for r in rows} == {"DGX-GB200", "DGX-GB300", "DGX-B300"}
    refused = {r.model: mb.expressible(r) for r in rows if mb.expressible(r) is not None}
    assert refused["Nemotron_3_Super"] == "hybrid Mamba layers are not modelled"
    assert "DeepSeekV3" not in refused and "capacity factor" in refused["DeepSeekV3 (tokendrop)"]
    assert {r.model for r in rows if mb.expressible(r) is None} == set(mb.MODELS)


def test_rows_become_their_configuration():
    qwen = mb.plan_inputs(_row(9))  # 26.08, 8 GB200s, Qwen3-30B-A3B, MXFP8, EP 8, GBS 512, MBS 4
    assert (qwen.model, qwen.topology, qwen.ep, qwen.dp, qwen.zero, qwen.precision, qwen.compiled) == (
        "qwen3-30b-a3b,seq=4096", "8xGB200", 8, 8, 1, "mxfp8", True)
    assert (qwen.microbatch_size, qwen.global_batch) == (4, 512)
    llama = mb.plan_inputs(_row(39))  # 405B on 256 GB200s: TP 4, PP 16, VP 8, NVFP4
    assert (llama.tp, llama.pp, llama.schedule, llama.chunks, llama.sequence_parallel, llama.precision) == (
        4, 16, "interleaved", 8, True, "nvfp4")
    fsdp = mb.plan_inputs(_row(70))  # Llama 3 70B FSDP 64 on GB300
    assert (fsdp.zero, fsdp.dp, fsdp.topology) == (3, 64, "1x64xGB300")
    assert mb.plan_inputs(_row(11)).topology == "4x64xGB200"  # 256 GPUs: racks of 64
    # DeepSeek-V3's default rows train the multi-token-prediction module its config names; "w/o MTP" leaves it out
    assert mb.plan_inputs(_row(2)).model == "deepseek-v3,seq=4096"
    assert mb.plan_inputs(_row(203)).model == "deepseek-v3,mtp=0,seq=4096"
    b300 = mb.plan_inputs(_row(49))
    assert b300.topology == "1x8xB300"
    assert "precision not defined by the file (costed as fp8)" in mb.unmodelled(_row(70))


def test_a_variant_sharing_the_outer_microbatch_cell_takes_the_size_its_accumulation_implies():
    # 25.09, Llama 3 70B on 64 GB200s: "mbs 2" is shared, the parenthesised variant's TP 2 PP 4 GA 16 is its own,
    # and gbs = mbs x DP x GA holds only at mbs 1 (128 = 1 x 8 x 16), as its recipe sets
    outer, inner = _row(210), _row(211)
    assert (outer.mbs, outer.accumulation, inner.mbs, inner.accumulation) == (2, 1, 1, 16)
    for row in (r for r in mb.load_rows() if r.accumulation):  # every other row's batch columns agree as published
        dp = row.gpus // (row.tp * row.pp * row.cp)
        agrees = row.gbs == row.mbs * dp * row.accumulation
        named = any("batch columns disagree" in gap for gap in mb.unmodelled(row)) if row.model in mb.MODELS else None
        assert agrees or named, row.line
    # 25.11's Qwen3-235B on 64 GB300s publishes gbs 8192, mbs 2, DP 64, GA 32: which cell is wrong is not known
    qwen = _row(198)
    assert qwen.gbs != qwen.mbs * 64 * qwen.accumulation
    assert any("gbs 8192 != mbs 2 x DP 64 x GA 32" in gap for gap in mb.unmodelled(_row(198)))


def test_each_dense_pipeline_is_split_as_megatron_core_builds_its_recipe():
    from sim.plan.build import build_plan

    # Llama 3.1 405B counts the embedding and the loss in the split: (126 + 2) / (16 x 4) = 2 layers per chunk, the
    # first chunk the embedding and one block, the last one block and the head (get_num_layers_to_build)
    llama405 = build_plan(mb.plan_inputs(_row(37))).plan.placement.layer_counts()
    assert mb.partition(_row(37)) == "uniform" and llama405 == (2,) * 64
    # Llama 3 70B does not: 80 / (4 x 5) = 4 blocks per chunk, the embedding joining the first, the head the last
    llama70 = build_plan(mb.plan_inputs(_row(211))).plan.placement.layer_counts()
    assert mb.partition(_row(211)) == "blocks" and llama70 == (5,) + (4,) * 18 + (5,)
    # and Megatron-Core frees each stage's output once sent (the Bridge's GPTModelProvider sets it)
    assert mb.plan_inputs(_row(211)).deallocate_pipeline_outputs
    assert not mb.plan_inputs(_row(9)).deallocate_pipeline_outputs  # PP 1: nothing sent
    # DeepSeek-V3's is its recipe's Megatron layout (PP 4 x VP 4: the embedding and 4 decoders, 14 stages of 4, the
    # last decoder with the MTP layer and the loss; without MTP the loss alone)
    deepseek = build_plan(mb.plan_inputs(_row(3))).plan.placement.layer_counts()
    assert mb.partition(_row(3)) == "Et*4|(t*4|)*14tmL" and deepseek == (5,) + (4,) * 14 + (3,)
    assert mb.partition(_row(203)) == "Et*4|(t*4|)*14tL"
    assert not any("layout" in gap for gap in mb.unmodelled(_row(3)))
    # Qwen3-235B-A22B counts the embedding and the loss too: (94 + 2) / (8 x 3) = 4 layers per chunk
    qwen = build_plan(mb.plan_inputs(_row(11))).plan.placement.layer_counts()  # 26.08, GB200, PP 8, VP 3
    assert mb.partition(_row(11)) == "uniform" and qwen == (4,) * 24
    # a mixture's recipe whose layout is not read is split by the product's own rule, and named
    unread = _row(204)  # 25.11's DeepSeek-V3 without MTP at PP 8 x VP 4: the recipe's layout map has no such entry
    assert mb.partition(unread) == "balanced"
    assert "the recipe's pipeline layout not read (layers split by --partition balanced)" in mb.unmodelled(unread)


def test_only_each_configurations_newest_row_is_judged():
    rows = [r for r in mb.load_rows() if mb.expressible(r) is None]
    current = mb.newest(rows)
    by_config = {}
    for row, now in zip(rows, current):
        by_config.setdefault(row.config, []).append((row.container, now))
    for entries in by_config.values():  # exactly one newest per configuration: the latest container's
        newest = [container for container, now in entries if now]
        assert len(newest) == 1 or len(set(newest)) == 1
        latest = max(entries, key=lambda e: tuple(int(p) for p in e[0].split(".")))[0]
        assert all(container == latest for container in newest)
    assert 0 < sum(current) < len(rows)


def test_the_expert_all_to_alls_overlap_and_the_step_is_captured_from_the_container_whose_recipe_does_so():
    rows = {(r.container, r.system, r.model): r for r in mb.load_rows()}
    # DeepSeek-V3 on GB300: the recipe of 26.06 (v0.5.0) on overlaps, that of 26.04.01 (v0.4.2) does not
    assert mb.plan_inputs(rows["26.08", "DGX-GB300", "DeepSeekV3"]).ep_overlap
    assert mb.plan_inputs(rows["26.06", "DGX-GB300", "DeepSeekV3"]).ep_overlap
    assert not mb.plan_inputs(rows["26.04.01", "DGX-GB300", "DeepSeekV3"]).ep_overlap
    # on B300 only from 26.06.01 (v0.5.1); GPT-OSS on B300 never; on GB200 from 26.04, before the full graphs
    assert not mb.ep_overlap(rows["26.06", "DGX-B300", "DeepSeekV3"])
    assert not mb.ep_overlap(rows["26.06", "DGX-B300", "GPT OSS 120B"])
    gb200 = rows["26.04.01", "DGX-GB200", "GPT OSS 120B"]
    assert mb.ep_overlap(gb200) and not mb.plan_inputs(gb200).cuda_graphs  # overlapped, partial graphs only
    assert mb.plan_inputs(rows["26.08", "DGX-GB200", "GPT OSS 120B"]).cuda_graphs
    assert not mb.plan_inputs(rows["26.04.01", "DGX-GB300", "DeepSeekV3"]).cuda_graphs
    # dense models never
    assert not any(mb.ep_overlap(r) for r in rows.values() if mb.expressible(r) is None and not r.moe)


def test_tensor_parallel_communication_overlaps_as_the_llama_recipes_keep_it():
    rows = {(r.container, r.system, r.model, r.precision): r for r in mb.load_rows()}
    assert mb.plan_inputs(rows["26.06", "DGX-GB300", "LLAMA3.1_405B", "FP8"]).async_tp  # TP 4
    assert mb.plan_inputs(rows["26.06", "DGX-GB300", "LLAMA3.1_405B", "MXFP8"]).async_tp  # TP 2, CP 2
    assert not mb.plan_inputs(rows["26.06", "DGX-GB300", "LLAMA3.1_405B", "NVFP4"]).async_tp  # turned off
    assert not any(mb.plan_inputs(r).async_tp for r in mb.load_rows()
                   if mb.expressible(r) is None and (r.tp == 1 or r.moe))


def test_data_parallel_communication_overlaps_in_the_recipes_buckets_wherever_dp_is_above_one():
    # CommOverlapConfig._get_optimizer_overlap_cfgs: overlap_grad_reduce, overlap_param_gather and 128 Mi-parameter
    # buckets when data_parallel_size > 1 under the distributed optimizer; nothing of it under FSDP or at DP 1.
    assert mb.DDP_BUCKET_PARAMS == 134_217_728
    for row in (r for r in mb.load_rows() if mb.expressible(r) is None):
        inputs = mb.plan_inputs(row)
        on = row.fsdp == 0 and inputs.dp > 1
        assert (inputs.grad_overlap, inputs.param_gather_overlap) == (on, on), row
        assert inputs.grad_bucket_params == (134_217_728 if on else 0)
    qwen = mb.plan_inputs(_row(9))  # 8 GB200s, EP 8: DP 8
    assert qwen.grad_overlap and qwen.param_gather_overlap and qwen.zero == 1


@pytest.mark.parametrize("line", [9, 199])  # a mixture with EP on 8 GB200s; Llama 3 8B in FP8-CS
def test_a_rows_prediction_is_sim_runs(line, tmp_path):
    row = _row(line)
    result = mb.predict_row(row)
    inputs = mb.plan_inputs(row)
    flags = ["--model", inputs.model, "--topology", inputs.topology, "--dp", str(inputs.dp), "--ep", str(inputs.ep),
             "--zero", str(inputs.zero), "--global-batch", str(inputs.global_batch), "--microbatch-size",
             str(inputs.microbatch_size), "--compile", "--ignore-memory", "--no-gantt", "--out", str(tmp_path)]
    flags += ["--precision", inputs.precision] if inputs.precision else []
    flags += ["--ep-overlap"] if inputs.ep_overlap else []
    flags += ["--cuda-graphs"] if inputs.cuda_graphs else []
    flags += ["--async-tp"] if inputs.async_tp else []
    flags += ["--grad-overlap"] if inputs.grad_overlap else []
    flags += ["--param-gather-overlap"] if inputs.param_gather_overlap else []
    flags += ["--grad-bucket-size", str(inputs.grad_bucket_params)] if inputs.grad_bucket_params else []
    subprocess.run([sys.executable, "-m", "sim.run", *flags], check=True, capture_output=True)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert result.predicted == metrics["tokens_per_s_per_device"]
    assert result.error == pytest.approx(result.predicted / row.tokens_per_s_per_gpu - 1)
    assert result.row.moe == (line == 9)


def test_the_report_counts_the_newest_rows_the_ledger_says_do_not_fit():
    # Every published row ran: a row whose predicted peak exceeds its device's capacity is a false out-of-memory.
    rows = [r for r in mb.load_rows() if mb.expressible(r) is None]
    dense, moe = next(r for r in rows if not r.moe), next(r for r in rows if r.moe)
    results = [RowResult(dense, 1.0, 1.0, (), False), RowResult(moe, 1.0, 1.0, (), True)]
    text = mb.report(mb.Result((dense, moe), tuple(results), (True, True), ()))
    assert "fit verdict, dense: 1 of 1 newest rows predicted not to fit" in text
    assert "fit verdict, MoE: 0 of 1 newest rows predicted not to fit" in text


def test_each_row_names_what_of_its_recipes_memory_settings_is_not_applied():
    # recipe_memory_settings.csv: the recipes' recomputation and offloading, read at each container's tag
    rows = {(r.container, r.system, r.model, r.precision): r for r in mb.load_rows() if mb.expressible(r) is None}
    assert all(mb.recipe_memory(r) is not None for r in rows.values())
    deepseek = rows["26.08", "DGX-GB200", "DeepSeekV3", "MXFP8"]  # v0.6.0: recompute_modules = ["mla_up_proj"]
    assert mb.recipe_memory(deepseek)["citation"].startswith("v0.6.0:src/megatron/bridge/perf_recipes/deepseek/gb200")
    deepseek_inputs = mb.plan_inputs(deepseek)  # applied: Megatron-Core's output-discarding up-projection checkpoint
    assert (deepseek_inputs.recompute, deepseek_inputs.recompute_modules) == ("selective", ("mla_up_proj",))
    assert not any("recomputation" in item for item in mb.unmodelled(deepseek))
    gpt_oss = rows["26.04.01", "DGX-GB200", "GPT OSS 120B", "BF16"]  # recompute_modules = ["layernorm", "moe_act"]
    assert mb.recomputed_modules(gpt_oss) == ("layernorm", "moe_act")
    dense_mlp = rows["26.04.01", "DGX-GB200", "DeepSeekV3", "MXFP8"]  # ["mlp"]: a whole-module checkpoint, not modelled
    assert mb.recomputed_modules(dense_mlp) == () and mb.plan_inputs(dense_mlp).recompute_mode == "none"
    assert "the recipe's selective recomputation of ['mlp'] not applied" in mb.unmodelled(dense_mlp)
    llama = rows["26.04.01", "DGX-GB200", "LLAMA3_70B", "FP8"]  # FSDP: cpu_offloading_num_layers = 40, applied
    assert mb.offloaded_layers(llama) == 40 and mb.plan_inputs(llama).offload_activations == 40
    assert {mb.plan_inputs(r).blocks for r in rows.values()} == {"transformer-engine"}  # Megatron-Core's TE layers
    assert not any("offloading" in item for item in mb.unmodelled(llama))
    assert mb.offloaded_layers(rows["26.04.01", "DGX-GB300", "LLAMA3_70B", "FP8"]) == 20
    small = rows["26.08", "DGX-GB200", "Qwen3_30B_a3B", "MXFP8"]  # nothing recomputed or offloaded
    assert not any("recipe" in item for item in mb.unmodelled(small)) and mb.plan_inputs(small).recompute_mode == "none"
    assert not any("recomputation not published" in item for r in rows.values() for item in mb.unmodelled(r))
