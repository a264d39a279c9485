"""Megatron-Bridge's published pre-training throughput on Blackwell (DGX-GB200, DGX-GB300, DGX-B300), predicted:
every row of ``../shared/data/megatron-bridge/`` (copied to ``experiments/data/megatron-bridge/``) the product can
express, through the one prediction path (``build_plan`` and ``predict``), beside the published tokens per second
per GPU; the rows it cannot express, each with the reason.

Each row becomes the ``sim.run`` inputs its columns mean (:func:`plan_inputs`): the model's preset at the row's sequence
length; on GB200 and GB300, racks of 64 of the job's GPUs (``M × 64 × GB200``; 72 or fewer GPUs, one domain), on B300
``N/8 × 8 × B300``; ``--tp`` (with sequence parallelism, which Megatron-Core requires of a mixture under TP and the
recipes set), ``--pp`` (``--schedule interleaved --chunks VP`` where VP > 1, else 1F1B; the layers split as the recipe
has Megatron-Core split them, DeepSeek-V3's by its recipe's ``pipeline_model_parallel_layout``, :func:`partition`;
each stage's output freed once sent, ``--deallocate-pipeline-outputs``, as the Bridge's ``GPTModelProvider`` sets
``deallocate_pipeline_outputs = True`` at every tag read, v0.1.0rc3 to v0.6.0
``src/megatron/bridge/models/gpt_provider.py``), ``--cp``, ``--ep``, DP the GPUs left; micro-batches of the row's
``mbs`` (where a parenthesised variant shares the outer one's cell and only its own accumulation count balances the
global batch, the size that count implies: :func:`microbatch_size`); FSDP > 0 as ``--zero 3`` over the
data-parallel devices, FSDP = 0 as Megatron's distributed optimizer
(``--zero 1``, the recipes' default, [assumed]: the file does not say); the global batch in microbatches of the row's
size; Transformer Engine's fused kernels (``--compile``); Transformer Engine's tensor-parallel communication overlap
where the recipe keeps it (Llama 3 under TP > 1 but in NVFP4, :func:`tp_comm_overlap`) as ``--async-tp``; the
data-parallel gradient reduction and parameter gather overlapped in the recipes' 128 Mi-parameter buckets wherever DP >
1 under the distributed optimizer (:func:`dp_comm_overlap`:
``--grad-overlap --param-gather-overlap --grad-bucket-size``); the expert all-to-alls overlapped with compute
(``--ep-overlap``) from the container whose performance recipe overlaps them (:data:`EP_OVERLAP_FROM`, read in
Megatron-Bridge's history) and the step captured as one CUDA graph (``--cuda-graphs``) from the container whose recipe
captures the full iteration (:data:`FULL_ITERATION_GRAPHS_FROM`; the fused grouped MLP, FP8 attention and paged stash
that came with it are named in ``unmodelled``); the precision: BF16 as the model's own, FP8-CS as ``fp8``, FP8-MX and
MXFP8 as ``mxfp8``, NVFP4 as ``nvfp4``, and the unqualified "FP8" of 26.02 on and the unlabelled 25.09 rows as ``fp8``
(the file does not define them: named in the row's ``unmodelled`` column). Routing is balanced and dropless, as the file
says the MoE benchmarks force. Every block is Megatron-Core's of Transformer Engine layers (``--blocks
transformer-engine``: the linears keep their inputs as they multiply them, the SwiGLU is fused). What the recipes keep
in memory (:data:`RECIPE_MEMORY`, read at each container's tag; the tables do not publish it) is applied where the
product models it: the FP8 Llama 3 configs with FSDP offload the activations of their first layers to the CPU
(``cpu_offloading_num_layers``, as ``--offload-activations``); no row recomputes whole layers; the modules DeepSeek-V3
and GPT-OSS recompute selectively (``recompute_modules``: ``mla_up_proj``, ``moe_act``, ``layernorm``) are applied as
``--recompute selective --recompute-modules`` (:func:`recomputed_modules`), except a list naming a module the product
does not model (``mlp``, a whole-module checkpoint: named in the row's ``unmodelled`` column). The predicted
peak memory is reported; a row the ledger says does not fit is still timed.

Racks of 64 [assumed]: the file does not say how the GPUs were allocated. Filled in order as ``NxGB200`` hands
them out (domains of 72, the last partial), a 256-GPU job with 32 or 64 devices per pipeline stage has a stage whose
expert-parallel group straddles two racks, and the all-to-all of its 24-48 MoE layers crosses InfiniBand at a
sixteenth of NVLink's bandwidth: Qwen3-235B-A22B on 256 GB200s (26.02.01, PP 8, EP 32) is then predicted at 1,798
tokens/s per GPU against the published 5,530, and at 5,410 with the job in racks of 64 (16 of the 18 trays, as
Slurm's block topology with segments of 16 nodes allocates NVL72 racks); no published MoE row shows the straddled
rate, so the runs evidently kept each expert group inside one NVLink domain.

The same configuration is often published by several containers, with throughput that moved as the software did
(Qwen3-30B-A3B on 8 GB200s: 26,084 tokens/s in 26.02, 39,936 in 26.08). Where the recipe's change is one the
product models (the all-to-all overlap, the captured step), the row's inputs follow its container; the rest of the
software is not modelled, so the rows judged are each configuration's newest; the older ones are listed as
superseded, with their own errors, and not counted.

Not expressible (each listed with its reason): Nemotron 3 (hybrid Mamba layers), Kimi K2 and DeepSeek-V4 Flash (no
config in the repository) and the "(tokendrop)" rows (their capacity factor is not published). DeepSeek-V3's default
rows train its multi-token-prediction module (the preset follows its config's ``num_nextn_predict_layers: 1``:
one more block after the last, scored by the shared output head); the "w/o MTP" rows are ``deepseek-v3,mtp=0``.
"""

from __future__ import annotations

import csv
import functools
import io
from dataclasses import dataclass
from pathlib import Path

from experiments.published_rows import RowResult, device_peaks
from experiments.scatter import accuracy_scatter_png, error_stats, target_line
from sim.core.cli import CliParser
from sim.core.fileio import write_bytes_atomic, write_text_atomic
from sim.models.recompute_modules import RECOMPUTE_MODULES
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict_built

__all__ = ["DATA", "RECIPE_MEMORY", "EP_OVERLAP_FROM", "FULL_ITERATION_GRAPHS_FROM", "DDP_BUCKET_PARAMS", "Row",
           "Result", "microbatch_size", "load_rows", "recipe_memory", "offloaded_layers", "recomputed_modules",
           "partition", "expressible", "ep_overlap", "tp_comm_overlap", "dp_comm_overlap", "plan_inputs", "predict_row",
           "newest", "summary", "parser", "run", "report", "write"]

DATA = Path(__file__).parent / "data" / "megatron-bridge" / "performance_summary_blackwell_nvl.csv"
#: What each row's recipe keeps in memory, read from Megatron-Bridge's workload configs at its container's tag
#: (``experiments/data/megatron-bridge/README.md``).
RECIPE_MEMORY = DATA.parent / "recipe_memory_settings.csv"

#: The preset of each published model name the product expresses.
MODELS = {"LLAMA3_8B": "llama3.1-8b", "LLAMA3_70B": "llama3.1-70b", "LLAMA3.1_405B": "llama3.1-405b",
          "Qwen3_30B_a3B": "qwen3-30b-a3b", "Qwen3_235B_a22B": "qwen3-235b-a22b", "GPT OSS 120B": "gpt-oss-120b",
          "DeepSeekV3": "deepseek-v3", "DeepSeekV3 (w/o MTP)": "deepseek-v3,mtp=0"}
#: Why each other published model is not expressed.
NOT_EXPRESSIBLE = {
    "Nemotron_3_Nano": "hybrid Mamba layers are not modelled",
    "Nemotron_3_Super": "hybrid Mamba layers are not modelled",
    "Nemotron_3_Ultra": "hybrid Mamba layers are not modelled",
    "Nemotron_3_5_Lightning": "hybrid Mamba layers are not modelled",
    "Kimi_K2": "no Kimi K2 config in the repository",
    "DeepSeekV4 Flash": "no DeepSeek-V4 config in the repository",
    "DeepSeekV3 (tokendrop)": "the capacity factor of the token-dropping runs is not published",
    "Qwen3_30B_a3B (tokendrop)": "the capacity factor of the token-dropping runs is not published",
    "Qwen3_235B_a22B (tokendrop)": "the capacity factor of the token-dropping runs is not published",
}
#: Median and max |error| the newest rows are held to (issue #39), dense and MoE apart.
TARGETS = {"dense": (0.06, 0.15), "moe": (0.10, 0.25)}
#: Mixtures of experts among the expressed models (the targets are judged for dense and MoE rows apart).
MOE_MODELS = frozenset({"qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-120b", "deepseek-v3"})
#: The product's precision for each published label ("" is 25.09's unlabelled outer variant).
PRECISIONS = {"BF16": None, "FP8-CS": "fp8", "FP8-MX": "mxfp8", "MXFP8": "mxfp8", "NVFP4": "nvfp4", "FP8": "fp8",
              "": "fp8"}
#: The first container whose performance recipe overlaps the expert all-to-alls with compute (``moe_a2a_overlap``:
#: Megatron-Core's ``overlap_moe_expert_parallel_comm`` with ``delay_wgrad_compute``), by published model and system;
#: read in Megatron-Bridge's history (containers mapped to its release tags by their dates and
#: ``docs/releases/software-versions.md``: 26.04 = v0.4.0, 26.04.01 = v0.4.2, 26.06 = v0.5.0, 26.06.01 = v0.5.1,
#: 26.08 = v0.6.0). The overlap came with full-iteration CUDA graphs and the CuTeDSL fused grouped MLP (commits
#: 8af195c0a, afb5dd47c, 55443cbfb, 5f98743d5, cherry-picked to r0.5.0 on 2026-06-10; for B300 ac4ad89ff and
#: e80116b22 of v0.5.1), except GPT-OSS on GB200, whose recipe overlapped from 26.04 on with partial graphs
#: (1513a1026). A pair not listed never overlaps in the published rows (GPT-OSS on B300 through v0.6.0).
EP_OVERLAP_FROM = {
    ("DeepSeekV3", "DGX-GB300"): "26.06", ("DeepSeekV3", "DGX-GB200"): "26.06", ("DeepSeekV3", "DGX-B300"): "26.06.01",
    ("Qwen3_30B_a3B", "DGX-GB300"): "26.06", ("Qwen3_30B_a3B", "DGX-GB200"): "26.06",
    ("Qwen3_30B_a3B", "DGX-B300"): "26.06",
    ("Qwen3_235B_a22B", "DGX-GB300"): "26.06", ("Qwen3_235B_a22B", "DGX-GB200"): "26.06",
    ("Qwen3_235B_a22B", "DGX-B300"): "26.06.01",
    ("GPT OSS 120B", "DGX-GB300"): "26.06", ("GPT OSS 120B", "DGX-GB200"): "26.04",
}
#: The containers from which a recipe that overlaps also captures the whole iteration in CUDA graphs (the same
#: commits as :data:`EP_OVERLAP_FROM`; GPT-OSS on GB200 only from 26.06).
FULL_ITERATION_GRAPHS_FROM = {**EP_OVERLAP_FROM, ("GPT OSS 120B", "DGX-GB200"): "26.06"}
#: GPUs of a job in each NVL72 rack: 16 of its 18 compute trays (module docstring).
RACK_GPUS = 64
#: Labels whose format the file does not define.
UNDEFINED_PRECISIONS = frozenset({"FP8", ""})


@dataclass(frozen=True)
class Row:
    """One published pre-training row (the columns read; ``experiments/data/megatron-bridge/README.md``).
    ``accumulation`` is the published GA column (0 where the table has none); ``mbs`` is :func:`microbatch_size`'s
    reading of the row."""

    line: int
    container: str
    system: str
    model: str
    gpus: int
    precision: str
    variant: str
    gbs: int
    mbs: int
    seq: int
    fsdp: int
    tp: int
    pp: int
    cp: int
    vp: int
    ep: int
    tokens_per_s_per_gpu: float
    source_line: int = 0
    accumulation: int = 0

    @property
    def config(self) -> tuple:
        """What a static model sees of the row: everything but the container (the software version)."""
        return (self.system, self.model, self.gpus, self.precision, self.variant, self.gbs, self.mbs, self.seq,
                self.fsdp, self.tp, self.pp, self.cp, self.vp, self.ep)

    @property
    def moe(self) -> bool:
        """Whether the published model is a mixture of experts (:data:`MOE_MODELS`)."""
        return MODELS[self.model].partition(",")[0] in MOE_MODELS


def _count(text: str) -> int:
    """A published degree: empty or "n/a" is 1 (FSDP: 0)."""
    return int(text) if text.strip() not in ("", "n/a") else 1


def _data_parallel(entry: dict[str, str]) -> int:
    """The data-parallel size of a file row: the GPUs over TP × PP × CP."""
    return int(entry["n_gpus"]) // (_count(entry["tp"]) * _count(entry["pp"]) * _count(entry["cp"]))


def microbatch_size(entry: dict[str, str]) -> int:
    """The micro-batch size of a file row. The global batch is micro-batch × data-parallel size × accumulation steps
    (``gbs = mbs × DP × GA``); where a parenthesised variant published its own layout and accumulation but shares the
    outer variant's ``mbs`` cell, and the shared value breaks that product while the variant's GA divides it, the
    variant's size is the one its GA implies: 25.09's Llama 3 70B on GB200, ``TP 1 (2), PP 1 (4), GA 1 (16)`` under
    one ``mbs 2``, is 128 / (8 × 16) = 1, as its recipe says (``fp8_mx: mbs: 1, tp: 2, pp: 4, vp: 5``,
    Megatron-Bridge v0.1.0rc3 ``scripts/performance/configs/llama3/llama3_70b_llm_pretrain.yaml`` lines 147-152). Any
    other disagreement is left as published and named in the row's ``unmodelled`` column (:func:`unmodelled`)."""
    mbs, gbs = int(entry["mbs"]), int(entry["gbs"])
    if entry["variant"] != "inside_parentheses" or entry["ga"].strip() in ("", "n/a"):
        return mbs
    cells = [cell.strip() for cell in entry["raw_row"].strip().strip("|").split("|")]
    mbs_cell = 3 if entry["container"] == "25.09" else 4  # 25.09's tables have no precision column (the README)
    shared = "(" not in cells[mbs_cell]
    per_step = _data_parallel(entry) * int(entry["ga"])
    if shared and gbs != mbs * per_step and gbs % per_step == 0:
        return gbs // per_step
    return mbs


def load_rows(path: Path = DATA) -> list[Row]:
    """Every pre-training row of ``path``, in file order."""
    rows = []
    with path.open(newline="", encoding="utf-8") as handle:
        for line, entry in enumerate(csv.DictReader(handle), start=2):
            if entry["section"] != "Pre-Training Performance":
                continue
            rows.append(Row(
                line=line, container=entry["container"], system=entry["system"], model=entry["model"],
                gpus=int(entry["n_gpus"]), precision=entry["precision"], variant=entry["variant"],
                gbs=int(entry["gbs"]), mbs=microbatch_size(entry), seq=int(entry["seq_len"]),
                fsdp=int(entry["fsdp"]) if entry["fsdp"].strip() not in ("", "n/a") else 0, tp=_count(entry["tp"]),
                pp=_count(entry["pp"]), cp=_count(entry["cp"]), vp=_count(entry["vp"]), ep=_count(entry["ep"]),
                tokens_per_s_per_gpu=float(entry["tokens_per_sec_per_gpu"]), source_line=int(entry["source_line"]),
                accumulation=_count(entry["ga"]) if entry["ga"].strip() not in ("", "n/a") else 0))
    return rows


@functools.lru_cache(maxsize=1)
def _recipe_memory_table(path: Path = RECIPE_MEMORY) -> dict[tuple[int, str, str, str, int], dict[str, str]]:
    """:data:`RECIPE_MEMORY` keyed by (source line, container, system, model, variant index: 0 for the row outside
    the parentheses or alone, 1 for the one inside), read once."""
    table: dict[tuple[int, str, str, str, int], dict[str, str]] = {}
    seen: dict[tuple[int, str, str, str], int] = {}  # rows read so far per (line, container, system, model)
    with path.open(newline="", encoding="utf-8") as handle:
        for entry in csv.DictReader(handle):
            key = (int(entry["source_line"]), entry["container"], entry["system"], entry["model"])
            index = seen[key] = seen.get(key, -1) + 1
            table[(*key, index)] = entry
    return table


def recipe_memory(row: Row) -> dict[str, str] | None:
    """What ``row``'s recipe keeps in memory (:data:`RECIPE_MEMORY`: recomputation, offloading, other settings and
    their citations), or ``None`` for a row it does not list."""
    key = (row.source_line, row.container, row.system, row.model, int(row.variant == "inside_parentheses"))
    return _recipe_memory_table().get(key)


def expressible(row: Row) -> str | None:
    """None when the product expresses ``row``, else why not."""
    if row.model in MODELS:
        return None
    return NOT_EXPRESSIBLE.get(row.model, f"model {row.model!r} is not known to the experiment")


def _precision(row: Row) -> str | None:
    if row.container == "25.09" and row.variant == "inside_parentheses":
        return "mxfp8"  # the parenthesised 25.09 variant is the block-scaled one (the file's notes)
    return PRECISIONS[row.precision]


def _from(table: dict[tuple[str, str], str], row: Row) -> bool:
    """Whether ``row``'s container is at or after the first one ``table`` names for its model (its base model for
    DeepSeek-V3's variants) and system."""
    first = table.get((row.model.split(" (")[0], row.system))
    return first is not None and _version(row.container) >= _version(first)


def tp_comm_overlap(row: Row) -> bool:
    """Whether ``row``'s recipe overlaps its tensor-parallel communication with the GEMMs: Megatron-Bridge's Llama 3
    70B and 3.1 405B pre-training recipes set ``tp_comm_overlap=True`` (Transformer Engine's userbuffers;
    ``llama3_70b_pretrain_config``, ``llama31_405b_pretrain_config``) and the performance scripts keep it under TP > 1
    except in NVFP4 (``tp_comm_overlap = False if precision == "nvfp4"``, read at v0.4.2, v0.5.0 and v0.6.0; the older
    containers are assumed the same). Costed as async TP's decomposition (``--async-tp``)."""
    return not row.moe and row.tp > 1 and _precision(row) != "nvfp4"


#: Parameters per bucket of the overlapped data-parallel reduction and gather in Megatron-Bridge's recipes:
#: ``CommOverlapConfig._get_optimizer_overlap_cfgs`` sets ``bucket_size = 128 * 1024 * 1024`` with
#: ``overlap_grad_reduce`` and ``overlap_param_gather`` whenever the data-parallel size is > 1 under the distributed
#: optimizer (``src/megatron/bridge/training/comm_overlap.py``, the same at v0.2.0, v0.4.0, v0.5.0 and v0.6.0).
DDP_BUCKET_PARAMS = 128 * 1024 * 1024


def dp_comm_overlap(row: Row) -> bool:
    """Whether ``row``'s recipe overlaps its data-parallel gradient reduction with the backward and the distributed
    optimizer's parameter gather with the next forward (:data:`DDP_BUCKET_PARAMS`): the distributed optimizer
    (FSDP = 0) over more than one data-parallel replica. Costed as ``--grad-overlap --param-gather-overlap
    --grad-bucket-size 134217728`` (under VP the recipes also align the chunks' gathers, ``align_param_gather``:
    each chunk's gather here is waited for by that chunk's first forward)."""
    return row.fsdp == 0 and row.gpus // (row.tp * row.pp * row.cp) > 1


def ep_overlap(row: Row) -> bool:
    """Whether ``row``'s recipe overlaps the expert all-to-alls with compute (:data:`EP_OVERLAP_FROM`)."""
    return _from(EP_OVERLAP_FROM, row)


def plan_inputs(row: Row) -> PlanInputs:
    """The ``sim.run`` inputs of ``row`` (module docstring)."""
    dp = row.gpus // (row.tp * row.pp * row.cp)
    if row.system == "DGX-B300":
        topology = f"{row.gpus // 8}x8xB300" if row.gpus >= 8 else f"{row.gpus}xB300"
    else:  # NVL72 racks holding RACK_GPUS of the job's GPUs each (module docstring)
        device = row.system.removeprefix("DGX-")
        racks, rest = divmod(row.gpus, RACK_GPUS)
        topology = f"{racks}x{RACK_GPUS}x{device}" if racks and not rest else f"{row.gpus}x{device}"
    interleaved = row.pp > 1 and row.vp > 1
    return PlanInputs(
        model=f"{MODELS[row.model]},seq={row.seq}", topology=topology,
        schedule="interleaved" if interleaved else "1f1b", chunks=row.vp if interleaved else 1,
        microbatch_size=row.mbs, global_batch=row.gbs, tp=row.tp, pp=row.pp, cp=row.cp, dp=dp, ep=row.ep,
        sequence_parallel=row.tp > 1, zero=3 if row.fsdp > 0 else 1 if dp * row.cp > 1 else 0,
        cp_comm="allgather" if row.cp > 1 else "ring", precision=_precision(row), compiled=True,
        ep_overlap=ep_overlap(row), cuda_graphs=_from(FULL_ITERATION_GRAPHS_FROM, row),
        async_tp=tp_comm_overlap(row), grad_overlap=dp_comm_overlap(row), param_gather_overlap=dp_comm_overlap(row),
        grad_bucket_params=DDP_BUCKET_PARAMS if dp_comm_overlap(row) else 0, blocks="transformer-engine",
        deallocate_pipeline_outputs=row.pp > 1,
        offload_activations=offloaded_layers(row), partition=partition(row), **_recomputation(row))


#: Megatron-Bridge's recipes whose pipeline split counts the embedding and the loss as one layer each
#: (``account_for_embedding_in_pipeline_split`` and ``account_for_loss_in_pipeline_split``): Llama 3.1 405B's at every
#: tag read (v0.1.0rc3 ``recipes/llama/llama31_405b.py`` lines 47-48 to v0.5.0 ``recipes/llama/llama3.py`` lines
#: 1146-1147) and Qwen3-235B-A22B's (v0.2.0 ``recipes/qwen/qwen3_moe.py`` lines 160-161, v0.4.2 and v0.5.0 lines
#: 166-167, v0.6.0 ``recipes/qwen/h100/qwen3_moe.py`` lines 261-262, which its performance recipes start from).
#: Megatron-Core then splits num_layers + 2 evenly over the model chunks and builds one block fewer in the first chunk
#: and in the last (``get_num_layers_to_build``, ``transformer_block.py``, Megatron-LM d98e8a6).
EMBEDDING_AND_LOSS_IN_SPLIT = frozenset({"LLAMA3.1_405B", "Qwen3_235B_a22B"})


#: DeepSeek-V3's layer layout by (PP, VP) as Megatron-Bridge's recipes set it, ``{last}`` its last stage's MTP layer
#: (where the model trains one) and the loss: ``set_deepseek_v3_pipeline_model_parallel_layout``'s ``layout_map``
#: (the same at v0.2.0, v0.4.2 and v0.5.0 ``src/megatron/bridge/recipes/deepseek/deepseek_v3.py`` and v0.6.0
#: ``recipes/deepseek/h100/deepseek_v3.py``, ``last_layer = ["mtp"] * mtp_layers + ["loss"]``), and on GB300 at PP 2 ×
#: VP 8 the ``pp_layout="Et*4|(t*4|)*14tmL"`` its performance configs set (v0.4.2 and v0.5.0
#: ``deepseek_workload_base_configs.py``, v0.6.0 ``perf_recipes/deepseek/gb300/deepseek_v3.py``): Megatron-Core's
#: layout syntax, which ``--partition`` takes (:mod:`sim.plan.megatron_layout`).
DEEPSEEK_V3_LAYOUTS = {(4, 1): "Et*16|t*16|t*16|t*13{last}", (8, 1): "Et*8|(t*8|)*6t*5{last}",
                       (4, 2): "Et*8|(t*8|)*6t*5{last}", (16, 1): "Et*4|(t*4|)*14t{last}",
                       (8, 2): "Et*4|(t*4|)*14t{last}", (4, 4): "Et*4|(t*4|)*14t{last}",
                       (2, 8): "Et*4|(t*4|)*14t{last}"}


def partition(row: Row) -> str:
    """``--partition`` of ``row``: the layer split its recipe makes. The dense models' are Megatron-Core's even
    splits: with the embedding and the loss counted (:data:`EMBEDDING_AND_LOSS_IN_SPLIT`) every model chunk holds the
    same number of the model's layers, embedding and head included (``uniform``); else the blocks split evenly, the
    embedding joining the first chunk and the head the last (``blocks``, Megatron-Core's default). DeepSeek-V3's is
    its recipe's layout (:data:`DEEPSEEK_V3_LAYOUTS`), Qwen3-235B-A22B's the embedding-and-loss split; the other
    mixtures' are not read here: ``balanced`` (the product's own split, named in ``unmodelled``)."""
    if row.pp == 1:
        return "balanced"  # one stage: every split is the same
    if row.model.startswith("DeepSeekV3") and (row.pp, row.vp) in DEEPSEEK_V3_LAYOUTS:
        return DEEPSEEK_V3_LAYOUTS[row.pp, row.vp].format(last="L" if "w/o MTP" in row.model else "mL")
    if row.model in EMBEDDING_AND_LOSS_IN_SPLIT:
        return "uniform"
    return "balanced" if row.moe else "blocks"


def offloaded_layers(row: Row) -> int:
    """The layers whose activations ``row``'s recipe offloads to the CPU (``cpu_offloading_num_layers`` where the
    recipe sets ``cpu_offloading=True``, :func:`recipe_memory`); 0 for none or a row whose recipe was not read."""
    settings = recipe_memory(row)
    offloading = settings["offloading"] if settings is not None else ""
    if not offloading.startswith("cpu_offloading=True"):
        return 0
    return int(offloading.rsplit("cpu_offloading_num_layers=", 1)[-1].split(",")[0].strip())


def _recipe_modules(row: Row) -> tuple[str, ...]:
    """The modules ``row``'s recipe recomputes selectively (``recompute_granularity = "selective"`` with a non-empty
    ``recompute_modules`` list, :func:`recipe_memory`), as the recipe names them; empty for none."""
    settings = recipe_memory(row)
    if settings is None or settings["recompute_granularity"] != "selective":
        return ()
    text = settings["recompute_modules"]
    if not text.startswith("["):
        return ()
    return tuple(name.strip().strip("'\"") for name in text[1:text.index("]")].split(",") if name.strip())


def recomputed_modules(row: Row) -> tuple[str, ...]:
    """The modules ``row``'s recipe recomputes selectively where the product models every one of them
    (:data:`sim.models.recompute_modules.RECOMPUTE_MODULES`: DeepSeek-V3's ``mla_up_proj`` or ``moe_act``,
    GPT-OSS's ``layernorm`` and ``moe_act``), in canonical order; empty for none, or for a list holding a module not
    modelled (DeepSeek-V3's ``mlp`` in some recipes: named in ``unmodelled``)."""
    named = _recipe_modules(row)
    if not named or any(name not in RECOMPUTE_MODULES for name in named):
        return ()
    return tuple(name for name in RECOMPUTE_MODULES if name in named)


def _recomputation(row: Row) -> dict[str, object]:
    """``recompute`` and ``recompute_modules`` of ``row``'s inputs: selective recomputation of
    :func:`recomputed_modules` where there are any, else none (no recipe recomputes whole layers)."""
    modules = recomputed_modules(row)
    return {"recompute": "selective", "recompute_modules": modules} if modules else {}


def _recipe_memory_gaps(row: Row) -> list[str]:
    """What of the recipe's memory settings (:func:`recipe_memory`) the prediction does not apply: its selective
    recomputation of modules the product does not model, and whether the recipe read is uncertain (its CPU offloading
    and its recomputation of modelled modules are applied: :func:`offloaded_layers`, :func:`recomputed_modules`)."""
    settings = recipe_memory(row)
    if settings is None:
        return ["the recipe's memory settings not read"]
    gaps = []
    named = _recipe_modules(row)
    if named and not recomputed_modules(row):
        gaps.append(f"the recipe's selective recomputation of {list(named)} not applied")
    if "UNCERTAIN" in settings["other_memory_settings"]:
        gaps.append("the recipe's memory settings uncertain (no config matches the row exactly)")
    return gaps


def unmodelled(row: Row) -> tuple[str, ...]:
    """What of ``row`` the prediction assumes or leaves out."""
    missing = []
    if row.precision in UNDEFINED_PRECISIONS and not (row.container == "25.09" and row.variant == "inside_parentheses"):
        missing.append("precision not defined by the file (costed as fp8)")
    if row.fsdp == 0 and row.gpus // (row.tp * row.pp) > 1:
        missing.append("distributed optimizer assumed")
    missing.extend(_recipe_memory_gaps(row))
    if row.moe and row.pp > 1 and partition(row) == "balanced":
        missing.append("the recipe's pipeline layout not read (layers split by --partition balanced)")
    if row.accumulation and row.gbs != row.mbs * row.accumulation * row.gpus // (row.tp * row.pp * row.cp):
        missing.append(f"the published batch columns disagree (gbs {row.gbs} != mbs {row.mbs} x DP "
                       f"{row.gpus // (row.tp * row.pp * row.cp)} x GA {row.accumulation}; costed at gbs and mbs)")
    if tp_comm_overlap(row):
        missing.append("Transformer Engine's TP overlap costed as async TP (the SMs its userbuffers take not modelled)")
    if _from(FULL_ITERATION_GRAPHS_FROM, row):
        missing.append("the CuTeDSL fused grouped MLP, FP8 attention and the paged stash's capacity padding")
    if row.model == "GPT OSS 120B":  # the file's own footnote: "Performance regression in GPT-OSS 120B pre-training"
        missing.append("attention sinks costed as plain FlashAttention (Megatron's sink kernel not published)")
    return tuple(missing)


def predict_row(row: Row) -> RowResult[Row]:
    """``row``'s prediction through ``build_plan`` and ``predict`` (memory reported, not enforced)."""
    prediction = predict_built(build_plan(plan_inputs(row)), check_memory=False)
    metrics = prediction.metrics
    peak, fits, reserved = device_peaks(metrics)
    return RowResult(row, metrics["tokens_per_s_per_device"], peak, unmodelled(row), fits, reserved,
                     metrics["regime"])


def _version(container: str) -> tuple[int, ...]:
    return tuple(int(part) for part in container.split("."))


def newest(rows: list[Row]) -> list[bool]:
    """For each row, whether it is its configuration's newest publication (the others are superseded)."""
    latest: dict[tuple, tuple[int, ...]] = {}
    for row in rows:
        latest[row.config] = max(latest.get(row.config, ()), _version(row.container))
    return [_version(row.container) == latest[row.config] for row in rows]


def summary(results: list[RowResult[Row]]) -> dict[str, dict[str, float]]:
    """Median and max |error| and the row count, for dense and MoE rows apart and together."""
    return {"dense": error_stats([abs(r.error) for r in results if not r.row.moe]),
            "moe": error_stats([abs(r.error) for r in results if r.row.moe]),
            "all": error_stats([abs(r.error) for r in results])}


def _families(results: list[RowResult[Row]]) -> list[str]:
    lines = []
    for model in sorted({r.row.model for r in results}):
        for system in sorted({r.row.system for r in results if r.row.model == model}):
            stats = error_stats([abs(r.error) for r in results if (r.row.model, r.row.system) == (model, system)])
            lines.append(f"  {model:<22} {system:<10} {stats['rows']:>3} rows  median |error| "
                         f"{stats['median_abs_error']:6.1%}  max {stats['max_abs_error']:6.1%}")
    return lines


def _table(results: list[RowResult[Row]], current: list[bool]) -> list[str]:
    lines = [f"{'line':>4} {'container':<9} {'system':<9} {'model':<21} {'GPUs':>4} {'prec':<6} "
             f"{'TP×PP×CP×VP×EP':<15} {'FSDP':>4} {'gbs':>5} {'mbs':>3} {'published':>9} {'predicted':>9} "
             f"{'error':>7} {'peak GB':>7}  newest"]
    for r, now in zip(results, current, strict=True):
        row = r.row
        degrees = f"{row.tp}×{row.pp}×{row.cp}×{row.vp}×{row.ep}"
        lines.append(f"{row.line:>4} {row.container:<9} {row.system[4:]:<9} {row.model[:21]:<21} {row.gpus:>4} "
                     f"{row.precision or '-':<6} {degrees:<15} {row.fsdp:>4} {row.gbs:>5} {row.mbs:>3} "
                     f"{row.tokens_per_s_per_gpu:>9,.0f} {r.predicted:>9,.0f} {r.error:>+7.1%} "
                     f"{r.peak_memory_bytes / 1e9:>7.1f}  {'yes' if now else 'superseded'}")
    return lines


def _plot(results: list[RowResult[Row]]) -> bytes:
    xs = [r.row.tokens_per_s_per_gpu for r in results]
    ys = [r.predicted for r in results]
    series = []
    for moe, color, label in ((False, "#117733", "dense"), (True, "#CC6677", "mixture of experts")):
        pick = [r for r in results if r.row.moe == moe]
        series.append(([r.row.tokens_per_s_per_gpu for r in pick], [r.predicted for r in pick], color,
                       f"{label} ({len(pick)})"))
    return accuracy_scatter_png(series, low=min(xs + ys) * 0.7, high=max(xs + ys) * 1.4,
                                xlabel="published tokens/s per GPU (Megatron-Bridge)",
                                ylabel="predicted tokens/s per GPU", title="Megatron-Bridge on GB200 / GB300 / B300",
                                size=14)


@dataclass(frozen=True)
class Result:
    """Every pre-training row read (``rows``); the expressible ones predicted, in file order, each marked newest of
    its configuration or superseded (``current``); the others with the reason they are not expressible."""

    rows: tuple[Row, ...]
    results: tuple[RowResult[Row], ...]
    current: tuple[bool, ...]
    refused: tuple[tuple[Row, str], ...]


def parser() -> CliParser:
    """``python -m experiments.run megatron_bridge [--out DIR]``."""
    parser = CliParser(prog="python -m experiments.run megatron_bridge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/megatron_bridge", help="output directory (default runs/megatron_bridge)")
    return parser


def run() -> Result:
    """Every expressible row predicted (nothing fitted)."""
    rows = load_rows()
    refused = [(row, reason) for row in rows if (reason := expressible(row)) is not None]
    chosen = [row for row in rows if expressible(row) is None]
    results = [predict_row(row) for row in chosen]
    return Result(tuple(rows), tuple(results), tuple(newest(chosen)), tuple(refused))


def report(result: Result) -> str:
    """The rows, the newest rows by model and system, the error summaries beside the targets, and the reasons rows
    are not expressible."""
    rows, results, current, refused = result.rows, list(result.results), list(result.current), result.refused
    lines = [f"{len(rows)} Megatron-Bridge pre-training rows (experiments/data/megatron-bridge): {len(results)} "
             f"expressible ({sum(current)} newest of their configuration, {len(results) - sum(current)} superseded), "
             f"{len(refused)} not; error = predicted / published − 1; nothing fitted", *_table(results, current)]
    latest = [r for r, now in zip(results, current, strict=True) if now]
    lines += ["newest rows by model and system:", *_families(latest)]
    stats = summary(latest)
    for key in ("dense", "moe", "all"):
        entry = stats[key]
        lines.append(f"{key}: {entry['rows']} newest rows, median |error| {entry['median_abs_error']:.1%}, max "
                     f"{entry['max_abs_error']:.1%}")
    old = summary([r for r, now in zip(results, current, strict=True) if not now])["all"]
    lines.append(f"superseded rows (older software, same configurations): {old['rows']}, median |error| "
                 f"{old['median_abs_error']:.1%}")
    reasons: dict[str, int] = {}
    for _, reason in refused:
        reasons[reason] = reasons.get(reason, 0) + 1
    lines += [f"not expressible: {count} rows: {reason}" for reason, count in sorted(reasons.items())]
    # Issue #39's targets, newest rows, dense and MoE apart.
    lines += [target_line(f"{key} (issue #39)", stats[key], *TARGETS[key]) for key in ("dense", "moe")]
    # Every published row ran, so the memory ledger should say each fits (issue #40: no false out-of-memory).
    for label, pick in (("dense", False), ("MoE", True)):
        family = [r for r in latest if r.row.moe == pick]
        false_out_of_memory = sum(not r.fits for r in family)
        lines.append(f"fit verdict, {label}: {false_out_of_memory} of {len(family)} newest rows predicted not to fit "
                     f"(target 0, issue #40)")
    return "\n".join(lines)


def write(result: Result, out: Path) -> list[Path]:
    """``out/megatron_bridge.csv`` (every expressible row, newest or superseded), ``out/megatron_bridge_refused.csv``
    (the others and why) and ``out/megatron_bridge.png`` (the newest rows' scatter)."""
    results, current, refused = result.results, result.current, result.refused
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["line", "container", "system", "model", "gpus", "precision", "tp", "pp", "cp", "vp", "ep",
                     "fsdp", "gbs", "mbs", "seq", "published_tps_per_gpu", "predicted_tps_per_gpu", "error",
                     "predicted_peak_gb", "predicted_fits", "newest", "unmodelled"])
    for r, now in zip(results, current, strict=True):
        row = r.row
        writer.writerow([row.line, row.container, row.system, row.model, row.gpus, row.precision, row.tp, row.pp,
                         row.cp, row.vp, row.ep, row.fsdp, row.gbs, row.mbs, row.seq, repr(row.tokens_per_s_per_gpu),
                         f"{r.predicted:.3f}", f"{r.error:.6f}", f"{r.peak_memory_bytes / 1e9:.3f}", int(r.fits),
                         int(now), "; ".join(r.unmodelled)])
    write_text_atomic(text.getvalue(), out / "megatron_bridge.csv")
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["line", "container", "system", "model", "gpus", "reason"])
    for row, reason in refused:
        writer.writerow([row.line, row.container, row.system, row.model, row.gpus, reason])
    write_text_atomic(text.getvalue(), out / "megatron_bridge_refused.csv")
    write_bytes_atomic(out / "megatron_bridge.png", _plot([r for r, now in zip(results, current) if now]))
    return [out / "megatron_bridge.csv", out / "megatron_bridge_refused.csv", out / "megatron_bridge.png"]
