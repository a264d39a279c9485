"""``python -m sim.run``: simulate one pipeline-parallel training iteration and write its plan and timeline.

Example::

    python -m sim.run --topology 16xV100 --model gpt:layers=48,hidden=2048 --schedule 1f1b --microbatches 32 \\
        --out runs/a

writes ``runs/a/plan.json`` (the lowered plan the executor runs), ``schedule.csv`` (compute-only view, PyTorch's
CSV syntax), ``metrics.json``, ``trace.json`` (Chrome trace) and ``gantt.png``, and prints a summary. ``--model list``
and ``--topology list`` print what is built in. Bad input prints one ``error: ...`` line and exits with status 2.
"""

from __future__ import annotations

from sim.core.errors import exit_on_interrupt_while_starting

if __name__ == "__main__":  # a Ctrl-C during the imports below is one line, not a traceback
    exit_on_interrupt_while_starting()

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from sim.core.cli import CliParser, argument_type, parse_byte_size
from sim.core.errors import SpecError, run_cli
from sim.core.fileio import prepare_output_dir, write_json_atomic, write_text_chunks_atomic
from sim.cost.plan_settings import RECOMPUTE_MODULES_OPTION
from sim.cost.precision import PRECISIONS
from sim.engine.perturbation import Perturbation, SlowLink, Straggler, parse_straggler
from sim.faults.options import FaultOptions, FaultPrediction, predict_faults
from sim.ir.parallel import RESHARD_POLICIES
from sim.models import MODELS, build_model
from sim.models.blocks import BLOCKS
from sim.models.loss import LOSSES
from sim.models.recompute_modules import DEFAULT_RECOMPUTE_MODULES, RECOMPUTE_MODULES, parse_recompute_modules
from sim.models.routing import BALANCED, CAPACITY_FACTOR_HELP, ROUTING_HELP, parse_routing
from sim.models.sharding import DISPATCHERS
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs, format_builtin_lists
from sim.plan.memory_fit import out_of_memory_message
from sim.predict import predict
from sim.report.outputs import format_summary, plan_title, write_plan_files, write_run_outputs
from sim.report.partime import format_partime_summary
from sim.schedules import SCHEDULES

__all__ = ["main", "make_parser", "FLAGS"]

#: The library arguments this command sets from its flags (fields of PlanInputs and Parallelism), each with its flag:
#: an error the library raises about one (``tp must be an integer >= 1``) is printed as the user typed it (``--tp must
#: be ...``; :func:`sim.core.errors.run_cli`), and a memory remedy is offered as the flags that make it.
FLAGS = {"tp": "--tp", "dp": "--dp", "pp": "--pp", "cp": "--cp", "cp_comm": "--cp-comm", "order": "--rank-order",
         "ep": "--ep", "etp": "--etp", "routing": "--routing", "capacity_factor": "--capacity-factor",
         "ep_overlap": "--ep-overlap", "ep_dispatcher": "--ep-dispatcher", "loss": "--loss", "blocks": "--blocks",
         "offload_activations": "--offload-activations", "recompute_modules": "--recompute-modules",
         "fsdp_float8_gather": "--fsdp-float8-all-gather", "async_tp": "--async-tp",
         "param_gather_overlap": "--param-gather-overlap", "grad_bucket_params": "--grad-bucket-size",
         "deallocate_pipeline_outputs": "--deallocate-pipeline-outputs",
         "zero": "--zero",
         "reshard_after_forward": "--fsdp-reshard-after-forward", "dp_replicate": "--dp-replicate",
         "precision": "--precision", "compiled": "--compile", "compile": "--compile",
         "sequence_parallel": "--sequence-parallel", "grad_overlap": "--grad-overlap", "devices": "--devices",
         "partition": "--partition", "chunks": "--chunks", "recompute": "--recompute",
         "microbatch_size": "--microbatch-size", "global_batch": "--global-batch", "schedule": "--schedule",
         "microbatches": "--microbatches", "vertical_sync": "--vertical-sync", "fps": "--fps",
         "cuda_graphs": "--cuda-graphs", "profile": "--profile", "model": "--model", "space": "--space",
         "subnets": "--subnets", "lookahead": "--lookahead", "prefetch": "--prefetch",
         "device_param_budget_bytes": "--device-param-budget"}


def make_parser() -> argparse.ArgumentParser:
    """The ``sim.run`` argument parser."""
    parser = CliParser(prog="python -m sim.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", help="e.g. 16xV100, 2x8xA100, 4xV100+4xA100, dgx-h100, 4xideal, a YAML file, or "
                        "'list' (required unless --model list)")
    parser.add_argument("--model", help="e.g. gpt:layers=48,hidden=2048, uniform:layers=8, supernet:blocks=12, or "
                        "'list' (required unless --space names a supernet)")
    parser.add_argument("--schedule", choices=[*sorted(SCHEDULES), "csp"],
                        help="schedule generator (default 1f1b); csp = NASPipe's causal synchronous parallel over a "
                        "subnet sequence")
    csp = parser.add_argument_group("csp (NASPipe) options")
    csp.add_argument("--space", help="supernet search space preset c0|c1|c2|c3 (instead of --model)")
    csp.add_argument("--subnets", type=int, default=64, help="subnets to train, in order (default 64)")
    csp.add_argument("--lookahead", type=int, default=30, help="most subnets in flight (default 30, NASPipe's)")
    csp.add_argument("--one-at-a-time", action="store_true", help="ablation: no CSP overlap, one subnet at a time")
    csp.add_argument("--device-param-budget", type=parse_byte_size, metavar="BYTES",
                     help="most choice-block parameter bytes per device, e.g. 2GB, 512MiB or 3e8 (default: all "
                     "layers resident)")
    csp.add_argument("--prefetch", choices=["predict", "on_demand", "resident"],
                     help="context switch under --device-param-budget: predict (NASPipe's predictor, default), "
                     "on_demand (copy when picked) or resident (ablation: all layers resident); needs a budget")
    parser.add_argument("--schedule-file", help="schedule CSV (PyTorch pipelining syntax, compute_only or "
                        "compute_comms) to run instead of --schedule")
    parser.add_argument("--chunks", type=int,
                        help="model chunks (virtual stages) per rank, placed in a loop; interleaved only (default 1)")
    parser.add_argument("--vertical-sync", action="store_true",
                        help="pipedream: every stage uses the weight version stage 0 used for the minibatch")
    parser.add_argument("--recompute", nargs="?", const="full", choices=["full", "selective"],
                        help="activation recomputation: full (the default when given alone) keeps only each stage's "
                        "input and recomputes it before the backward; selective recomputes part of each block inside "
                        "its backward: gpt the attention core (Megatron-LM, Korthikanti et al. 2022 §5), llama what "
                        "torchtitan's per-op policy does not keep, moe the norms, the experts' SwiGLU and MLA's "
                        "up-projections (Megatron-Core's --recompute-modules layernorm moe_act mla_up_proj; fewer "
                        "with --recompute-modules)")
    parser.add_argument("--recompute-modules", type=argument_type(parse_recompute_modules),
                        default=DEFAULT_RECOMPUTE_MODULES, metavar="M[,M...]",
                        help="with --recompute selective on a moe model, the Megatron-Core modules it recomputes: "
                        f"a comma-separated list of {', '.join(RECOMPUTE_MODULES)} (default: all; DeepSeek-V3's "
                        "Megatron-Bridge recipes recompute mla_up_proj alone)")
    parser.add_argument("--microbatches", "-m", type=int, help="microbatches per iteration (default 8)")
    stream = parser.add_argument_group("stream (PARTIME) options")
    stream.add_argument("--frames", type=int, help="--schedule stream: frames of the stream, one per step (a frame is "
                        "a microbatch of --microbatch-size samples; default 8)")
    stream.add_argument("--fps", type=float, help="--schedule stream: a live source's frame rate; says whether real "
                        "time holds (frames queue when the pipeline is slower)")
    parser.add_argument("--microbatch-size", type=int, default=1, help="samples per microbatch (default 1)")
    par = parser.add_argument_group("tensor, data and pipeline parallelism")
    *others, last = [name for name, entry in MODELS.items() if entry.build_shard is not None]
    sharded = f"{', '.join(others)} and {last}" if others else last
    par.add_argument("--tp", type=int, default=1,
                     help=f"tensor-parallel degree (Megatron-LM; the {sharded} families and their presets; default 1)")
    par.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    par.add_argument("--pp", type=int, help="pipeline ranks (default: the devices left, devices / (tp · dp))")
    par.add_argument("--global-batch", type=int, metavar="G",
                     help="samples per iteration over all replicas: microbatches = G / (microbatch size · dp)")
    par.add_argument("--rank-order", default="tp-dp-pp",
                     help="nesting of the ranks over the devices, innermost first (default tp-dp-pp, Megatron's)")
    par.add_argument("--devices", type=_device_list, default=(), metavar="D0,D1,...",
                     help="the device of each position of the rank order, a permutation of 0..tp·dp·pp−1 (default: in "
                     "order); e.g. 4,5,6,7,0,1,2,3 puts the first pipeline ranks on the second server")
    par.add_argument("--cp", type=int, default=1, metavar="C",
                     help="context parallelism (llama and moe families): each sequence split over C devices (2C "
                     "chunks, rank i holding chunks i and 2C-1-i), which exchange keys and values for attention; the "
                     "data-parallel reduction and ZeRO/FSDP span dp x cp devices (default 1)")
    par.add_argument("--cp-comm", choices=["ring", "allgather"], default="ring",
                     help="how context-parallel ranks exchange keys and values: ring (passed around, each hop under "
                     "one attention step) or allgather (gathered once, as Llama 3 and torchtitan do)")
    par.add_argument("--ep", type=int, default=1, metavar="E",
                     help="expert parallelism (moe family): each MoE layer's experts split over E devices of the "
                     "stage, drawn from its tp x cp x dp devices (Megatron-Core's MoE parallel folding), which "
                     "exchange tokens by all-to-all (default 1)")
    par.add_argument("--etp", type=int, default=1, metavar="T",
                     help="expert tensor parallelism: each expert's width split over T devices (default 1)")
    par.add_argument("--routing", default="balanced", metavar="ROUTING", help=ROUTING_HELP)
    par.add_argument("--capacity-factor", type=float, default=0.0, metavar="C", help=CAPACITY_FACTOR_HELP)
    par.add_argument("--async-tp", dest="async_tp", action="store_true",
                     help="with --sequence-parallel, run each tensor-parallel all-gather and reduce-scatter decomposed "
                     "beside the GEMM it feeds or follows (PyTorch's async TP, torchtitan's "
                     "enable_async_tensor_parallel; llama family; simulated only: executor.run refuses it)")
    par.add_argument("--fsdp-float8-all-gather", dest="fsdp_float8_gather", action="store_true",
                     help="under --zero 3 with --precision fp8, cast the blocks' linear weights to FP8 before FSDP's "
                     "all-gather and gather them at one byte a parameter (torchtitan's "
                     "float8.enable_fsdp_float8_all_gather)")
    par.add_argument("--ep-dispatcher", choices=list(DISPATCHERS), default=DISPATCHERS[0],
                     help="how expert-parallel ranks exchange tokens: all-to-all (default; Megatron-Core's all-to-all "
                     "dispatcher: each token copy straight to its expert's rank), deduplicated (DeepEP's and "
                     "DeepSeek-V3's: each token once to each server its experts are on, then to them inside it) or "
                     "all-gather (Megatron-Core's all-gather dispatcher, Megatron-LM's default: every token, its "
                     "scores and routing map to every rank of the group, the outputs reduce-scattered back; with "
                     "--tp 1 and --etp 1)")
    par.add_argument("--ep-overlap", action="store_true",
                     help="overlap each expert all-to-all with the rank's next compute op (another microbatch's), as "
                     "DualPipe and Megatron-Core's EP overlap do, instead of holding the compute stream (needs --ep "
                     "or --etp > 1; simulated only: executor.run refuses it)")
    par.add_argument("--sequence-parallel", action="store_true",
                     help="Megatron's sequence parallelism: reduce-scatter + all-gather, norms and dropout sharded")
    par.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                     help="ZeRO stage: 1 splits the optimizer state (Megatron's distributed optimizer: gradients "
                     "reduce-scattered once per step, parameters all-gathered after it), 2 also the gradients "
                     "(reduce-scattered after every microbatch), 3 also the parameters (FSDP: each layer gathered "
                     "before its forward and backward, overlapped with its neighbours' compute)")
    parser.add_argument("--precision", choices=list(PRECISIONS), default=None,
                        help="training precision (default: the model's own: fp16 gpt, bf16 llama and moe, fp32 "
                        "cnn/vgg16); fp8 runs a llama or moe block's linears on FP8 with per-tensor scaling (torchao's "
                        "Float8Linear, Transformer Engine's current scaling), fp8-rowwise with a scale per row "
                        "(torchao's "
                        "rowwise recipe), mxfp8 and nvfp4 block-scaled (Blackwell)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="each step captured as one CUDA graph and replayed (Megatron-Core's full-iteration "
                        "graphs; PARTIME's captured stream step): no host issue per kernel or collective and no "
                        "framework overhead per microbatch, one launch per step (GPUs only; not csp)")
    parser.add_argument("--compile", dest="compiled", action="store_true",
                        help="run a llama or moe model's blocks with their elementwise work fused (torch.compile, as "
                        "torchtitan does; Transformer Engine's fused kernels): the norms, SwiGLU, residual adds and "
                        "FP8 casts in fewer kernels (GPUs only)")
    parser.add_argument("--loss", choices=list(LOSSES), default=LOSSES[0],
                        help="how the framework computes the cross entropy over the vocabulary, which sets the LM "
                        "head's memory: fused (default; Megatron-LM's vocab-parallel loss, fp32 logits kept), eager "
                        "(torchtitan without --compile: PyTorch's cross_entropy on an fp32 copy, two more fp32 "
                        "logit tensors in the backward) or compiled (torchtitan under torch.compile: bf16 logits "
                        "kept, one gradient copy)")
    parser.add_argument("--blocks", choices=list(BLOCKS), default=BLOCKS[0],
                        help="the modules the framework builds a llama or moe block from, which sets what the block "
                        "keeps for its backward: eager (default; PyTorch modules as torchtitan builds them, linears "
                        "keeping bf16 inputs) or transformer-engine (Megatron-Core's Transformer Engine layers: norms "
                        "fused into the linears, a fused SwiGLU, and under --precision fp8, mxfp8 or nvfp4 every "
                        "linear keeping its quantized input)")
    parser.add_argument("--offload-activations", type=int, default=0, metavar="N",
                        help="keep the activations of the first N blocks of a llama or moe model in host memory "
                        "between forward and backward (Megatron-Core's cpu_offloading_num_layers through Transformer "
                        "Engine): at most the other blocks' activations stay on the GPU, and an offloaded block "
                        "takes at least its copy over the host link (default 0; needs --pp 1 and no --recompute)")
    par.add_argument("--dp-replicate", type=int, default=1, metavar="R",
                     help="with --zero 3, HSDP: the --dp replicas form R groups, each sharding the state among its "
                     "dp/R members, the groups all-reducing each layer's gradient shard (default 1: plain FSDP)")
    par.add_argument("--fsdp-reshard-after-forward", dest="reshard_after_forward", choices=list(RESHARD_POLICIES),
                     default="default",
                     help="with --zero 3, torchtitan's parallelism.fsdp_reshard_after_forward: 'always' frees each "
                     "layer's gathered parameters after its forward and gathers them again for its backward, every "
                     "microbatch; 'never' keeps them (FSDP's reshard_after_forward=False), and with --pp > 1 gathers "
                     "each stage once per step before its first forward and reduce-scatters its gradients once "
                     "after its last backward, as torchtitan and PyTorch's pipelining run it (more memory: every "
                     "stage's whole parameters and gradients for the step); 'default' (the default) is torchtitan's: "
                     "'never' under --pp > 1, else 'always'")
    par.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_const",
                     const="never", default="default", help="the same as --fsdp-reshard-after-forward never")
    par.add_argument("--param-gather-overlap", action="store_true",
                     help="under --zero 1, all-gather the updated parameters ahead of the next forward bucket by "
                     "bucket instead of after the optimizer step (Megatron's --overlap-param-gather: each bucket's "
                     "gather waited for where the forward first uses it, which then starts the next)")
    par.add_argument("--grad-overlap", action="store_true",
                     help="reduce gradients in buckets while the last backward runs instead of after the backward "
                     "pass (Megatron's default without --overlap-grad-reduce): PyTorch DDP's 25 MiB buckets, or "
                     "under --zero 1 Megatron-Core's, max(40M, 1M x DP) parameters each (--grad-bucket-size sets them)")
    par.add_argument("--deallocate-pipeline-outputs", action="store_true",
                     help="with --pp > 1, free each stage's output once it is sent (Megatron-Core's "
                     "deallocate_pipeline_outputs, set by Megatron-LM and Megatron-Bridge): every in-flight "
                     "microbatch keeps one boundary activation fewer; PyTorch's pipelining (torchtitan) keeps it")
    par.add_argument("--grad-bucket-size", dest="grad_bucket_params", type=int, default=0, metavar="PARAMS",
                     help="parameters per bucket of --grad-overlap and --param-gather-overlap (Megatron's "
                     "--ddp-bucket-size; Megatron-Bridge's recipes use 134217728, 128 Mi); default: the rule above")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the CSP subnet sampler and of a long run's failures (default 0)")
    slow = parser.add_argument_group("stragglers (sim.engine.perturbation)")
    slow.add_argument("--straggler", action="append", metavar="DEVICE:FACTOR[@START-END] or LINK:FACTOR",
                      help="device DEVICE's compute ops (DEVICE its rank or its name in the device table: 5 or "
                      "gpu5) take FACTOR times their cost, always or when they start between START and END seconds of "
                      "the iteration; or the links of a type (e.g. ib-ndr) or of a device (gpu5-links) carry FACTOR "
                      "times slower (repeatable); the summary compares the iteration with the one without")
    slow.add_argument("--jitter", type=float, default=0.0, metavar="SIGMA",
                      help="multiply every compute op's cost by a seeded lognormal factor of mean 1 and shape SIGMA "
                      "(0 to 1; --seed seeds it)")
    runs = parser.add_argument_group("a long run with failures (sim.faults): given --train-hours or --iterations")
    runs.add_argument("--train-hours", type=float, metavar="H",
                      help="failure-free training time of the run, in hours (its iterations: H / the iteration time)")
    runs.add_argument("--iterations", type=int, metavar="N", help="iterations of the run (instead of --train-hours)")
    runs.add_argument("--mtbf", type=float, metavar="HOURS",
                      help="mean time between failures of one device (default: the failure mix's, 50,676 h for "
                      "Llama 3's), or of the whole job with --mtbf-scope cluster")
    runs.add_argument("--mtbf-scope", choices=["device", "cluster"], default="device",
                      help="device: --mtbf is each device's, the job's is it / devices (default); cluster: the job's")
    runs.add_argument("--failure-mix", metavar="FILE",
                      help="YAML or JSON table of failure causes with counts and repair minutes (default: Llama 3 "
                      "405B's 419 interruptions, profiles/faults/llama3-405b.yaml)")
    runs.add_argument("--checkpoint-every", type=int, metavar="K",
                      help="iterations between checkpoints (default: the best of a sweep of intervals)")
    runs.add_argument("--async-checkpoint", action="store_true",
                      help="checkpoints stall training only to copy to host memory, the write to storage runs behind")
    runs.add_argument("--storage-bandwidth", type=float, metavar="GB/s",
                      help="aggregate storage write bandwidth in GB/s (default: 0.122 per device, the share per GPU of "
                      "the 2 TB/s Llama 3's 16,384 GPUs sustained)")
    runs.add_argument("--restart-minutes", type=float, default=10.0, metavar="MIN",
                      help="detection, rescheduling and start-up of each restart, in minutes (default 10, assumed)")
    runs.add_argument("--fault-trials", type=int, default=16, metavar="T",
                      help="seeded runs the expected figures and the interval sweep average (default 16)")
    parser.add_argument("--partition", default="balanced",
                        help="uniform, balanced (exact DP, default), blocks (Megatron-DeepSpeed's type:transformer: "
                        "blocks split evenly, embedding first, head last), layer counts per stage, e.g. 12,12,13,13, "
                        "or a Megatron-Core pipeline_model_parallel_layout, e.g. 'Et*4|(t*4|)*14tmL' (E embedding, t "
                        "decoder, m MTP, L loss; | between stages)")
    parser.add_argument("--profile", help="measured profile JSON (profiles/README.md) replacing roofline costs")
    parser.add_argument("--ignore-memory", action="store_true",
                        help="report peak memory but do not fail when a device runs out")
    parser.add_argument("--no-gantt", action="store_true", help="skip drawing gantt.png")
    parser.add_argument("--out", help="output directory")
    return parser


def _run(argv: list[str] | None) -> int:
    args = make_parser().parse_args(argv)
    lists = format_builtin_lists(args.model, args.topology)
    if lists is not None:
        print(lists)
        return 0
    if not args.topology:
        raise SpecError("--topology is required (e.g. 16xV100, a YAML file, or 'list')")
    if not args.out:
        raise SpecError("--out is required (the directory to write plan.json, trace.json, gantt.png into)")
    # An unusable --out is refused before anything is simulated or printed, not after the summary; it is made (and
    # recorded, so that a failure removes it) only when the outputs are written.
    prepare_output_dir(args.out, "--out", create=False)
    if args.schedule and args.schedule_file:
        raise SpecError(f"--schedule {args.schedule} and --schedule-file {args.schedule_file} both name the "
                        f"schedule; give one")
    fault_options = _fault_options(args)
    if args.schedule == "csp":
        if fault_options != replace(FaultOptions(), seed=fault_options.seed):
            raise SpecError("a long run with failures (--train-hours, --iterations and their options) is predicted for "
                            "fixed schedules; --schedule csp decides its program online")
        return _run_csp(args)
    if args.space:
        raise SpecError("--space names a supernet for --schedule csp; other schedules take --model")
    if not args.model:
        raise SpecError("--model is required (e.g. gpt:layers=48,hidden=2048, or 'list')")
    microbatches = args.microbatches
    if args.frames is not None:
        if args.schedule != "stream":
            raise SpecError(f"--frames {args.frames} counts the frames of --schedule stream; other schedules take "
                            f"--microbatches")
        if microbatches is not None:
            raise SpecError(f"--frames {args.frames} and --microbatches {microbatches} both count the frames; give "
                            f"--frames")
        microbatches = args.frames
    inputs = PlanInputs(
        model=args.model, topology=args.topology, schedule=args.schedule or "1f1b", microbatches=microbatches,
        microbatch_size=args.microbatch_size, partition=args.partition, profile=args.profile,
        schedule_file=args.schedule_file, chunks=1 if args.chunks is None else args.chunks,
        recompute=args.recompute or "none", vertical_sync=args.vertical_sync, tp=args.tp, dp=args.dp, pp=args.pp,
        cp=args.cp, cp_comm=args.cp_comm,
        global_batch=args.global_batch, rank_order=args.rank_order, sequence_parallel=args.sequence_parallel,
        zero=args.zero, reshard_after_forward=args.reshard_after_forward, dp_replicate=args.dp_replicate,
        grad_overlap=args.grad_overlap,
        devices=args.devices, fps=args.fps, cuda_graphs=args.cuda_graphs, precision=args.precision,
        compiled=args.compiled, ep=args.ep, etp=args.etp, routing=args.routing,
        capacity_factor=args.capacity_factor, ep_overlap=args.ep_overlap, ep_dispatcher=args.ep_dispatcher,
        fsdp_float8_gather=args.fsdp_float8_gather, async_tp=args.async_tp,
        param_gather_overlap=args.param_gather_overlap, grad_bucket_params=args.grad_bucket_params,
        deallocate_pipeline_outputs=args.deallocate_pipeline_outputs,
        loss=args.loss, blocks=args.blocks, offload_activations=args.offload_activations,
        recompute_modules=args.recompute_modules,
    )
    if fault_options != replace(FaultOptions(), seed=fault_options.seed):  # any long-run flag given
        fault_options.check()  # the long run's flags, before anything is simulated or printed
    built = build_plan(inputs)
    perturbation = _perturbation(args, built.plan.world_size)
    perturbation.topology(built.topology)  # a link name that is not there: refused before anything is printed
    if not args.ignore_memory:
        _check_memory(inputs, built)  # before anything is printed: a plan that cannot run gets one line
    plan, topology = built.plan, built.topology
    print(topology.describe())
    tp = built.plan.layout.tp
    print(f"model {built.graph.summary()}{f' (one tensor-parallel shard of {tp})' if tp > 1 else ''}")
    chunks, recompute = plan.option("chunks"), plan.option("recompute")
    recompute_text = {True: ", activation recomputation", "selective": ", selective recomputation"}.get(recompute, "")
    if plan.option(RECOMPUTE_MODULES_OPTION) is not None:
        recompute_text += f" of {plan.option(RECOMPUTE_MODULES_OPTION)}"
    print(f"plan {plan.schedule}: {plan.num_vstages} stages on {plan.num_ranks} ranks"
          f"{f' ({chunks} chunks per rank, loop placement)' if chunks else ''}, layers per stage "
          f"{','.join(map(str, plan.placement.layer_counts()))}, {plan.num_microbatches} microbatches × "
          f"{plan.microbatch_size} sample(s){recompute_text}")
    if plan.parallel is not None:
        print(f"parallel {plan.layout.describe()}; {_group_lines(plan)}")
    prediction = predict(plan, built.profile, topology=topology, oracle=built.costs.oracle,
                         check_memory=not args.ignore_memory, perturbation=perturbation)
    print(f"costs {prediction.cost_source}")
    metrics = prediction.metrics
    unslowed = _without_perturbation(built, metrics, perturbation, not args.ignore_memory)
    routing = _routing_against_balanced(inputs, metrics["iteration_time_s"])
    if routing is not None:
        metrics = {**metrics, "routing": routing}
    faults = _long_run(fault_options, metrics, plan, topology)
    if faults is not None:
        metrics = {**metrics, "faults": faults.metrics}
    out = Path(args.out)
    prepare_output_dir(out, "--out")
    write_plan_files(out, plan)
    title = plan_title(plan)
    charts = {} if faults is None else {"long_run.png": lambda: faults.chart_png(
        f"{title} · {faults.run.iterations:,} iterations, job MTBF {faults.run.mtbf_s / 3600:.3g} h, seed {args.seed}")}
    names = write_run_outputs(out, prediction.trace, metrics, title=title, gantt=not args.no_gantt, charts=charts)
    print(format_summary(metrics))
    if unslowed is not None:
        slowed = metrics["perturbation"]["slowed_ops"]
        print(f"stragglers        {perturbation.describe()}: "
              f"{f'{slowed} ops slowed; ' if perturbation.stragglers else ''}"
              f"{metrics['perturbation']['slowdown']:.3f}x the iteration without them ({unslowed * 1e3:.3f} ms)")
    if routing is not None:
        factor = routing["capacity_factor"]
        spread = routing["routing"] + (f", capacity factor {factor:g}" if factor else "")
        print(f"routing           {spread}: {routing['slowdown_vs_balanced']:.2f}x the iteration time of balanced "
              f"dropless routing ({routing['balanced_iteration_time_s'] * 1e3:.3f} ms)")
    if "stream" in metrics:
        print(format_partime_summary(metrics["stream"]))
    if faults is not None:
        print(faults.summary())
    print(f"wrote {out}/{{{', '.join(['plan.json', 'schedule.csv', *names])}}}")
    return 0


def _routing_against_balanced(inputs: PlanInputs, iteration_time_s: float) -> dict | None:
    """What a skewed or traced routing, or a capacity factor, costs: the same plan predicted with balanced dropless
    routing beside it (``metrics.json``'s ``routing``); ``None`` when the plan routes balanced and dropless."""
    if parse_routing(inputs.routing) == BALANCED and not inputs.capacity_factor:
        return None
    balanced = build_plan(replace(inputs, routing="balanced", capacity_factor=0.0))
    baseline = predict(balanced.plan, balanced.profile, topology=balanced.topology, oracle=balanced.costs.oracle,
                       check_memory=False).metrics["iteration_time_s"]
    return {"routing": parse_routing(inputs.routing).describe(), "capacity_factor": float(inputs.capacity_factor),
            "balanced_iteration_time_s": baseline, "slowdown_vs_balanced": iteration_time_s / baseline}


def _perturbation(args: argparse.Namespace, devices: int) -> Perturbation:
    """``--straggler`` and ``--jitter`` (with ``--seed``) as a :class:`sim.engine.perturbation.Perturbation`."""
    entries = [entry for flag in args.straggler or () for entry in flag.split(",") if entry.strip()]
    parsed = [parse_straggler(entry, devices) for entry in entries]
    return Perturbation(tuple(p for p in parsed if isinstance(p, Straggler)), args.jitter, args.seed,
                        tuple(p for p in parsed if isinstance(p, SlowLink)))


def _without_perturbation(built, metrics: dict, perturbation: Perturbation, check_memory: bool) -> float | None:
    """The what-if of a perturbed run: the same plan without its stragglers and jitter; their cost goes into
    ``metrics["perturbation"]`` and the iteration time without them is returned (``None`` when nothing slows it)."""
    if not perturbation:
        return None
    unslowed = predict(built.plan, built.profile, topology=built.topology, oracle=built.costs.oracle,
                       check_memory=check_memory).metrics["iteration_time_s"]
    metrics["perturbation"].update({"unslowed_iteration_time_s": unslowed,
                                    "slowdown": metrics["iteration_time_s"] / unslowed})
    return unslowed


def _fault_options(args: argparse.Namespace) -> FaultOptions:
    """The long-run flags as :class:`sim.faults.options.FaultOptions` (checked there)."""
    storage = None if args.storage_bandwidth is None else args.storage_bandwidth * 1e9
    return FaultOptions(train_hours=args.train_hours, iterations=args.iterations, mtbf_hours=args.mtbf,
                        mtbf_scope=args.mtbf_scope, failure_mix=args.failure_mix,
                        checkpoint_every=args.checkpoint_every, asynchronous=args.async_checkpoint,
                        storage_bandwidth=storage, restart_minutes=args.restart_minutes,
                        seed=args.seed, trials=args.fault_trials)


def _long_run(options: FaultOptions, metrics: dict, plan, topology) -> FaultPrediction | None:
    """The long run with failures the flags ask for (``sim.faults.options``), or ``None``."""
    if not options.requested:
        return None
    tokens = metrics.get("tokens_per_iteration") or 0
    return predict_faults(options, iteration_s=metrics["iteration_time_s"], tokens_per_iteration=int(tokens),
                          model=build_model(plan.model), topology=topology)


def _check_memory(inputs: PlanInputs, built) -> None:
    """Refuse a plan whose peak memory exceeds a device's, saying by how much and which flags would make it fit
    (:func:`sim.plan.memory_fit.out_of_memory_message`; plans with host copies are left to the engine)."""
    message = out_of_memory_message(inputs, built, lambda name, value: f"{FLAGS[name]} {value}", "--ignore-memory")
    if message is not None:
        raise SpecError(message)


def _device_list(text: str) -> tuple[int, ...]:
    """``--devices 4,5,6,7,0,1,2,3`` → a tuple of device numbers (the layout checks that it is a permutation)."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of device numbers: {text!r} (e.g. 4,5,6,7,0,1,2,3)") from None


def _group_lines(plan) -> str:
    """The first group of each kind, and how many there are, for the summary (plan.json lists them all)."""
    groups = plan.layout.groups()
    return "; ".join(f"{kind} groups: {len(found)}, first {found[0]}" for kind, found in groups.items())


def _run_csp(args: argparse.Namespace) -> int:
    """``--schedule csp``: write NASPipe's CSP plan over a sampled subnet sequence, simulate it, write the outputs."""
    from sim.csp.csp_metrics import csp_decision_log
    from sim.csp.csp_plan import CspInputs, build_csp_plan

    # CSP picks subnets online with one stage per rank, one subnet per step, and updates the weights per subnet:
    # these options of the fixed schedules have no meaning for it, so naming one is an error, not silently dropped.
    for flag, given in (("--recompute", args.recompute), ("--chunks", args.chunks is not None),
                        ("--tp", args.tp != 1), ("--dp", args.dp != 1), ("--pp", args.pp is not None),
                        ("--cp", args.cp != 1), ("--ep", args.ep != 1), ("--etp", args.etp != 1),
                        ("--routing", args.routing != "balanced"), ("--capacity-factor", args.capacity_factor != 0),
                        ("--ep-overlap", args.ep_overlap), ("--ep-dispatcher", args.ep_dispatcher != DISPATCHERS[0]),
                        ("--loss", args.loss != LOSSES[0]), ("--blocks", args.blocks != BLOCKS[0]),
                        ("--offload-activations", args.offload_activations != 0),
                        ("--recompute-modules", args.recompute_modules != DEFAULT_RECOMPUTE_MODULES),
                        ("--fsdp-float8-all-gather", args.fsdp_float8_gather), ("--async-tp", args.async_tp),
                        ("--param-gather-overlap", args.param_gather_overlap),
                        ("--grad-bucket-size", args.grad_bucket_params != 0),
                        ("--deallocate-pipeline-outputs", args.deallocate_pipeline_outputs),
                        ("--global-batch", args.global_batch is not None),
                        ("--zero", args.zero != 0),
                        ("--fsdp-reshard-after-forward", args.reshard_after_forward != "default"),
                        ("--dp-replicate", args.dp_replicate != 1), ("--precision", args.precision is not None),
                        ("--compile", args.compiled), ("--cuda-graphs", args.cuda_graphs),
                        ("--sequence-parallel", args.sequence_parallel), ("--grad-overlap", args.grad_overlap),
                        ("--vertical-sync", args.vertical_sync), ("--microbatches", args.microbatches is not None),
                        ("--profile", args.profile is not None)):
        if given:
            reason = ("a profile times one model's layers; csp costs each subnet's own candidates by the roofline"
                      if flag == "--profile" else "a csp plan trains --subnets, one minibatch each"
                      if flag == "--microbatches" else "fixed schedules only")
            raise SpecError(f"{flag} does not apply to --schedule csp ({reason})")
    plan = build_csp_plan(CspInputs(
        model=args.model, space=args.space, topology=args.topology, subnets=args.subnets, seed=args.seed,
        lookahead=args.lookahead, microbatch_size=args.microbatch_size, partition=args.partition,
        one_at_a_time=args.one_at_a_time, device_param_budget_bytes=args.device_param_budget,
        prefetch=args.prefetch))
    prediction = predict(plan, check_memory=not args.ignore_memory)
    result, metrics, topology = prediction.csp, prediction.metrics, prediction.topology
    assert result is not None
    print(topology.describe())
    print(f"model {build_model(plan.model).summary()}")
    mode = ("one subnet at a time (ablation)" if plan.option("one_at_a_time")
            else f"CSP, lookahead {plan.option('lookahead')}")
    budget = plan.option("device_param_budget_bytes")
    if budget is not None:
        mode += f", device parameter budget {budget:,} B, prefetch {plan.option('prefetch')}"
    print(f"plan csp: {plan.num_microbatches} subnets (seed {plan.option('seed')}) on {plan.num_ranks} stages, "
          f"layers per stage {','.join(map(str, plan.placement.layer_counts()))}, {mode}")
    print(f"costs {prediction.cost_source}")
    out = Path(args.out)
    prepare_output_dir(out, "--out")
    write_text_chunks_atomic(plan.iter_dumps(), out / "plan.json")
    write_json_atomic(csp_decision_log(plan, result), out / "csp.json")
    title = f"csp · {plan.model} · {plan.topology} · {plan.num_microbatches} subnets"
    names = write_run_outputs(out, result.trace, metrics, title=title, gantt=not args.no_gantt)
    print(format_summary(metrics, unit="subnets"))
    print("CSP stalls per stage (s): " + ", ".join(f"{s.blocked_s:.4f}" for s in result.stalls))
    if result.copies:
        print(f"context switch ({plan.option('prefetch')}): copied "
              f"{sum(c.h2d_bytes for c in result.copies) / 1e9:.3f} GB in, "
              f"{sum(c.d2h_bytes for c in result.copies) / 1e9:.3f} GB out; compute waited for copies "
              f"{metrics['csp']['copy_wait_s']:.4f} s; peak resident per stage (GB) "
              + ", ".join(f"{c.peak_resident_bytes / 1e9:.3f}" for c in result.copies))
    print(f"wrote {out}/{{{', '.join(['plan.json', 'csp.json', *names])}}}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    return run_cli(lambda: _run(argv), FLAGS)


if __name__ == "__main__":
    sys.exit(main())
